"""tail_ray.train without Ray: one process (world size 1, no DDP wrapper) and two gloo
processes (DDP), a user's own model and loop, records from the optimizer's step hooks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import tail_ray.train as tt
from tail_ray.collective.launch import run_local_group
from tail_ray.errors import ConfigError
from tail_ray.train.session import compression_settings


class TwoTowers(nn.Module):
    """A model of the kinds DDP users have: a frozen embedding, a tower used only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(32, 128)
        self.embed.requires_grad_(False)  # frozen: never communicated
        self.trunk = nn.Linear(128, 128)
        self.spare = nn.Linear(128, 128)  # unused by forward(x): DDP needs find_unused_parameters
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.trunk(torch.relu(self.embed(x)))))


TRAINABLE = {"trunk.weight", "trunk.bias", "spare.weight", "spare.bias", "head.weight", "head.bias"}


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)


def _records(writer: tt.ListWriter, kind: str) -> list[dict]:
    return [r for r in writer.records if r["type"] == kind]


def test_seed_is_per_worker_reproducible_and_the_users_wins() -> None:
    a0 = compression_settings("tail", {}, seed=1, rank=0)
    assert a0 != compression_settings("tail", {}, seed=1, rank=1)
    assert a0 == compression_settings("tail", {}, seed=1, rank=0)
    assert compression_settings("qsgd", {"seed": 5, "bits": 4}, seed=1, rank=0) == {"seed": 5, "bits": 4}
    # A seed the user set is rank 0's; the others derive their own from it (independent noise).
    ranks = [compression_settings("tail", {"seed": 5}, seed=1, rank=r)["seed"] for r in range(3)]
    assert ranks[0] == 5 and len(set(ranks)) == 3
    assert compression_settings("none", None, seed=1, rank=0) == {}


def test_world_size_one_reports_every_optimizer_step_and_sees_the_schedulers_lr() -> None:
    writer = tt.ListWriter()
    model = tt.prepare_model(TwoTowers(), "tail", {"link_aware": False}, metrics=writer, job_id="solo")
    assert type(model) is TwoTowers  # no DDP wrapper at world size 1, as with Ray
    session = tt.current_session()
    seen: list[float] = []
    real_set_lr = session.state.set_lr
    session.state.set_lr = lambda lr: (seen.append(lr), real_set_lr(lr))  # type: ignore[method-assign]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.1)
    for step in range(5):
        x, y = _batch(step, 0)
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        tt.report_loss(loss)
        optimizer.step()
        scheduler.step()
    steps = _records(writer, "step")
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4]
    assert all(r["job_id"] == "solo" and r["world_size"] == 1 and r["bytes_sent"] == 0 for r in steps)
    assert all(0 < r["loss"] < 10 and r["method"] == "tail" for r in steps)
    layers = _records(writer, "layer")
    # spare.* has no gradient at all without DDP (None): nothing to compress, nothing reported.
    assert {r["layer"] for r in layers} == TRAINABLE - {"spare.weight", "spare.bias"}
    trunk = [r for r in layers if r["layer"] == "trunk.weight"]
    assert len(trunk) == 5 and all(r["bits"] < 32 and r["encoded_bytes"] < r["raw_bytes"] for r in trunk)
    # The lr reached the controller before the compressing step: 0.1, then the drop at step 3.
    assert seen == [0.1, pytest.approx(0.01)]
    tt.finish()
    assert writer.closed


