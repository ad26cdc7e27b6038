"""Loading DeepSeek-V4 checkpoints (official or transformers layout) through the project's Loader: the V4 network,
its name table (checkpoint.py), its fp32 / integer tensors, FP8 weights with ue8m0 or float32 `.scale` grids through
the loader's FP8 path, and MXFP4 experts decoded exactly. A run serves those experts as released instead, through an
expert provider (builder.resident_experts, the offloading runtime)."""
from __future__ import annotations

import torch

from ..errors import UserError
from ..hf_checkpoint import CheckpointIndex
from ..loader import Loader
from ..quant.mxfp4 import mxfp4_dequant
from . import checkpoint
from .config import V4Args
from .model import Transformer

# module tensors kept in fp32 whatever the compute dtype (as transformers keeps them): mHC, sinks, compressor
# position biases, norms, the router
_FP32_PARTS = ("hc_attn.", "hc_ffn.", "hc_head.", "attn_sink", ".ape", "norm.weight", "ffn.gate.weight",
               "ffn.gate.bias")


def kept_dtype(module_name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a module tensor is kept in when the network computes in `dtype` (the planner counts the same)."""
    if module_name.endswith("tid2eid"):
        return torch.int32
    return torch.float32 if any(p in module_name for p in _FP32_PARTS) else dtype


def stored_dtype(module_name: str) -> str:
    """The safetensors dtype `quantize` writes a non-expert tensor in (--dense bf16): as the network keeps it."""
    kept = kept_dtype(module_name, torch.bfloat16)
    return {torch.float32: "F32", torch.int32: "I32"}.get(kept, "BF16")


def mtp_status(index: CheckpointIndex, args: V4Args) -> tuple[bool, str | None]:
    """(MTP block present?, notice): off with a note when the checkpoint has no mtp.0.* tensors (transformers drops
    them) or carries a DSpark drafter instead; an error when it has only some."""
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


class V4Loader(Loader):
    """Loader for deepseek_v4 checkpoints (see Loader: same arguments, same load())."""
    decodes_released = True     # MXFP4 experts decode exactly (dequant); runs serve them as released (a provider)

    def build(self, args: V4Args, with_mtp: bool) -> Transformer:
        return Transformer(args, with_mtp=with_mtp)

    def mtp_status(self, index: CheckpointIndex, args: V4Args) -> tuple[bool, str | None]:
        return mtp_status(index, args)

    def map_name(self, name: str, args: V4Args):
        return checkpoint.map_name(name, args)

    def checkpoint_name(self, module_name: str, args: V4Args, expert="<e>") -> str:
        return checkpoint.checkpoint_name(module_name, args, expert)

    def tensor_dtype(self, module_name: str) -> torch.dtype:
        return kept_dtype(module_name, self.dtype)

    def dequant(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if weight.dtype == torch.int8:                  # MXFP4 codes; the values are exact in bf16
            return mxfp4_dequant(weight, scale, torch.float32)
        return super().dequant(weight, scale)
