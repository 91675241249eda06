"""The comm hook against plain DDP, world size 2 on gloo, in spawned processes.

Spawning a process pair costs seconds (each imports torch), so ONE pair, started by the
module fixture ``scenarios``, runs every scenario in turn; each scenario writes what both
ranks saw into its own folder and the tests assert on those files here, in the parent.
"""

import pickle

import pytest
import torch
from torch import nn

from tail_ray.collective import PayloadHookState, make_hook_state, register_tail_hook
from tail_ray.collective.launch import run_local_group
from tail_ray.collective.payload import payload_hook
from tail_ray.collective.transport import SIZE_BYTES, all_gather_bytes, ring_allreduce_bytes
from tail_ray.compression import make_compressor
from tail_ray.compression.wire import PAYLOAD_OVERHEAD_BYTES
from tail_ray.errors import ConfigError

PAYLOAD_HEADER_BYTES = PAYLOAD_OVERHEAD_BYTES  # header + CRC32 trailer
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
    # Rank 0 sends an empty payload, rank 1 a long one: sizes differ (gloo's all-gather would pad).
    payload = bytes((rank * 31 + i) % 256 for i in range(rank * 5000))
    got, traffic = all_gather_bytes(payload)
    torch.save({"got": got, "traffic": traffic}, out_dir / f"rank{rank}.pt")


def test_payloads_of_different_sizes_are_gathered_exactly(scenarios):
    tmp_path = scenarios / "transport"
    expected = [bytes((r * 31 + i) % 256 for i in range(r * 5000)) for r in range(2)]
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert res["got"] == expected
        assert res["traffic"].payload_bytes == len(expected[rank])
        # Exact sizes, nothing padded: rank 0 sends its size word alone, rank 1 its 5000 bytes.
        assert res["traffic"].bytes_sent == SIZE_BYTES + len(expected[rank])
        assert res["traffic"].bytes_received == SIZE_BYTES + len(expected[1 - rank])
        assert res["traffic"].padded_bytes == 5000


# -- "none" equals plain DDP ---------------------------------------------------------------------


def _none_vs_ddp_worker(rank, world_size, out_dir, method, use_allgather):
    plain = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    hooked = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    if use_allgather:
        # The all-gather hook path with the exact raw-fp32 compressor: must match all-reduce.
        state = PayloadHookState("qsgd", hooked, make_compressor("none"))
        hooked.register_comm_hook(state, payload_hook)
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
def test_none_gives_the_gradients_of_plain_ddp(scenarios, use_allgather):
    tmp_path = scenarios / ("none_allgather" if use_allgather else "none_allreduce")
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    raw_bytes = 4 * sum(p.numel() for p in model.parameters())
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for steps in per_rank:
        # DDP puts everything in one bucket for step 0 and rebuilds buckets after it.
        assert steps[-1]["metrics"].exchanges >= 3  # bucket_cap_mb=0.01 gives several buckets
        for res in steps:
            for name in names:
                if use_allgather:  # (a + b) / 2 here, a / 2 + b / 2 in DDP: rounding differs
                    torch.testing.assert_close(res["hooked"][name], res["plain"][name], rtol=1e-6, atol=1e-7)
                else:  # PyTorch's allreduce_hook: the very computation DDP does without a hook
                    assert torch.equal(res["hooked"][name], res["plain"][name]), name
            met = res["metrics"]
            assert sorted(layer.layer for layer in met.layers) == sorted(names)
            assert met.raw_bytes == raw_bytes
            if use_allgather:
                # Per bucket: a size word + the payload (its header, the layers' bytes, the CRC);
                # equal sizes on both ranks here.
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

MANY_BUCKET_METHODS = [
    ("none", None),
    ("fp16", None),
    ("bf16", None),
    ("powersgd", {"rank": 2}),
    ("qsgd", {"bits": 8}),
    ("topk", {"density": 0.05}),
    ("tail", None),
]


