"""Loading DeepSeek-V4 checkpoints (official or transformers layout) through the project's Loader: the V4 network,
its name table (checkpoint.py), its fp32 / integer tensors, and MXFP4 experts decoded exactly or served as released
(FP8 weights with ue8m0 or float32 `.scale` grids take the loader's FP8 path)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import UserError
from ..experts import BlobExperts
from ..hf_checkpoint import CheckpointIndex, TensorReader
from ..loader import Loader
from ..quant.mxfp4 import Mxfp4Format, mxfp4_dequant
from . import checkpoint
from .config import V4Args
from .model import Transformer

# module tensors kept in fp32 whatever the compute dtype (as transformers keeps them): mHC, sinks, compressor
# position biases, norms, the router
_FP32_PARTS = ("hc_attn.", "hc_ffn.", "hc_head.", "attn_sink", ".ape", "norm.weight", "ffn.gate.weight",
               "ffn.gate.bias")


class V4Loader(Loader):
    """Loader for deepseek_v4 checkpoints (see Loader: same arguments, same load())."""

    def build(self, args: V4Args, with_mtp: bool) -> Transformer:
        return Transformer(args, with_mtp=with_mtp)

    def mtp_status(self, index: CheckpointIndex, args: V4Args) -> tuple[bool, str | None]:
        """(MTP block present?, notice): off with a note when the checkpoint has no mtp.0.* tensors (transformers
        drops them) or carries a DSpark drafter instead; an error when it has only some."""
        if args.drafter is not None:
            return False, "; ".join(args.load_notes())
        if not args.has_mtp:
            return False, None
        present = {checkpoint.official_name(n) for n in index.files if checkpoint.official_name(n).startswith("mtp.0.")}
        if not present:
            return False, ("note: config declares an MTP block but the checkpoint has no mtp.0.* tensors; MTP "
                           "speculative decoding is off")
        for name in checkpoint.MTP_OWN:
            if "mtp.0." + name not in present:
                raise UserError(f"checkpoint has a partial MTP block: mtp.0.{name} is missing")
        return True, None

    def map_name(self, name: str, args: V4Args):
        return checkpoint.map_name(name, args)

    def checkpoint_name(self, module_name: str, args: V4Args, expert="<e>") -> str:
        return checkpoint.checkpoint_name(module_name, args, expert)

    def tensor_dtype(self, module_name: str) -> torch.dtype:
        if module_name.endswith("tid2eid"):
            return torch.long
        return torch.float32 if any(p in module_name for p in _FP32_PARTS) else self.dtype

    def dequant(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.int8:                  # MXFP4 codes; the values are exact in bf16
            return mxfp4_dequant(weight, scale, torch.float32)
        return super().dequant(weight, scale)


def released_expert_blobs(reader: TensorReader, args: V4Args, layer_id: int) -> torch.Tensor:
    """uint8 [n_experts, blob_bytes] of one MoE layer (the MTP block's: layer_id == num_hidden_layers): the
    checkpoint's MXFP4 codes and scales repacked verbatim into mxfp4 blobs (quant/mxfp4.py)."""
    fmt = Mxfp4Format()
    layout = fmt.layout(args.moe_intermediate_size, args.hidden_size)
    module = "mtp.block.ffn.experts." if layer_id == args.mtp_layer_id else f"layers.{layer_id}.ffn.experts."
    blobs = torch.empty(args.n_routed_experts, layout.blob_bytes, dtype=torch.uint8)
    for e in range(args.n_routed_experts):
        parts = []
        for matrix in ("w1", "w3", "w2"):                # gate, up, down: quant.layout.MATRICES
            name = checkpoint.checkpoint_name(module + matrix, args, e)
            codes, scales = reader.weight(name)
            if codes.dtype != torch.int8 or scales is None:
                raise UserError(f"{name} is {codes.dtype}, not MXFP4 codes with a scale: the released experts are "
                                f"served as they are only from an MXFP4 checkpoint")
            parts += [codes, scales]
        fmt.pack_prequantized(*parts, out=blobs[e])
    return blobs


def load_v4(root: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
            mtp: bool = True, progress: bool = False, log=None, released_experts: bool = False) -> Transformer:
    """A deepseek_v4 checkpoint directory -> the resident network: routed experts dequantized to `dtype`, or with
    `released_experts` served as released (MXFP4 blobs; on the CPU through the packed kernel)."""
    loader = V4Loader(root, torch.device(device), dtype, progress=progress, log=log)
    if not released_experts:
        return loader.load(mtp=mtp)
    args = V4Args.from_dict(json.loads((Path(root) / "config.json").read_text()))
    layout = Mxfp4Format().layout(args.moe_intermediate_size, args.hidden_size)
    with TensorReader(CheckpointIndex.open(root)) as reader:
        def provider(layer_id: int) -> BlobExperts:
            blobs = released_expert_blobs(reader, args, layer_id).to(device)
            return BlobExperts(blobs, Mxfp4Format(), layout, limit=args.swiglu_limit)
        return loader.load(args, expert_provider=provider, mtp=mtp)
