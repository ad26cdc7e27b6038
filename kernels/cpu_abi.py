"""What the Python side and the compiled CPU library (kernels/csrc/cpu_kernels.cpp) must agree on, and the check that
they do, run when the library loads (kernels/cpu_build.py): the descriptors' layouts (ctypes structs here, C++ structs
there: every size and field offset compared) and the weight formats' codes (quant/table.py against the library's
own). A library that disagrees is not used (the PyTorch twins run, with one line saying why).
"""
from __future__ import annotations

import ctypes

from ..quant.table import CPU_F32, cpu_codes

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
F32 = CPU_F32


class Lin(ctypes.Structure):
    """One weight matrix [n, k] in a kernel format (F32 / BF16: a plain tensor; else packed parts w, s, z)."""
    _fields_ = [("fmt", _i64), ("n", _i64), ("k", _i64), ("group", _i64), ("w", _ptr), ("s", _ptr), ("z", _ptr)]


class AttnDesc(ctypes.Structure):
    """A V3-family block's attention for dsv3_attention (kernels/cpu_decode.py fills it)."""
    _fields_ = [("wq_a", Lin), ("wq_b", Lin), ("wkv_a", Lin), ("wo", Lin), ("attn_norm", _ptr), ("q_norm", _ptr),
                ("kv_norm", _ptr), ("wkv_b", _ptr)] + \
        [(f, _i64) for f in ("dim", "heads", "q_lora", "dn", "dr", "dv", "kv_lora", "cache_dim", "interleave")] + \
        [(f, _f32) for f in ("eps", "latent_eps", "softmax_scale", "unused")]


class FfnDesc(ctypes.Structure):
    """A V3-family block's feed-forward (dense MLP, or router + routed experts + shared experts) for dsv3_ffn."""
    _fields_ = [("w1", Lin), ("w3", Lin), ("w2", Lin), ("norm", _ptr), ("gate_w", _ptr), ("gate_bias", _ptr),
                ("expert_ptrs", _ptr), ("expert_desc", _ptr)] + \
        [(f, _i64) for f in ("dim", "n_experts", "topk", "n_group", "topk_group", "softmax", "method", "norm_topk")] + \
        [(f, _f32) for f in ("eps", "scaling")]


STRUCTS = (Lin, AttnDesc, FfnDesc)


def layout_of(struct) -> list[int]:
    """[sizeof, the byte offset of each field in declaration order], as dsv3_struct_layout reports a C++ struct."""
    return [ctypes.sizeof(struct)] + [getattr(struct, name).offset for name, _ in struct._fields_]


def mismatch(lib) -> str | None:
    """Why `lib` does not fit this side (a struct laid out differently, a format code that differs), or None."""
    lib.dsv3_format_code.restype = _i64
    lib.dsv3_format_code.argtypes = [ctypes.c_char_p]
    for name, code in cpu_codes().items():
        theirs = lib.dsv3_format_code(name.encode())
        if theirs != code:
            return f"format {name!r} has code {theirs} in the library, {code} in quant/table.py"
    lib.dsv3_struct_layout.restype = _i64
    lib.dsv3_struct_layout.argtypes = [ctypes.c_char_p, _ptr, _i64]
    for struct in STRUCTS:
        ours = layout_of(struct)
        buf = (_i64 * 64)()
        n = lib.dsv3_struct_layout(struct.__name__.encode(), ctypes.addressof(buf), len(buf))
        theirs = list(buf[:n]) if n >= 0 else None
        if theirs != ours:
            return f"struct {struct.__name__} is laid out as {theirs} in the library, {ours} here"
    return None
