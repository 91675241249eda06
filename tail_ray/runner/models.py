"""Models jobs train, by name: small enough to train on CPU in tests, with layers to compress.

Each has layers >= 64K elements so compression has something to bite on.

- ``digits_cnn``: 2 conv + 2 fc on 8x8 digits (fc1.weight has 65,536 elements).
- ``char_transformer``: a byte-level causal transformer LM (2 blocks, d_model 128).
- ``synthetic_mlp``: a wide MLP (~3.4M parameters) for throughput and network benchmarks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from tail_ray.errors import ConfigError
from tail_ray.jobspec import MODEL_NAMES
from tail_ray.runner.datasets import Dataset


class DigitsCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class CharTransformer(nn.Module):
    causal_mask: torch.Tensor  # a registered buffer (nn.Module.__getattr__ types it Tensor | Module)

    def __init__(
        self, vocab: int = 256, d_model: int = 128, n_layers: int = 2, n_heads: int = 4, seq_len: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "causal_mask", nn.Transformer.generate_square_subsequent_mask(seq_len), persistent=False
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.causal_mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


class SyntheticMLP(nn.Module):
    def __init__(
        self, in_dim: int = 256, hidden: int = 1024, n_hidden: int = 4, num_classes: int = 10
    ) -> None:
        super().__init__()
        dims = [in_dim] + [hidden] * n_hidden
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(dims):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(hidden, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


_MODELS: dict[str, Callable[[Dataset], nn.Module]] = {
    "digits_cnn": lambda ds: DigitsCNN(ds.num_classes),
    "char_transformer": lambda ds: CharTransformer(vocab=ds.num_classes, seq_len=max(ds.seq_len, 1)),
    "synthetic_mlp": lambda ds: SyntheticMLP(in_dim=ds.train_x.shape[1], num_classes=ds.num_classes),
}


if tuple(sorted(_MODELS)) != MODEL_NAMES:  # the spec module lists the names torch-free: keep them equal
    raise ImportError(f"{sorted(_MODELS)} != tail_ray.jobspec.MODEL_NAMES {MODEL_NAMES}")


def model_names() -> list[str]:
    return sorted(_MODELS)


def make_model(name: str, dataset: Dataset, seed: int = 0) -> nn.Module:
    """Build a model for ``dataset`` with weights fixed by ``seed`` (same on every rank)."""
    try:
        factory = _MODELS[name]
    except KeyError:
        raise ConfigError(f"unknown model {name!r}; choose one of {model_names()}") from None
    torch.manual_seed(seed)
    return factory(dataset)


def loss_fn(dataset: Dataset, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if dataset.task == "lm":
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    return nn.functional.cross_entropy(logits, target)


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Dataset) -> dict[str, float]:
    """Validation metrics: accuracy for classification, loss and perplexity for LM."""
    was_training = model.training
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for x, y in dataset.val_batches():
        logits = model(x)
        total_loss += float(loss_fn(dataset, logits, y)) * len(x)
        if dataset.task != "lm":
            correct += int((logits.argmax(dim=1) == y).sum())
        count += len(x)
    model.train(was_training)
    val_loss = total_loss / max(count, 1)
    if dataset.task == "lm":
        return {"val_loss": val_loss, "val_perplexity": float(torch.exp(torch.tensor(val_loss)))}
    return {"val_loss": val_loss, "val_accuracy": correct / max(count, 1)}
