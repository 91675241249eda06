"""Error-feedback memory: nothing lost, keyed by name, owning residual norms, injected into compressors."""

import numpy as np

from tail_ray.compression.feedback import ErrorFeedback


def test_compensate_update_keeps_what_was_not_sent():
    mem = ErrorFeedback()
    rng = np.random.default_rng(0)
    sent_total = np.zeros(100)
    grad_total = np.zeros(100)
    for _ in range(5):
        g = rng.standard_normal(100).astype(np.float32)
        comp = mem.compensate("w", g)
        decoded = np.round(comp)  # any lossy code
        mem.update("w", comp, decoded)
        np.testing.assert_allclose(comp, decoded + mem.buffer("w", 100), atol=1e-6)
        sent_total += decoded
        grad_total += g
    # Nothing is lost, only delayed: everything sent + what is still owed == every gradient.
    np.testing.assert_allclose(sent_total + mem.buffer("w", 100), grad_total, atol=1e-4)


def test_caller_gradient_is_never_modified_and_keys_are_names():
    mem = ErrorFeedback()
    g = np.ones(10, np.float32)
    comp = mem.compensate("a", g)
    mem.update("a", comp, np.zeros(10, np.float32))
    assert np.all(g == 1) and "a" in mem and "b" not in mem
    assert np.all(mem.compensate("a", g) == 2)


def test_resized_layer_restarts_from_zero_and_state_roundtrips():
    mem = ErrorFeedback()
    mem.update("w", np.ones(4, np.float32), np.zeros(4, np.float32))
    state = mem.state_dict()
    other = ErrorFeedback()
    other.load_state_dict(state)
    assert np.all(other.buffer("w", 4) == 1)
    assert np.all(other.buffer("w", 6) == 0)  # size changed: the old residual means nothing
    other.reset()
    assert other.names() == []


def test_the_memory_owns_residual_norms():
    mem = ErrorFeedback()
    assert mem.norm_sq("w") == 0.0  # no residual: nothing owed
    e = mem.buffer("w", 4)
    e[:] = [3.0, 4.0, 0.0, 0.0]
    mem.measured("w", 25.0)  # what a fused kernel reports after rewriting the buffer
    assert mem.norm_sq("w") == 25.0
    mem.keep("v", np.array([1.0, 2.0], np.float32))  # unmeasured: computed when asked
    assert mem.norm_sq("v") == 5.0
    other = ErrorFeedback()
    other.load_state_dict(mem.state_dict())  # norms measured again on restore
    assert (other.norm_sq("w"), other.norm_sq("v")) == (25.0, 5.0)


def test_fold_adds_what_is_owed_and_forgets_it():
    import torch

    mem = ErrorFeedback()
    mem.update("w", np.ones(3, np.float32), np.zeros(3, np.float32))
    g = torch.full((3,), 2.0)
    mem.fold_into({"w": g, "absent": torch.zeros(2)})
    assert torch.equal(g, torch.full((3,), 3.0))
    assert mem.names() == [] and mem.norm_sq("w") == 0.0


def test_a_compressor_runs_on_the_memory_it_is_given():
    """Error feedback is injected: a caller may hand a compressor its memory (another stage's
    or another device's); a compressor told to run without error feedback refuses one."""
    import pytest
    import torch

    from tail_ray.compression.qsgd import QSGDCompressor, QSGDConfig
    from tail_ray.compression.tail import TailCompressor, TailConfig
    from tail_ray.errors import ConfigError

    mem = ErrorFeedback()
    comp = TailCompressor(TailConfig(seed=1, rounding="nearest"), feedback=mem)  # dither keeps none
    comp.compress({"w": torch.randn(8192)})
    assert comp.feedback is mem and mem.names() == ["w"] and mem.norm_sq("w") > 0
    assert QSGDCompressor(QSGDConfig(error_feedback=False)).feedback is None
    with pytest.raises(ConfigError, match="error_feedback is false"):
        QSGDCompressor(QSGDConfig(error_feedback=False), feedback=mem)


def test_a_residual_lives_where_its_gradient_does():
    """The device backend's residuals are tensors on the gradient's device: handed out there,
    moved once when asked for on the other side, checkpointed and folded as host ones are."""
    import torch

    mem = ErrorFeedback()
    dev = torch.device("cpu")  # the same code path as CUDA, minus the copy
    e = mem.device_buffer("w", 4, dev)
    assert isinstance(e, torch.Tensor) and e.device == dev and mem.norm_sq("w") == 0.0
    assert mem.device_buffer("w", 4, dev) is e  # the same buffer, rewritten in place by a kernel
    e.copy_(torch.tensor([1.0, -2.0, 0.0, 2.0]))
    mem.measured("w", 9.0)
    assert torch.equal(mem.state_dict()["w"], torch.tensor([1.0, -2.0, 0.0, 2.0]))
    host = mem.buffer("w", 4)  # asked for on the host: moved there, values kept
    assert isinstance(host, np.ndarray) and host.tolist() == [1.0, -2.0, 0.0, 2.0]
    back = mem.device_buffer("w", 4, dev)
    assert back.tolist() == [1.0, -2.0, 0.0, 2.0]
    assert mem.device_buffer("w", 5, dev).tolist() == [0.0] * 5  # resized layer: fresh zeros
    g = torch.ones(5)
    mem.device_buffer("w", 5, dev).fill_(0.5)
    mem.fold_into({"w": g})
    assert g.tolist() == [1.5] * 5 and mem.names() == []