def _many_buckets_worker(rank, world_size, out_dir):
    # One process pair runs every method in turn (spawning costs seconds on a busy machine).
    out = {}
    for method, config in MANY_BUCKET_METHODS:
        torch.manual_seed(0)
        # 12 layers >= 4096 elements and a tiny bucket_cap_mb: one bucket per layer or so, all
        # in flight in one backward.
        model = nn.Sequential(
            *[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(12)], nn.Linear(64, 10)
        )
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.001)
        state = register_tail_hook(ddp, method, config)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        exchanges = []
        for step in range(5):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            metrics = state.drain_metrics()
            exchanges.append(metrics.exchanges)
        params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
        out[method] = {"params": params, "exchanges": exchanges, "last": metrics}
    torch.save(out, out_dir / f"rank{rank}.pt")


def test_many_buckets_every_method_no_hang_no_mismatch_ranks_in_sync(scenarios):
    # A collective mismatch raises on gloo, a hang hits the group's timeout: either fails the
    # scenarios fixture, and so this test.
    tmp_path = scenarios / "many_buckets"
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))
    assert list(r0) == [m for m, _ in MANY_BUCKET_METHODS]
    for method, res in r0.items():
        assert res["exchanges"][-1] >= 10, f"{method}: the test needs many buckets in flight"
        last = res["last"]
        assert len(last.layers) == 26 and last.bytes_sent > 0
        assert all(0.0 <= layer.rel_error < 1.0 for layer in last.layers), method
        if method != "none":
            assert last.bytes_sent < last.raw_bytes, method
        # Every rank applied the same averaged gradient at every step, so weights are identical.
        for name, p in res["params"].items():
            assert torch.equal(p, r1[method]["params"][name]), (method, name)


# -- tail pinned to 8 bits vs plain DDP: within the analytic bound ------------------------------


def _tail8_worker(rank, world_size, out_dir):
    local = _model()
    plain = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    hooked = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    state = register_tail_hook(
        hooked, "tail", {"candidate_bits": (8,), "raw_below_numel": 4096, "small_layer_bits": 32}
    )
    steps = []
    for step in range(4):  # no optimizer step: same weights, residuals carry over steps
        x, y = _batch(rank, step)
        for m in (local, plain, hooked):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        steps.append(
            {
                "local": _grads(local),
                "plain": _grads(plain.module),
                "hooked": _grads(hooked.module),
                "metrics": state.drain_metrics(),
            }
        )
    torch.save(steps, out_dir / f"rank{rank}.pt")


def test_tail_pinned_to_8_bits_is_within_the_quantization_bound_of_plain_ddp(scenarios):
    tmp_path = scenarios / "tail8"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    levels = 2 ** (8 - 1) - 1
    # raw_below_numel=4096, small_layer_bits=32 in the worker: smaller layers go raw fp32,
    # exactly averaged.
    quantized = {n for n, g in ranks[0][0]["local"].items() if g.numel() >= 4096}
    assert quantized == {"0.weight", "2.weight", "4.weight"}
    for step in range(4):
        # Per element, stochastic rounding moves a value by less than one step s/L, s the
        # bucket's max-abs <= the layer's max-abs. The hook applies d_i = g_i + e_i - e_i' with
        # |e_i|, |e_i'| < s/L (e_i = 0 at step 0), and averages over ranks.
        for name in ranks[0][step]["plain"]:
            plain = ranks[0][step]["plain"][name]
            hooked = ranks[0][step]["hooked"][name]
            if name not in quantized:
                torch.testing.assert_close(hooked, plain, rtol=1e-6, atol=1e-7)
                continue
            biggest = max(float(r[s]["local"][name].abs().max()) for r in ranks for s in range(step + 1))
            n_steps_of_error = 1 if step == 0 else 2
            bound = n_steps_of_error * biggest * (1 + 1 / levels) / levels
            err = float((hooked - plain).abs().max())
            assert 0 < err <= bound, (step, name, err, bound)
            torch.testing.assert_close(hooked, ranks[1][step]["hooked"][name], rtol=0, atol=0)
        met = ranks[0][step]["metrics"]
        by_layer = {s.layer: s for s in met.layers}
        assert all(by_layer[n].bits == 8 for n in quantized)
        assert met.bytes_sent < met.raw_bytes


