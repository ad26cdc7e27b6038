"""Routed experts on the CPU, computed from their packed blobs: all of a layer's selected experts in one call.

    out[t] = sum over k, in ascending expert id, of weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t, k]

`cpu_experts_forward` runs the compiled kernel (kernels/csrc/cpu_kernels.cpp, built by cpu_build) or, where there
is none, its twin `cpu_experts_ref`; both compute the same math, which differs from dequantize-then-matmul
(`ExpertFormat.expert_forward_ref`) in two ways chosen for speed:
- int4, int4g32 and int8: activations (x, and h = silu(gate x) * up x) are quantized to int8 per weight group
  (symmetric, scale amax / 127, round half to even) and multiplied with the codes in integers:
  s * xs * (sum q xq - z sum xq) (int4g32's z is 8, its offset; int8 weights have no zero point); int4g32's codes
  times their bf16 scale are not rounded to bf16 as its dequantization does (the product in fp32);
- fp8: each 128x128 block's scale multiplies the block's partial dot in fp32 instead of each weight being
  rounded to bf16 after scaling (bf16(fp32(q) * s)): the weights differ by at most 2^-9 relative;
- mxfp4 (exact weights): activations int8 per 32-block (as int4's, MXFP4_ACT "int8") or fp32 ("fp32").
Every format's kernel clamps the SwiGLU at `limit` where one is given (DeepSeek-V4's swiglu_limit).
bf16 weights are used as they are. Each token's result is computed the same way whatever else is in the call
(decode, MTP verification, prefill), in fp32, and the weighted sum adds each product in ascending expert id.
Formats: bf16, fp8, int8, int4 (group 64 or 128, or 32 with an even number of groups per row), mxfp4, int4g32;
nf4 stays on bitsandbytes.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from . import cpu_build
from ..layers import swiglu_act
from ..quant.table import CPU_F32, FORMAT_TABLE

# Nothing of quant/ but its table is imported here (quant/layout.py dispatches to this module): a layout is any
# object with quant.layout.BlobLayout's fields and `view`.
MXFP4_ACT = "int8"                    # the mxfp4 kernel's activations: "int8" (per 32-block) or "fp32"
_MXFP4_ACTS = {"int8": 0, "fp32": 1}
MATRICES = ("gate", "up", "down")     # blob order (quant.layout.MATRICES)
FP8_BLOCK = 128                       # edge of an fp8 scale block (quant.fp8.BLOCK)
MXFP4_BLOCK = 32                      # weights per mxfp4 scale (quant.mxfp4.BLOCK)
MAX_GROUPS = 1024                     # groups (int4) or 128-blocks (fp8) per weight row the kernel holds
INT8_ACTIVATIONS = ("int4", "int8", "int4g32")   # formats whose kernels quantize activations to int8 per group


def supports(layout, limit: float | None = None) -> bool:
    """Whether blobs of `layout` have a CPU kernel (else their format's own expert_forward runs); every kernel
    applies a SwiGLU clamp `limit`."""
    entry = FORMAT_TABLE.get(layout.format)
    if entry is None or entry.cpu is None:
        return False
    if layout.format == "mxfp4":
        return True
    g = layout.group_size or FP8_BLOCK
    if max(layout.inter, layout.hidden) > MAX_GROUPS * g:
        return False
    if layout.format == "int4":
        if g not in (32, 64, 128):
            return False
        if g == 32 and any(-(-k // g) % 2 for k in (layout.inter, layout.hidden)):
            return False
    return True


def available(layout, limit: float | None = None) -> bool:
    """Whether blobs of `layout` run through the compiled kernel here (a library, and a kernel: `supports`)."""
    return supports(layout, limit) and cpu_build.library() is not None


def layout_desc(layout) -> torch.Tensor:
    """int64 [13] the kernel reads: format, group, inter, hidden, then (weight, scale, zero) offsets per matrix."""
    desc = getattr(layout, "_cpu_desc", None)
    if desc is None:
        entry = FORMAT_TABLE[layout.format]
        offs = [layout.components[f"{m}.{p}"].offset if p else -1 for m in MATRICES for p in entry.parts]
        desc = torch.tensor([entry.cpu, layout.group_size or FP8_BLOCK, layout.inter, layout.hidden, *offs],
                            dtype=torch.int64)
        layout._cpu_desc = desc
    return desc


F32 = CPU_F32                         # the kernel's plain-fp32 weight format (dense experts, dense linears)


def dense_experts(w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(addresses [E], descriptor [13]) that let the kernel read stacked fp32 experts w1 / w3 [E, I, D], w2 [E, D, I]
    as one blob per expert: expert e's gate at w1[e], its up and down at constant offsets from there. None unless
    all three are contiguous fp32 CPU tensors."""
    if not all(w.device.type == "cpu" and w.dtype == torch.float32 and w.is_contiguous() for w in (w1, w3, w2)):
        return None
    e, inter, dim = w1.shape
    base = w1.data_ptr()
    ptrs = base + torch.arange(e, dtype=torch.int64) * w1.stride(0) * w1.element_size()
    desc = torch.tensor([F32, 0, inter, dim, 0, -1, -1, w3.data_ptr() - base, -1, -1, w2.data_ptr() - base, -1, -1],
                        dtype=torch.int64)
    return ptrs, desc


def blob_pointers(blobs, n_experts: int, layout) -> torch.Tensor:
    """int64 [E] addresses of each expert's blob (0: none) from a [E, blob_bytes] pool, a sequence or a mapping."""
    if isinstance(blobs, torch.Tensor):
        assert blobs.dtype == torch.uint8 and blobs.dim() == 2 and blobs.shape[1] == layout.blob_bytes \
            and blobs.stride(1) == 1, f"pool must be uint8 [E, {layout.blob_bytes}] with contiguous rows"
        return blobs.data_ptr() + torch.arange(blobs.shape[0], dtype=torch.int64) * blobs.stride(0)
    items = blobs.items() if isinstance(blobs, Mapping) else enumerate(blobs)
    ptrs = torch.zeros(n_experts, dtype=torch.int64)
    for e, b in items:
        if b is None:
            continue
        assert b.dtype == torch.uint8 and b.dim() == 1 and b.numel() == layout.blob_bytes and b.is_contiguous() \
            and b.device.type == "cpu", f"expert {e}: expected a contiguous CPU uint8 blob of {layout.blob_bytes} bytes"
        ptrs[e] = b.data_ptr()
    return ptrs


def cpu_experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        blobs: torch.Tensor | Sequence | Mapping, layout, *, ptrs: torch.Tensor | None = None,
                        per_pair: bool = False, out: torch.Tensor | None = None, threads: int = 0,
                        limit: float | None = None, act: str | None = None) -> torch.Tensor:
    """Routed experts of one layer on the CPU.

    x [T, D], ids [T, K] (expert ids), weights [T, K] fp32. blobs: the layer's uint8 [E, blob_bytes] pool (row e =
    expert e), or a sequence / {id: blob} mapping of per-expert blobs, where a missing or None entry means "not
    computed here" (its pairs are skipped). ptrs: `blob_pointers(blobs, ...)` computed once by a caller that calls
    often with the same blobs. per_pair False: [T, D], the weighted sum in ascending expert id. per_pair True:
    [T, K, D], the unweighted output of each computed (t, k) pair at its place, zeros elsewhere (the fused GPU
    kernel's external outputs). out: an fp32 buffer of that shape to fill (no allocation). threads: at most this
    many (0: torch's intra-op setting). limit: clamp the SwiGLU (swiglu_act). act: the mxfp4 kernel's
    activations (default MXFP4_ACT). Returns x.dtype (fp32 when out is given).
    """
    t, k = ids.shape
    if x.dtype != torch.float32 and not per_pair and out is None:
        # 16-bit activations: each weighted output rounded to x.dtype and added in x.dtype, in ascending expert id,
        # as model.combine_experts does (so every provider gives the same bits)
        y = cpu_experts_forward(x, ids, weights, blobs, layout, ptrs=ptrs, per_pair=True, threads=threads,
                                limit=limit, act=act)
        order = ids.argsort(dim=1, stable=True)
        rows = torch.arange(t)[:, None]
        y, w = y[rows, order], weights[rows, order]                     # [T, K, D], [T, K] ascending ids
        acc = torch.zeros_like(x)
        for j in range(k):
            acc = acc + (y[:, j] * w[:, j, None]).to(x.dtype)
        return acc
    lib = cpu_build.library()
    act = act or MXFP4_ACT
    if lib is None or not supports(layout, limit):
        y = cpu_experts_ref(x, ids, weights, blobs, layout, per_pair=per_pair, limit=limit, act=act)
        if out is not None:
            out.copy_(y)
            return out
        return y
    if ptrs is None:
        n = blobs.shape[0] if isinstance(blobs, torch.Tensor) else \
            max(max(blobs, default=-1) + 1 if isinstance(blobs, Mapping) else len(blobs), int(ids.max()) + 1)
        ptrs = blob_pointers(blobs, n, layout)
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    ids = ids if ids.dtype == torch.int64 and ids.is_contiguous() else ids.long().contiguous()
    weights = weights if weights.dtype == torch.float32 and weights.is_contiguous() else weights.float().contiguous()
    shape = (t, k, x.shape[1]) if per_pair else (t, x.shape[1])
    given = out is not None
    if out is None:
        out = torch.zeros(shape) if per_pair else torch.empty(shape)
    assert out.shape == shape and out.dtype == torch.float32 and out.is_contiguous(), \
        f"out must be contiguous fp32 {shape}, got {out.dtype} {tuple(out.shape)}"
    assert x.shape[1] == layout.hidden and weights.shape == ids.shape, \
        f"x [T, {layout.hidden}] and weights like ids [T, K] expected"
    rc = lib.dsv3_moe(xf.data_ptr(), t, ids.data_ptr(), weights.data_ptr(), k, ptrs.data_ptr(), ptrs.numel(),
                      layout_desc(layout).data_ptr(), out.data_ptr(), int(per_pair), int(threads),
                      float("inf") if limit is None else float(limit), _MXFP4_ACTS[act])
    if rc != 0:
        raise ValueError(f"CPU expert kernel: {'expert id out of range' if rc == -1 else f'error {rc}'}")
    return out if given or x.dtype == torch.float32 else out.to(x.dtype)


