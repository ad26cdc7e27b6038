"""INT4 expert format: group-wise asymmetric 4-bit along K (the input dim), packed for the Triton kernel.

Per matrix [N, K], with Kp = K rounded up to the group size g (zero padding):
  qweight uint8 [N, Kp/2]    within each group of g consecutive k, byte b (0 <= b < g/2) holds element b
                             in its low nibble and element b + g/2 in its high nibble, so a kernel splits a
                             byte tile into two contiguous halves of k with no interleave
  scales  float16 [N, Kp/g]
  zeros   float16 [N, Kp/g]  w = (q - z) * s, computed in fp32
Padded columns dequantize to about zero; kernels must treat x beyond K as zero.

Each group's range always includes 0 (so z stays in [0, 15], where fp16 holds it to 2^-8) and is chosen by
a clipping search: shrink [min, max] by a grid of ratios, then refine each end on its own, keeping per group
the candidate with the least squared reconstruction error, evaluated with the fp16-rounded scale and zero.
"""
from __future__ import annotations

import torch

from ..errors import UserError
from .layout import ExpertFormat

GROUP_SIZES = (32, 64, 128)
QMAX = 15
SHRINK_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # 1.0 .. 0.5, both ends together
END_STEPS = tuple(0.05 * d for d in (-3, -2, -1, 1, 2, 3))  # then each end on its own around the best ratio
MIN_RATIO = 0.3
FP16_TINY = 2.0 ** -24  # smallest positive float16
CHUNK_ELEMENTS_CPU = 1 << 18
CHUNK_ELEMENTS_GPU = 1 << 26


def padded_k(k: int, group_size: int) -> int:
    return -(-k // group_size) * group_size


def _scale_zero(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16-representable (scale, zero) as fp32 for a range [lo, hi] widened to include 0."""
    lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
    s = ((hi - lo) / QMAX).clamp(min=FP16_TINY).half().float()
    z = (-lo / s).half().float()
    return s, z


def _quant_codes(wg: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    # wg [N, G, g]; s, z [N, G, 1] -> float codes in 0..15
    return (wg / s).add_(z).round_().clamp_(0, QMAX)


def _group_sq_error(wg, s, z, valid):
    err = _quant_codes(wg, s, z).sub_(z).mul_(s).sub_(wg).square_()
    if valid is not None:
        err.mul_(valid)
    return err.sum(dim=-1, keepdim=True)


def _search_scale_zero(wg: torch.Tensor, valid: torch.Tensor | None, clip_search: bool):
    """Per-group (s, z) [N, G, 1], vectorised over all groups; a Python loop only over candidate ratios."""
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)  # padding is 0: neutral
    best_s, best_z = _scale_zero(lo, hi)
    if not clip_search:
        return best_s, best_z
    best_err = _group_sq_error(wg, best_s, best_z, valid)
    ratio_lo = torch.ones_like(lo)
    ratio_hi = torch.ones_like(hi)

    def consider(r_lo, r_hi):
        nonlocal best_s, best_z, best_err, ratio_lo, ratio_hi
        s, z = _scale_zero(lo * r_lo, hi * r_hi)
        err = _group_sq_error(wg, s, z, valid)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
        ratio_lo, ratio_hi = torch.where(better, r_lo, ratio_lo), torch.where(better, r_hi, ratio_hi)

    for r in SHRINK_RATIOS[1:]:
        consider(torch.full_like(lo, r), torch.full_like(hi, r))
    base_lo, base_hi = ratio_lo.clone(), ratio_hi.clone()
    for d in END_STEPS:
        consider((base_lo + d).clamp(MIN_RATIO, 1.0), base_hi)
    base_lo, base_hi = ratio_lo.clone(), ratio_hi.clone()
    for d in END_STEPS:
        consider(base_lo, (base_hi + d).clamp(MIN_RATIO, 1.0))
    return best_s, best_z


def int4_quantize(w: torch.Tensor, group_size: int = 128, clip_search: bool = True):
    """w [N, K] float -> (qweight uint8 [N, Kp/2], scales float16 [N, Kp/g], zeros float16 [N, Kp/g])."""
    n, k = w.shape
    g = group_size
    kp = padded_k(k, g)
    wp = torch.zeros(n, kp, dtype=torch.float32, device=w.device)
    wp[:, :k] = w
    wg = wp.view(n, kp // g, g)
    valid = None
    if kp != k:
        valid = torch.zeros(kp, dtype=torch.float32, device=w.device)
        valid[:k] = 1.0
        valid = valid.view(kp // g, g)
    # row chunks that stay in cache on CPU (about 3x faster there); one chunk per matrix on a GPU
    rows = max(1, (CHUNK_ELEMENTS_CPU if w.device.type == "cpu" else CHUNK_ELEMENTS_GPU) // kp)
    s, z = (torch.cat(t) for t in zip(*(_search_scale_zero(wg[i:i + rows], valid, clip_search)
                                        for i in range(0, n, rows))))
    q = _quant_codes(wg, s, z).to(torch.uint8)                 # [N, G, g]
    packed = q[..., : g // 2] | (q[..., g // 2:] << 4)         # [N, G, g/2]
    return packed.reshape(n, kp // 2), s.squeeze(-1).half(), z.squeeze(-1).half()


def int4_unpack_codes(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """qweight uint8 [N, Kp/2] -> codes uint8 [N, Kp] in natural k order."""
    n, half = qweight.shape
    g = group_size
    b = qweight.view(n, half * 2 // g, g // 2)
    return torch.cat([b & 0xF, b >> 4], dim=-1).view(n, half * 2)


def int4_dequant(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, k: int,
                 group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q - z) * s in fp32, padding columns dropped -> [N, K] in `dtype`."""
    n = qweight.shape[0]
    q = int4_unpack_codes(qweight, group_size).float().view(n, -1, group_size)
    w = (q - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.view(n, -1)[:, :k].to(dtype).contiguous()


class Int4Format(ExpertFormat):
    """Per matrix: `qweight` uint8 [N, Kp/2], `scales` and `zeros` float16 [N, Kp/g]."""
    name = "int4"

    @classmethod
    def create(cls, group_size: int | None = None) -> "Int4Format":
        return cls(group_size or 128)

    @property
    def label(self) -> str:
        return f"int4 (group {self.group_size})"

    def __init__(self, group_size: int = 128, clip_search: bool = True) -> None:
        super().__init__()
        if group_size not in GROUP_SIZES:
            raise UserError(f"int4 group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
        self.group_size = group_size
        self.clip_search = clip_search  # False: plain min/max ranges (for comparison)

    def _parts(self, n: int, k: int):
        kp = padded_k(k, self.group_size)
        groups = kp // self.group_size
        return [("qweight", "uint8", (n, kp // 2)), ("scales", "float16", (n, groups)),
                ("zeros", "float16", (n, groups))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scales, zeros = int4_quantize(w, self.group_size, self.clip_search)
        return {"qweight": qweight, "scales": scales, "zeros": zeros}

    def _dequantize(self, parts, shape, dtype):
        return int4_dequant(parts["qweight"], parts["scales"], parts["zeros"], shape[1], self.group_size, dtype)
