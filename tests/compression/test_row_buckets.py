"""Row-aligned buckets under dither (``TailConfig.row_buckets``): a matrix row that no rank has
a gradient for (an embedding's absent tokens) reaches the optimizer as exactly zero, where a
bucket shared with a present row would have given it up to half a step of noise."""

import numpy as np
import pytest
import torch

from tail_ray import ConfigError, TailCompressor, TailConfig
from tail_ray.bitwidth.row_buckets import (
    MIN_ROW_BUCKET,
    MIN_ZERO_ROW_SHARE,
    row_bucket,
    row_length,
    zero_row_share,
)
from tail_ray.compression.tail_config import DITHER_START_STEPS
from tail_ray.compression.wire import decode_payload

VOCAB, WIDTH = 256, 128


@pytest.mark.parametrize(
    ("shape", "bucket", "expected"),
    [
        ((256, 128), 512, 128),  # the char LM's embedding: 4 rows a bucket before
        ((50257, 768), 512, 384),  # a GPT-2-size untied embedding: a row spans 1.5 buckets before
        ((32, 16, 3, 3), 512, 144),  # a conv filter of 144 elements
        ((128, 512), 512, None),  # the bucket divides the row: buckets never straddle rows
        ((64, 1024), 512, None),
        ((1000, 50), 512, None),  # rows too short: a scale per row would cost too much
        ((1000, 101), 512, 101),  # a prime width above the floor is its own bucket
        ((1000, 2 * 127), 512, 254),
        ((512,), 512, None),  # a vector has no rows
        ((1, 4096), 512, None),
    ],
)
def test_the_bucket_is_the_largest_divisor_of_the_row_within_the_base(shape, bucket, expected):
    assert row_bucket(row_length(shape), bucket) == expected
    if expected is not None:
        assert row_length(shape) % expected == 0 and MIN_ROW_BUCKET <= expected <= bucket


def test_zero_rows_are_counted_whatever_their_sign():
    g = np.ones((4, 8), np.float32)
    assert zero_row_share(g.ravel(), 8) == 0.0
    g[2] = -0.0
    g[3, :7] = 0.0  # one element left: not a zero row
    assert zero_row_share(g.ravel(), 8) == 0.25
    assert zero_row_share(g.ravel(), 7) == 0.0  # not a whole number of rows: no rows to speak of


@pytest.mark.parametrize("period", [2, 4, 8, 16])
def test_the_sampled_rows_do_not_line_up_with_a_periodic_layout(period):
    """Every ``period``-th token present: a plain stride over 256 rows would read only those
    (or none of them); the hashed sample reads the share as it is."""
    g = np.zeros((VOCAB, WIDTH), np.float32)
    g[::period] = 1.0
    assert abs(zero_row_share(g.ravel(), WIDTH) - (1 - 1 / period)) <= 0.1


def _embedding_grad(rng: np.random.Generator, present: np.ndarray) -> torch.Tensor:
    """An embedding's gradient: rows of the tokens in the batch, zero elsewhere."""
    g = np.zeros((VOCAB, WIDTH), np.float32)
    g[present] = rng.standard_normal((present.size, WIDTH)).astype(np.float32) * 1e-2
    return torch.from_numpy(g)


def _mean_of_two_ranks(row_buckets: bool, steps: int) -> tuple[torch.Tensor, np.ndarray, list[bytes]]:
    """``steps`` steps of two dithering ranks whose batches share no token in rows 1, 5, 9, ...
    (absent on both) while rows 0, 4, 8, ... are present on both, and the mean of the last."""
    rng = np.random.default_rng(0)
    ranks = [TailCompressor(TailConfig(seed=10 + r, row_buckets=row_buckets)) for r in range(2)]
    present = np.arange(0, VOCAB, 4)
    absent = np.arange(1, VOCAB, 4)  # each shares a base bucket (4 rows of 128) with a present row
    for _ in range(steps):
        grads = [{"embed.weight": _embedding_grad(rng, present)} for _ in ranks]
        payloads = [c.compress(g) for c, g in zip(ranks, grads, strict=True)]
    out = {"embed.weight": torch.empty(VOCAB, WIDTH)}
    ranks[0].aggregate(payloads, out, own=0)
    return out["embed.weight"], absent, payloads


@pytest.mark.parametrize("steps", [1, DITHER_START_STEPS + 2])  # at the start's 8 bits and after
def test_rows_no_rank_has_a_gradient_for_arrive_as_exact_zeros(steps):
    mean, absent, payloads = _mean_of_two_ranks(row_buckets=True, steps=steps)
    assert torch.count_nonzero(mean[absent]) == 0
    assert torch.count_nonzero(mean[absent - 1]) > 0.9 * absent.size * WIDTH  # the present rows came
    assert {r.bucket_size for p in payloads for r in decode_payload(p)} == {WIDTH}


def test_without_row_buckets_those_rows_carry_the_dither_noise():
    """The control: the same ranks with the base bucket put noise on every absent row."""
    mean, absent, payloads = _mean_of_two_ranks(row_buckets=False, steps=DITHER_START_STEPS + 2)
    assert torch.count_nonzero(mean[absent]) > 0.9 * absent.size * WIDTH
    assert {r.bucket_size for p in payloads for r in decode_payload(p)} == {512}


def test_dense_layers_and_nearest_rounding_keep_the_base_bucket():
    rng = np.random.default_rng(1)
    dense = {"embed.weight": torch.from_numpy(rng.standard_normal((VOCAB, WIDTH)).astype(np.float32))}
    sparse = {"embed.weight": _embedding_grad(rng, np.arange(0, VOCAB, 4))}
    assert {r.bucket_size for r in decode_payload(TailCompressor(TailConfig(seed=1)).compress(dense))} == {
        512
    }
    nearest = TailCompressor(TailConfig(seed=1, rounding="nearest"))  # a zero decodes as zero there
    assert {r.bucket_size for r in decode_payload(nearest.compress(sparse))} == {512}


