"""Executors: the ways a forward pass runs, each built from the model's own sub-steps (model.py), never from copies.

    Eager       the model's forward as written (prefill chunks, and the twin of every other executor)
    CpuStep     CPU decode steps through the compiled kernels, one per sub-step, the whole step in one call where
                nothing watches (cpu.py; kernels/cpu_decode.py); DeepSeek-V4's: V4CpuStep (cpu_v4.py;
                kernels/cpu_v4.py)
    GraphStep   GPU decode steps replayed from CUDA graphs: segments of captured sub-steps between the host-scheduled
                ones (graphs.py)
    prefill_hidden  layer-major prefill of a long prompt (prefill.py)

`choose` picks one per Engine. An executor answers `hidden(token_ids, start, cache, absorb)` and
`mtp_hidden(hidden, next_token_ids, start, cache, absorb)` as the model's `hidden` / `mtp_hidden` do; where it
cannot run a sub-step it runs the eager one, and says so once (one log line per reason).
"""
from __future__ import annotations

import torch

from .eager import Eager


def base(model, device: torch.device, log=None) -> Eager:
    """The executor for `device` without graphs: the compiled step on the CPU for a family it has kernels for, else
    eager."""
    if device.type == "cpu":
        from .cpu import CpuStep
        from .cpu_v4 import V4CpuStep

        for step in (CpuStep, V4CpuStep):
            if step.kernels.knows(model):
                return step(model, device, log)
    return Eager(model, device, log)


def choose(model, device: torch.device, cuda_graphs: bool = True, log=None):
    """The executor for an Engine on `device`: CUDA graphs where kernels run on a GPU (unless turned off: the flag,
    or DSV3LITE_GRAPHS=0) over the base executor, else the base executor."""
    from ..kernels import dispatch
    from . import graphs

    fallback = base(model, device, log)
    if device.type == "cuda" and cuda_graphs and graphs.enabled() and dispatch.use_kernels(device) \
            and graphs.supported(model):
        return graphs.GraphStep(fallback)
    return fallback
