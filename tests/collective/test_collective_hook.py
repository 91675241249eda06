"""The comm hook against plain DDP, world size 2 on gloo, in spawned processes.

Each test spawns its own 2-process group (about 3 s); the workers write what they saw to
files in tmp_path and the assertions run here, in the parent.
"""

import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective import TailHookState, make_hook_state, register_tail_hook
from tail_ray.collective.hook import tail_hook
from tail_ray.collective.launch import run_local_group
from tail_ray.collective.transport import SIZE_BYTES, all_gather_bytes, ring_allreduce_bytes
from tail_ray.compression import make_compressor
from tail_ray.compression.wire import _HEADER

PAYLOAD_HEADER_BYTES = _HEADER.size
TIMEOUT_S = 60


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Several layers of different shapes so that a small bucket_cap_mb makes many buckets.
    return nn.Sequential(
        nn.Linear(32, 128),
        nn.ReLU(),
        nn.Linear(128, 96),
        nn.ReLU(),
        nn.Linear(96, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# -- transport ---------------------------------------------------------------------------------


def _transport_worker(rank, world_size, out_dir):
    # Rank 0 sends an empty payload, rank 1 a long one: sizes differ, gloo still needs equal sizes.
    payload = bytes((rank * 31 + i) % 256 for i in range(rank * 5000))
    got, traffic = all_gather_bytes(payload)
    torch.save({"got": got, "traffic": traffic}, out_dir / f"rank{rank}.pt")


def test_payloads_of_different_sizes_are_gathered_exactly(tmp_path):
    run_local_group(_transport_worker, 2, (tmp_path,), timeout_s=TIMEOUT_S)
    expected = [bytes((r * 31 + i) % 256 for i in range(r * 5000)) for r in range(2)]
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert res["got"] == expected
        assert res["traffic"].payload_bytes == len(expected[rank])
        assert res["traffic"].bytes_sent == SIZE_BYTES + 5000
        assert res["traffic"].bytes_received == SIZE_BYTES + 5000


# -- "none" equals plain DDP ---------------------------------------------------------------------


def _none_vs_ddp_worker(rank, world_size, out_dir, method, use_allgather):
    plain = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    hooked = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    if use_allgather:
        # The all-gather hook path with the exact raw-fp32 compressor: must match all-reduce.
        state = TailHookState("qsgd", hooked, compressor=make_compressor("none"))
        hooked.register_comm_hook(state, tail_hook)
    else:
        state = register_tail_hook(hooked, method)
    results = []
    for step in range(3):
        x, y = _batch(rank, step)
        for m in (plain, hooked):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        results.append(
            {"plain": _grads(plain.module), "hooked": _grads(hooked.module), "metrics": state.drain_metrics()}
        )
    torch.save(results, out_dir / f"rank{rank}.pt")


@pytest.mark.parametrize("use_allgather", [False, True], ids=["allreduce", "allgather"])
def test_none_gives_the_gradients_of_plain_ddp(tmp_path, use_allgather):
    run_local_group(_none_vs_ddp_worker, 2, (tmp_path, "none", use_allgather), timeout_s=TIMEOUT_S)
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    raw_bytes = 4 * sum(p.numel() for p in model.parameters())
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for steps in per_rank:
        # DDP puts everything in one bucket for step 0 and rebuilds buckets after it.
        assert steps[-1]["metrics"].exchanges >= 3  # bucket_cap_mb=0.01 gives several buckets
        for res in steps:
            for name in names:
                # allreduce: the same sum in the same order -> bitwise; allgather: (a+b)/2 vs a/2+b/2.
                torch.testing.assert_close(res["hooked"][name], res["plain"][name], rtol=1e-6, atol=1e-7)
            met = res["metrics"]
            assert sorted(layer.layer for layer in met.layers) == sorted(names)
            assert met.raw_bytes == raw_bytes
            if use_allgather:
                # Per bucket: a size word + the payload (its header + the layers' bytes); equal
                # sizes on both ranks here, so no padding.
                assert met.bytes_sent == met.encoded_bytes + met.exchanges * (
                    SIZE_BYTES + PAYLOAD_HEADER_BYTES
                )
                assert met.bytes_received == met.bytes_sent
            else:
                assert met.bytes_sent <= ring_allreduce_bytes(raw_bytes, 2) + 64
                assert met.bytes_sent >= ring_allreduce_bytes(raw_bytes, 2) - 64
            assert met.comm_s > 0.0
    # Both ranks end with the same averaged gradient.
    for name in names:
        torch.testing.assert_close(per_rank[0][-1]["hooked"][name], per_rank[1][-1]["hooked"][name])


# -- many buckets, every method: same collective order on both ranks ----------------------------


def _many_buckets_worker(rank, world_size, out_dir, method, config):
    torch.manual_seed(0)
    # 12 layers, bucket_cap_mb tiny: about one bucket per layer, all in flight in one backward.
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(48, 48), nn.Tanh()) for _ in range(12)], nn.Linear(48, 10)
    )
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
    state = register_tail_hook(ddp, method, config)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    exchanges = []
    for step in range(6):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 48, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        exchanges.append(state.drain_metrics().exchanges)
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    torch.save({"params": params, "exchanges": exchanges}, out_dir / f"rank{rank}.pt")


