"""A compressor's ``aggregate`` (the fused decode-average the payload hook calls) against the reference.

The reference is unfused: decode every payload to tensors, average in rank order, copy_. The
fused path must match it bit for bit, with the same controller statistics whether this rank's
own payload is decoded or taken from the compressor's own records."""

from typing import Any

import numpy as np
import pytest
import torch

from tail_ray.compression import make_compressor
from tail_ray.compression.aggregate import mean_tensors_into
from tail_ray.compression.tail import TailCompressor, TailConfig
from tail_ray.errors import CodecError

SIZES = {"w": 70_001, "v": 40_000, "n": 8_192, "b": 100}


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().view(-1).numpy().view(np.int32)


def _payloads(world: int, step_seed: int = 0, nan_rank: int | None = None) -> tuple[list[Any], list[bytes]]:
    """Each rank pinned to different bits (so ranks' layers differ in bits); ``nan_rank`` sends
    layer "n" raw (non-finite), the others quantize it: a mixed layer."""
    rng = np.random.default_rng(step_seed)
    comps = [
        TailCompressor(TailConfig(seed=7 + r, candidate_bits=((2, 3, 4, 5, 8)[r % 5],))) for r in range(world)
    ]
    payloads = []
    for r, comp in enumerate(comps):
        for _ in range(2):  # a second step: residuals and the controller are in play
            grads = {
                n: torch.from_numpy(rng.standard_normal(k).astype(np.float32) * 1e-2)
                for n, k in SIZES.items()
            }
            if r == nan_rank:
                grads["n"][5] = float("nan")
            payload = comp.compress(grads)
        payloads.append(payload)
    return comps, payloads


def _recorder(comp: TailCompressor) -> list[tuple[str, float, float, float]]:
    calls: list[tuple[str, float, float, float]] = []
    comp.controller.policy.observe_spread = lambda *a: calls.append(a)  # type: ignore[method-assign]
    return calls


