"""Routed-expert SwiGLU for all selected experts of one MoE layer, reading packed blobs from the slot pool.

    y[t] = sum over k, in ascending expert id, of weights[t, k] * down_e(silu(gate_e x[t]) * up_e x[t]),  e = ids[t, k]

Every expert is one uint8 blob (quant/layout.py); the device tier keeps blobs in one [n_slots, blob_bytes] pool
and `slot_of_expert` says which row holds each expert of this layer. Two launches (decode: M = 1..16 tokens):
  (a) gate+up+silu·mul: one program per (token, k) pair and I-block; the pair whose token is the first (in
      its block of BLOCK_M tokens) to pick expert e does the work for every token that picked e, so each
      expert's gate/up bytes are read once per block; it writes h [M*K, I] (x.dtype) at rows t*K + k.
  (b) down + weighted sum: one program per D-block (and block of tokens) walks the distinct experts in
      ascending id, multiplies h rows by down_e and adds weights * result into an fp32 accumulator. The
      order is fixed and nothing is atomic, so y does not depend on which slot holds an expert.
BLOCK_M is 16 on the tensor-core path (3+ tokens) and M itself for 1-2 tokens (fp32 multiply-adds); the inner
products are quant_matmul.py's `_dot_step`.
Experts with slot -1 (not resident) are skipped, or take their outputs from `external_out` (computed
elsewhere, e.g. on the CPU) so that they still join the sum in its place in the order.
Formats int4 / int4g32 / fp8 / bf16 (nf4 stays on bitsandbytes: fused_moe_auto runs the twin for it).
"""
from __future__ import annotations

import torch

from . import dispatch
from .dispatch import jit as _jit, tl, triton
from .quant_matmul import (FMT_CODES, FMT_FP8, FMT_FP8_BYTES, GROUPED, _X_DTYPES, _acc_result, _acc_zeros, _cast,
                           _dot_step, dot_precision, fp8_code, fp8_weight_view, num_tiles, plan_blocks)
from ..quant.layout import BlobLayout, MATRICES
from ..quant.table import FORMAT_TABLE



def _check_inputs(x, expert_ids, weights, slot_of_expert, pool, layout, external_out):
    assert x.dim() == 2 and x.dtype in _X_DTYPES, (
        f"x must be [M, D] float16/bfloat16/float32, got {x.dtype} {tuple(x.shape)}")
    m, d = x.shape
    assert d == layout.hidden, f"x has D={d}, the blob layout hidden={layout.hidden}"
    assert expert_ids.dim() == 2 and expert_ids.shape[0] == m and expert_ids.shape[1] >= 1, (
        f"expert_ids must be [{m}, K], got shape {tuple(expert_ids.shape)}")
    assert expert_ids.dtype in (torch.int32, torch.int64), f"expert_ids must be int32/int64, got {expert_ids.dtype}"
    assert weights.shape == expert_ids.shape and weights.dtype == torch.float32, (
        f"weights must be float32 {tuple(expert_ids.shape)}, got {weights.dtype} {tuple(weights.shape)}")
    assert slot_of_expert.dim() == 1 and slot_of_expert.dtype == torch.int32, (
        f"slot_of_expert must be int32 [E], got {slot_of_expert.dtype} {tuple(slot_of_expert.shape)}")
    assert pool.dtype == torch.uint8 and pool.dim() == 2 and pool.shape[1] == layout.blob_bytes, (
        f"pool must be uint8 [n_slots, {layout.blob_bytes}], got {pool.dtype} {tuple(pool.shape)}")
    assert pool.stride(1) == 1, "pool rows must be contiguous"
    if external_out is not None:
        assert external_out.shape == (m, expert_ids.shape[1], d) and external_out.dtype == x.dtype, (
            f"external_out must be {x.dtype} [{m}, {expert_ids.shape[1]}, {d}], "
            f"got {external_out.dtype} {tuple(external_out.shape)}")
    for name, t in (("expert_ids", expert_ids), ("weights", weights), ("slot_of_expert", slot_of_expert),
                    ("pool", pool), ("external_out", external_out)):
        assert t is None or t.device == x.device, f"{name} is on {t.device}, x on {x.device}"


# ----------------------------------------------------------------------------------------------
# Triton kernels
#
# Both kernels see the expert ids of one block of BLOCK_M tokens as a [BLOCK_M, BLOCK_KE] tile. A token picks
# an expert at most once, so "the tokens that picked e" is one row mask (`has`) plus the column of each
# (`kidx`), and an expert's tokens are rows of a BLOCK_M-row dot. Pool components are reached through typed
# views of the pool (element offsets), slot rows as int64 (the pool may exceed 2^31 elements).
# ----------------------------------------------------------------------------------------------

