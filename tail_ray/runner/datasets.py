"""Datasets jobs train on. All local: nothing is downloaded at run time.

- ``digits``: scikit-learn's bundled 8x8 handwritten digits (1,797 images, 10 classes).
- ``stdlib_chars``: a byte-level language-modelling corpus made of the Python standard
  library's own ``.py`` files (present on every machine that runs Python).
- ``synthetic``: random inputs with a fixed random teacher's labels, for throughput runs.

Every dataset serves deterministic batches from (seed, step, rank, world_size), so a run
restarted from a checkpoint, or resized, sees a well-defined stream without a data loader's
hidden state.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tail_ray.errors import ConfigError
from tail_ray.jobspec import DATASET_NAMES

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Dataset:
    name: str
    task: str  # "classification" or "lm"
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int
    seq_len: int = 0  # lm only: tokens per sample

    def batch(self, *, seed: int, step: int, rank: int, world_size: int, batch_size: int) -> Batch:
        """The batch worker ``rank`` trains on at ``step``: disjoint across ranks within a step."""
        gen = torch.Generator().manual_seed(hash((seed, step)) & 0x7FFF_FFFF)
        n = self._num_train_samples()
        idx = torch.randint(0, n, (world_size * batch_size,), generator=gen)
        mine = idx[rank * batch_size : (rank + 1) * batch_size]
        return self._gather(mine, train=True)

    def val_batches(self, batch_size: int = 256) -> Iterator[Batch]:
        n = self._num_val_samples()
        for start in range(0, n, batch_size):
            yield self._gather(torch.arange(start, min(n, start + batch_size)), train=False)

    def _num_train_samples(self) -> int:
        return len(self.train_x) - self.seq_len if self.task == "lm" else len(self.train_x)

    def _num_val_samples(self) -> int:
        # LM validation uses non-overlapping windows so it is cheap and fixed.
        return (len(self.val_x) - 1) // self.seq_len if self.task == "lm" else len(self.val_x)

    def _gather(self, idx: torch.Tensor, *, train: bool) -> Batch:
        if self.task != "lm":
            xs, ys = (self.train_x, self.train_y) if train else (self.val_x, self.val_y)
            return xs[idx], ys[idx]
        tokens = self.train_x if train else self.val_x
        starts = idx if train else idx * self.seq_len
        offs = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        window = tokens[offs]
        return window[:, :-1], window[:, 1:]


def _digits(seed: int) -> Dataset:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))  # fixed split
    x, y = x[perm], y[perm]
    n_val = 360
    return Dataset("digits", "classification", x[n_val:], y[n_val:], x[:n_val], y[:n_val], 10)


STDLIB_CORPUS_BYTES = 2_000_000


def stdlib_corpus(max_bytes: int = STDLIB_CORPUS_BYTES) -> bytes:
    """The standard library's own source, files in sorted order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    if len(out) < 100_000:
        raise ConfigError(f"the standard library at {root} has too little source for stdlib_chars")
    return bytes(out[:max_bytes])


def _stdlib_chars(seed: int) -> Dataset:
    tokens = torch.from_numpy(np.frombuffer(stdlib_corpus(), dtype=np.uint8).astype(np.int64))
    split = int(0.9 * len(tokens))
    train, val = tokens[:split], tokens[split:]
    return Dataset("stdlib_chars", "lm", train, train, val, val, 256, seq_len=64)


def _synthetic(seed: int) -> Dataset:
    gen = torch.Generator().manual_seed(4321)
    dim, n = 256, 8192
    x = torch.randn(n, dim, generator=gen)
    teacher = torch.randn(dim, 10, generator=gen)
    y = (x @ teacher).argmax(dim=1)
    return Dataset("synthetic", "classification", x[1024:], y[1024:], x[:1024], y[:1024], 10)


_DATASETS: dict[str, Callable[[int], Dataset]] = {
    "digits": _digits,
    "stdlib_chars": _stdlib_chars,
    "synthetic": _synthetic,
}


if tuple(sorted(_DATASETS)) != DATASET_NAMES:  # the spec module lists the names torch-free: keep them equal
    raise ImportError(f"{sorted(_DATASETS)} != tail_ray.jobspec.DATASET_NAMES {DATASET_NAMES}")


def dataset_names() -> list[str]:
    return sorted(_DATASETS)


def make_dataset(name: str, seed: int = 0) -> Dataset:
    try:
        return _DATASETS[name](seed)
    except KeyError:
        raise ConfigError(f"unknown dataset {name!r}; choose one of {dataset_names()}") from None