def _bucket(names: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Gradient views of one flat buffer, as DDP hands them to the hook."""
    buf = torch.full((sum(SIZES[n] for n in names),), 123.0)
    views, at = {}, 0
    for n in names:
        views[n] = buf[at : at + SIZES[n]]
        at += SIZES[n]
    return buf, views


def _reference(payloads: list[bytes], names: list[str]) -> dict[str, torch.Tensor]:
    """The unfused mean: every payload decoded to tensors, summed in rank order, divided."""
    out = {n: torch.empty(SIZES[n]) for n in names}
    mean_tensors_into([TailCompressor().decompress(p) for p in payloads], out)
    return out


@pytest.mark.parametrize(
    ("world", "own_rank", "nan_rank"), [(2, 0, None), (2, 1, 0), (3, 2, 1), (4, 1, None)]
)
def test_fused_equals_unfused_bit_for_bit(world: int, own_rank: int, nan_rank: int | None) -> None:
    names = list(SIZES)
    comps, payloads = _payloads(world, nan_rank=nan_rank)
    want = _reference(payloads, names)
    # Decoding every payload (own=None) ...
    want_calls = _recorder(comps[own_rank])
    _, decoded_grads = _bucket(names)
    comps[own_rank].aggregate(payloads, decoded_grads, own=None)
    # ... and taking this rank's own from its records give the same mean and statistics.
    comps, payloads = _payloads(world, nan_rank=nan_rank)
    got_calls = _recorder(comps[own_rank])
    _, grads = _bucket(names)
    comps[own_rank].aggregate(payloads, grads, own=own_rank)
    for name in names:
        np.testing.assert_array_equal(_bits(grads[name]), _bits(want[name]), err_msg=name)
        np.testing.assert_array_equal(_bits(decoded_grads[name]), _bits(want[name]), err_msg=name)
    # repr: exact for floats, and NaN (a non-finite layer's spread) compares equal to itself.
    assert repr(got_calls) == repr(want_calls) and len(got_calls) == 3  # b is below raw_below_numel


def test_own_payload_is_not_decoded_and_records_are_handed_out_once() -> None:
    comps, payloads = _payloads(2)
    names = list(SIZES)
    want = _reference(payloads, names)
    _, grads = _bucket(names)
    # Rank 1's own entry is garbage: aggregate takes its records from the compressor.
    comps[1].aggregate([payloads[0], b"not a payload"], grads, own=1)
    for name in names:
        np.testing.assert_array_equal(_bits(grads[name]), _bits(want[name]))
    with pytest.raises(CodecError, match=r"checksum|magic|header"):  # now it must decode its own
        comps[1].aggregate([payloads[0], b"not a payload"], grads, own=1)


@pytest.mark.parametrize("what", ["missing", "numel"])
def test_a_bad_peer_payload_raises_codec_error_and_writes_nothing(what: str) -> None:
    comps, payloads = _payloads(2)
    names = list(SIZES)
    other = TailCompressor(TailConfig(seed=3))
    rng = np.random.default_rng(9)
    grads_peer = {n: torch.from_numpy(rng.standard_normal(k).astype(np.float32)) for n, k in SIZES.items()}
    if what == "missing":
        del grads_peer["v"]
    else:
        grads_peer["v"] = torch.ones(SIZES["v"] + 1)
    buf, grads = _bucket(names)
    with pytest.raises(CodecError) as info:
        comps[0].aggregate([payloads[0], other.compress(grads_peer)], grads, own=0)
    if what == "missing":
        assert info.value.layer == "v" and info.value.field == "name"
    else:  # one element too many: over the bucket's total (checked while decoding) or v's size
        assert info.value.field == "numel"
        assert info.value.layer == "v" or "add up to more than" in str(info.value)
    assert bool((buf == 123.0).all())  # checked before anything is written


def test_a_tiny_payload_claiming_a_huge_layer_fails_before_allocating_it() -> None:
    """A 50M-element all-zero layer codes to 1/500 of its fp32 size (its scales); aggregate
    bounds every payload by the gradients' total size, so the decoder refuses it before
    allocating 50M levels."""
    comps, payloads = _payloads(2)
    names = list(SIZES)
    huge = TailCompressor(TailConfig(seed=3)).compress({"v": torch.zeros(50_000_000)})
    assert len(huge) < 4 * 50_000_000 // 500
    buf, grads = _bucket(names)
    with pytest.raises(CodecError) as info:
        comps[0].aggregate([payloads[0], huge], grads, own=0)
    assert info.value.field == "numel" and "exceeds" in str(info.value)
    assert bool((buf == 123.0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_non_fp32_and_non_contiguous_gradients(dtype: torch.dtype) -> None:
    comps, payloads = _payloads(2)
    payloads = [
        c.compress({"w": torch.randn(300, 200) * 1e-2, "v": torch.randn(SIZES["v"]) * 1e-2}) for c in comps
    ]
    want = {"w": torch.empty(300 * 200), "v": torch.empty(SIZES["v"])}
    mean_tensors_into([TailCompressor().decompress(p) for p in payloads], want)
    w = torch.zeros(200, 300).t()  # non-contiguous fp32
    v = torch.zeros(SIZES["v"], dtype=dtype)
    comps[0].aggregate(payloads, {"w": w, "v": v}, own=0)
    assert not w.is_contiguous()
    np.testing.assert_array_equal(_bits(w), _bits(want["w"].view(300, 200)))
    ref_v = torch.zeros(SIZES["v"], dtype=dtype).copy_(want["v"])
    assert torch.equal(v, ref_v)


@pytest.mark.parametrize("method", ["qsgd", "topk", "none"])
def test_other_compressors_equal_decoding_everything(method: str) -> None:
    """qsgd and topk (sparse layers) take the records path; "none" the contract's default
    (decompress every payload to tensors, then average)."""
    settings: dict[str, Any] = {"qsgd": {"bits": 3}, "topk": {"density": 0.05}, "none": {}}[method]
    comps = [make_compressor(method, **settings) for _ in range(2)]
    gen = torch.Generator().manual_seed(2)
    payloads = [
        c.compress({"w": torch.randn(20_000, generator=gen), "b": torch.randn(10, generator=gen)})
        for c in comps
    ]
    want = {"w": torch.empty(20_000), "b": torch.empty(10)}
    mean_tensors_into([comps[0].decompress(p) for p in payloads], want)
    grads = {"w": torch.zeros(20_000), "b": torch.zeros(10)}
    comps[0].aggregate(payloads, grads, own=0)
    for name, g in grads.items():
        np.testing.assert_array_equal(_bits(g), _bits(want[name]))


def test_the_contract_default_checks_every_payload_before_writing() -> None:
    """The default ``aggregate`` (decode to tensors) also refuses a payload that lacks a layer,
    naming the rank, and writes nothing."""
    comp = make_compressor("none")
    payloads = [comp.compress({"w": torch.ones(8), "b": torch.ones(2)}), comp.compress({"w": torch.ones(8)})]
    grads = {"w": torch.zeros(8), "b": torch.zeros(2)}
    with pytest.raises(CodecError, match="rank 1") as info:
        comp.aggregate(payloads, grads)
    assert info.value.layer == "b"
    assert all(bool((g == 0).all()) for g in grads.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gradients_on_a_gpu_get_the_same_mean() -> None:
    comps, payloads = _payloads(2)
    names = list(SIZES)
    want = _reference(payloads, names)
    grads = {n: torch.zeros(SIZES[n], device="cuda") for n in names}
    comps[0].aggregate(payloads, grads, own=0)
    for name, g in grads.items():
        np.testing.assert_array_equal(_bits(g.cpu()), _bits(want[name]))
