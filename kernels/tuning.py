"""Launch configurations of the weight-reading Triton kernels, in one place: the defaults, and the candidates that the
GPU suite's sweep times on hardware (benchmarks/gpu_kernels.py, section `sweep`).

A kernel has one configuration per regime:
  rows    1-2 rows of x (batch-1 decode): fp32 multiply-adds, memory-bound
  dot     3+ rows of 16-bit x: tl.dot on tensor cores
  dot32   3+ rows of fp32 x: "ieee" dot products, whose operands sit in registers (smaller tiles, or they spill)
Knobs: block_n (output columns a program computes), block_k (weight elements a K tile reads, per row), num_warps,
num_stages, prefetch (read the next K tile before multiplying the current one), block_m (grouped kernels: rows of a
tile). Every default compiles within shared memory and without register spills on sm_80, 86, 89 and 90, every
candidate on sm_90, where the sweep runs (tests/test_gpu_compile.py). DSV3LITE_TUNING=FILE.json ({kernel: {regime:
{knob: value}}}, what the sweep writes) replaces entries for a run.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os

import torch

ENV = "DSV3LITE_TUNING"
_ROWS = dict(block_k=128, num_warps=4, num_stages=1, prefetch=True)
_DOT = dict(block_k=64, num_warps=4, num_stages=2, prefetch=False)   # (prefetching gate+up spills 8-16 B on sm_80/90)
_DOT32 = dict(block_k=32, num_warps=4, num_stages=1, prefetch=False)

DEFAULTS = {
    # W4A16 / W8A16 (quant_matmul.py); split-K is chosen per call from the SM count
    "gemv": {"rows": dict(_ROWS, block_n=32), "dot": dict(_DOT, block_n=32), "dot32": dict(_DOT32, block_n=32)},
    # fused MoE decode (fused_moe.py): gate+up+silu (block_n: columns of I) and down (block_n: columns of D)
    "moe_gate_up": {"rows": dict(_ROWS, block_n=16), "dot": dict(_DOT, block_n=16), "dot32": dict(_DOT32, block_n=16)},
    "moe_down": {"rows": dict(_ROWS, block_n=16), "dot": dict(_DOT, block_n=16), "dot32": dict(_DOT32, block_n=16)},
    # grouped fused MoE (prefill: tiles of block_m token rows of one expert; always tl.dot)
    "grouped": {"dot": dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=2, prefetch=True),
                "dot32": dict(block_m=64, block_n=32, block_k=32, num_warps=4, num_stages=1, prefetch=False)},
}

# what the sweep times at batch 1 (regime "rows"), each against the default, on DeepSeek-V3's shapes
CANDIDATES = {
    "gemv": [dict(prefetch=False), dict(block_n=64), dict(block_k=256), dict(num_warps=8, block_n=64)],
    "moe_gate_up": [dict(prefetch=False), dict(block_n=32, block_k=64), dict(block_k=256), dict(num_warps=2)],
    "moe_down": [dict(prefetch=False), dict(block_n=32), dict(block_k=256), dict(num_warps=2)],
}


def regime(rows: int, dtype: torch.dtype, dot_min_rows: int) -> str:
    """'rows', 'dot' or 'dot32' for `rows` rows of x in `dtype`."""
    if rows < dot_min_rows:
        return "rows"
    return "dot32" if dtype == torch.float32 else "dot"


def config(kernel: str, name: str) -> dict:
    """The knobs of `kernel` in regime `name`: DEFAULTS, with DSV3LITE_TUNING's entries (and `trying`'s) over them."""
    return dict(DEFAULTS[kernel][name], **_overrides().get(kernel, {}).get(name, {}), **_TRYING.get((kernel, name), {}))


_TRYING: dict = {}


@contextlib.contextmanager
def trying(kernel: str, name: str, knobs: dict):
    """Launches of `kernel` in regime `name` take `knobs` over their configuration inside the block (the sweep)."""
    unknown = set(knobs) - set(DEFAULTS[kernel][name])
    assert not unknown, f"unknown knobs {sorted(unknown)} for {kernel}.{name}"
    _TRYING[kernel, name] = knobs
    try:
        yield
    finally:
        del _TRYING[kernel, name]


@functools.cache
def _overrides() -> dict:
    path = os.environ.get(ENV, "").strip()
    if not path:
        return {}
    with open(path) as f:
        found = json.load(f)
    for kernel, regimes in found.items():
        assert kernel in DEFAULTS, f"{ENV}: unknown kernel {kernel!r} in {path}"
        for name, knobs in regimes.items():
            assert name in DEFAULTS[kernel], f"{ENV}: unknown regime {kernel}.{name} in {path}"
            unknown = set(knobs) - set(DEFAULTS[kernel][name])
            assert not unknown, f"{ENV}: unknown knobs {sorted(unknown)} for {kernel}.{name} in {path}"
    return found
