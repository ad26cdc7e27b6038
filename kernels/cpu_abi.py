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


class HcDesc(ctypes.Structure):
    """One DeepSeek-V4 mHC (hc_attn or hc_ffn) for the V4 kernels (kernels/csrc/cpu_v4.cpp)."""
    _fields_ = [("fn", _ptr), ("base", _ptr), ("scale", _ptr), ("n", _i64), ("iters", _i64), ("eps", _f32),
                ("hc_eps", _f32)]


class V4AttnDesc(ctypes.Structure):
    """A DeepSeek-V4 block's attention for dsv4_attention (kernels/cpu_v4.py fills it)."""
    _fields_ = [("hc", HcDesc)] + [(f, Lin) for f in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "c_wkv", "c_wgate",
                                                      "i_wq_b", "i_wproj", "i_wkv", "i_wgate")] + \
        [(f, _ptr) for f in ("attn_norm", "q_norm", "kv_norm", "sink", "c_ape", "c_norm", "i_ape", "i_norm",
                             "inv_freq")] + \
        [(f, _i64) for f in ("dim", "heads", "head_dim", "rope", "q_lora", "groups", "window", "ratio", "overlap",
                             "index_heads", "index_dim", "index_topk")] + [("eps", _f32), ("unused", _f32)]


class V4CacheDesc(ctypes.Structure):
    """The tensors of one V4 block's cache object (dsv3lite/v4/cache.py) for dsv4_attention."""
    _fields_ = [(f, _ptr) for f in ("ring", "c_cv", "c_g", "c_entries", "i_cv", "i_g", "i_entries")] + \
        [(f, _i64) for f in ("ring_slots", "c_slots", "i_slots", "entry_cap")]


class V4FfnDesc(ctypes.Structure):
    """A DeepSeek-V4 block's feed-forward (router, routed and shared experts inside mHC) for dsv4_ffn."""
    _fields_ = [("hc", HcDesc)] + [(f, Lin) for f in ("w1", "w3", "w2", "gate")] + \
        [(f, _ptr) for f in ("norm", "gate_bias", "tid2eid", "expert_ptrs", "expert_desc")] + \
        [(f, _i64) for f in ("dim", "n_experts", "topk", "vocab", "tid_bytes", "norm_topk", "act")] + \
        [(f, _f32) for f in ("eps", "scaling", "limit", "unused")]


# each library function that reports layouts, and the structs it knows
STRUCTS = {"dsv3_struct_layout": (Lin, AttnDesc, FfnDesc),
           "dsv4_struct_layout": (HcDesc, V4AttnDesc, V4CacheDesc, V4FfnDesc)}


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
    for reporter, structs in STRUCTS.items():
        fn = getattr(lib, reporter, None)
        if fn is None:
            return f"it has no {reporter}"
        fn.restype = _i64
        fn.argtypes = [ctypes.c_char_p, _ptr, _i64]
        for struct in structs:
            ours = layout_of(struct)
            buf = (_i64 * 64)()
            n = fn(struct.__name__.encode(), ctypes.addressof(buf), len(buf))
            theirs = list(buf[:n]) if n >= 0 else None
            if theirs != ours:
                return f"struct {struct.__name__} is laid out as {theirs} in the library, {ours} here"
    return None
