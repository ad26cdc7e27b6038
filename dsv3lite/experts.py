"""Where routed experts come from (`expert_source`), and the resident provider that reads packed blobs
(the `MoE.experts` seam; see model.py).

`BlobExperts` holds every expert of one layer resident as [n_experts, blob_bytes] uint8 in one of the
quant formats; the offloading runtime's provider reads the same blobs from its slot pool, so both give
the same bits for the same expert. Where kernels run (CUDA), decode steps go through the fused MoE
kernel with the blobs as the slot pool (slot e = expert e), prompts through its grouped (expert-major) kernels.
On CPU every call (decode, MTP verification, prefill) is one call of the compiled CPU kernel for all of the layer's
selected experts (kernels/cpu_experts.py), where there is one; else each expert through its format's path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .config import ModelArgs
from .errors import UserError
from .kernels import cpu_experts, dispatch
from .kernels.fused_moe import fused_moe, fused_moe_grouped
from .limits import FUSED_MAX_TOKENS
from .moe import combine_experts
from .quant.layout import BlobLayout, ExpertFormat


@dataclass
class ExpertSource:
    """The routed experts of one checkpoint as packed blobs: their format, and per layer where the bytes come from
    (mapped from a quantized directory's experts file, or quantized at load from an HF checkpoint)."""
    root: Path
    args: ModelArgs
    fmt: ExpertFormat
    layout: BlobLayout
    manifest: object | None              # quant.checkpoint.Manifest of the blobs' directory, else None
    blob_root: Path | None = None        # that directory: `root` itself, or an expert cache of an HF `root`
    _index: object = field(default=None, init=False, repr=False)    # the HF checkpoint's index, opened once

    def __post_init__(self):
        if self.manifest is not None and self.blob_root is None:
            self.blob_root = self.root

    @property
    def released(self) -> bool:
        """True for an HF checkpoint's experts in the expert format they are stored in (Kimi's compressed-tensors
        int4, DeepSeek-V4's MXFP4): repacked, never quantized, and never served dense."""
        return self.manifest is None and self.fmt.name == getattr(self.args, "released_experts", None)

    @property
    def mapped(self) -> bool:
        """True when the blobs are mapped from a file (no copy, pages read on first touch)."""
        return self.manifest is not None

    def index(self):
        """The HF checkpoint's index (opened once)."""
        if self._index is None:
            from .hf_checkpoint import CheckpointIndex
            self._index = CheckpointIndex.open(self.root)
        return self._index

    def cached(self, log, progress: bool = True) -> "ExpertSource":
        """An HF source served from its expert cache on disk (written once now when missing: expert_cache_dir.py);
        a mapped source, or one whose cache is off or does not fit, as it is."""
        from . import expert_cache_dir

        if self.mapped:
            return self
        found = expert_cache_dir.ensure(self, log, progress)
        if found is None:
            return self
        path, manifest = found
        return ExpertSource(self.root, self.args, manifest.expert_format(), manifest.layout, manifest, path)

    def layer_blobs(self, layer_id: int) -> torch.Tensor:
        """uint8 [n_experts, blob_bytes] of one MoE layer (MTP layer included)."""
        from .quant.checkpoint import open_layer_blobs, quantize_layer_from_hf

        if self.manifest is not None:
            return open_layer_blobs(self.blob_root, self.manifest, layer_id)
        return quantize_layer_from_hf(self.index(), self.args, layer_id, self.fmt, self.layout)


def expert_source(root: Path, args: ModelArgs, experts: str | None, blobs_required: bool) -> ExpertSource | None:
    """Where the routed experts come from. A quantized directory: its own blobs (`experts`, if given, must be its
    format). An HF directory with `experts`: quantized to that format at load. An HF directory without: None (the
    checkpoint's dense experts), unless `blobs_required` (offloading), then blobs in the checkpoint's own
    precision (fp8 for an FP8 checkpoint, else bf16). A checkpoint whose experts are stored in an expert format of
    their own (args.released_experts: Kimi-K2-Thinking / K2.5's int4, DeepSeek-V4's MXFP4) has no dense experts: blobs
    of that format, repacked as stored, unless `experts` asks for another."""
    from .quant.checkpoint import EXPERTS_ONLY, is_quantized_dir, read_manifest
    from .quant.formats import get_format

    if is_quantized_dir(root):
        manifest = read_manifest(root)
        if manifest.dense_dtype == EXPERTS_ONLY:
            raise UserError(f"{root} is an expert cache (routed experts only): pass the HF checkpoint it was made "
                            f"from as --weights")
        if experts is not None and experts != manifest.format:
            raise UserError(f"{root} holds {manifest.format} experts; --experts {experts} needs the HF checkpoint "
                            f"(quantize it again, or drop --experts)")
        return ExpertSource(root, args, manifest.expert_format(), manifest.layout, manifest)
    if experts is None and not blobs_required and not getattr(args, "released_experts", None):
        return None
    fmt = get_format(experts or getattr(args, "released_experts", None) or ("fp8" if args.fp8_block_size else "bf16"))
    return ExpertSource(root, args, fmt, fmt.layout(args.moe_intermediate_size, args.hidden_size), None)


class BlobExperts(nn.Module):
    def __init__(self, blobs: torch.Tensor, fmt: ExpertFormat, layout: BlobLayout, resident_cap=None,
                 limit: float | None = None):
        """resident_cap: a host_memory.ResidentCap told of every blob the CPU kernel reads (--cpu-mem on the CPU).
        limit: the SwiGLU clamp (DeepSeek-V4's swiglu_limit; quant.layout.swiglu_act)."""
        super().__init__()
        self.resident_cap, self.limit = resident_cap, limit
        assert blobs.dtype == torch.uint8 and blobs.dim() == 2 and blobs.shape[1] == layout.blob_bytes
        self.fmt, self.layout = fmt, layout
        self.register_buffer("blobs", blobs, persistent=False)
        self.register_buffer("slot_table", torch.arange(blobs.shape[0], dtype=torch.int32, device=blobs.device),
                             persistent=False)
        self._cpu_ptrs: tuple[int, torch.Tensor] | None = None   # (blobs.data_ptr(), blob addresses) for the CPU kernel

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self.fmt.expert_forward(self.blobs[e], x, self.layout, self.limit).to(x.dtype)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and cpu_experts.available(self.layout, self.limit):
            return self._cpu(x, ids, weights)
        if self.fmt.fused_kernel and dispatch.use_kernels(x.device):
            if x.shape[0] <= FUSED_MAX_TOKENS:
                return fused_moe(x, ids, weights, self.slot_table, self.blobs, self.layout, limit=self.limit)
            # prefill: expert-major on tensor cores, weights decoded in registers, no read of the routing
            return fused_moe_grouped(x, ids, weights, self.slot_table, self.blobs, self.layout, limit=self.limit)
        return combine_experts(self.expert, x, ids, weights)

    def graph_safe(self, device: torch.device) -> bool:
        """Whether a decode step's call reads nothing back to the host, so that a CUDA graph may hold it
        (dsv3lite/graphs.py): the fused kernel on a GPU, the CPU kernel (tests' stand-in captures) without
        --cpu-mem's per-read bookkeeping."""
        if self.resident_cap is not None:
            return False
        if device.type == "cpu":
            return cpu_experts.available(self.layout, self.limit)
        return bool(self.fmt.fused_kernel) and dispatch.use_kernels(device)

    def cpu_blobs(self):
        """(blob addresses [E], layout descriptor, tensors read) for the compiled CPU steps (kernels/cpu_decode.py,
        kernels/cpu_v4.py, which apply `limit`), or None: not on the CPU, no compiled kernel for the layout, or
        --cpu-mem tracking each read."""
        if self.resident_cap is not None or self.blobs.device.type != "cpu" or \
                not cpu_experts.available(self.layout, self.limit):
            return None
        return (cpu_experts.blob_pointers(self.blobs, self.blobs.shape[0], self.layout),
                cpu_experts.layout_desc(self.layout), [self.blobs])

    def _cpu(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """All selected experts in one kernel call (its work buffers persist between calls)."""
        base = self.blobs.data_ptr()
        if self._cpu_ptrs is None or self._cpu_ptrs[0] != base:
            self._cpu_ptrs = (base, cpu_experts.blob_pointers(self.blobs, self.blobs.shape[0], self.layout))
        if self.resident_cap is not None:
            self.resident_cap.touch(self._cpu_ptrs[1][ids.view(-1).unique()].tolist())
        return cpu_experts.cpu_experts_forward(x, ids, weights, self.blobs, self.layout, ptrs=self._cpu_ptrs[1],
                                               limit=self.limit)
