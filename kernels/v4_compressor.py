"""DeepSeek-V4's compressors at decode (docs/dsv4-math.md §2.3, §4): the pooling math, a Triton kernel and its twin.

A compressor pools each window of `ratio` tokens into one entry: per channel c, a softmax over the window's gates
G = Cz + ape weights the values Cv, then RMSNorm and RoPE (interleaved pairs on the last 2 * len(cos) dims) at the
window's first position. With overlap (CSA's compressor and its indexer's) every token projects 2 * width channels
and entry w pools series A (channels 0..width-1) of window w-1 with series B (width..2 width-1) of window w, so its
softmax runs over 2 * ratio tokens; tokens before position 0 take no part.

At decode the (Cv, G) of the recent tokens sit in fp32 rings (dsv3lite/v4/cache.py's CompressorState: position p at
row p mod R), and a step that completes window w needs entry w alone. `compress_entry` reads the window's rows
straight from the rings and writes the finished entry into the entries tensor, one program per sequence, in place of
the eager path's ~15 operators (ring gathers, pads, the softmax, the norm, the rotation); `compress_entry_ref` is
its twin: the same rows gathered, then the eager math (`pool_windows`, `rms_norm`, `apply_rope`), which the model's
Compressor uses for prompts.
"""
from __future__ import annotations

import torch

from . import dispatch
from .dispatch import jit as _jit, tl, triton
from .mla_decode import MAX_QUERIES


