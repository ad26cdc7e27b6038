"""INT4G32 expert format: symmetric 4-bit weights, one bf16 scale per group of 32 along K (the input dim), packed as
compressed-tensors packs them: the routed-expert format of Kimi-K2-Thinking and Kimi-K2.5 as released.

Per matrix [N, K], with Kp = K rounded up to 32 (zero padding; released checkpoints need none):
  qweight uint8 [N, Kp/2]    byte b of a row holds k = 2b in its low nibble and k = 2b + 1 in its high one, each as
                             the code q + 8 (q in -8..7): exactly the bytes of a checkpoint's little-endian int32
                             `weight_packed` words (quant/compressed_tensors.py)
  scales  bfloat16 [N, Kp/32]
  w = bf16(fp32(q) * fp32(s)): one fp32 multiply (exact: q has 4 bits), one bf16 rounding, as compressed-tensors
  dequantizes in the scale's dtype; then the compute dtype.
A released checkpoint's words and scales are repacked into blobs verbatim (`pack_prequantized`), never re-quantized.
`pack` quantizes float weights the way compressed-tensors' round-to-nearest does for bf16 weights (`quantize
--experts int4g32` of a BF16 checkpoint, tests). The CPU kernel reads the nibbles against int8 activations
(kernels/cpu_experts.py); the fused Triton MoE kernel reads them on GPUs (kernels/quant_matmul.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .compressed_tensors import GROUP
from .layout import MATRICES, BlobLayout, ExpertFormat

OFFSET = 8                    # stored nibble = q + 8
QMIN, QMAX = -8, 7


def padded_k(k: int) -> int:
    return -(-k // GROUP) * GROUP


def int4g32_codes(qweight: torch.Tensor) -> torch.Tensor:
    """qweight uint8 [N, Kp/2] (or int32 words [N, Kp/8], a checkpoint's weight_packed) -> codes int8 [N, Kp] in k
    order."""
    b = qweight.contiguous().view(torch.uint8).view(qweight.shape[0], -1)
    return torch.stack((b & 0xF, b >> 4), dim=-1).view(b.shape[0], -1).to(torch.int8) - OFFSET


def int4g32_dequant(qweight: torch.Tensor, scales: torch.Tensor, k: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bf16(q * s) -> [N, K] in `dtype`; qweight uint8 [N, Kp/2] or int32 words, scales bf16 [N, Kp/32]."""
    q = int4g32_codes(qweight).float()
    n = q.shape[0]
    w = (q.view(n, -1, GROUP) * scales.float().unsqueeze(-1)).to(torch.bfloat16).view(n, -1)
    return w[:, :k].to(dtype).contiguous()


def int4g32_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qweight uint8 [N, Kp/2], scales bf16 [N, Kp/32]), K zero-padded: compressed-tensors'
    round-to-nearest of the bf16 weights, step for step (its min/max observer and quantize, in bf16 arithmetic):
    s = bf16(amax / 7.5) (the smallest bf16 step where amax is 0), q = clamp(round(bf16(w / s)), -8, 7)."""
    n, k = w.shape
    kp = padded_k(k)
    wb = F.pad(w.to(torch.bfloat16), (0, kp - k)).view(n, kp // GROUP, GROUP)
    amax = wb.abs().amax(dim=-1, keepdim=True)
    s = amax / torch.tensor((QMAX - QMIN) / 2, dtype=torch.bfloat16)
    s = torch.where(s == 0, torch.finfo(torch.bfloat16).eps, s)
    q = torch.round(wb / s).clamp_(QMIN, QMAX).to(torch.int16) + OFFSET                # [N, G, 32] in 0..15
    q = q.view(n, kp // 2, 2).to(torch.uint8)
    return (q[..., 0] | (q[..., 1] << 4)).contiguous(), s.squeeze(-1).contiguous()


class Int4G32Format(ExpertFormat):
    """Per matrix: `qweight` uint8 [N, Kp/2] (compressed-tensors' packing) and `scales` bfloat16 [N, Kp/32]."""
    name = "int4g32"
    group_size = GROUP

    @property
    def label(self) -> str:
        return "int4g32 (symmetric, bf16 scales)"

    def _parts(self, n: int, k: int):
        kp = padded_k(k)
        return [("qweight", "uint8", (n, kp // 2)), ("scales", "bfloat16", (n, kp // GROUP))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        qweight, scales = int4g32_quantize(w)
        return {"qweight": qweight, "scales": scales}

    def _dequantize(self, parts, shape, dtype):
        return int4g32_dequant(parts["qweight"], parts["scales"], shape[1], dtype)

    def pack_prequantized(self, gate_w: torch.Tensor, gate_s: torch.Tensor, up_w: torch.Tensor, up_s: torch.Tensor,
                          down_w: torch.Tensor, down_s: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Blob from a released checkpoint's `weight_packed` int32 [N, K/8] and `weight_scale` bf16 [N, K/32] of gate,
        up and down: bytes copied verbatim (never re-quantized). K must be a multiple of 32, as compressed-tensors'
        groups need."""
        if gate_w.dim() != 2:
            raise ValueError(f"gate: expected 2-d packed words [I, D/8], got shape {tuple(gate_w.shape)}")
        layout: BlobLayout = self.layout(gate_w.shape[0], gate_w.shape[1] * 8)
        parts = {}
        for m, w, s in zip(MATRICES, (gate_w, up_w, down_w), (gate_s, up_s, down_s)):
            n, k = layout.matrix_shape(m)
            if k % GROUP or w.dtype != torch.int32 or tuple(w.shape) != (n, k // 8):
                raise ValueError(f"{m}: expected int32 packed words {(n, k // 8)} (K a multiple of {GROUP}), got "
                                 f"{w.dtype} {tuple(w.shape)}")
            if s.dtype != torch.bfloat16 or tuple(s.shape) != (n, k // GROUP):
                raise ValueError(f"{m}: expected bfloat16 scales {(n, k // GROUP)}, got {s.dtype} {tuple(s.shape)}")
            parts[m] = {"qweight": w.contiguous().view(torch.uint8).view(n, k // 2), "scales": s}
        return self._write(layout, parts, out, gate_w.device)