def test_a_dense_layer_with_a_few_dead_units_keeps_the_base_bucket():
    """A few zero rows (dead ReLU units) do not cut the whole layer's buckets: at the same bits
    a smaller bucket codes more bytes. Twice the threshold's share does (the rows are counted
    on a sample of them, so not the threshold itself)."""
    rng = np.random.default_rng(3)
    g = rng.standard_normal((512, WIDTH)).astype(np.float32)
    g[:7] = 0.0  # 7 dead units of 512, as in the char LM's second block
    comp = TailCompressor(TailConfig(seed=1))
    assert {r.bucket_size for r in decode_payload(comp.compress({"fc1.weight": torch.from_numpy(g)}))} == {
        512
    }
    g[: int(2 * MIN_ZERO_ROW_SHARE * 512)] = 0.0
    comp = TailCompressor(TailConfig(seed=1))
    assert {r.bucket_size for r in decode_payload(comp.compress({"fc1.weight": torch.from_numpy(g)}))} == {
        WIDTH
    }


def test_sharded_exchanges_keep_one_bucket():
    """The sharded exchanges cut layers at multiples of one bucket: no row buckets there."""
    comp = TailCompressor(TailConfig(seed=1))
    grads = {"embed.weight": _embedding_grad(np.random.default_rng(2), np.arange(0, VOCAB, 4))}
    assert {r.bucket_size for r in decode_payload(comp.compress(grads))} == {WIDTH}
    shards = [
        {"embed.weight": slice(0, VOCAB * WIDTH // 2)},
        {"embed.weight": slice(VOCAB * WIDTH // 2, None)},
    ]
    payloads = comp.compress_shards(grads, shards, own_shard=0)
    assert {r.bucket_size for p in payloads for r in decode_payload(p)} == {512}


def test_the_setting_is_a_bool():
    with pytest.raises(ConfigError, match="row_buckets must be true or false"):
        TailConfig(row_buckets="yes")  # type: ignore[arg-type]
    assert TailConfig().row_buckets is True


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


@pytest.mark.parametrize("row_buckets", [True, False])
def test_adam_leaves_the_rows_of_tokens_never_seen_where_they_were(row_buckets):
    """End to end through the hook's world-size-1 round trip and a real Adam: the embedding
    rows of tokens no batch holds get exactly zero gradients, so Adam never moves them, as
    without compression. Without row buckets the dither noise moves every one of them."""
    from tail_ray.collective import compress_gradients_locally, register_tail_hook

    model = _TinyLM()
    state = register_tail_hook(None, "tail", {"seed": 3, "row_buckets": row_buckets}, model=model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = model.embed.weight.detach().clone()
    gen = torch.Generator().manual_seed(0)
    seen = torch.arange(0, VOCAB, 4)  # tokens 4k only: rows 4k+1..4k+3 share their base buckets
    for _ in range(DITHER_START_STEPS + 5):
        tokens = seen[torch.randint(0, seen.numel(), (16, 12), generator=gen)]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens), torch.randint(0, 8, (16,), generator=gen)).backward()
        compress_gradients_locally(state, model)
        opt.step()
    never = torch.ones(VOCAB, dtype=torch.bool)
    never[seen] = False
    moved = (model.embed.weight.detach() != before).any(dim=1)
    assert moved[seen].all()  # training happened
    if row_buckets:
        assert not moved[never].any()
    else:
        assert moved[never].all()


@pytest.mark.parametrize("row_buckets", [True, False])
def test_a_resumed_run_sends_what_the_uninterrupted_one_does(row_buckets):
    """The plan's row bucket is in the checkpoint and comes back, where the base bucket used to
    replace every restored one under bucket_choice "fixed"."""
    rng = np.random.default_rng(4)
    batches = [{"embed.weight": _embedding_grad(rng, np.arange(0, VOCAB, 4))} for _ in range(10)]
    settings = TailConfig(seed=7, row_buckets=row_buckets)
    going = TailCompressor(settings)
    for grads in batches[:6]:
        going.compress(grads)
    resumed = TailCompressor(settings)
    resumed.load_state_dict(going.state_dict())
    assert resumed.controller.plans["embed.weight"].bucket_size == (WIDTH if row_buckets else 512)
    for grads in batches[6:]:
        assert resumed.compress(grads) == going.compress(grads)


def test_the_rows_are_recounted_once_a_window():
    """A layer's rows are counted at its first decision in each window of
    ROW_CHECK_EVERY_STEPS steps; decisions in between keep the window's verdict."""
    from tail_ray.bitwidth.plan import ROW_CHECK_EVERY_STEPS

    rng = np.random.default_rng(5)
    comp = TailCompressor(TailConfig(seed=2))
    sparse = {"embed.weight": _embedding_grad(rng, np.arange(0, VOCAB, 4))}
    dense = {"embed.weight": torch.from_numpy(rng.standard_normal((VOCAB, WIDTH)).astype(np.float32))}
    buckets = []
    for step in range(ROW_CHECK_EVERY_STEPS + 30):
        grads = sparse if step < ROW_CHECK_EVERY_STEPS // 2 else dense
        buckets.append({r.bucket_size for r in decode_payload(comp.compress(grads))})
    window = ROW_CHECK_EVERY_STEPS
    assert all(b == {WIDTH} for b in buckets[:window])  # dense from the middle, the verdict holds
    assert buckets[-1] == {512}  # recounted at the first decision of the next window
    assert comp.controller.plans["embed.weight"].decided_step >= window
