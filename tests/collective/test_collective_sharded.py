"""The sharded and hierarchical collectives on 4 and 8 gloo ranks (spawned, CPU, small models).

One group per world size runs every scenario in turn (spawning 8 processes costs seconds);
each scenario writes what every rank saw into its own folder, and the tests assert on those
files here, in the parent:

- exact: the sharded exchange with the raw fp32 compressor equals plain DDP's all-reduce (to
  rounding: it sums in rank order) and every rank gets the same bits;
- tail: Tail through the sharded (and, at W=4, the hierarchical) collective trains a few
  steps; every rank ends with bit-identical parameters; stage two shows in the metrics;
- conservation: over several steps, one of them sent plain as the link-aware switch would,
  what the collective delivered plus what error feedback of BOTH stages still owes (summed
  over ranks as a resize would) equals the sum of the true means of the raw gradients:
  nothing is lost, nothing counted twice, across the switch and across a resize.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tail_ray.collective import PayloadHookState, make_hook_state, register_tail_hook
from tail_ray.collective.gate import Mode
from tail_ray.collective.launch import run_local_group
from tail_ray.collective.payload import payload_hook
from tail_ray.collective.topology import NodeLayout
from tail_ray.collective.transport import SIZE_BYTES, all_gather_bytes
from tail_ray.compression import make_compressor

TIMEOUT_S = 120
IN, HIDDEN, OUT = 64, 512, 10
MIN_SLICE = 4096  # small enough that fc1.weight (32768) is cut into W slices at W = 8
PLAIN_STEP = 3  # the conservation scenario sends this step by plain all-reduce


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 64), nn.ReLU(), nn.Linear(64, OUT)
    )


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, IN, generator=gen), torch.randint(0, OUT, (16,), generator=gen)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _layout(rank: int, world_size: int) -> NodeLayout:
    """Two "nodes" of W/2 ranks, node-major, as a launcher would report them (the test's ranks
    all share this host; the hierarchical collective only needs the layout it is told)."""
    per_node = world_size // 2
    return NodeLayout(node_rank=rank // per_node, local_rank=rank % per_node, local_world_size=per_node)


def _exact(rank: int, world_size: int, out_dir) -> None:
    plain = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    hooked = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    state = PayloadHookState(
        "qsgd", hooked, make_compressor("none"), collective="sharded", shard_min_numel=MIN_SLICE
    )
    hooked.register_comm_hook(state, payload_hook)
    steps = []
    for step in range(3):
        x, y = _batch(rank, step)
        for m in (plain, hooked):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        steps.append(
            {"plain": _grads(plain.module), "hooked": _grads(hooked.module), "m": state.drain_metrics()}
        )
    torch.save(steps, out_dir / f"rank{rank}.pt")


def _tail(rank: int, world_size: int, out_dir, collective: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    config = {"collective": collective, "shard_min_numel": MIN_SLICE, "link_aware": False, "seed": 17 + rank}
    layout = _layout(rank, world_size) if collective == "hierarchical" else None
    state = register_tail_hook(ddp, "tail", config, layout=layout)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    metrics = []
    for step in range(4):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        metrics.append(state.drain_metrics())
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    torch.save(
        {"params": params, "metrics": metrics, "collective": state.collective}, out_dir / f"rank{rank}.pt"
    )


def _conservation(rank: int, world_size: int, out_dir, collective: str) -> None:
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.05)
    # Nearest rounding: the promise tested is error feedback's (dither, the default, keeps no
    # residual: it is unbiased instead, test_dither.py).
    config = {
        "collective": collective,
        "shard_min_numel": MIN_SLICE,
        "link_aware": False,
        "seed": 5 + rank,
        "rounding": "nearest",
    }
    layout = _layout(rank, world_size) if collective == "hierarchical" else None
    state = make_hook_state(ddp, "tail", config, layout=layout)
    sent_sum: dict[str, torch.Tensor] = {}
    true_by_layer: dict[str, torch.Tensor] = {}

    def checking_hook(st, bucket):  # no annotations: DDP compares them with its own types
        # The true mean of this bucket's raw gradients, by one extra fp64 all-reduce.
        for name, g in st.bucket_layers(bucket).items():
            t = g.detach().double().clone()
            dist.all_reduce(t)
            true_by_layer[name] = true_by_layer.get(name, 0) + t / world_size
        fut = payload_hook(st, bucket)
        fut.wait()  # a plain step's all-reduce runs asynchronously
        for name, g in st.bucket_layers(bucket).items():
            sent_sum[name] = sent_sum.get(name, 0) + g.detach().double().clone()
        return fut

    ddp.register_comm_hook(state, checking_hook)
    for step in range(6):  # no optimizer step: residuals carry over steps, weights stay put
        # Step 3 goes plain, as the link-aware switch would send it: every stage folds what
        # it owes into the gradient, scaled to count once in the plain average.
        plain = step == PLAIN_STEP
        state.mode_for_bucket = (
            (lambda _: Mode.ALLREDUCE) if plain else PayloadHookState.mode_for_bucket.__get__(state)
        )
        x, y = _batch(rank, step)
        ddp.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
    torch.save(
        {"true": true_by_layer, "sent": sent_sum, "state": state.state_dict()}, out_dir / f"rank{rank}.pt"
    )


def _gather_payload(rank: int, group_rank: int) -> bytes:
    """Rank 1's is empty; the others differ in length and content."""
    return bytes((rank * 37 + i) % 251 for i in range(0 if rank == 1 else 300 + 1000 * group_rank))