@pytest.mark.parametrize(("optimizer_class", "linear"), [(torch.optim.SGD, True), (torch.optim.AdamW, False)])
def test_the_session_tells_the_budget_which_optimizer_steps(optimizer_class: type, linear: bool) -> None:
    model = tt.prepare_model(TwoTowers(), "tail", metrics=tt.ListWriter())
    policy = tt.current_session().state.compressor.controller.policy
    assert not policy.linear  # nothing known before the first step: the cautious budget
    optimizer = optimizer_class([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = _batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    assert policy.linear is linear


@pytest.mark.parametrize("sgd_first", [True, False])
def test_an_adam_on_part_of_the_model_keeps_the_cautious_budget(sgd_first: bool) -> None:
    # The budget is the model's: SGD on the head and Adam on the trunk is not a linear optimizer,
    # whichever of them steps first (only the first one seen makes the step records).
    model = tt.prepare_model(TwoTowers(), "tail", metrics=tt.ListWriter())
    policy = tt.current_session().state.compressor.controller.policy
    sgd = torch.optim.SGD(model.head.parameters(), lr=0.1)
    adam = torch.optim.Adam([*model.trunk.parameters(), *model.spare.parameters()], lr=1e-3)
    for step in range(3):
        x, y = _batch(step, 0)
        nn.functional.cross_entropy(model(x), y).backward()
        for optimizer in (sgd, adam) if sgd_first else (adam, sgd):
            optimizer.step()
            optimizer.zero_grad()
        assert not policy.linear
    assert len(_records(tt.current_session().writer, "step")) == 3  # one record per step
    tt.finish()


def test_a_checkpoint_loaded_after_the_first_step_keeps_this_runs_optimizer() -> None:
    model = tt.prepare_model(TwoTowers(), "tail", metrics=tt.ListWriter())
    session = tt.current_session()
    saved = session.state_dict()  # before any step: the optimizer not known
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x, y = _batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    sgd.step()
    session.load_state_dict(saved)
    assert session.state.compressor.controller.policy.linear
    tt.finish()


def test_set_lr_overrides_the_optimizer_and_unknown_settings_fail_early() -> None:
    tt.prepare_model(TwoTowers(), "tail", metrics=tt.ListWriter())
    session = tt.current_session()
    tt.set_lr(0.5)
    optimizer = torch.optim.SGD(TwoTowers().parameters(), lr=0.1)  # another model's optimizer
    session._before_step(optimizer, (), {})
    assert session._lr == 0.5
    with pytest.raises(ConfigError, match="no_such_setting"):
        tt.prepare_model(TwoTowers(), "tail", {"no_such_setting": 1}, metrics=tt.ListWriter())
    with pytest.raises(ConfigError, match="unknown compression method"):
        tt.prepare_model(TwoTowers(), "zip")


def test_outside_ray_metrics_go_to_json_lines(tmp_path: Path) -> None:
    model = tt.prepare_model(nn.Linear(64, 64), "qsgd", metrics=tmp_path, job_id="files")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    tt.finish()
    lines = [json.loads(line) for line in (tmp_path / "files.rank0.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["type"] == "step"] == [0, 1, 2]
    assert {r["layer"] for r in lines if r["type"] == "layer"} == {"weight", "bias"}


def test_a_training_thread_that_returns_hands_its_last_records_over() -> None:
    # Ray Train V2 runs the loop in a thread and kills the worker soon after it returns (no
    # atexit there): the session must close, and so flush, when that thread ends.
    writer = tt.ListWriter()

    def loop() -> None:
        model = tt.prepare_model(nn.Linear(16, 16), "qsgd", metrics=writer, job_id="threaded")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(4, 16)).square().mean().backward()
            optimizer.step()

    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    deadline = time.monotonic() + 10
    while not writer.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.closed, "the session was not closed when its training thread returned"
    assert [r["step"] for r in _records(writer, "step")] == [0, 1, 2]


def test_checkpoint_directory_keeps_the_controller_and_drops_residuals_on_resize(tmp_path: Path) -> None:
    # nearest: the quantizer keeps residuals to checkpoint (dither keeps none)
    settings = {"link_aware": False, "rounding": "nearest"}
    model = tt.prepare_model(nn.Linear(128, 128), "tail", settings, metrics=tt.ListWriter())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(8, 128)).square().mean().backward()
        optimizer.step()
    saved = tt.save_checkpoint(tmp_path)
    assert saved.name == "tail_ray.rank0.pt"
    state = tt.state_dict()
    assert state["step"] == 4 and state["hook"]["compressor"]["residuals"]

    tt.prepare_model(nn.Linear(128, 128), "tail", settings, metrics=tt.ListWriter())
    assert tt.load_checkpoint(tmp_path) is True  # same rank, same world size: exact
    restored = tt.state_dict()
    assert restored["step"] == 4
    before, back = state["hook"]["compressor"], restored["hook"]["compressor"]
    assert torch.equal(back["residuals"]["weight"], before["residuals"]["weight"])
    resized = {**state, "world_size": 2}  # written by a group of another size
    assert tt.load_state_dict(resized) is False
    after = tt.state_dict()["hook"]["compressor"]
    assert (
        not after["residuals"]
        and after["controller"]["plans"].keys() == state["hook"]["compressor"]["controller"]["plans"].keys()
    )


def _ddp_worker(rank: int, world_size: int, out_dir: str) -> None:
    writer = tt.ListWriter()
    model = tt.prepare_model(
        TwoTowers(), "tail", {"link_aware": False}, metrics=writer, find_unused_parameters=True
    )
    assert isinstance(model, nn.parallel.DistributedDataParallel)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    accumulate = 2
    for step in range(3):
        optimizer.zero_grad()
        for micro in range(accumulate):
            x, y = _batch(10 * step + micro, rank)
            if micro < accumulate - 1:
                with model.no_sync():  # gradient accumulation: no exchange until the last micro-batch
                    nn.functional.cross_entropy(model(x), y).backward()
            else:
                nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    session = tt.current_session()
    tt.finish()
    Path(out_dir, f"rank{rank}.json").write_text(
        json.dumps({"records": writer.records, "job_id": session.job_id})
    )
    dist.barrier()


def test_two_ddp_ranks_with_frozen_unused_parameters_and_accumulation(tmp_path: Path) -> None:
    run_local_group(_ddp_worker, 2, (str(tmp_path),), timeout_s=120)
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert runs[0]["job_id"] == runs[1]["job_id"]  # rank 0's id, broadcast over the group
    for rank, run in enumerate(runs):
        steps = [r for r in run["records"] if r["type"] == "step"]
        assert [r["step"] for r in steps] == [0, 1, 2]  # one record per optimizer step, not per micro-batch
        assert all(r["rank"] == rank and r["world_size"] == 2 and r["bytes_sent"] > 0 for r in steps)
        layers = {r["layer"] for r in run["records"] if r["type"] == "layer"}
        assert layers == TRAINABLE  # the frozen embedding is never communicated


def test_step_records_carry_both_stages_of_a_sharded_collective():
    """One row per layer, then one per second-stage slice under "<name>@stage2" with that
    stage's own bits and bytes, then the step record."""
    from tail_ray.collective import HookStepMetrics
    from tail_ray.compression.stats import LayerStats
    from tail_ray.train.session import STAGE_TWO_SUFFIX, step_records

    first = LayerStats("fc1.weight", 8192, 4, 0.5, 32768, 4200, 0.1, "rans")
    second = LayerStats("fc1.weight", 4096, 5, 0.7, 16384, 2600, 0.05, "bitpack")
    m = HookStepMetrics(layers=[first], stage_two=[second], bytes_sent=6800)
    rows = step_records(m, job_id="job", step=3, rank=1, world_size=4, method="tail", step_s=0.1, loss=2.0)
    assert [(r["layer"], r["bits"], r["encoded_bytes"]) for r in rows[:2]] == [
        ("fc1.weight", 4, 4200),
        (f"fc1.weight{STAGE_TWO_SUFFIX}", 5, 2600),
    ]
    assert all(r["step"] == 3 and r["rank"] == 1 for r in rows)
    assert len(rows) == 3 and rows[2]["bytes_sent"] == 6800
