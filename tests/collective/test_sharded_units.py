"""The sharded collectives' pieces in one process: layout, compress_shards, choice, cost model."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from jobs.collective_cost import gpt2_small_layers, simulate
from tail_ray.collective.choice import Collective, resolve
from tail_ray.collective.cost import COLLECTIVES, Codec, Link, collective_cost
from tail_ray.collective.shards import model_layout, restrict, shard_layout
from tail_ray.collective.topology import NodeLayout
from tail_ray.compression import make_compressor
from tail_ray.errors import ConfigError

LAYERS = [("a", 100_000), ("b", 3_000), ("c", 70_000), ("d", 10), ("e", 250_000), ("f", 40_000)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8, 64])
def test_layout_partitions_every_layer_into_aligned_slices_with_distinct_owners(world_size):
    layout = model_layout(LAYERS, world_size, alignment=512, min_slice_numel=4096)
    for name, numel in LAYERS:
        pieces = layout[name]
        assert pieces[0].start == 0 and pieces[-1].stop == numel
        for p, q in itertools.pairwise(pieces):
            assert p.stop == q.start and p.stop % 512 == 0  # contiguous, cut between buckets
        if len(pieces) > 1:
            assert all(p.stop - p.start >= 4096 for p in pieces)
        owners = [p.owner for p in pieces]
        assert len(set(owners)) == len(owners) and all(0 <= o < world_size for o in owners)


def test_layout_is_balanced_and_a_bucket_gets_the_models_slices():
    layers = gpt2_small_layers()
    total = sum(n for _, n in layers)
    for world_size in (8, 256, 1024):
        shards = shard_layout(layers, world_size, alignment=512)
        owned = [sum(s.stop - s.start for s in shard.values()) for shard in shards]
        assert sum(owned) == total
        # Within a few minimum slices of the mean (a hash placement left 1.5x at W = 1024).
        assert max(owned) <= total / world_size + 4 * 16384, (world_size, max(owned), total / world_size)
    # A bucket (a subset of layers, any order) sees the same slices as the whole model.
    shards = shard_layout(layers, 16, alignment=512)
    bucket = ["h3.mlp.fc.w", "wte", "h0.ln1.b"]
    for whole, part in zip(shards, restrict(shards, bucket), strict=True):
        assert part == {name: whole[name] for name in bucket if name in whole}


def test_simulated_traffic_per_rank_is_flat_in_world_size():
    rows = {r["world_size"]: r for r in simulate(gpt2_small_layers(), 1024)}
    for w, r in rows.items():
        assert r["allgather"] == w - 1
        assert r["sharded_mean"] == pytest.approx(2 * (w - 1) / w, rel=1e-6)
        assert r["sharded_max"] <= 2.25
        if w >= 16:
            assert r["hierarchical_node_mean"] <= 2.0 and r["hierarchical_node_max"] <= 2.25


@pytest.mark.parametrize("method", ["tail", "qsgd", "topk"])
def test_compress_shards_sends_exactly_what_compress_would(method):
    """Cutting records between buckets changes nothing: the shards' decoded slices, laid side
    by side, are bit for bit what one payload of the same step decodes to."""
    gen = torch.Generator().manual_seed(0)
    grads = {n: torch.randn(k, generator=gen) for n, k in LAYERS}
    # Tail's nearest: what compress_shards falls back to from dither (test_dither.py)
    settings = {"seed": 3} if method != "topk" else {"density": 0.05}
    if method == "tail":
        settings["rounding"] = "nearest"
    whole = make_compressor(method, **settings).decompress(
        make_compressor(method, **settings).compress(grads)
    )
    sharding = make_compressor(method, **settings)
    shards = shard_layout([(n, t.numel()) for n, t in grads.items()], 4, alignment=sharding.shard_alignment,
                          min_slice_numel=4096)  # fmt: skip
    payloads = sharding.compress_shards(grads, shards)
    assert len(payloads) == 4
    got = {n: torch.full_like(t, float("nan")) for n, t in grads.items()}
    for shard, payload in zip(shards, payloads, strict=True):
        for name, part in shard.items():
            got[name][part] = sharding.decompress(payload)[name]
    for name in grads:
        assert torch.equal(got[name], whole[name]), name
    stats = {s.layer: s for s in sharding.last_stats}
    assert set(stats) == set(grads) and all(s.numel == grads[s.layer].numel() for s in stats.values())


def test_second_stage_has_its_own_residuals_and_independent_rounding():
    first = make_compressor("tail", seed=5)
    second = first.second_stage()
    assert type(second) is type(first) and second.feedback is not first.feedback
    assert second.config.seed != first.config.seed


def test_peer_reports_give_every_rank_the_owners_noise():
    owner, other = make_compressor("tail", seed=1), make_compressor("tail", seed=2)
    gen = torch.Generator().manual_seed(1)
    layer = {"w": torch.randn(8192, generator=gen)}
    payloads = [make_compressor("tail", seed=s).compress({"w": layer["w"] + torch.randn(8192, generator=gen)})
                for s in range(4)]  # fmt: skip
    owner.compress(layer)  # its own step, then the mean of the four ranks
    owner.aggregate(payloads, {"w": torch.zeros(8192)})
    assert other.controller.policy.relative_noise("w") is None
    other.observe_reports([(["w"], owner.peer_report(["w"]))])
    assert other.controller.policy.relative_noise("w") == pytest.approx(
        owner.controller.policy.relative_noise("w")
    )
    other.observe_reports([(["w", "x"], b"short")])  # a report of the wrong size only warns


# Folds what a compressor owes into a gradient at the scales the collectives use (W, 1/W), and
# prints the bits' digest: run under ATen's default (no AVX) and AVX2 kernels.
_FOLD_SCRIPT = """
import hashlib, numpy as np, torch
from tail_ray.collective.exchange import fold_scaled
from tail_ray.compression import make_compressor
rng = np.random.default_rng(0)
h = hashlib.sha256()
for scale in (3.0, 1 / 3, 7.0):
    comp = make_compressor("tail", seed=1)
    residual = torch.from_numpy(rng.standard_normal(10_001).astype(np.float32))
    comp.load_state_dict({**comp.state_dict(), "residuals": {"w": residual}})
    grad = torch.from_numpy(rng.standard_normal(10_001).astype(np.float32))
    fold_scaled(comp, {"w": grad}, scale)
    h.update(grad.numpy().tobytes())
