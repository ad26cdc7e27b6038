"""Absorbed-MLA decode attention over the latent KV cache: a split-KV Triton kernel and its PyTorch twin.

Every head reads the same cached rows [latent c_t (kv_lora_rank) | k_pe_t (rope_dim)]: keys are whole
rows, values their first kv_lora_rank columns. Queries are absorbed (q_nope @ W_UK ‖ q_pe), so each
head's output is a mix of latents; the model applies W_UV and W_o afterwards (docs/dsv3-math.md §4, §7).
Sq <= 4 new tokens per sequence (MTP verification) use the bottom-right causal mask.

Sparse decode (DeepSeek-V3.2's DSA): with `indices` [B, Sq, K], query s attends only to the rows its index list
names (the lightning indexer's top-k), still under the causal rule; -1 entries name no row.
"""
from __future__ import annotations

import torch

from . import dispatch
from .dispatch import jit as _jit, tl, triton


MAX_QUERIES = 4           # new tokens per sequence the kernel takes (a decode step plus MTP drafts)
_MIN_SPLIT_TOKENS = 128   # a split shorter than this costs more to merge than it saves
_MAX_SPLITS = 64
MERGE_ROWS, MERGE_COLS = 4, 64   # merge tile: DeepSeek-V3's 128 heads x 512 latents merge on 256 programs
_LOG2E = 1.4426950408889634


def _check_inputs(q, latent_cache, seqlens, kv_lora_rank, indices=None):
    assert q.dim() == 4, f"q must be [B, Sq, H, Dk], got shape {tuple(q.shape)}"
    assert latent_cache.dim() == 3, f"latent_cache must be [B, Tmax, Dk], got shape {tuple(latent_cache.shape)}"
    batch, sq, _, dk = q.shape
    assert 1 <= sq <= MAX_QUERIES, f"Sq must be in 1..{MAX_QUERIES}, got {sq}"
    assert latent_cache.shape[0] == batch and latent_cache.shape[2] == dk, (
        f"latent_cache {tuple(latent_cache.shape)} does not match q {tuple(q.shape)}: want [{batch}, Tmax, {dk}]")
    assert 0 < kv_lora_rank < dk, (
        f"kv_lora_rank must be in 1..{dk - 1} (Dk = kv_lora_rank + rope_dim), got {kv_lora_rank}")
    assert seqlens.shape == (batch,), f"seqlens must be [{batch}], got shape {tuple(seqlens.shape)}"
    assert seqlens.dtype == torch.int32, f"seqlens must be int32, got {seqlens.dtype}"
    assert q.device == latent_cache.device == seqlens.device, (
        f"q, latent_cache and seqlens must share a device, got {q.device}, {latent_cache.device}, {seqlens.device}")
    if indices is not None:
        assert indices.dim() == 3 and indices.shape[:2] == (batch, sq) and indices.shape[2] >= 1, (
            f"indices must be [{batch}, {sq}, K], got shape {tuple(indices.shape)}")
        assert indices.dtype == torch.int32, f"indices must be int32, got {indices.dtype}"
        assert indices.device == q.device, f"indices must be on {q.device}, got {indices.device}"


# ----------------------------------------------------------------------------------------------
# Triton kernel
#
# The Sq queries of a sequence are folded into the head axis: row r = s * H + h of q[b] viewed as
# [Sq*H, Dk], so all queries of a sequence share each K tile. Stage 1 grid: (B, row blocks of
# BLOCK_H, KV splits); each program runs an online softmax over its split in BLOCK_N tiles and
# writes a normalised partial output and its lse. Stage 2 merges the splits by their lse.
# SPARSE: each program serves one query s (grid axis 1 = Sq x head blocks) and walks that query's index
# list instead of the sequence; splits then divide the index list.
# ----------------------------------------------------------------------------------------------

@_jit
def _split_len(seqlen, num_splits, BLOCK_N: tl.constexpr):
    # Tokens per split, a multiple of BLOCK_N; both stages must agree on it.
    return tl.maximum(tl.cdiv(tl.cdiv(seqlen, num_splits), BLOCK_N), 1) * BLOCK_N