@_jit
def _moe_gate_up_kernel(
    x_ptr, ids_ptr, slot_ptr, wpool_ptr, spool_ptr, h_ptr,
    M, D, I, n_tiles,
    stride_xm, stride_im,             # x [M, D], expert_ids [M, TOP_K] row strides
    wslot, sslot,                     # slot row stride in elements of the weight / scale pool views
    gate_w, gate_s, gate_z, up_w, up_s, up_z,   # component element offsets within a blob
    stride_wn, stride_sn,             # gate/up weight and scale row strides (elements)
    TOP_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_KE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    pair = tl.program_id(0)
    t0 = pair // TOP_K
    rows = (t0 // BLOCK_M) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_KE)
    id_ok = (rows < M)[:, None] & (cols < TOP_K)[None, :]
    ids = tl.load(ids_ptr + rows[:, None] * stride_im + cols[None, :], mask=id_ok, other=-1).to(tl.int32)
    e = tl.load(ids_ptr + t0 * stride_im + pair % TOP_K).to(tl.int32)
    match = (ids == e) & id_ok
    earlier = tl.sum(tl.where(match & (rows < t0)[:, None], 1, 0))   # tokens before t0 that picked e
    slot = tl.load(slot_ptr + e)
    if (earlier == 0) & (slot >= 0):   # this pair owns expert e for the block
        has = tl.max(match.to(tl.int32), 1) > 0                  # [BLOCK_M]: token picked e ...
        kidx = tl.sum(tl.where(match, cols[None, :], 0), 1)      # ... as its kidx-th choice
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        wbase = wpool_ptr + slot.to(tl.int64) * wslot
        sbase = spool_ptr + slot.to(tl.int64) * sslot
        if FMT == 1 or FMT == 3:
            s_off = (offs_n // 128) * stride_sn
        else:
            s_off = offs_n * stride_sn
        x_off = rows * stride_xm
        acc_gate = _acc_zeros(BLOCK_M, BLOCK_N, FMT, GROUP, BLOCK_K, USE_DOT)
        acc_up = _acc_zeros(BLOCK_M, BLOCK_N, FMT, GROUP, BLOCK_K, USE_DOT)
        for it in range(0, n_tiles):
            acc_gate = _dot_step(acc_gate, it, x_ptr, x_off, has, D, wbase + gate_w, offs_n * stride_wn,
                                 sbase + gate_s, sbase + gate_z, s_off, n_ok,
                                 FMT, GROUP, BLOCK_K, USE_DOT, UPCAST, PRECISION)
            acc_up = _dot_step(acc_up, it, x_ptr, x_off, has, D, wbase + up_w, offs_n * stride_wn,
                               sbase + up_s, sbase + up_z, s_off, n_ok,
                               FMT, GROUP, BLOCK_K, USE_DOT, UPCAST, PRECISION)
        gate = _acc_result(acc_gate, USE_DOT)
        h = gate * tl.sigmoid(gate) * _acc_result(acc_up, USE_DOT)
        h_ptrs = h_ptr + ((rows * TOP_K + kidx) * I)[:, None] + offs_n[None, :]
        tl.store(h_ptrs, _cast(h, h_ptr.dtype.element_ty, UPCAST), mask=has[:, None] & n_ok[None, :])


@_jit
def _moe_down_kernel(
    h_ptr, ids_ptr, weights_ptr, slot_ptr, wpool_ptr, spool_ptr, ext_ptr, y_ptr,
    M, D, I, E, n_tiles,              # E: experts in the layer (slot_of_expert's length)
    stride_im, stride_rm, stride_ym,  # expert_ids, weights, y row strides
    wslot, sslot,
    down_w, down_s, down_z,
    stride_wn, stride_sn,             # down weight and scale row strides (elements)
    TOP_K: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_KE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr, HAS_EXTERNAL: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_KE)
    id_ok = (rows < M)[:, None] & (cols < TOP_K)[None, :]
    ids = tl.load(ids_ptr + rows[:, None] * stride_im + cols[None, :], mask=id_ok, other=-1).to(tl.int32)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < D
    if FMT == 1 or FMT == 3:
        s_off = (offs_n // 128) * stride_sn
    else:
        s_off = offs_n * stride_sn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    prev = tl.min(ids) * 0 - 1                                  # int32 scalar -1: below every expert id
    n_pairs = tl.minimum(M - tl.program_id(1) * BLOCK_M, BLOCK_M) * TOP_K
    for _ in range(0, tl.minimum(n_pairs, E)):               # at least the number of distinct experts
        e = tl.min(tl.where(id_ok & (ids > prev), ids, 2147483647))   # the next expert id up
        prev = e
        if e < 2147483647:
            match = (ids == e) & id_ok
            has = tl.max(match.to(tl.int32), 1) > 0
            kidx = tl.sum(tl.where(match, cols[None, :], 0), 1)
            pair_rows = rows * TOP_K + kidx
            route_w = tl.load(weights_ptr + rows * stride_rm + kidx, mask=has, other=0.0)
            slot = tl.load(slot_ptr + e)
            if slot >= 0:
                wbase = wpool_ptr + slot.to(tl.int64) * wslot
                sbase = spool_ptr + slot.to(tl.int64) * sslot
                out_e = _acc_zeros(BLOCK_M, BLOCK_N, FMT, GROUP, BLOCK_K, USE_DOT)
                for it in range(0, n_tiles):
                    out_e = _dot_step(out_e, it, h_ptr, pair_rows * I, has, I, wbase + down_w, offs_n * stride_wn,
                                      sbase + down_s, sbase + down_z, s_off, n_ok,
                                      FMT, GROUP, BLOCK_K, USE_DOT, UPCAST, PRECISION)
                acc += route_w[:, None] * _acc_result(out_e, USE_DOT)
            elif HAS_EXTERNAL:
                ext = ext_ptr + (pair_rows * D)[:, None] + offs_n[None, :]
                acc += route_w[:, None] * tl.load(ext, mask=has[:, None] & n_ok[None, :], other=0.0).to(tl.float32)

    y = y_ptr + (rows * stride_ym)[:, None] + offs_n[None, :]
    tl.store(y, _cast(acc, y_ptr.dtype.element_ty, UPCAST), mask=(rows < M)[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------

def _pool_views(pool: torch.Tensor, layout: BlobLayout, fmt: int):
    """(weight pool view, scale pool view, {component: element offset}, {matrix: (weight row, scale row stride)})."""
    entry = FORMAT_TABLE.get(layout.format)
    if entry is None or entry.triton is None:
        raise ValueError(f"fused_moe has no kernel for {layout.format!r} experts; use fused_moe_ref")
    wpart, *rest = entry.parts
    sparts = tuple(p for p in rest if p)
    # fp8 weights as the GPU's kernels read them (its own type, or bytes), every other weight as the table says
    wview = fp8_weight_view(pool, fmt) if fmt in (FMT_FP8, FMT_FP8_BYTES) else pool.view(getattr(torch, entry.weight_dtype))
    sview = pool.view(getattr(torch, entry.scale_dtype)) if entry.scale_dtype else wview
    offsets, strides = {}, {}
    for m in MATRICES:
        comp = layout.components[f"{m}.{wpart}"]
        offsets[f"{m}.w"] = comp.offset // wview.element_size()
        scale_stride = 0
        for kind, part in zip(("s", "z"), sparts):
            c = layout.components[f"{m}.{part}"]
            offsets[f"{m}.{kind}"] = c.offset // sview.element_size()
            scale_stride = c.shape[1]
        offsets.setdefault(f"{m}.s", 0)
        offsets.setdefault(f"{m}.z", offsets[f"{m}.s"])
        strides[m] = (comp.shape[1], scale_stride)
    return wview, sview, offsets, strides


def fused_moe(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, slot_of_expert: torch.Tensor,
              pool: torch.Tensor, layout: BlobLayout, external_out: torch.Tensor | None = None, *,
              use_dot: bool | None = None, block_n: int | None = None, block_d: int | None = None,
              block_k: int | None = None, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """Routed-expert outputs of one MoE layer from packed blobs in the slot pool, with the two Triton kernels.

    x [M, D]; expert_ids [M, K] int32/int64, distinct within a row (top-k), in any order (the sum runs in
    ascending expert id), each < E;
    weights [M, K] float32 routing weights; slot_of_expert int32 [E]: the pool row of each expert of this
    layer, -1 when not resident (skipped, or taken from `external_out` [M, K, D] in x.dtype when given);
    pool uint8 [n_slots, layout.blob_bytes] (rows contiguous); layout: int4, int4g32, fp8 or bf16.
    Returns y [M, D] in x.dtype: sum_k weights * expert(x), accumulated in fp32 in ascending expert id.
    Nothing is read from slots that no selected expert maps to. Tuning knobs (None = automatic): use_dot
    (tensor cores; 16-token blocks), block_n / block_d (I / D width of a program in launches (a) / (b)),
    block_k (K tile in weight elements).
    """
    assert triton is not None, "fused_moe needs Triton; use fused_moe_ref (or fused_moe_auto)"
    _check_inputs(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
    fmt = FMT_CODES.get(layout.format)
    if fmt is None:
        raise ValueError(f"fused_moe has no kernel for {layout.format!r} experts; use fused_moe_ref")
    if fmt == FMT_FP8:
        fmt = fp8_code(x.device)
    assert pool.stride(0) % 16 == 0, f"pool row stride {pool.stride(0)} must be a multiple of 16 bytes"
    m, d = x.shape
    top_k = expert_ids.shape[1]
    inter = layout.inter
    if x.stride(1) != 1:
        x = x.contiguous()
    ids = expert_ids if expert_ids.stride(1) == 1 else expert_ids.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    y = torch.empty_like(x)
    if m == 0:
        return y
    assert m * max(x.stride(0), top_k * max(inter, d)) < 2**31, "offsets are int32: split the batch"
    wview, sview, off, strides = _pool_views(pool, layout, fmt)
    group = layout.group_size if fmt in GROUPED else (128 if fmt in (FMT_FP8, FMT_FP8_BYTES) else 0)
    upcast = dispatch.interpreted()
    precision = dot_precision(x.dtype, upcast)
    block_ke = triton.next_power_of_2(top_k)
    wslot, sslot = pool.stride(0) // wview.element_size(), pool.stride(0) // sview.element_size()
    h = torch.empty(m * top_k, inter, dtype=x.dtype, device=x.device)   # rows of skipped pairs stay unwritten

    # 16-wide programs: ~1000 of them for one token's 8 experts (V3), and fewer registers than 32-wide
    bm, bn, bk, dot = plan_blocks(fmt, m, inter, d, group, use_dot, block_n or 16, block_k)
    _moe_gate_up_kernel[(m * top_k, triton.cdiv(inter, bn))](
        x, ids, slot_of_expert, wview, sview, h,
        m, d, inter, num_tiles(fmt, d, group, bk),
        x.stride(0), ids.stride(0),
        wslot, sslot,
        off["gate.w"], off["gate.s"], off["gate.z"], off["up.w"], off["up.s"], off["up.z"],
        *strides["gate"],
        TOP_K=top_k, FMT=fmt, GROUP=group, BLOCK_M=bm, BLOCK_KE=block_ke, BLOCK_N=bn, BLOCK_K=bk,
        USE_DOT=dot, UPCAST=upcast, PRECISION=precision, num_warps=num_warps, num_stages=num_stages,
    )
    bm, bd, bk, dot = plan_blocks(fmt, m, d, inter, group, use_dot, block_d or 16, block_k)
    ext = external_out.contiguous() if external_out is not None else y   # y: a dummy pointer, never read
    _moe_down_kernel[(triton.cdiv(d, bd), triton.cdiv(m, bm))](
        h, ids, weights, slot_of_expert, wview, sview, ext, y,
        m, d, inter, slot_of_expert.shape[0], num_tiles(fmt, inter, group, bk),
        ids.stride(0), weights.stride(0), y.stride(0),
        wslot, sslot,
        off["down.w"], off["down.s"], off["down.z"],
        *strides["down"],
        TOP_K=top_k, FMT=fmt, GROUP=group, BLOCK_M=bm, BLOCK_KE=block_ke, BLOCK_N=bd, BLOCK_K=bk,
        USE_DOT=dot, HAS_EXTERNAL=external_out is not None, UPCAST=upcast, PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y


# ----------------------------------------------------------------------------------------------
# PyTorch twin: the CPU path. model.combine_experts over each expert's blob in its pool row, so with every
# expert resident it gives the same bits as BlobExperts (the resident provider).
# ----------------------------------------------------------------------------------------------

def fused_moe_ref(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, slot_of_expert: torch.Tensor,
                  pool: torch.Tensor, layout: BlobLayout, external_out: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `fused_moe` (same arguments), for every format, nf4 included (via the format's own forward).

    Each expert's weighted output is rounded to x.dtype and added in ascending expert id (`combine_experts`).
    Reads slot_of_expert and the routing on the host (a device sync on CUDA).
    """
    from ..moe import combine_experts           # here, not at the top: keeps the kernels importable alone
    from ..quant.formats import format_for_layout

    _check_inputs(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
    fmt = format_for_layout(layout)
    slots = slot_of_expert.tolist()
    flat = expert_ids.flatten().tolist() if external_out is not None else None

    def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
        if slots[e] >= 0:
            return fmt.expert_forward(pool[slots[e]], xs, layout).to(xs.dtype)
        if external_out is None:
            return torch.zeros_like(xs)           # adds +-0: the same as leaving the expert out
        pairs = [i for i, v in enumerate(flat) if v == e]   # combine_experts' row order: ascending (token, k)
        return external_out.reshape(-1, xs.shape[1])[torch.tensor(pairs, device=xs.device)]

    return combine_experts(expert, x, expert_ids, weights)


def fused_moe_auto(x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, slot_of_expert: torch.Tensor,
                   pool: torch.Tensor, layout: BlobLayout, external_out: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe` where kernels run (dispatch.use_kernels) and the format has one, else `fused_moe_ref`."""
    if layout.format in FMT_CODES and dispatch.use_kernels(x.device):
        return fused_moe(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
    return fused_moe_ref(x, expert_ids, weights, slot_of_expert, pool, layout, external_out)
