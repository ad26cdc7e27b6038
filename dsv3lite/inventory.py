"""What `dsv3lite info` reports about a checkpoint, reading no weights: parameters per component (footprint.py),
the bytes of each as stored (its safetensors headers; config.json alone when there are no weights), and the
routed-expert blobs of the host tier, from offload.setup.expert_tier, the code `plan` and a run use, so `info` and
`plan` cannot disagree on the experts' format, the host tier or whether the MTP layer runs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .config import ModelArgs
from .errors import UserError
from .family import family_of
from .footprint import DENSE_WEIGHT_BYTES, Footprint

COMPONENTS = {"embeddings": "embed", "lm_head": "head", "attention+norms": "attention", "dense MLPs": "dense_mlp",
              "routers": "routers", "shared experts": "shared_experts", "routed experts": "routed_experts",
              "MTP (non-expert)": "mtp_dense", "MTP routed experts": "mtp_routed_experts"}
MTP_COMPONENTS = ("MTP (non-expert)", "MTP routed experts")


@dataclass
class Inventory:
    args: ModelArgs
    footprint: Footprint
    params: dict[str, int]            # component -> parameters (the MTP rows only when the MTP layer runs)
    bytes: dict[str, int]             # component -> bytes as stored (or as --dense packs them)
    stored: str                       # how they are stored, in words
    tier: object                      # offload.setup.ExpertTier

    @property
    def host_tier_bytes(self) -> int:
        return self.tier.bytes


def inventory(root: Path, dense: str | None = None) -> Inventory:
    """The checkpoint at `root` as `info` reports it; dense: count the non-expert weights as --dense packs them."""
    from .offload.setup import expert_tier
    from .quant.checkpoint import is_quantized_dir, read_manifest

    a = ModelArgs.from_dir(root)                          # the family's args (family.py)
    family = family_of(a)
    if dense is not None and not family.packs_dense:
        raise UserError(f"--dense is not supported for {family.name} checkpoints yet")
    fp = family.footprint(a)
    tier = expert_tier(root, a, None, mtp=True)
    params = {k: getattr(fp, attr) for k, attr in COMPONENTS.items()
              if tier.with_mtp or k not in MTP_COMPONENTS}
    if tier.weights_here:
        sizes, dtypes = _stored_bytes(root, a, family.map_name)
        stored = "as stored: " + ", ".join(dtypes)
    else:                                                 # bf16, the routed experts as the tier's blobs
        blob = tier.source.layout.blob_bytes
        sizes = {k: v * 2 for k, v in params.items()}
        sizes["routed experts"] = len(a.moe_layer_ids) * a.n_routed_experts * blob
        if tier.with_mtp:
            sizes["MTP routed experts"] = a.n_routed_experts * blob
        stored = f"from config.json alone: bf16, {tier.source.fmt.label} routed experts"
    sizes = {k: sizes.get(k, 0) for k in params}
    if getattr(a, "released_experts", None) and tier.weights_here:   # routed experts as stored, repacked verbatim
        blob = tier.source.layout.blob_bytes
        sizes["routed experts"] = len(a.moe_layer_ids) * a.n_routed_experts * blob
        if "MTP routed experts" in params:
            sizes["MTP routed experts"] = a.n_routed_experts * blob
        stored += f"; {tier.source.fmt.label} routed experts as released"
    if is_quantized_dir(root):
        m = read_manifest(root)
        stored = f"{m.dense_dtype} dense weights, {tier.source.fmt.label} routed experts"
    if dense is not None:                                 # as PackedLinear holds them (the family says which)
        sizes.update(family.packed_info_bytes(a, DENSE_WEIGHT_BYTES[dense], params, fp))
        stored += f"; non-expert weights packed to {dense} (--dense)"
    return Inventory(a, fp, params, sizes, stored, tier)


def _stored_bytes(root: Path, args: ModelArgs, names) -> tuple[dict[str, int], list[str]]:
    """(component -> bytes of its tensors in the checkpoint's files, the dtypes found, most bytes first)."""
    from .hf_checkpoint import CheckpointIndex, component_of

    sizes: dict[str, int] = {}
    by_dtype: dict[str, int] = {}
    for name, meta in CheckpointIndex.open(root).headers().items():
        component = component_of(name, args, names)
        if component is None:
            continue
        begin, end = meta["data_offsets"]
        sizes[component] = sizes.get(component, 0) + end - begin
        by_dtype[meta["dtype"]] = by_dtype.get(meta["dtype"], 0) + end - begin
    return sizes, [d.lower() for d in sorted(by_dtype, key=by_dtype.get, reverse=True)]
