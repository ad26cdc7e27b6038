"""DeepSeek-V4 checkpoint names, in one place (docs/dsv4-math.md §5): both layouts -> module names, and back.

Official checkpoints name tensors without a prefix (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.hc_attn_fn`, `mtp.0.e_proj.weight`, ...); FP8 weights carry `<name>.scale` (F8_E8M0, 128x128 blocks),
MXFP4 experts `<name>.scale` per 32 weights. transformers' save_pretrained writes the same names with a `model.`
prefix, except for the few in HF_RENAMES. The network's module names are the official ones, except for the mHC
parameters (`hc_attn_fn` -> `hc_attn.fn`), the routed experts (stacked: `ffn.experts.w1` [E, I, D]) and the MTP
block (`mtp.0.attn...` -> `mtp.block.attn...`).
"""
from __future__ import annotations

import re

from ..hf_checkpoint import EXPERT_BLOBS, Target
from .config import V4Args

HF_PREFIX = "model."
# transformers' save_pretrained names (after the model. prefix is dropped) -> official names
HF_RENAMES = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
              "hc_head.hc_scale": "hc_head_scale"}
_HF_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")         # the main attention's kv_norm
# official mHC parameter names -> module names, at the top level and in a block
HC_NAMES = {f"hc_{part}_{p}": f"hc_{part}.{p}" for part in ("head", "attn", "ffn") for p in ("fn", "base", "scale")}
# the MTP block's own tensors around its V4 block (mtp.0.<name>)
MTP_OWN = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight")
EXPERT_MATRICES = ("w1", "w3", "w2")       # gate, up, down: the order of quant.layout.MATRICES
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_BLOCK = re.compile(r"^(layers\.(\d+)|mtp\.(\d+))\.(.+)$")


def official_name(name: str) -> str:
    """A checkpoint name of either layout -> the official name."""
    if name.startswith(HF_PREFIX):
        name = name[len(HF_PREFIX):]
        name = HF_RENAMES.get(name, name)
        m = _HF_KV_NORM.match(name)
        if m:
            name = m.group(1) + ".kv_norm.weight"
    return name


def map_name(name: str, args: V4Args) -> Target | None:
    """Checkpoint name (either layout) -> Target; None for tensors deliberately not loaded (a DSpark drafter's
    mtp.1, mtp.2, ..., and mtp.* when the network has no MTP)."""
    if name.endswith(EXPERT_BLOBS):
        return None                                     # a quantized directory's expert blobs (quant/checkpoint.py)
    name = official_name(name)
    if name in HC_NAMES:
        return Target(HC_NAMES[name])
    m = _BLOCK.match(name)
    if not m:
        return Target(name)
    rest = m.group(4)
    if m.group(3) is not None:                          # mtp.K.<rest>
        if int(m.group(3)) != 0 or not args.has_mtp:
            return None
        if rest in MTP_OWN:
            return Target(f"mtp.{rest}")
        if rest in ("hc_head_fn", "hc_head_base", "hc_head_scale"):
            return Target(f"mtp.{HC_NAMES[rest]}")
        prefix = "mtp.block."
    else:
        prefix = f"layers.{m.group(2)}."
    e = _EXPERT.match(rest)
    if e:
        return Target(f"{prefix}ffn.experts.{e.group(2)}", int(e.group(1)))
    return Target(prefix + HC_NAMES.get(rest, rest))


_REVERSE_HC = {v: k for k, v in HC_NAMES.items()}


def checkpoint_name(module_name: str, args: V4Args, expert: int | str = "<e>") -> str:
    """Module tensor name -> the official checkpoint name (routed experts: of expert `expert`)."""
    if module_name.startswith("mtp.block."):
        prefix, rest = "mtp.0.", module_name[len("mtp.block."):]
    elif module_name.startswith("mtp."):
        rest = module_name[len("mtp."):]
        return "mtp.0." + _REVERSE_HC.get(rest, rest)
    elif module_name.startswith("layers."):
        _, layer, rest = module_name.split(".", 2)
        prefix = f"layers.{layer}."
    else:
        return _REVERSE_HC.get(module_name, module_name)
    if rest.startswith("ffn.experts."):
        return f"{prefix}ffn.experts.{expert}.{rest.rsplit('.', 1)[1]}.weight"
    return prefix + _REVERSE_HC.get(rest, rest)


def expert_names(args: V4Args, index):
    """(layer, expert) -> the checkpoint names of a routed expert's gate, up and down weights (w1, w3, w2) in the
    layout of the checkpoint `index` (hf_checkpoint.CheckpointIndex); layer num_hidden_layers is the MTP block."""
    prefix = HF_PREFIX if any(n.startswith(HF_PREFIX) for n in index.files) else ""

    def names(layer: int, e: int) -> tuple[str, str, str]:
        block = "mtp.0." if layer == args.mtp_layer_id else f"{prefix}layers.{layer}."
        return tuple(f"{block}ffn.experts.{e}.{w}.weight" for w in EXPERT_MATRICES)
    return names
