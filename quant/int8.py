"""INT8 expert format: symmetric 8-bit weights, one float32 scale per group of 128 along K (the input dim).

Per matrix [N, K], with Kp = K rounded up to 128 (zero padding):
  weight uint8 [N, Kp]        the int8 codes q in [-127, 127] as their two's-complement bytes
  scale  float32 [N, Kp/128]  w = q * s, s = amax / 127 of the group
The CPU kernel multiplies the codes with activations quantized to int8 per group in integers (kernels/cpu_experts.py),
which reads these weights at memory speed where fp8's e4m3 decoding costs compute; the dense `--dense int8`
packing is this quantizer too. No Triton kernel: on a GPU the format dequantizes (expert_forward_ref).
"""
from __future__ import annotations

import torch

from .layout import ExpertFormat

GROUP = 128


def int8_quantize(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, Kp], scale float32 [N, Kp/group]): symmetric, scale = amax / 127, K zero-padded."""
    n, k = w.shape
    kp = -(-k // group) * group
    wp = torch.zeros(n, kp, dtype=torch.float32, device=w.device)
    wp[:, :k] = w
    wg = wp.view(n, kp // group, group)
    scale = wg.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, wg / scale, torch.zeros_like(wg)).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(n, kp), scale.squeeze(-1)


def int8_dequant(q: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * s in fp32, padding dropped -> [N, K] in `dtype`; q int8 (or its uint8 bytes) [N, Kp]."""
    n, kp = q.shape
    w = q.view(torch.int8).float().view(n, kp // GROUP, GROUP) * scale.float().unsqueeze(-1)
    return w.view(n, kp)[:, :k].to(dtype).contiguous()


class Int8Format(ExpertFormat):
    """Per matrix: `weight` uint8 [N, Kp] (int8 codes) and `scale` float32 [N, Kp/128]."""
    name = "int8"
    group_size = GROUP

    def _parts(self, n: int, k: int):
        kp = -(-k // GROUP) * GROUP
        return [("weight", "uint8", (n, kp)), ("scale", "float32", (n, kp // GROUP))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s = int8_quantize(w.float())
        return {"weight": q.view(torch.uint8), "scale": s}

    def _dequantize(self, parts, shape, dtype):
        return int8_dequant(parts["weight"], parts["scale"], shape[1], dtype)