print(h.hexdigest())
"""


def test_folding_what_is_owed_gives_the_same_bits_on_any_cpu():
    """ATen's add_(x, alpha=s) is a fused multiply-add in its AVX2 / AVX-512 kernels and two
    roundings in its default one: the owed residuals must be folded with the same bits on
    every CPU (every rank adds them into a gradient that becomes the parameters)."""
    digests = set()
    for capability in ("default", "avx2"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
        out = subprocess.run(
            [sys.executable, "-c", _FOLD_SCRIPT], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        digests.add(out.stdout.strip())
    assert len(digests) == 1, digests


def test_collective_setting_and_auto():
    with pytest.raises(ConfigError, match=r"allgather.*sharded.*hierarchical.*auto"):
        Collective.parse("ring")
    two_by_two = NodeLayout(node_rank=0, local_rank=1, local_world_size=2)
    assert resolve("auto", world_size=2, layout=None, shardable=True) == Collective.ALLGATHER
    assert resolve("auto", world_size=4, layout=None, shardable=True) == Collective.SHARDED
    assert resolve("auto", world_size=4, layout=two_by_two, shardable=True) == Collective.HIERARCHICAL
    one_node = NodeLayout(node_rank=0, local_rank=1, local_world_size=4)
    assert resolve("auto", world_size=4, layout=one_node, shardable=True) == Collective.SHARDED
    assert resolve("auto", world_size=4, layout=None, shardable=False) == Collective.ALLGATHER
    assert (
        resolve("sharded", world_size=1, layout=None, shardable=True) == Collective.ALLGATHER
    )  # nothing sent
    with pytest.raises(ConfigError, match="node layout"):
        resolve("hierarchical", world_size=4, layout=None, shardable=True)
    with pytest.raises(ConfigError, match="compress shards"):
        resolve("sharded", world_size=4, layout=None, shardable=False)
    with pytest.raises(ConfigError, match="local_rank"):
        NodeLayout(node_rank=0, local_rank=2, local_world_size=2)
    assert NodeLayout.from_env({"GROUP_RANK": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}) == NodeLayout(
        1, 0, 8
    )
    assert NodeLayout.from_env({}) is None


def test_cost_model_terms():
    link, codec = Link(10.0, alpha_s=0.0), Codec(compress_gbps=2.0, decode_gbps=4.0)
    g, ratio = 400e6, 10.0
    p = g / ratio
    for w in (2, 8, 1024):
        ring = collective_cost("ring", world_size=w, gradient_bytes=g, ratio=ratio, link=link)
        assert ring.bytes_sent == pytest.approx(2 * (w - 1) / w * g)
        assert ring.link_s == pytest.approx(ring.bytes_sent / 1.25e9)
        ag = collective_cost("allgather", world_size=w, gradient_bytes=g, ratio=ratio, link=link, codec=codec)
        assert ag.bytes_sent == pytest.approx((w - 1) * p, rel=1e-6)
        assert ag.codec_s == pytest.approx(g / 2e9 + (w - 1) * g / 4e9)
        sh = collective_cost("sharded", world_size=w, gradient_bytes=g, ratio=ratio, link=link, codec=codec)
        words = 2 * (w - 1) * 16  # a length and an envelope word per message
        assert sh.bytes_sent == pytest.approx(2 * (w - 1) / w * p + words)
        assert sh.bytes_sent <= 2 * p * 1.001  # flat in W
    hier = collective_cost(
        "hierarchical",
        world_size=64,
        gradient_bytes=g,
        ratio=ratio,
        link=link,
        codec=codec,
        local_world_size=8,
    )
    assert hier.link_bytes == pytest.approx(2 * 7 / 8 * p, rel=1e-4) and hier.local_s > 0
    assert collective_cost("hierarchical", world_size=8, gradient_bytes=g, ratio=ratio, link=link,
                           local_world_size=8).link_bytes == 0  # fmt: skip
    assert set(COLLECTIVES) == {"ring", "allgather", "sharded", "hierarchical"}
    with pytest.raises(ConfigError):
        collective_cost("tree", world_size=4, gradient_bytes=g, ratio=ratio, link=link)
