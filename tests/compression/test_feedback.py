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