@_jit
def _mla_decode_split_kernel(
    q_ptr, cache_ptr, seqlens_ptr, indices_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,                      # softmax_scale * log2(e): the kernel works in base 2
    num_rows, num_heads, num_queries, kv_lora_rank, rope_dim, index_count,
    stride_qb, stride_qr,            # q as [B, Sq*H, Dk]
    stride_cb, stride_ct,            # latent_cache [B, Tmax, Dk]
    stride_ib, stride_is,            # indices [B, Sq, index_count] (SPARSE only)
    stride_ob, stride_or, stride_os,  # partial out [B, Sq*H, splits, kv_lora_rank]
    stride_lb, stride_lr, stride_ls,  # partial lse [B, Sq*H, splits]
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_DPE: tl.constexpr,
    SPARSE: tl.constexpr,            # keys are the rows each query's index list names
    UPCAST: tl.constexpr,            # fp32 dot operands (interpreter: its bf16 dot is wrong)
    DOT_PRECISION: tl.constexpr,     # "ieee" for fp32 operands, so fp32 models get no tf32 rounding
):
    b = tl.program_id(0).to(tl.int64)
    row_block = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seqlen = tl.load(seqlens_ptr + b)

    if SPARSE:   # one query per program: row block = (query, block of heads)
        head_blocks = tl.cdiv(num_heads, BLOCK_H)
        query = row_block // head_blocks
        heads = (row_block % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok = heads < num_heads
        rows = query * num_heads + heads
        query_key = seqlen - num_queries + query          # the query's position: it sees keys t <= it
        last_key = tl.where(row_ok, query_key, -1)
        split_len = _split_len(index_count, num_splits, BLOCK_N)
        start = split * split_len
        stop = tl.minimum(start + split_len, index_count)
        index_row = indices_ptr + b * stride_ib + query * stride_is
    else:
        rows = row_block * BLOCK_H + tl.arange(0, BLOCK_H)
        row_ok = rows < num_rows
        # query s sits at position seqlen - Sq + s and sees keys t <= that position; padded rows see none
        last_key = tl.where(row_ok, seqlen - num_queries + rows // num_heads, -1)
        split_len = _split_len(seqlen, num_splits, BLOCK_N)
        start = split * split_len
        stop = tl.minimum(start + split_len, tl.max(last_key, 0) + 1)   # last_key < seqlen

    offs_dl = tl.arange(0, BLOCK_DL)
    offs_dpe = tl.arange(0, BLOCK_DPE)
    dl_ok = offs_dl < kv_lora_rank
    dpe_ok = offs_dpe < rope_dim

    q_rows = q_ptr + b * stride_qb + rows[:, None] * stride_qr
    q_lat = tl.load(q_rows + offs_dl[None, :], mask=row_ok[:, None] & dl_ok[None, :], other=0.0)
    q_pe = tl.load(q_rows + kv_lora_rank + offs_dpe[None, :], mask=row_ok[:, None] & dpe_ok[None, :], other=0.0)
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)   # running max of scores (base-2 units)
    l_i = tl.zeros([BLOCK_H], tl.float32)                  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_DL], tl.float32)
    cache_seq = cache_ptr + b * stride_cb
    for n0 in range(start, stop, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < stop
        if SPARSE:   # the keys are the rows named by index-list entries n0..n0+BLOCK_N
            key_pos = tl.load(index_row + offs_n, mask=n_ok, other=-1)
            n_ok = n_ok & (key_pos >= 0) & (key_pos <= query_key)
            key_pos = tl.where(n_ok, key_pos, 0)
        else:
            key_pos = offs_n
        k_rows = cache_seq + key_pos[:, None].to(tl.int64) * stride_ct
        # masked rows load as 0 so that garbage past seqlen never reaches the value dot
        k_lat = tl.load(k_rows + offs_dl[None, :], mask=n_ok[:, None] & dl_ok[None, :], other=0.0)
        k_pe = tl.load(k_rows + kv_lora_rank + offs_dpe[None, :], mask=n_ok[:, None] & dpe_ok[None, :], other=0.0)
        if UPCAST:
            k_lat = k_lat.to(tl.float32)
            k_pe = k_pe.to(tl.float32)

        scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
        scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores *= scale_log2
        visible = n_ok[None, :] & (key_pos[None, :] <= last_key[:, None])
        scores = tl.where(visible, scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION)
        m_i = m_new

    # an empty split (or padded row) stores out 0 and lse -inf, which the merge weighs as 0
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, (m_i + tl.log2(tl.where(has_keys, l_i, 1.0))) * 0.6931471805599453, float("-inf"))

    out_rows = part_out_ptr + b * stride_ob + rows[:, None] * stride_or + split * stride_os
    tl.store(out_rows + offs_dl[None, :], out.to(part_out_ptr.dtype.element_ty), mask=row_ok[:, None] & dl_ok[None, :])
    tl.store(part_lse_ptr + b * stride_lb + rows * stride_lr + split * stride_ls, lse, mask=row_ok)