MANY_BUCKET_METHODS = [
    ("none", None),
    ("fp16", None),
    ("bf16", None),
    ("powersgd", {"rank": 2}),
]


@pytest.mark.parametrize(("method", "config"), MANY_BUCKET_METHODS, ids=[m for m, _ in MANY_BUCKET_METHODS])
def test_many_buckets_no_hang_no_mismatch_and_ranks_stay_in_sync(tmp_path, method, config):
    # A collective mismatch raises on gloo, a hang hits the group's timeout: both fail here.
    run_local_group(_many_buckets_worker, 2, (tmp_path, method, config), timeout_s=TIMEOUT_S)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert r0["exchanges"][-1] >= 10, "the test needs many buckets in flight"
    # Every rank applied the same averaged gradient at every step, so weights are identical.
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name


# -- checkpoints --------------------------------------------------------------------------------


def _pickle_worker(rank, world_size, out_dir):
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    state = register_tail_hook(ddp, "powersgd", {"rank": 1})
    for step in range(4):
        x, y = _batch(rank, step)
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
    (out_dir / f"rank{rank}.pkl").write_bytes(pickle.dumps(state))
    torch.save(state.state_dict(), out_dir / f"rank{rank}.pt")


def test_state_pickles_without_process_group_and_restores(tmp_path):
    run_local_group(_pickle_worker, 2, (tmp_path,), timeout_s=TIMEOUT_S)
    # Unpickled in this process, which has no process group at all.
    assert not dist.is_initialized()
    state = pickle.loads((tmp_path / "rank0.pkl").read_bytes())
    assert state.process_group is None
    assert state.powersgd.process_group is None
    assert state.powersgd.iter == 4
    assert state.powersgd.error_dict, "PowerSGD's error feedback memory travels with the pickle"
    # state_dict restores into a fresh state built for a new model object.
    fresh = make_hook_state(_model(), "powersgd", {"rank": 1})
    fresh.load_state_dict(torch.load(tmp_path / "rank0.pt", weights_only=False))
    assert fresh.powersgd.iter == 4


def test_state_dict_is_keyed_by_parameter_name():
    model = _model()
    state = make_hook_state(model, "powersgd", {"rank": 1, "start_powerSGD_iter": 2})
    from tail_ray.collective import compress_gradients_locally

    for step in range(4):
        x, y = _batch(0, step)
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        compress_gradients_locally(state, model)
    saved = state.state_dict()
    weights = {n for n, p in model.named_parameters() if p.dim() == 2}
    assert set(saved["local_powersgd_error"]) == weights
    restored = make_hook_state(_model(), "powersgd", {"rank": 1})
    restored.load_state_dict(pickle.loads(pickle.dumps(saved)))
    for name in weights:
        assert torch.equal(restored.local_powersgd_error[name], state.local_powersgd_error[name])
    assert restored.local_step == 4
