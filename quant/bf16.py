"""The bf16 expert format: each matrix stored as it is, in bfloat16 (no quantization)."""
from __future__ import annotations

import torch

from .layout import ExpertFormat


class Bf16Format(ExpertFormat):
    """Per matrix: `weight` bfloat16 [N, K]."""
    name = "bf16"
    group_size = None

    def _parts(self, n: int, k: int):
        return [("weight", "bfloat16", (n, k))]

    def _quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": w.to(torch.bfloat16)}

    def _dequantize(self, parts, shape, dtype):
        return parts["weight"].to(dtype)
