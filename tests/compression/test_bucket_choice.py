"""Bucket size per layer (issue 15, ``TailConfig(bucket_choice="auto")``): never more error than
the base bucket at the controller's bits, fewer bytes where units differ in scale, the same
choice for the same input, and payloads any instance decodes and averages."""

import numpy as np
import pytest
import torch

from tail_ray import ConfigError, TailCompressor, TailConfig
from tail_ray.bitwidth.bucket_choice import MIN_GAIN, choose_bucket
from tail_ray.bitwidth.quant_error import relative_errors
from tail_ray.compression.records import QuantRecord
from tail_ray.compression.tail_config import DITHER_START_STEPS
from tail_ray.compression.wire import decode_payload

BITS = (2, 3, 4, 5, 6, 8)


def _rows(seed: int, rows: int = 128, cols: int = 512, spread: float = 1.5) -> np.ndarray:
    """A matrix gradient whose rows (units) differ in scale, as fc layers' do: delta_j x a."""
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal((rows, 1)) * spread)
    return (rng.standard_normal((rows, cols)) * scale * 1e-3).astype(np.float32).ravel()


def _exact(x: np.ndarray, bucket: int) -> list[float]:
    return relative_errors(x, None, bucket, BITS, sample_numel=None, rng=np.random.default_rng(0)).tolist()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("bits", [3, 4])
def test_the_pick_has_no_more_error_than_the_base_bucket_at_its_bits(seed, bits):
    x = _rows(seed)
    pick = choose_bucket(x, 512, bits, BITS, sample_numel=None, rng=np.random.default_rng(seed))
    assert pick is not None and pick.bucket_size > 512  # units of different scale: larger buckets pay
    limit = _exact(x, 512)[BITS.index(bits)]
    assert pick.rel_error <= limit and pick.saving >= MIN_GAIN
    assert _exact(x, pick.bucket_size)[BITS.index(pick.bits)] == pytest.approx(pick.rel_error, rel=1e-9)


def test_the_pick_is_the_same_for_the_same_input_and_sample():
    x = _rows(3)
    picks = {
        choose_bucket(x, 512, 4, BITS, sample_numel=4096, rng=np.random.default_rng(7)) for _ in range(3)
    }
    assert len(picks) == 1


# (With 2-byte scales a larger bucket saves less than with 4: these spreads were 0.4 and 0.7.)
@pytest.mark.parametrize(("spread", "seed"), [(0.6, 0), (0.9, 0), (1.0, 0)])
def test_a_saving_within_a_sample_s_noise_keeps_the_base(spread, seed):
    # Units that differ a little: a larger bucket at a bit more saves < 1 % (estimated), too
    # little to trust; the base is kept. Without the margin it would be taken.
    x = _rows(seed, spread=spread)
    pick = choose_bucket(x, 512, 4, BITS, sample_numel=None, rng=np.random.default_rng(0), min_gain=0.0)
    assert pick is not None and 0 < pick.saving < MIN_GAIN
    assert choose_bucket(x, 512, 4, BITS, sample_numel=None, rng=np.random.default_rng(0)) is None


def test_no_pick_for_a_layer_too_small_for_a_second_bucket_or_all_zero():
    assert (
        choose_bucket(_rows(0, rows=1), 512, 4, BITS, sample_numel=None, rng=np.random.default_rng(0)) is None
    )
    zeros = np.zeros(8192, np.float32)
    assert choose_bucket(zeros, 512, 4, BITS, sample_numel=None, rng=np.random.default_rng(0)) is None


def _tail(choice: str, seed: int = 5) -> TailCompressor:
    return TailCompressor(TailConfig(bucket_choice=choice, allocation="layer", seed=seed, sample_numel=None))


def test_auto_sends_fewer_bytes_at_no_more_error_and_any_instance_decodes_it():
    grads = {"fc.weight": torch.from_numpy(_rows(4).reshape(128, 512)), "b": torch.zeros(10)}
    fixed, auto = _tail("fixed"), _tail("auto")
    for _ in range(DITHER_START_STEPS + 1):  # past dither's first steps at the largest bits
        p_fixed, p_auto = fixed.compress(grads), auto.compress(grads)
    rec = {r.name: r for r in decode_payload(p_auto)}["fc.weight"]
    assert isinstance(rec, QuantRecord) and rec.bucket_size > 512  # the wire carries the layer's bucket
    assert auto.controller.plans["fc.weight"].bucket_size == rec.bucket_size
    assert len(p_auto) < 0.9 * len(p_fixed)
    st_fixed, st_auto = fixed.last_stats[0], auto.last_stats[0]
    assert st_auto.rel_error <= st_fixed.rel_error
    out = TailCompressor().decompress(p_auto)["fc.weight"]  # a default instance decodes it
    x = grads["fc.weight"].reshape(-1)
    measured = float((out - x).pow(2).sum() / x.pow(2).sum())
    assert measured < 2 * st_fixed.rel_error  # one draw around its expectation