# ----------------------------------------------------------------------------------------------
# PyTorch: the eager math and the twin
# ----------------------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4's weighted RMSNorm: statistics, weight and product in fp32, one rounding to x.dtype."""
    h = x.float()
    return (weight.float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the last 2 * cos.shape[-1] dims of x [..., W] as interleaved pairs (x[2i], x[2i+1]) by the tables
    (broadcast against x's pairs), in fp32, the result rounded to x.dtype; the other dims pass. sin -> -sin undoes
    the rotation."""
    r = 2 * cos.shape[-1]
    rope = x[..., x.shape[-1] - r:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    c, s = cos.float(), sin.float()
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :x.shape[-1] - r], rotated), dim=-1)


def pool_windows(cv: torch.Tensor, g: torch.Tensor, n: int, ratio: int, overlap: bool, width: int) -> torch.Tensor:
    """The pooled values of n consecutive windows, fp32 [B, n, width]: cv, g [B, >= (n + overlap) * ratio, channels]
    fp32 from the first token the windows read (with overlap, window w-1's first; empty tokens: value 0, gate -inf)."""
    m, o = ratio, int(overlap)
    bsz = cv.shape[0]
    cv = cv[:, :(n + o) * m].view(bsz, n + o, m, -1)
    g = g[:, :(n + o) * m].view(bsz, n + o, m, -1)
    if overlap:                  # slots 0..m-1: window w-1's series A; slots m..2m-1: window w's series B
        cv = torch.cat((cv[:, :-1, :, :width], cv[:, 1:, :, width:]), dim=2)
        g = torch.cat((g[:, :-1, :, :width], g[:, 1:, :, width:]), dim=2)
    return (cv * g.softmax(dim=2)).sum(dim=2)


def _window_rows(ring: torch.Tensor, window: int, ratio: int, overlap: bool, empty: float) -> torch.Tensor:
    """The ring rows [B, (1 + overlap) * ratio, C] of the tokens entry `window` pools, `empty` for positions < 0."""
    first = (window - int(overlap)) * ratio
    positions = torch.arange(first, (window + 1) * ratio, device=ring.device)
    rows = ring.index_select(1, positions.clamp(min=0) % ring.shape[1])
    return rows.masked_fill((positions < 0)[None, :, None], empty)


def compress_entry_ref(cv_ring: torch.Tensor, g_ring: torch.Tensor, window: int, ratio: int, overlap: bool,
                       norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Entry `window` [B, width] in `dtype` from the rings cv_ring, g_ring [B, R, channels] fp32 (position p at row
    p mod R; every token of the window among the last R written); cos, sin [r/2]: the compress rotary at the
    window's first position, window * ratio, rounded to `dtype`."""
    width = norm_weight.shape[0]
    cv = _window_rows(cv_ring, window, ratio, overlap, 0.0)
    g = _window_rows(g_ring, window, ratio, overlap, float("-inf"))
    pooled = pool_windows(cv, g, 1, ratio, overlap, width)[:, 0]
    return apply_rope(rms_norm(pooled.to(dtype), norm_weight, eps), cos, sin)


# ----------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------

def launch_config(width: int) -> dict:
    """One program a sequence over the entry's width as pairs (even and odd channels, what the rotation pairs):
    BLOCK_P pairs held in registers with the running max, sum and weighted sum of each; 4 warps up to 1,024 channels,
    8 beyond (V4-Flash: 512 wide, 128 for the indexer's keys)."""
    pairs = triton.next_power_of_2(max(1, width // 2))
    return dict(BLOCK_P=pairs, num_warps=4 if pairs <= 512 else 8)


@_jit
def _v4_compress_kernel(
    cv_ptr, g_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, end_ptr,
    window, ratio, ring_rows, width, rope_pairs, eps, queries,
    stride_rb, stride_rr,              # rings [B, R, channels] (channels contiguous)
    stride_ob,                         # out [B, width] (END_ON_DEVICE: entry 0's row, else the entry's)
    stride_on,                         # out's rows (END_ON_DEVICE)
    OVERLAP: tl.constexpr, BLOCK_P: tl.constexpr,
    END_ON_DEVICE: tl.constexpr,       # a captured step: `queries` tokens ending at end_ptr's value; the entry of
                                       # the window they complete, if any (else nothing is written)
):
    b = tl.program_id(0).to(tl.int64)
    pairs = tl.arange(0, BLOCK_P)
    ok = pairs < width // 2
    store = ok
    if END_ON_DEVICE:
        end = tl.load(end_ptr).to(tl.int32)
        completes = end // ratio > (end - queries) // ratio
        store = pairs < tl.where(completes, width // 2, 0)                      # nothing when none completes
        window = tl.maximum(end // ratio - 1, 0)
        out_ptr += window.to(tl.int64) * stride_on
    even = 2 * pairs
    m_e = tl.full([BLOCK_P], float("-inf"), tl.float32)
    m_o = tl.full([BLOCK_P], float("-inf"), tl.float32)
    l_e = tl.zeros([BLOCK_P], tl.float32)
    l_o = tl.zeros([BLOCK_P], tl.float32)
    acc_e = tl.zeros([BLOCK_P], tl.float32)
    acc_o = tl.zeros([BLOCK_P], tl.float32)
    first = (window - OVERLAP) * ratio
    for t in tl.range(tl.maximum(-first, 0), (1 + OVERLAP) * ratio):          # tokens before 0 take no part
        row = ((first + t) % ring_rows).to(tl.int64)
        series = (t >= ratio).to(tl.int32) * OVERLAP * width                    # overlap: window w's series B
        base = b * stride_rb + row * stride_rr + series
        g_e = tl.load(g_ptr + base + even, mask=ok, other=0.0)
        g_o = tl.load(g_ptr + base + even + 1, mask=ok, other=0.0)
        v_e = tl.load(cv_ptr + base + even, mask=ok, other=0.0)
        v_o = tl.load(cv_ptr + base + even + 1, mask=ok, other=0.0)
        new_e = tl.maximum(m_e, g_e)
        new_o = tl.maximum(m_o, g_o)
        a_e = tl.exp(m_e - new_e)
        a_o = tl.exp(m_o - new_o)
        p_e = tl.exp(g_e - new_e)
        p_o = tl.exp(g_o - new_o)
        l_e = l_e * a_e + p_e
        l_o = l_o * a_o + p_o
        acc_e = acc_e * a_e + p_e * v_e
        acc_o = acc_o * a_o + p_o * v_o
        m_e = new_e
        m_o = new_o
    dtype = out_ptr.dtype.element_ty
    x_e = tl.where(ok, (acc_e / l_e).to(dtype).to(tl.float32), 0.0)           # pooled, rounded before the norm
    x_o = tl.where(ok, (acc_o / l_o).to(dtype).to(tl.float32), 0.0)
    rms = 1.0 / tl.sqrt(tl.sum(x_e * x_e + x_o * x_o, 0) / width + eps)
    n_e = (tl.load(w_ptr + even, mask=ok, other=0.0) * (x_e * rms)).to(dtype).to(tl.float32)
    n_o = (tl.load(w_ptr + even + 1, mask=ok, other=0.0) * (x_o * rms)).to(dtype).to(tl.float32)
    j = pairs - (width // 2 - rope_pairs)                                      # the rotated pairs: the last ones
    rot = ok & (j >= 0)
    c = tl.load(cos_ptr + j, mask=rot, other=1.0)
    s = tl.load(sin_ptr + j, mask=rot, other=0.0)
    tl.store(out_ptr + b * stride_ob + even, (n_e * c - n_o * s).to(dtype), mask=store)
    tl.store(out_ptr + b * stride_ob + even + 1, (n_o * c + n_e * s).to(dtype), mask=store)


def window_of(end: torch.Tensor, ratio: int) -> torch.Tensor:
    """The window a step ending at `end` (exclusive; an integer tensor) may complete: the last whole one, clamped
    at 0, shaped as `end` (what `compress_entry` with a device end pools, and where its rotary rows are taken)."""
    return (end.long() // ratio - 1).clamp(min=0)


def compress_entry(cv_ring: torch.Tensor, g_ring: torch.Tensor, entries: torch.Tensor, window, ratio: int,
                   overlap: bool, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                   queries: int = 0) -> None:
    """`compress_entry_ref` with the Triton kernel, written into entries[:, window] ([B, N, width], the cache's
    dtype, which the entry is rounded to); cos, sin [r/2] rounded to entries' dtype.

    window: an int, or (a captured step) an integer tensor of one element on the rings' device holding the end
    (exclusive) of the step's `queries` tokens: the kernel then writes the entry of the window they complete,
    window_of(end), and nothing when they complete none; cos, sin are then the rows of window_of(end) * ratio."""
    assert triton is not None, "compress_entry needs Triton; use compress_entry_ref"
    on_device = isinstance(window, torch.Tensor)
    if on_device:
        assert window.numel() == 1 and window.device == cv_ring.device and not window.is_floating_point() and \
            1 <= queries <= ratio, f"a device end is one integer on {cv_ring.device}, for 1..{ratio} queries"
    batch, rows, channels = cv_ring.shape
    width = norm_weight.shape[0]
    assert g_ring.shape == cv_ring.shape and cv_ring.dtype == g_ring.dtype == torch.float32, (
        f"the rings must be float32 [B, R, C] alike, got {cv_ring.dtype} {tuple(cv_ring.shape)} and "
        f"{g_ring.dtype} {tuple(g_ring.shape)}")
    assert channels == width * (2 if overlap else 1) and width % 2 == 0, (
        f"{channels} channels for a {width}-wide entry (overlap {overlap})")
    assert rows >= (2 if overlap else 1) * ratio, f"a ring of {rows} rows cannot hold a window of {ratio} tokens"
    assert entries.dim() == 3 and entries.shape[0] == batch and entries.shape[2] == width and \
        (on_device or 0 <= window < entries.shape[1]), (
            f"entry {window} of entries {tuple(entries.shape)} (batch {batch}, {width})")
    assert cv_ring.stride() == g_ring.stride() and cv_ring.stride(2) == 1 and entries.stride(2) == 1, \
        "rows must be contiguous"
    assert cos.shape == sin.shape and cos.dim() == 1 and 2 * cos.shape[0] <= width, (
        f"cos / sin of {tuple(cos.shape)} for a {width}-wide entry")
    _v4_compress_kernel[(batch,)](
        cv_ring, g_ring, norm_weight.float().contiguous(), cos.float().contiguous(), sin.float().contiguous(),
        entries if on_device else entries[:, window], window if on_device else entries,
        0 if on_device else window, ratio, rows, width, cos.shape[0], eps, queries,
        cv_ring.stride(0), cv_ring.stride(1),
        entries.stride(0), entries.stride(1),
        OVERLAP=int(overlap), END_ON_DEVICE=on_device, **launch_config(width),
    )


def use_kernel(device: torch.device, queries: int, completed: int, entries_dtype: torch.dtype,
               dtype: torch.dtype) -> bool:
    """Whether a step of `queries` tokens that completes `completed` windows pools through `compress_entry`: one
    entry (every decode step and MTP verify: queries <= ratio), the cache in the model's dtype, kernels on."""
    return completed == 1 and queries <= MAX_QUERIES and entries_dtype == dtype and dispatch.use_kernels(device)