def _gather(rank, world_size, out_dir):
    """all_gather_bytes at exact sizes, on the whole world and on a subgroup (ranks 1-3): the
    P2P peers must be global ranks, not group ranks."""
    got, traffic = all_gather_bytes(_gather_payload(rank, rank))
    sub_got = sub_traffic = None
    if rank >= 1:  # only members create it, as topology.py creates its groups
        sub = dist.new_group([1, 2, 3], use_local_synchronization=True)
        sub_got, sub_traffic = all_gather_bytes(_gather_payload(rank, rank - 1), sub)
    torch.save(
        {"got": got, "traffic": traffic, "sub_got": sub_got, "sub_traffic": sub_traffic},
        out_dir / f"rank{rank}.pt",
    )


# (scenario folder, worker, its args) per world size: 8 processes on 2 cores are slow to start,
# so the 8-rank group runs only what needs W = 8 (slices on every rank, large fan-in).
SCENARIOS = {
    4: [
        ("exact", _exact, ()),
        ("tail_sharded", _tail, ("sharded",)),
        ("conservation_sharded", _conservation, ("sharded",)),
        ("tail_hierarchical", _tail, ("hierarchical",)),
        ("conservation_hierarchical", _conservation, ("hierarchical",)),
        # Last: its subgroup must not come before the groups the hierarchical scenarios make.
        ("gather", _gather, ()),
    ],
    8: [
        ("tail_sharded", _tail, ("sharded",)),
        ("conservation_sharded", _conservation, ("sharded",)),
    ],
}


def _all_scenarios(rank: int, world_size: int, out_dir) -> None:
    for name, fn, args in SCENARIOS[world_size]:
        folder = out_dir / name
        folder.mkdir(exist_ok=True)
        fn(rank, world_size, folder, *args)
        dist.barrier()


def _warm_numba_cache() -> None:
    """Compile the Tail kernels once here (cached on disk) so W spawned ranks load them."""
    grads = {n: torch.randn_like(p) for n, p in _model().named_parameters()}
    compressor = make_compressor("tail")
    for _ in range(2):
        compressor.decompress(compressor.compress(grads))


_GROUPS: dict[int, object] = {}


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """world size -> the folder its group wrote (each group runs once, when first needed)."""
    _warm_numba_cache()

    def get(world_size: int):
        if world_size not in _GROUPS:
            out_dir = tmp_path_factory.mktemp(f"sharded_w{world_size}")
            run_local_group(_all_scenarios, world_size, (out_dir,), timeout_s=TIMEOUT_S)
            _GROUPS[world_size] = out_dir
        return _GROUPS[world_size]

    return get