# -- the link-aware switch: both modes, the same choices on both ranks ---------------------------

GATE_SETTINGS = {
    "link_warmup_steps": 1,
    "link_trial_steps": 2,
    "link_recheck_every_steps": 3,
    "link_max_recheck_every_steps": 6,
    "raw_below_numel": 1024,
}
GATE_STEPS = 24


def _gate_worker(rank, world_size, out_dir):
    plain = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    hooked = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
    state = register_tail_hook(hooked, "tail", GATE_SETTINGS)
    steps = []
    for step in range(GATE_STEPS):  # no optimizer step: same weights, so plain DDP is the reference
        x, y = _batch(rank, step)
        for m in (plain, hooked):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        steps.append(
            {
                "plain": _grads(plain.module),
                "hooked": _grads(hooked.module),
                "metrics": state.drain_metrics(),
                "residuals": state.compressor.feedback.names(),
            }
        )
    torch.save({"steps": steps, "decisions": state.gate.decisions}, out_dir / f"rank{rank}.pt")


def test_link_switch_makes_the_same_choices_on_every_rank_and_plain_steps_are_exact(scenarios):
    ranks = [torch.load(scenarios / "gate" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    modes = [
        [
            "allreduce" if all(s.code == "allreduce" for s in st["metrics"].layers) else "compress"
            for st in r["steps"]
        ]
        for r in ranks
    ]
    assert modes[0] == modes[1]
    # The start: one warm-up + two timed compressed steps, then an all-reduce trial. Timing on
    # this machine decides the rest, but every rank agreed on it (else gloo would have failed).
    assert modes[0][:4] == ["compress", "compress", "compress", "allreduce"]
    assert ranks[0]["decisions"] == ranks[1]["decisions"] and len(ranks[0]["decisions"]) >= 2
    raw_bytes = 4 * sum(p.numel() for p in _model().parameters())
    for step, mode in enumerate(modes[0]):
        st = ranks[0]["steps"][step]
        met = st["metrics"]
        if mode == "compress":
            assert met.bytes_sent < raw_bytes // 4, step
            continue
        # Plain steps: asynchronous all-reduce, ring traffic, and no residual left behind.
        assert st["residuals"] == [], step
        assert abs(met.bytes_sent - ring_allreduce_bytes(raw_bytes, 2)) <= 64, step
        if modes[0][step - 1] == "allreduce":
            # Nothing owed from compressed steps: exactly plain DDP's gradient.
            for name, g in st["plain"].items():
                torch.testing.assert_close(st["hooked"][name], g, rtol=1e-6, atol=1e-7)
        else:
            # The first plain step also delivers what error feedback owed: not plain DDP's.
            assert any(not torch.allclose(st["hooked"][n], g) for n, g in st["plain"].items())
        for name in st["hooked"]:
            torch.testing.assert_close(
                st["hooked"][name], ranks[1]["steps"][step]["hooked"][name], rtol=0, atol=0
            )


# -- checkpoints --------------------------------------------------------------------------------


def _pickle_worker(rank, world_size, out_dir):
    for method, config in (
        ("powersgd", {"rank": 1}),
        # nearest: the quantizer's residuals travel too (dither keeps none)
        ("tail", {"raw_below_numel": 4096, "small_layer_bits": 32, "rounding": "nearest"}),
    ):
        ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.01)
        state = register_tail_hook(ddp, method, config)
        for step in range(4):
            x, y = _batch(rank, step)
            ddp.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
        (out_dir / f"{method}{rank}.pkl").write_bytes(pickle.dumps(state))
        torch.save(state.state_dict(), out_dir / f"{method}{rank}.pt")


def test_state_pickles_without_process_group_and_restores_by_name(scenarios):
    tmp_path = scenarios / "pickle"
    # Unpickled in this process (the pytest process, which never joined the workers' group).
    psgd = pickle.loads((tmp_path / "powersgd0.pkl").read_bytes())
    assert psgd.process_group is None
    assert psgd.powersgd.process_group is None
    assert psgd.powersgd.iter == 4
    assert psgd.powersgd.error_dict, "PowerSGD's error feedback memory travels with the pickle"
    fresh = make_hook_state(_model(), "powersgd", {"rank": 1})
    fresh.load_state_dict(torch.load(tmp_path / "powersgd0.pt", weights_only=False))
    assert fresh.powersgd.iter == 4

    tail = pickle.loads((tmp_path / "tail0.pkl").read_bytes())
    assert tail.process_group is None
    saved = torch.load(tmp_path / "tail0.pt", weights_only=False)
    residuals = saved["compressor"]["residuals"]
    # Keyed by parameter name (the layers Tail quantizes: >= raw_below_numel), not bucket index.
    assert set(residuals) == {"0.weight", "2.weight", "4.weight"}
    restored = make_hook_state(
        _model(), "tail", {"raw_below_numel": 4096, "small_layer_bits": 32}
    )  # new model object, new ids
    restored.load_state_dict(saved)
    again = restored.state_dict()["compressor"]
    for name, residual in residuals.items():
        assert torch.equal(again["residuals"][name], residual)
        assert residual.abs().sum() > 0
    assert (
        again["layer_steps"]
        == saved["compressor"]["layer_steps"]
        == dict.fromkeys(saved["compressor"]["layer_steps"], 4)
    )
    # A resized job drops the per-worker residuals but keeps the controller.
    resized = make_hook_state(_model(), "tail", {"raw_below_numel": 4096, "small_layer_bits": 32})
    resized.load_state_dict(saved, residuals=False)
    assert not resized.state_dict()["compressor"]["residuals"]
    assert resized.state_dict()["compressor"]["controller"] == saved["compressor"]["controller"]
    with pytest.raises(ConfigError, match="method"):
        make_hook_state(_model(), "qsgd").load_state_dict(saved)


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
        assert torch.equal(restored.local_error[name], state.local_error[name])
    assert restored.local_step == 4


# -- one process pair for every scenario above ---------------------------------------------------

SCENARIOS = {
    "transport": (_transport_worker, ()),
    "none_allreduce": (_none_vs_ddp_worker, ("none", False)),
    "none_allgather": (_none_vs_ddp_worker, ("none", True)),
    "many_buckets": (_many_buckets_worker, ()),
    "tail8": (_tail8_worker, ()),
    "pickle": (_pickle_worker, ()),
    "gate": (_gate_worker, ()),
}


def _all_scenarios(rank, world_size, out_dir):
    for name, (worker, args) in SCENARIOS.items():
        folder = out_dir / name
        folder.mkdir(exist_ok=True)
        worker(rank, world_size, folder, *args)


def _warm_numba_cache() -> None:
    # The compressors' numba kernels compile on first use and cache to disk. Compiling them
    # once here, before spawning, lets both workers load the cache instead of compiling at
    # the same time on a cold CI machine (which took ~2 minutes on 2 busy cores).
    grads = {"w": torch.randn(64, 128), "b": torch.randn(64)}
    for method, config in MANY_BUCKET_METHODS:
        if method in ("qsgd", "topk", "tail"):
            for bits in ((8,), None) if method == "tail" else (None,):
                settings = dict(config or {}) | ({"candidate_bits": bits} if bits else {})
                compressor = make_compressor(method, raw_below_numel=1024, **settings)
                for _ in range(2):
                    compressor.decompress(compressor.compress(grads))


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory):
    _warm_numba_cache()
    out_dir = tmp_path_factory.mktemp("scenarios")
    run_local_group(_all_scenarios, 2, (out_dir,), timeout_s=4 * TIMEOUT_S)
    return out_dir
