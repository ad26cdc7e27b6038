"""The expert formats, one line each: the module that implements a format, and what every kernel knows of it; and
the names the command line offers before anything heavy is imported (`dsv3lite --help` must not wait for torch).

This is the one place a format's kernel facts live: the Triton launchers (kernels/quant_matmul.py, fused_moe.py),
the CPU kernels' Python side (kernels/cpu_experts.py, cpu_linear.py, cpu_decode.py) and the planner read it, and the
compiled CPU library is checked against it when it loads (kernels/cpu_abi.py). It imports nothing of the package, so
kernels and formats alike may read it. A new format is its module (a quant.layout.ExpertFormat subclass) plus one
line here.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FormatEntry:
    module: str                       # quant.<module> holds the ExpertFormat subclass ...
    cls: str                          # ... of this name
    triton: int | None = None         # FMT constexpr of the Triton kernels; None: no Triton path (dequantized)
    cpu: int | None = None            # Fmt of kernels/csrc/cpu_kernels.cpp; None: no compiled CPU path
    parts: tuple = ()                 # (weight, scale, zero) component names of one matrix (None: absent)
    weight_dtype: str = "uint8"       # element type of its weight component (torch dtype name) ...
    scale_dtype: str | None = None    # ... and of its scale / zero components


FORMAT_TABLE: dict[str, FormatEntry] = {
    "bf16": FormatEntry("bf16", "Bf16Format", triton=2, cpu=0, parts=("weight", None, None), weight_dtype="bfloat16"),
    "fp8": FormatEntry("fp8", "Fp8Format", triton=1, cpu=1, parts=("weight", "scale", None),
                       weight_dtype="float8_e4m3fn", scale_dtype="float32"),
    "int4": FormatEntry("int4", "Int4Format", triton=0, cpu=2, parts=("qweight", "scales", "zeros"),
                        scale_dtype="float16"),
    "int8": FormatEntry("int8", "Int8Format", cpu=3, parts=("weight", "scale", None), weight_dtype="int8",
                        scale_dtype="float32"),
    "nf4": FormatEntry("nf4", "Nf4Format"),
    "mxfp4": FormatEntry("mxfp4", "Mxfp4Format", triton=5, cpu=5, parts=("codes", "scales", None), scale_dtype="uint8"),
    "int4g32": FormatEntry("int4g32", "Int4G32Format", triton=4, cpu=6, parts=("qweight", "scales", None),
                           scale_dtype="bfloat16"),
}

FORMATS = tuple(FORMAT_TABLE)                   # the CLI's --experts choices
INT4_GROUP_SIZES = (32, 64, 128)                # int4's group sizes (quant/int4.py)

# codes that are not expert formats
TRITON_FP8_BYTES = 3        # fp8 weights read as bytes and decoded with bit arithmetic (GPUs without native fp8)
CPU_F32 = 4                 # plain fp32 weights: dense linears and dense experts on the CPU


def triton_code(name: str) -> int | None:
    entry = FORMAT_TABLE.get(name)
    return None if entry is None else entry.triton


def cpu_code(name: str) -> int | None:
    entry = FORMAT_TABLE.get(name)
    return None if entry is None else entry.cpu


def cpu_codes() -> dict[str, int]:
    """{name: code} of every code the compiled CPU kernels know (expert formats, and "f32")."""
    return {**{n: e.cpu for n, e in FORMAT_TABLE.items() if e.cpu is not None}, "f32": CPU_F32}