def _load(folder, world_size: int) -> list:
    return [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def test_sharded_raw_equals_plain_allreduce_and_ranks_agree_bitwise(groups):
    world_size, out_dir = 4, groups(4)
    per_rank = _load(out_dir / "exact", world_size)
    names = [n for n, _ in _model().named_parameters()]
    for steps in per_rank:
        for res in steps:
            for name in names:
                torch.testing.assert_close(res["hooked"][name], res["plain"][name], rtol=1e-5, atol=1e-7)
        assert steps[-1]["m"].exchanges >= 2  # rebuilt after step 0: several buckets, several layouts
    for step in range(len(per_rank[0])):
        for name in names:
            for other in per_rank[1:]:
                assert torch.equal(per_rank[0][step]["hooked"][name], other[step]["hooked"][name]), name


# Hierarchical at W = 4 only: 2 "nodes" x 2 ranks (at W = 8 it would be the same code paths).
CASES = [(4, "sharded"), (4, "hierarchical"), (8, "sharded")]
CASE_IDS = [f"W{w}-{c}" for w, c in CASES]


@pytest.mark.parametrize(("world_size", "collective"), CASES, ids=CASE_IDS)
def test_tail_trains_with_bit_identical_parameters_on_every_rank(groups, world_size, collective):
    out_dir = groups(world_size)
    per_rank = _load(out_dir / f"tail_{collective}", world_size)
    assert all(r["collective"] == collective for r in per_rank)
    for other in per_rank[1:]:
        for name, p in per_rank[0]["params"].items():
            assert torch.equal(p, other["params"][name]), name
    stage_two = [layer for r in per_rank for m in r["metrics"] for layer in m.stage_two]
    assert stage_two, "no rank reports a second stage"
    assert all(layer.layer in per_rank[0]["params"] for layer in stage_two)
    assert all(0.0 <= layer.rel_error < 1.0 and 2 <= layer.bits <= 32 for layer in stage_two)
    last = [r["metrics"][-1] for r in per_rank]
    raw = 4 * sum(p.numel() for p in per_rank[0]["params"].values())
    if collective == "sharded":
        # Per rank about 2 (W-1)/W of a payload (more for a rank that owns more of this small
        # model, and the second stage may spend more bits on the mean), never the W-1 of an
        # all-gather.
        sent = sum(m.bytes_sent for m in last) / len(last)
        own = sum(m.encoded_bytes for m in last) / len(last)
        assert 0 < sent < 3 * own, (sent, own)
        assert all(m.raw_bytes == raw for m in last)


@pytest.mark.parametrize(("world_size", "collective"), CASES, ids=CASE_IDS)
def test_error_feedback_of_both_stages_conserves_the_sum(groups, world_size, collective):
    out_dir = groups(world_size)
    per_rank = _load(out_dir / f"conservation_{collective}", world_size)
    # What every rank's compressors still owe the mean, weighted and placed as a resize would.
    fresh = register_tail_hook(None, "tail", {"collective": "allgather"}, model=_model())
    fresh.load_resized([r["state"] for r in per_rank])
    owed = fresh._carried
    assert owed, "error feedback owes nothing: the test would prove nothing"
    stage_two_layers = {name for r in per_rank for name in r["state"]["owed"].get("stage_two", {})["offsets"]}
    assert stage_two_layers, "no second-stage residuals were checkpointed"
    sent0 = per_rank[0]["sent"]
    for name, true in per_rank[0]["true"].items():
        for r in per_rank[1:]:
            assert torch.equal(r["sent"][name], sent0[name]), name  # every rank got the same
        delivered = sent0[name].reshape(-1) + owed.get(name, torch.zeros(true.numel())).double()
        scale = float(true.abs().max())
        torch.testing.assert_close(delivered, true.reshape(-1), rtol=0, atol=2e-5 * scale)


def test_payloads_of_any_sizes_are_gathered_at_exact_sizes_on_the_world_and_a_subgroup(groups):
    out_dir = groups(4)
    per_rank = _load(out_dir / "gather", 4)
    world = [_gather_payload(r, r) for r in range(4)]
    for rank, res in enumerate(per_rank):
        assert res["got"] == world, rank
        own, others = len(world[rank]), [len(p) for j, p in enumerate(world) if j != rank]
        # Nothing padded: each rank sends its own payload (and size word) to the 3 others.
        assert res["traffic"].bytes_sent == 3 * (SIZE_BYTES + own)
        assert res["traffic"].bytes_received == sum(SIZE_BYTES + n for n in others)
        assert res["traffic"].padded_bytes == max(len(p) for p in world)
    sub = [_gather_payload(r, r - 1) for r in (1, 2, 3)]
    assert per_rank[0]["sub_got"] is None
    for rank in (1, 2, 3):
        res = per_rank[rank]
        assert res["sub_got"] == sub, rank
        assert res["sub_traffic"].bytes_sent == 2 * (SIZE_BYTES + len(sub[rank - 1]))