@_jit
def _mla_decode_merge_kernel(
    part_out_ptr, part_lse_ptr, seqlens_ptr, out_ptr, lse_ptr,
    num_rows, num_splits, kv_lora_rank, index_count,
    stride_pob, stride_por, stride_pos,  # partial out [B, Sq*H, splits, kv_lora_rank]
    stride_plb, stride_plr, stride_pls,  # partial lse [B, Sq*H, splits]
    stride_ob, stride_or,                # out as [B, Sq*H, kv_lora_rank]
    stride_lb, stride_lr,                # lse as [B, Sq*H]
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DL: tl.constexpr, BLOCK_S: tl.constexpr,
    SPARSE: tl.constexpr,                # splits divide the index lists (index_count entries), not the sequence
):
    # program (b, block of BLOCK_H rows, block of BLOCK_DL latent columns): small tiles, so that a sequence's merge
    # runs on enough programs to keep the GPU busy (BLOCK_N: the split kernel's, for the split length)
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    if SPARSE:
        keys = index_count
    else:
        keys = tl.load(seqlens_ptr + b)
    split_len = _split_len(keys, num_splits, BLOCK_N)
    used = tl.minimum(tl.cdiv(keys, split_len), num_splits)

    lse_rows = part_lse_ptr + b * stride_plb + rows * stride_plr
    offs_s = tl.arange(0, BLOCK_S)
    lse_all = tl.load(lse_rows[:, None] + offs_s[None, :] * stride_pls,
                      mask=row_ok[:, None] & (offs_s[None, :] < used), other=float("-inf"))
    lse_max = tl.max(lse_all, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.sum(tl.exp(lse_all - lse_max[:, None]), 1)

    offs_dl = tl.program_id(2) * BLOCK_DL + tl.arange(0, BLOCK_DL)
    mask = row_ok[:, None] & (offs_dl[None, :] < kv_lora_rank)
    out_rows = part_out_ptr + b * stride_pob + rows[:, None] * stride_por + offs_dl[None, :]
    acc = tl.zeros([BLOCK_H, BLOCK_DL], tl.float32)
    for j in range(0, used):
        weight = tl.exp(tl.load(lse_rows + j * stride_pls, mask=row_ok, other=float("-inf")) - lse_max)
        acc += weight[:, None] * tl.load(out_rows + j * stride_pos, mask=mask, other=0.0).to(tl.float32)

    has_keys = total > 0.0
    out = acc / tl.where(has_keys, total, 1.0)[:, None]
    tl.store(out_ptr + b * stride_ob + rows[:, None] * stride_or + offs_dl[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(2) == 0:
        lse = tl.where(has_keys, lse_max + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + rows * stride_lr, lse, mask=row_ok)


def _split_config(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> dict:
    """The split kernel's blocks, warps and stages. 16 is the smallest M/K of a 16-bit tl.dot; widths pad to powers
    of two and are masked. A 16 x 512 fp32 accumulator spills at 4 warps: 8 for wide latents. A K tile of 32 rows of
    512 fp32 values in two stages takes 112,704 B of shared memory, past the 101,376 of sm_86 / sm_89: fp32 reads 16
    rows a tile, in one stage (two spill on sm_80; tests/test_gpu_compile.py)."""
    block_dl = max(16, triton.next_power_of_2(kv_lora_rank))
    wide, fp32 = block_dl >= 256, dtype == torch.float32
    return dict(BLOCK_H=16, BLOCK_N=64 if not wide else (16 if fp32 else 32), BLOCK_DL=block_dl,
                BLOCK_DPE=max(16, triton.next_power_of_2(rope_dim)), num_warps=8 if wide else 4,
                num_stages=1 if wide and fp32 else 2)


def max_splits(context: int) -> int:
    """The most KV splits a sequence of `context` rows gets (no split shorter than _MIN_SPLIT_TOKENS)."""
    return max(1, min(context // _MIN_SPLIT_TOKENS, _MAX_SPLITS))


def _auto_num_splits(batch: int, row_blocks: int, context: int, rows: int, kv_lora_rank: int, dk: int,
                     device: torch.device) -> int:
    """About two waves of programs over the GPU, within max_splits(context), and no more splits than keep the
    partial outputs (written and read once each, rows x kv_lora_rank per split, in the cache's dtype) within half
    the bytes of the cache rows they summarise (context x dk)."""
    wanted = -(-2 * dispatch.sm_count(device) // (batch * row_blocks))
    by_bytes = context * dk // (2 * rows * kv_lora_rank)
    return max(1, min(wanted, max_splits(context), by_bytes))


def mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, seqlens: torch.Tensor, softmax_scale: float,
               kv_lora_rank: int, num_splits: int | None = None,
               indices: torch.Tensor | None = None, context: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA decode with the split-KV Triton kernel.

    q: [B, Sq, H, kv_lora_rank + rope_dim], 1 <= Sq <= 4, contiguous (absorbed q_nope ‖ RoPE'd q_pe).
    latent_cache: [B, Tmax, kv_lora_rank + rope_dim], each row contiguous; rows past seqlens[b] are never read.
        Rows may sit further apart than their width (a view of a wider cache, e.g. one that also holds the
        indexer's keys). Tmax also bounds the automatic split count, so pass latent_cache[:, :max_len] when known.
    seqlens: int32 [B], valid rows per sequence including the Sq new ones (the last Sq rows), in
        Sq..Tmax (0 marks a free batch slot: out 0, lse -inf). Not checked: that would sync the device.
    softmax_scale: the model's scale (192-based times mscale² for V3), applied to the 576-wide dot.
    num_splits: KV splits per sequence (of each index list when sparse); None picks them from batch, heads,
        context and SM count.
    indices: None (dense), or int32 [B, Sq, K] (sparse decode): the rows query s attends to, without repeats;
        entries that are -1, or past the query's own position, are skipped.
    context: the rows the automatic split count is chosen for (default: latent_cache's), e.g. the cache's capacity
        when latent_cache is a slice of it: the same count, so the same bits, as a call over the whole cache.
    Returns out [B, Sq, H, kv_lora_rank] in q.dtype and lse [B, Sq, H] float32 (natural log).
    """
    assert triton is not None, "mla_decode needs Triton; use mla_decode_ref (or mla_decode_auto)"
    _check_inputs(q, latent_cache, seqlens, kv_lora_rank, indices)
    assert q.dtype in (torch.bfloat16, torch.float16, torch.float32), f"unsupported dtype {q.dtype}"
    assert latent_cache.dtype == q.dtype, f"latent_cache dtype {latent_cache.dtype} != q dtype {q.dtype}"
    assert q.is_contiguous(), "q must be contiguous"
    batch, sq, heads, dk = q.shape
    assert latent_cache.stride(2) == 1 and latent_cache.stride(1) >= dk, (
        f"latent_cache rows must each be contiguous, got strides {latent_cache.stride()}")
    rope_dim = dk - kv_lora_rank
    rows = sq * heads
    sparse = indices is not None
    if sparse:
        assert indices.stride(2) == 1, "indices must be contiguous along K"
    index_count = indices.shape[2] if sparse else 0

    cfg = _split_config(kv_lora_rank, rope_dim, q.dtype)
    block_h, block_n = cfg["BLOCK_H"], cfg["BLOCK_N"]
    row_blocks = triton.cdiv(rows, block_h)
    # sparse: one query per program, so each query's heads get their own row blocks
    split_blocks = sq * triton.cdiv(heads, block_h) if sparse else row_blocks
    if num_splits is None:
        num_splits = _auto_num_splits(batch, split_blocks, index_count if sparse else context or latent_cache.shape[1],
                                      rows, kv_lora_rank, dk, q.device)
    assert isinstance(num_splits, int) and 1 <= num_splits <= _MAX_SPLITS, (
        f"num_splits must be an int in 1..{_MAX_SPLITS}, got {num_splits!r}")
    upcast = dispatch.interpreted()
    precision = "ieee" if (upcast or q.dtype == torch.float32) else "tf32"

    out = torch.empty(batch, sq, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, sq, heads, dtype=torch.float32, device=q.device)
    if num_splits == 1:   # one split is already the answer: stage 1 writes out and lse directly
        part_out, part_lse = out.view(batch, rows, 1, kv_lora_rank), lse.view(batch, rows, 1)
    else:
        # each split's output normalised, in q's dtype (half the bytes of fp32; the merge adds in fp32)
        part_out = torch.empty(batch, rows, num_splits, kv_lora_rank, dtype=q.dtype, device=q.device)
        part_lse = torch.empty(batch, rows, num_splits, dtype=torch.float32, device=q.device)

    index_arg = indices if sparse else seqlens            # a placeholder pointer when dense (never read)
    _mla_decode_split_kernel[(batch, split_blocks, num_splits)](
        q, latent_cache, seqlens, index_arg, part_out, part_lse,
        softmax_scale * _LOG2E,
        rows, heads, sq, kv_lora_rank, rope_dim, index_count,
        q.stride(0), dk,
        latent_cache.stride(0), latent_cache.stride(1),
        indices.stride(0) if sparse else 0, indices.stride(1) if sparse else 0,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        SPARSE=sparse, UPCAST=upcast, DOT_PRECISION=precision, **cfg,
    )
    if num_splits > 1:
        _mla_decode_merge_kernel[(batch, triton.cdiv(rows, MERGE_ROWS), triton.cdiv(kv_lora_rank, MERGE_COLS))](
            part_out, part_lse, seqlens, out, lse,
            rows, num_splits, kv_lora_rank, index_count,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            out.stride(0), kv_lora_rank,
            lse.stride(0), 1,
            BLOCK_H=MERGE_ROWS, BLOCK_N=block_n, BLOCK_DL=MERGE_COLS, BLOCK_S=triton.next_power_of_2(num_splits),
            SPARSE=sparse, num_warps=2,
        )
    return out, lse


# ----------------------------------------------------------------------------------------------
# PyTorch twin: fp32 math, one matmul pair per sequence, with the log-sum-exp.
# ----------------------------------------------------------------------------------------------

def mla_decode_ref(q: torch.Tensor, latent_cache: torch.Tensor, seqlens: torch.Tensor, softmax_scale: float,
                   kv_lora_rank: int, indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The twin of `mla_decode`: same arguments and outputs, plain PyTorch in fp32.

    Reads seqlens on the host once (a device sync on CUDA) and only the valid rows of each sequence.
    """
    _check_inputs(q, latent_cache, seqlens, kv_lora_rank, indices)
    batch, sq, heads, _ = q.shape
    out = torch.empty(batch, sq, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, sq, heads, dtype=torch.float32, device=q.device)
    steps = torch.arange(sq, device=q.device)
    for b, length in enumerate(seqlens.tolist()):
        positions = length - sq + steps                               # [Sq]: query s sees keys t <= positions[s]
        if indices is None:
            keys = latent_cache[b, :length].float()                     # [T, Dk]; values = keys[:, :kv_lora_rank]
            scores = torch.matmul(q[b].float(), keys.T) * softmax_scale  # [Sq, H, T]
            values = keys[:, :kv_lora_rank]
            if sq > 1:
                hidden = torch.arange(length, device=q.device) > positions[:, None]       # [Sq, T]
                scores.masked_fill_(hidden[:, None, :], float("-inf"))
        else:
            idx = indices[b].long()                                      # [Sq, K]
            hidden = (idx < 0) | (idx > positions[:, None])
            keys = latent_cache[b][idx.clamp(0, max(length - 1, 0))].float()   # [Sq, K, Dk]
            scores = torch.matmul(q[b].float(), keys.transpose(1, 2)) * softmax_scale   # [Sq, H, K]
            scores.masked_fill_(hidden[:, None, :], float("-inf"))
            values = keys[..., :kv_lora_rank].masked_fill(hidden[..., None], 0.0)   # no NaN from a skipped row
        lse_b = torch.logsumexp(scores, dim=-1)                      # [Sq, H]
        probs = torch.exp(scores - lse_b.masked_fill(lse_b == float("-inf"), 0.0)[..., None])
        out[b] = torch.matmul(probs, values).to(q.dtype)
        lse[b] = lse_b
    return out, lse


def mla_decode_auto(q: torch.Tensor, latent_cache: torch.Tensor, seqlens: torch.Tensor, softmax_scale: float,
                    kv_lora_rank: int, num_splits: int | None = None,
                    indices: torch.Tensor | None = None, context: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`mla_decode` where kernels run (see dispatch.use_kernels), else `mla_decode_ref` (num_splits and context
    unused)."""
    if dispatch.use_kernels(q.device):
        return mla_decode(q, latent_cache, seqlens, softmax_scale, kv_lora_rank, num_splits, indices, context)
    return mla_decode_ref(q, latent_cache, seqlens, softmax_scale, kv_lora_rank, indices)


def latent_attention(q: torch.Tensor, keys: torch.Tensor, softmax_scale: float, kv_lora_rank: int,
                     indices: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's absorbed attention in a few operators (the CPU decode path; `mla_decode_ref` computes the
    same plus the log-sum-exp): q [Sq, H, Dk] over keys [T, Dk] whose first kv_lora_rank values are also the
    values; the Sq queries are the last Sq positions (bottom-right causal). indices [Sq, K] (sparse): the rows
    each query attends to, as in `mla_decode`. -> [Sq, H, kv_lora_rank] in q.dtype."""
    sq, total = q.shape[0], keys.shape[0]
    if indices is not None:
        return _sparse_latent_attention(q, keys, softmax_scale, kv_lora_rank, indices)
    keys = keys if keys.dtype == torch.float32 else keys.float()
    scores = torch.matmul(q if q.dtype == torch.float32 else q.float(), keys.T) * softmax_scale     # [Sq, H, T]
    if sq > 1:
        hidden = torch.arange(total, device=q.device) > torch.arange(total - sq, total, device=q.device)[:, None]
        scores.masked_fill_(hidden[:, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), keys[:, :kv_lora_rank])
    return out if out.dtype == q.dtype else out.to(q.dtype)


def _sparse_latent_attention(q, keys, softmax_scale, kv_lora_rank, indices):
    sq, total = q.shape[0], keys.shape[0]
    idx = indices.long()
    positions = torch.arange(total - sq, total, device=q.device)[:, None]           # [Sq, 1]
    hidden = (idx < 0) | (idx > positions)                                          # [Sq, K]
    picked = keys.index_select(0, idx.clamp(0, total - 1).flatten()).view(sq, -1, keys.shape[1])   # [Sq, K, Dk]
    picked = picked if picked.dtype == torch.float32 else picked.float()
    scores = torch.matmul(q if q.dtype == torch.float32 else q.float(), picked.transpose(1, 2)) * softmax_scale
    if sq > 1 or bool(hidden.any()):          # a decode step's list (the indexer's top-k) names only visible rows
        scores.masked_fill_(hidden[:, None, :], float("-inf"))                      # [Sq, H, K]
    out = torch.matmul(scores.softmax(-1), picked[..., :kv_lora_rank])
    return out if out.dtype == q.dtype else out.to(q.dtype)


def mla_attend(q: torch.Tensor, latent_cache: torch.Tensor, softmax_scale: float, kv_lora_rank: int,
               indices: torch.Tensor | None = None, seqlens: torch.Tensor | None = None,
               capacity: int | None = None) -> torch.Tensor:
    """The model's absorbed attention: q [B, Sq, H, Dk] over every row of latent_cache [B, T, Dk] (the last Sq
    rows are the queries' own), or with indices [B, Sq, K] int32 only over the rows each query's list names
    -> out [B, Sq, H, kv_lora_rank]. The kernel where kernels run; one sequence on the CPU takes
    `latent_attention`; otherwise the twin (e.g. DSV3LITE_KERNELS=ref on a GPU). seqlens (int32 [B], on the
    device): the valid rows of each sequence, when latent_cache is the whole cache (a CUDA graph's decode step,
    dsv3lite/graphs.py: the length is read on the device, and the split count follows from the capacity T).
    capacity: the rows of the whole cache when latent_cache is its first rows: the kernel splits the context as it
    does for a graph's call, so a decode step gets the same bits with graphs and without."""
    if seqlens is not None:
        return mla_decode_auto(q, latent_cache, seqlens, softmax_scale, kv_lora_rank, indices=indices)[0]
    if q.shape[0] == 1 and q.device.type == "cpu" and not dispatch.use_kernels(q.device):
        return latent_attention(q[0], latent_cache[0], softmax_scale, kv_lora_rank,
                                None if indices is None else indices[0])[None]
    seqlens = torch.full((q.shape[0],), latent_cache.shape[1], dtype=torch.int32, device=latent_cache.device)
    return mla_decode_auto(q, latent_cache, seqlens, softmax_scale, kv_lora_rank, indices=indices,
                           context=capacity)[0]
