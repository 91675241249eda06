"""The hook's decode step takes this rank's own payload from the compressor (no entropy decode)."""

import numpy as np
import pytest
import torch

from tail_ray.collective.hook import decode_all
from tail_ray.compression import make_compressor
from tail_ray.compression.tail import TailCompressor, TailConfig


@pytest.mark.parametrize("own_rank", [0, 1])
def test_decode_all_matches_decoding_every_payload(own_rank: int) -> None:
    rng = np.random.default_rng(own_rank)
    comps = [TailCompressor(TailConfig(seed=10 + r)) for r in range(2)]
    grads = [
        {
            "w": torch.from_numpy(rng.standard_normal(20_000).astype(np.float32)),
            "b": torch.from_numpy(rng.standard_normal(64).astype(np.float32)),
        }
        for _ in range(2)
    ]
    payloads = [c.compress(g) for c, g in zip(comps, grads, strict=True)]
    mine = comps[own_rank]
    got = decode_all(mine, payloads, own_rank)
    want = [TailCompressor().decompress(p) for p in payloads]
    for g_rank, w_rank in zip(got, want, strict=True):
        assert list(g_rank) == list(w_rank)
        for name in w_rank:
            torch.testing.assert_close(g_rank[name], w_rank[name], rtol=0, atol=0)


def test_decode_all_without_shortcut_decodes_everything() -> None:
    comp = make_compressor("qsgd", bits=4)
    payloads = [comp.compress({"w": torch.ones(5000) * k}) for k in (1.0, 2.0)]
    got = decode_all(comp, payloads, 0)
    assert [float(d["w"].mean()) for d in got] == pytest.approx([1.0, 2.0], rel=0.05)
