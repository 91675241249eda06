"""Which backend compresses a gradient: the device (Triton) path for CUDA tensors, numba otherwise.

The choice is made per layer from the tensor itself, so the hook and the compressor contract
do not change: a CUDA gradient with ``triton`` importable goes to the device codec
(``device_codec``: error feedback, statistics, quantization and packing stay on the GPU; only
the bit-packed levels and the scales cross to the host), anything else to the numba path.

``TAIL_RAY_CODEC_BACKEND`` overrides the choice:
    auto    (default) Triton for CUDA tensors when triton is importable (and the GPU is a
            Volta, sm_70, or newer), numba otherwise
    cpu     always numba (CUDA gradients are copied to the host, as before issue 12)
    triton  always Triton; for a CPU tensor this needs ``TRITON_INTERPRET=1`` (Triton's
            interpreter: how CI runs the device kernels without a GPU; slow, for tests)

This module imports no triton (it is an optional extra: ``pip install tail-ray[gpu]``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from tail_ray.errors import ConfigError

log = logging.getLogger(__name__)

BACKEND_ENV = "TAIL_RAY_CODEC_BACKEND"
BACKENDS = ("auto", "cpu", "triton")
# The quantizer runs one Triton program per bucket, the whole bucket in registers; past this
# size (the default is 512) a layer is quantized on the host instead (a warning says so).
MAX_DEVICE_BUCKET = 1 << 14


@functools.cache
def triton_importable() -> bool:
    """Whether the ``triton`` package is installed (checked once per process)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _announce(backend: str, device: str) -> None:
    log.info("gradient codec: %s backend for %s tensors", backend, device)


def uses_triton(t: torch.Tensor) -> bool:
    """True when ``t`` is compressed by the Triton kernels (see the module docstring)."""
    choice = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if choice not in BACKENDS:
        raise ConfigError(f"{BACKEND_ENV} must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "cpu":
        return False
    if choice == "triton":
        if not triton_importable():
            raise ConfigError(
                f"{BACKEND_ENV}=triton but triton is not installed: pip install 'tail-ray[gpu]'"
            )
        if t.device.type != "cuda" and not interpreting():
            raise ConfigError(
                f"{BACKEND_ENV}=triton on a {t.device.type} tensor needs TRITON_INTERPRET=1 "
                "(Triton's interpreter, for tests) or a CUDA tensor"
            )
        _announce("triton", t.device.type)
        return True
    if t.device.type == "cuda" and triton_importable() and _triton_supports(t.device):
        _announce("triton", "cuda")
        return True
    return False


# Triton 3 generates code for Volta (sm_70) and newer; on an older GPU ``auto`` keeps the
# CPU path rather than failing at the first kernel launch.
_MIN_CAPABILITY = (7, 0)


def _triton_supports(device: torch.device) -> bool:
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _supported(index: int) -> bool:
    """Whether GPU ``index`` is new enough for Triton (asked, and warned about, once)."""
    major, minor = torch.cuda.get_device_capability(index)
    if (int(major), int(minor)) >= _MIN_CAPABILITY:
        return True
    log.warning("GPU %d is sm_%d%d, older than Triton supports: its gradients use the CPU codec",
                index, major, minor)  # fmt: skip
    return False


@dataclass(frozen=True, slots=True)
class DeviceFlat:
    """A layer's gradient as the device backend holds it: a flat, contiguous float32 tensor on
    its device (a view of the DDP bucket when it already is one; never written)."""

    tensor: torch.Tensor

    @property
    def size(self) -> int:
        """Element count (``np.ndarray.size``'s meaning, so engine code reads either)."""
        return int(self.tensor.numel())

    def host(self) -> np.ndarray:
        """The values as a flat float32 numpy array (a copy to host memory)."""
        return self.tensor.detach().to("cpu").numpy()


def device_flat(t: torch.Tensor) -> DeviceFlat:
    """``t`` as a DeviceFlat: a view when it is float32 and contiguous, else a converted copy
    on the same device."""
    flat = t.detach().reshape(-1)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        flat = flat.to(torch.float32).contiguous()
    return DeviceFlat(flat)


LayerArray = np.ndarray | DeviceFlat
"""A layer's flat float32 gradient as the engine sees it: numpy (numba path) or DeviceFlat."""
