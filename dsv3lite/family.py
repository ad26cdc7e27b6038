"""The model families the runtime serves, and what each gives the parts of the runtime that are not its network: its
loader, its sizes (parameter counts for `info`, resident bytes, KV cache and workspace for the --gpu-mem planner),
where its MTP block and routed experts sit in a checkpoint, and its experts' SwiGLU clamp. This is the one dispatch
on a family: by the class of its args, which config.ModelArgs.from_dict picks from the config's model_type.

    V3      ModelArgs   DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2/K2.5, Moonlight, V2    model.py, loader.Loader
    V4      V4Args      DeepSeek-V4-Flash, V4-Pro                                 dsv3lite/v4/
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    name: str
    loader: type                    # loader.Loader or the family's subclass
    footprint: Callable             # args -> footprint.Footprint (parameter counts)
    resident_components: Callable   # (args, dense_bytes, mtp, weight_bytes) -> {component: resident bytes}
    workspace_bytes: Callable       # (args, ctx_size, dense_bytes) -> a prefill chunk's activations
    kv_cache_bytes: Callable        # (args, ctx_size, mtp, value_bytes) -> every block's cache
    kv_label: Callable              # args -> what the KV cache holds, in words
    mtp_status: Callable            # (CheckpointIndex, args) -> (MTP block present?, note)
    map_name: Callable              # (checkpoint name, args) -> hf_checkpoint.Target or None
    stored_dtype: Callable          # (checkpoint name, module name) -> the dtype `quantize` writes a dense tensor in
    expert_names: Callable          # (args, CheckpointIndex) -> ((layer, expert) -> gate, up, down names)
    swiglu_limit: Callable          # args -> the routed and shared experts' SwiGLU clamp, or None
    info_lines: Callable            # (args, MTP runs?) -> `dsv3lite info`'s lines on the architecture
    kv_lines: Callable              # args -> its lines on the KV cache
    info_json: Callable             # args -> keys `dsv3lite info --json` adds for the family
    packed_info_bytes: Callable     # (args, bytes per weight, info's params, footprint) -> `info --dense`'s bytes
    packs_dense: bool               # whether --dense packs its non-expert weights


def family_of(args) -> Family:
    """The family of a network described by `args` (a ModelArgs or a V4Args)."""
    from .v4.config import V4Args

    return _v4() if isinstance(args, V4Args) else _v3()


@functools.cache
def _v3() -> Family:
    from . import footprint, hf_checkpoint
    from .loader import Loader

    return Family(
        "DeepSeek-V3", Loader, footprint.footprint, footprint.resident_components, footprint.workspace_bytes,
        footprint.kv_cache_bytes,
        lambda a: "KV cache: latents + indexer keys" if a.has_indexer else "latent KV cache",
        hf_checkpoint.mtp_status, hf_checkpoint.map_name, lambda name, module: hf_checkpoint.stored_dtype(name),
        lambda a, index: hf_checkpoint.expert_names, lambda a: None, footprint.info_lines, footprint.kv_lines,
        lambda a: {}, footprint.packed_info_bytes, packs_dense=True)


@functools.cache
def _v4() -> Family:
    from .v4 import checkpoint, loader, sizes

    return Family(
        "DeepSeek-V4", loader.V4Loader, sizes.footprint, sizes.resident_components, sizes.workspace_bytes,
        sizes.kv_cache_bytes, lambda a: "KV cache: windows, compressed entries, index keys", loader.mtp_status,
        checkpoint.map_name, lambda name, module: loader.stored_dtype(module), checkpoint.expert_names,
        lambda a: a.swiglu_limit, sizes.info_lines, sizes.kv_lines, sizes.info_json, sizes.packed_info_bytes,
        packs_dense=True)
