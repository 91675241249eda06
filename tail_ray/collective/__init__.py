"""The collective wrapper: variable-size all-gather transport, the DDP comm hook and its state.

Public API (see docs/collective.md):
    register_tail_hook(ddp_model, method="tail", config=None, process_group=None) -> TailHookState
    make_hook_state(model, method, config) + compress_gradients_locally(state, model)  (world size 1)
    TailHookState.drain_metrics() -> HookStepMetrics
"""

from tail_ray.collective.register import (
    compress_gradients_locally,
    hook_for,
    make_hook_state,
    register_tail_hook,
)
from tail_ray.collective.state import METHODS, HookStepMetrics, TailHookState
from tail_ray.collective.transport import GatherTraffic, all_gather_bytes, ring_allreduce_bytes

__all__ = [
    "METHODS",
    "GatherTraffic",
    "HookStepMetrics",
    "TailHookState",
    "all_gather_bytes",
    "compress_gradients_locally",
    "hook_for",
    "make_hook_state",
    "register_tail_hook",
    "ring_allreduce_bytes",
]
