"""When to run a Triton kernel and when its pure-PyTorch twin: one rule shared by every kernel.

CUDA runs the kernels unless `DSV3LITE_KERNELS=ref`; CPU runs the twins, except with both
`TRITON_INTERPRET=1` and `DSV3LITE_KERNELS=triton`, where the kernels run in Triton's interpreter
(that is how CI tests the model's kernel path).
"""
from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton on this platform (it ships only for Linux): only the twins run
    triton = tl = None

# the decorator every kernel file uses: triton.jit, or the plain function where Triton is absent
jit = triton.jit if triton is not None else (lambda fn: fn)


def interpreted() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes", "y")


def triton_available() -> bool:
    """True when Triton could be imported."""
    return triton is not None


def use_kernels(device: torch.device | str) -> bool:
    """Whether tensors on `device` go through the Triton kernels rather than the `*_ref` twins."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu" and not interpreted():           # the common CPU case, decided without the rest
        return False
    mode = os.environ.get("DSV3LITE_KERNELS", "").strip().lower()
    if not triton_available() or mode == "ref":
        return False
    if kind == "cuda":
        return True
    return interpreted() and mode == "triton"


def capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) compute capability of a CUDA device; None elsewhere (the interpreter)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_capability(device)
    return None


@functools.cache
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 in the interpreter, so split heuristics still split)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
