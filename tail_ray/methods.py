"""The gradient-communication methods a job can choose, by name (no torch: configs and the API read it).

``Method`` is the one list. What each method runs (its hook state, DDP comm hook, world-size-1
round trip and settings class) is its ``MethodSpec`` in ``tail_ray.collective.methods``, one
table keyed by this enum; the runner's config, the service's job schema, the CLI's help and
docs/collective.md all read the names from here.
"""

from __future__ import annotations

from enum import StrEnum

from tail_ray.errors import ConfigError


class Method(StrEnum):
    """A gradient-communication method. A ``str``: ``Method.TAIL == "tail"``."""

    NONE = "none"  # fp32 all-reduce: plain DDP
    FP16 = "fp16"  # PyTorch's fp16_compress_hook
    BF16 = "bf16"  # PyTorch's bf16_compress_hook
    POWERSGD = "powersgd"  # PyTorch's PowerSGD (low rank + error feedback)
    QSGD = "qsgd"  # fixed-bit stochastic quantization
    TOPK = "topk"  # top-k sparsification + error feedback
    TAIL = "tail"  # Tail: automatic bits per layer, sparse + entropy coding

    @classmethod
    def parse(cls, value: object) -> Method:
        """``value`` as a Method; anything else is a ``ConfigError`` listing the methods."""
        if isinstance(value, str) and value in METHODS:
            return cls(value)
        raise ConfigError(f"unknown compression method {value!r}; choose one of {list(METHODS)}")


METHODS: tuple[str, ...] = tuple(m.value for m in Method)