_ONE_EXPERT: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}    # n tokens -> (ids zeros [n, 1], weights ones)


def expert_forward_cpu(blob: torch.Tensor, x: torch.Tensor, layout,
                       limit: float | None = None) -> torch.Tensor | None:
    """One expert on x [N, D] (CPU): down(silu(gate x) * up x) through the kernel (limit: clamped), or None where it
    cannot run (no library, no kernel for this layout and limit) and the caller's own path should. Returns x.dtype."""
    if blob.device.type != "cpu" or not blob.is_contiguous() or not available(layout, limit):
        return None
    n = x.shape[0]
    fixed = _ONE_EXPERT.get(n)
    if fixed is None:
        fixed = (torch.zeros(n, 1, dtype=torch.int64), torch.ones(n, 1))
        if n <= 64:
            _ONE_EXPERT[n] = fixed
    ptrs = torch.tensor([blob.data_ptr()], dtype=torch.int64)
    return cpu_experts_forward(x, fixed[0], fixed[1], blob[None], layout, ptrs=ptrs, limit=limit)   # y * 1.0: exact


# ----------------------------------------------------------------------------------------------
# PyTorch twin

def quantize_activation(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [N, K] fp32 -> its int8 grid per group of `group` along K, dequantized: round(x * 127 / amax) * amax / 127
    (the kernel's activation rounding; zero groups stay zero). Padding to whole groups is dropped again."""
    n, kk = x.shape
    kp = -(-kk // group) * group
    xp = F.pad(x.float(), (0, kp - kk)).view(n, kp // group, group)
    amax = xp.abs().amax(dim=-1, keepdim=True)
    q127 = torch.full_like(amax, 127.0)       # tensor / tensor: one correctly rounded division, as the kernel's
    inv = torch.where(amax > 0, q127 / amax, torch.zeros_like(amax))     # (127 / t is reciprocal(t) * 127 in torch)
    q = torch.round(xp * inv)
    return (q * (amax / q127)).view(n, kp)[:, :kk]


def matrix_weights_ref(fmt: str, weight: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                       n: int, k: int, group: int | None) -> torch.Tensor:
    """One packed matrix [n, k] in fp32 as the kernels apply it: bf16 as is, fp8 codes times their block scale (no
    bf16 rounding), int4 (q - z) * s, int8 q * s (per group along k), mxfp4 e2m1 times
    2^(s - 127) (exact), int4g32 q * s (no bf16 rounding)."""
    if fmt == "bf16":
        return weight.float()
    if fmt == "mxfp4":                                 # weight: codes [n, kp/2], scale: ue8m0 bytes [n, kp/32]
        b = weight.view(torch.uint8).long()
        codes = torch.stack((b & 0xF, b >> 4), dim=-1).view(n, -1)         # the low nibble is the even k
        e, m = (codes >> 1) & 3, (codes & 1).float()                      # e2m1 from its bits: s e1 e0 m
        mag = torch.where(e == 0, m / 2, torch.ldexp(1 + m / 2, e - 1))
        w = torch.where(codes >= 8, -mag, mag).view(n, -1, MXFP4_BLOCK)
        s = scale.view(torch.uint8)
        s = torch.where(s == 255, torch.nan, torch.ldexp(torch.ones(s.shape), s.long() - 127))
        return (w * s[..., None]).view(n, -1)[:, :k]
    if fmt == "fp8":                                   # scale [ceil(n/128), ceil(k/128)] -> per element
        s = scale.repeat_interleave(FP8_BLOCK, dim=0)[:n].repeat_interleave(FP8_BLOCK, dim=1)[:, :k]
        return weight.float() * s
    if fmt == "int4":
        b = weight.view(n, -1, group // 2)             # byte i of a group: element i low, i + g/2 high
        q = torch.cat([b & 0xF, b >> 4], dim=-1).float()
        return ((q - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)).view(n, -1)[:, :k]
    if fmt == "int4g32":                               # byte b: k = 2b low, 2b + 1 high, each q + 8
        b = weight.view(n, -1)
        q = torch.stack((b & 0xF, b >> 4), dim=-1).view(n, -1).float() - 8
        return (q.view(n, -1, group) * scale.float().unsqueeze(-1)).view(n, -1)[:, :k]
    if fmt == "int8":                                  # codes as int8 (or their uint8 bytes, as blobs hold them)
        return (weight.view(torch.int8).float().view(n, -1, group) * scale.float().unsqueeze(-1)).view(n, -1)[:, :k]
    raise ValueError(f"no CPU kernel for {fmt} weights")


def expert_weights_ref(blob: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate, up, down) of one blob in fp32 as the kernel applies them (`matrix_weights_ref`)."""
    entry = FORMAT_TABLE.get(layout.format)
    if entry is None or entry.cpu is None:
        raise ValueError(f"no CPU kernel for {layout.format} experts")
    out = []
    for m in MATRICES:
        parts = [layout.view(blob, f"{m}.{p}") if p else None for p in entry.parts]
        out.append(matrix_weights_ref(layout.format, *parts, *layout.matrix_shape(m), layout.group_size))
    return tuple(out)


def expert_ref(blob: torch.Tensor, xs: torch.Tensor, layout, limit: float | None = None,
               act: str | None = None) -> torch.Tensor:
    """One expert on xs [N, D] fp32, as the kernel computes it (limit, act: see cpu_experts_forward)."""
    gate, up, down = expert_weights_ref(blob, layout)
    quantized = layout.format in INT8_ACTIVATIONS or (layout.format == "mxfp4" and (act or MXFP4_ACT) == "int8")
    prep = (lambda v: quantize_activation(v, layout.group_size)) if quantized else (lambda v: v)
    xq = prep(xs)
    return F.linear(prep(swiglu_act(F.linear(xq, gate), F.linear(xq, up), limit)), down)


def cpu_experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, blobs, layout, *,
                    per_pair: bool = False, limit: float | None = None, act: str | None = None) -> torch.Tensor:
    """Twin of cpu_experts_forward (same arguments, same results up to fp32 summation order)."""
    t, k = ids.shape
    xf = x.float()
    rows = ids.tolist()
    get = (lambda e: blobs[e]) if isinstance(blobs, torch.Tensor) else \
        (lambda e: blobs.get(e)) if isinstance(blobs, Mapping) else (lambda e: blobs[e] if e < len(blobs) else None)
    out = torch.zeros(t, k, x.shape[1]) if per_pair else torch.zeros(t, x.shape[1])
    for e in sorted({e for row in rows for e in row}):
        blob = get(e)
        if blob is None:
            continue
        pairs = [(i, j) for i, row in enumerate(rows) for j, v in enumerate(row) if v == e]
        tok = torch.tensor([i for i, _ in pairs])
        y = expert_ref(blob, xf[tok], layout, limit, act)
        for n, (i, j) in enumerate(pairs):
            if per_pair:
                out[i, j] = y[n]
            else:
                out[i] += y[n] * weights[i, j].float()
    return out.to(x.dtype)
