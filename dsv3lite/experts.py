"""Routed-expert providers that read packed blobs (the `MoE.experts` seam; see model.py).

`BlobExperts` holds every expert of one layer resident as [n_experts, blob_bytes] uint8 in one of the
quant formats; the offloading runtime's provider reads the same blobs from its slot pool, so both give
the same bits for the same expert. Where kernels run (CUDA), decode steps go through the fused MoE
kernel with the blobs as the slot pool (slot e = expert e).
"""
from __future__ import annotations

import torch
from torch import nn

from .kernels import dispatch
from .kernels.fused_moe import fused_moe
from .model import combine_experts
from .quant.layout import BlobLayout, ExpertFormat

FUSED_MAX_TOKENS = 16      # decode and MTP verify; prefill keeps the per-expert path (weights read once)


class BlobExperts(nn.Module):
    def __init__(self, blobs: torch.Tensor, fmt: ExpertFormat, layout: BlobLayout):
        super().__init__()
        assert blobs.dtype == torch.uint8 and blobs.dim() == 2 and blobs.shape[1] == layout.blob_bytes
        self.fmt, self.layout = fmt, layout
        self.register_buffer("blobs", blobs, persistent=False)
        self.register_buffer("slot_table", torch.arange(blobs.shape[0], dtype=torch.int32, device=blobs.device),
                             persistent=False)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.fmt.expert_forward(self.blobs[e], x, self.layout).to(x.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= FUSED_MAX_TOKENS and self.layout.format != "nf4" and dispatch.use_kernels(x.device):
            return fused_moe(x, ids, weights, self.slot_table, self.blobs, self.layout)
        return combine_experts(self.expert, x, ids, weights)
