"""Without a GPU, the device codec's Triton kernels run in Triton's CPU interpreter.

TRITON_INTERPRET must be set before ``triton`` is first imported: triton.language defines its
own @jit helpers (tl.max, tl.sum's combiners...) at import time, and those are made compiled or
interpreted then, once. A conftest runs before any test module of this directory is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
