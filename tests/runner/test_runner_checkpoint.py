"""Checkpoint save/restore in one process (world size 1, the real Tail hook state): an exact
restore replays training bit for bit; a restore at another world size keeps the controller
state and carries what the old residuals owed the mean into the first step."""

from __future__ import annotations

import pytest
import torch

from tail_ray.collective import compress_gradients_locally, make_hook_state
from tail_ray.runner.checkpoint import (
    TRAIN_STATE_FILE,
    load_checkpoint,
    rank_file,
    save_checkpoint,
    seed_everything,
)
from tail_ray.runner.datasets import make_dataset
from tail_ray.runner.models import loss_fn, make_model
from tail_ray.train.session import compression_settings

SEED = 3


@pytest.fixture(scope="module")
def digits():
    return make_dataset("digits")


def fresh(ds):
    model = make_model("digits_cnn", ds, SEED)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hook = make_hook_state(model, "tail", compression_settings("tail", {}, seed=SEED, rank=0))
    return model, opt, hook


def train(ds, model, opt, hook, steps: range) -> None:
    for step in steps:
        x, y = ds.batch(seed=SEED, step=step, rank=0, world_size=1, batch_size=32)
        opt.zero_grad()
        loss_fn(ds, model(x), y).backward()
        compress_gradients_locally(hook, model)
        opt.step()
        hook.drain_metrics()


def test_exact_restore_replays_training_bit_for_bit(digits, tmp_path):
    seed_everything(SEED, 0, 0)
    model, opt, hook = fresh(digits)
    train(digits, model, opt, hook, range(0, 4))
    save_checkpoint(
        tmp_path, rank=0, world_size=1, step=4, model=model, optimizer=opt, hook=hook, totals={"steps": 4}
    )
    train(digits, model, opt, hook, range(4, 8))
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model2, opt2, hook2 = fresh(digits)
    restored = load_checkpoint(
        tmp_path, rank=0, world_size=1, seed=SEED, model=model2, optimizer=opt2, hook=hook2
    )
    assert restored.step == 4 and restored.exact and restored.totals == {"steps": 4}
    train(digits, model2, opt2, hook2, range(4, 8))
    for name, tensor in model2.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_restore_without_restoring_drifts(digits, tmp_path):
    """The check above can fail: skipping the hook and RNG restore changes the result."""
    seed_everything(SEED, 0, 0)
    model, opt, hook = fresh(digits)
    train(digits, model, opt, hook, range(0, 4))
    save_checkpoint(tmp_path, rank=0, world_size=1, step=4, model=model, optimizer=opt, hook=hook)
    train(digits, model, opt, hook, range(4, 8))
    model2, opt2, hook2 = fresh(digits)
    load_checkpoint(tmp_path, rank=0, world_size=1, seed=SEED, model=model2, optimizer=opt2, hook=None)
    train(digits, model2, opt2, hook2, range(4, 8))
    assert not torch.equal(model2.state_dict()["fc1.weight"], model.state_dict()["fc1.weight"])


def test_resized_restore_keeps_controller_and_carries_what_residuals_owed(digits, tmp_path):
    """One worker grows to two (the elastic drill's resize): each new worker carries the old
    worker's residual (all of the old mean's debt), so the new mean gets it once."""
    seed_everything(SEED, 0, 0)
    model, opt, hook = fresh(digits)
    train(digits, model, opt, hook, range(0, 3))
    saved = hook.state_dict()["compressor"]
    assert saved["residuals"]
    save_checkpoint(tmp_path, rank=0, world_size=1, step=3, model=model, optimizer=opt, hook=hook)

    for new_rank in (0, 1):
        model2, opt2, hook2 = fresh(digits)
        restored = load_checkpoint(
            tmp_path, rank=new_rank, world_size=2, seed=SEED, model=model2, optimizer=opt2, hook=hook2
        )
        assert restored.step == 3 and restored.saved_world_size == 1 and not restored.exact
        back = hook2.state_dict()["compressor"]
        assert not back["residuals"]  # the new compressor starts clean ...
        carried = hook2.carried  # ... and the debt rides on the first gradient instead
        assert set(carried) == {n for n, e in saved["residuals"].items() if e.any()}
        for name, owed in carried.items():
            assert torch.equal(owed, saved["residuals"][name].reshape(-1)), name
        assert back["layer_steps"] == saved["layer_steps"]
        assert back["controller"]["plans"].keys() == saved["controller"]["plans"].keys()
        assert torch.equal(model2.state_dict()["fc1.weight"], model.state_dict()["fc1.weight"])
        train(digits, model2, opt2, hook2, range(3, 4))
        assert not hook2.carried  # delivered with the first step


def test_resize_with_a_rank_file_missing_drops_the_residuals(digits, tmp_path):
    seed_everything(SEED, 0, 0)
    model, opt, hook = fresh(digits)
    train(digits, model, opt, hook, range(0, 3))
    for rank in (0, 1):  # as two workers would have written it, then rank 1's file is lost
        save_checkpoint(tmp_path, rank=rank, world_size=2, step=3, model=model, optimizer=opt, hook=hook)
    (tmp_path / rank_file(1)).unlink()
    model2, opt2, hook2 = fresh(digits)
    load_checkpoint(tmp_path, rank=0, world_size=1, seed=SEED, model=model2, optimizer=opt2, hook=hook2)
    assert not hook2.state_dict()["compressor"]["residuals"] and not hook2.carried


def test_incomplete_checkpoint_says_which_file_is_missing(digits, tmp_path):
    model, opt, hook = fresh(digits)
    save_checkpoint(tmp_path, rank=1, world_size=2, step=1, model=model, optimizer=opt, hook=hook)
    with pytest.raises(FileNotFoundError, match=TRAIN_STATE_FILE):
        load_checkpoint(tmp_path, rank=0, world_size=2, seed=SEED, model=model, optimizer=opt, hook=hook)
