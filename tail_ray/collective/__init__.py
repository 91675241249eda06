"""The collective wrapper: DDP comm hooks per method family, their states, the method table, transport.

Public API (see docs/collective.md):
    register_tail_hook(ddp_model, method="tail", config=None, process_group=None) -> HookState
    make_hook_state(model, method, config) + compress_gradients_locally(state, model)  (world size 1)
    HookState.drain_metrics() -> HookStepMetrics
    METHOD_SPECS / method_spec(method): what each method runs
    Collective, NodeLayout: the payload methods' collective and a rank's node layout
    collective_cost: the collectives' cost model
"""

from tail_ray.collective.allreduce import AllReduceState
from tail_ray.collective.choice import Collective
from tail_ray.collective.cost import collective_cost
from tail_ray.collective.methods import METHOD_SPECS, MethodSpec, method_spec
from tail_ray.collective.metrics import HookStepMetrics
from tail_ray.collective.payload import PayloadHookState
from tail_ray.collective.powersgd import PowerSGDHookState
from tail_ray.collective.register import (
    compress_gradients_locally,
    hook_for,
    make_hook_state,
    register_tail_hook,
)
from tail_ray.collective.state import HookState
from tail_ray.collective.topology import NodeLayout
from tail_ray.collective.transport import GatherTraffic, all_gather_bytes, ring_allreduce_bytes
from tail_ray.methods import METHODS, Method

__all__ = [
    "METHODS",
    "METHOD_SPECS",
    "AllReduceState",
    "Collective",
    "GatherTraffic",
    "HookState",
    "HookStepMetrics",
    "Method",
    "MethodSpec",
    "NodeLayout",
    "PayloadHookState",
    "PowerSGDHookState",
    "all_gather_bytes",
    "collective_cost",
    "compress_gradients_locally",
    "hook_for",
    "make_hook_state",
    "method_spec",
    "register_tail_hook",
    "ring_allreduce_bytes",
]
