"""Routed-expert providers that read packed blobs (the `MoE.experts` seam; see model.py).

`BlobExperts` holds every expert of one layer resident as [n_experts, blob_bytes] uint8 in one of the
quant formats; the offloading runtime's provider reads the same blobs from its slot pool, so both give
the same bits for the same expert.
"""
from __future__ import annotations

import torch
from torch import nn

from .model import combine_experts
from .quant.layout import BlobLayout, ExpertFormat


class BlobExperts(nn.Module):
    def __init__(self, blobs: torch.Tensor, fmt: ExpertFormat, layout: BlobLayout):
        super().__init__()
        assert blobs.dtype == torch.uint8 and blobs.dim() == 2 and blobs.shape[1] == layout.blob_bytes
        self.fmt, self.layout = fmt, layout
        self.register_buffer("blobs", blobs, persistent=False)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.fmt.expert_forward(self.blobs[e], x, self.layout).to(x.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_experts(self.expert, x, ids, weights)