def test_ranks_with_different_buckets_average_as_their_decodes_do():
    grads = [{"fc.weight": torch.from_numpy(_rows(10 + r).reshape(128, 512))} for r in range(2)]
    comps = [_tail("auto", seed=1), _tail("fixed", seed=2)]
    payloads = [c.compress(g) for c, g in zip(comps, grads, strict=True)]
    sizes = {decode_payload(p)[0].bucket_size for p in payloads}
    assert len(sizes) == 2  # one rank chose another bucket than 512
    out = {"fc.weight": torch.empty(128, 512)}
    comps[0].aggregate(payloads, out, own=0)
    decoded = [TailCompressor().decompress(p)["fc.weight"] for p in payloads]
    expected = ((decoded[0].double() + decoded[1].double()) / 2).float().reshape(128, 512)
    assert torch.equal(out["fc.weight"], expected)


def test_state_dict_keeps_the_bucket_and_fixed_ignores_it():
    grads = {"fc.weight": torch.from_numpy(_rows(6).reshape(128, 512))}
    auto = _tail("auto")
    auto.compress(grads)
    state = auto.state_dict()
    bucket = auto.controller.plans["fc.weight"].bucket_size
    assert bucket > 512 and state["controller"]["plans"]["fc.weight"]["bucket_size"] == bucket
    again, fixed = _tail("auto"), _tail("fixed")
    again.load_state_dict(state)
    fixed.load_state_dict(state)
    assert again.controller.plans["fc.weight"].bucket_size == bucket
    assert fixed.controller.plans["fc.weight"].bucket_size == 512
    assert {r.bucket_size for r in decode_payload(fixed.compress(grads))} == {512}


@pytest.mark.parametrize("rounding", ["dither", "nearest"])
def test_a_checkpoint_with_per_layer_buckets_resumes_into_a_sharded_exchange(rounding):
    """Plans restored at a bucket other than the configured one decide again when the
    sharded exchange fixes one bucket (its slices are cut at its multiples), instead of
    failing on the first step (a second review's finding)."""
    comp = TailCompressor(
        TailConfig(seed=1, bucket_choice="auto", rounding=rounding, lowrank="off", sample_numel=None)
    )
    grads = {"fc.weight": torch.from_numpy(_rows(6).reshape(128, 512))}
    comp.compress(grads)
    state = comp.state_dict()
    assert state["controller"]["plans"]["fc.weight"]["bucket_size"] > 512
    resumed = TailCompressor(
        TailConfig(seed=1, bucket_choice="auto", rounding=rounding, lowrank="off", sample_numel=None)
    )
    resumed.load_state_dict(state)
    shards = [{"fc.weight": slice(0, 32768)}, {"fc.weight": slice(32768, 65536)}]
    payloads = resumed.compress_shards(grads, shards, own_shard=0)
    assert {r.bucket_size for p in payloads for r in decode_payload(p)} == {512}


def test_settings_and_the_paths_that_keep_one_bucket():
    with pytest.raises(ConfigError, match="bucket_choice must be one of"):
        TailConfig(bucket_choice="per-layer")
    with pytest.raises(ConfigError, match="needs allocation"):
        TailCompressor(TailConfig(bucket_choice="auto", allocation="model"))
    assert TailConfig().bucket_choice == "fixed"
    # Sharded exchanges cut layers between buckets of one size: auto is off there.
    comp = _tail("auto")
    grads = {"fc.weight": torch.from_numpy(_rows(8).reshape(128, 512))}
    shards = [{"fc.weight": slice(0, 32768)}, {"fc.weight": slice(32768, 65536)}]
    payloads = comp.compress_shards(grads, shards)
    assert {r.bucket_size for p in payloads for r in decode_payload(p)} == {512}
    assert comp.second_stage().controller.bucket_choice == "fixed"
