"""The model families the runtime serves, and what each gives the parts of the runtime that are not its network: its
loader, its sizes (parameter counts for `info`, resident bytes, KV cache and workspace for the --gpu-mem planner),
where its MTP block and routed experts sit in a checkpoint, and its experts' SwiGLU clamp. This is the one dispatch
on a family: by the class of its args, which config.ModelArgs.from_dict picks from the config's model_type.

    V3      ModelArgs   DeepSeek-V3/R1/V3.1/V3.2, Kimi-K2/K2.5, Moonlight, V2    model.py, loader.Loader
    V4      V4Args      DeepSeek-V4-Flash, V4-Pro                                 dsv3lite/v4/
"""
from __future__ import annotations


class V3Family:
    name = "DeepSeek-V3"
    kv_label = "latent KV cache"

    @staticmethod
    def loader():
        from .loader import Loader
        return Loader

    @staticmethod
    def footprint(a):
        from .footprint import footprint
        return footprint(a)

    @staticmethod
    def resident_components(a, dense_bytes: int, mtp: bool, weight_bytes: float | None = None) -> dict[str, int]:
        from .footprint import resident_components
        return resident_components(a, dense_bytes, mtp, weight_bytes)

    @staticmethod
    def workspace_bytes(a, ctx_size: int, dense_bytes: int) -> int:
        from .footprint import workspace_bytes
        return workspace_bytes(a, ctx_size, dense_bytes)

    @staticmethod
    def kv_cache_bytes(a, ctx_size: int, mtp: bool, value_bytes: int) -> int:
        return (a.num_hidden_layers + int(mtp)) * ctx_size * a.cache_dim * value_bytes

    @staticmethod
    def mtp_status(index, a):
        from .hf_checkpoint import mtp_status
        return mtp_status(index, a)

    @staticmethod
    def map_name(name: str, a):
        """A checkpoint tensor name -> hf_checkpoint.Target (module tensor, expert), or None (not loaded)."""
        from .hf_checkpoint import map_name
        return map_name(name, a)

    @staticmethod
    def stored_dtype(name: str, module_name: str) -> str:
        """The safetensors dtype `quantize` writes a non-expert tensor in (--dense bf16)."""
        from .hf_checkpoint import FP32_CHECKPOINT_SUFFIXES
        return "F32" if name.endswith(FP32_CHECKPOINT_SUFFIXES) else "BF16"

    @staticmethod
    def expert_names(a, index):
        """(layer, expert) -> the checkpoint names of its gate, up and down weights."""
        from .hf_checkpoint import PROJECTIONS, expert_tensor_name
        return lambda layer, e: tuple(expert_tensor_name(layer, e, p) for p in PROJECTIONS)

    @staticmethod
    def swiglu_limit(a) -> float | None:
        return None


class V4Family:
    name = "DeepSeek-V4"
    kv_label = "KV cache: windows, compressed entries, index keys"

    @staticmethod
    def loader():
        from .v4.loader import V4Loader
        return V4Loader

    @staticmethod
    def footprint(a):
        from .v4.sizes import footprint
        return footprint(a)

    @staticmethod
    def resident_components(a, dense_bytes: int, mtp: bool, weight_bytes: float | None = None) -> dict[str, int]:
        from .v4.sizes import resident_components
        return resident_components(a, dense_bytes, mtp, weight_bytes)

    @staticmethod
    def workspace_bytes(a, ctx_size: int, dense_bytes: int) -> int:
        from .v4.sizes import workspace_bytes
        return workspace_bytes(a, ctx_size, dense_bytes)

    @staticmethod
    def kv_cache_bytes(a, ctx_size: int, mtp: bool, value_bytes: int) -> int:
        from .v4.sizes import kv_cache_bytes
        return kv_cache_bytes(a, ctx_size, mtp, value_bytes)

    @staticmethod
    def mtp_status(index, a):
        from .v4.loader import mtp_status
        return mtp_status(index, a)

    @staticmethod
    def map_name(name: str, a):
        from .v4.checkpoint import map_name
        return map_name(name, a)

    @staticmethod
    def stored_dtype(name: str, module_name: str) -> str:
        import torch

        from .v4.loader import kept_dtype
        return {torch.float32: "F32", torch.int32: "I32"}.get(kept_dtype(module_name, torch.bfloat16), "BF16")

    @staticmethod
    def expert_names(a, index):
        from .v4.checkpoint import expert_names
        return expert_names(a, index)

    @staticmethod
    def swiglu_limit(a) -> float | None:
        return a.swiglu_limit


def family_of(args) -> type[V3Family] | type[V4Family]:
    """The family of a network described by `args` (a ModelArgs or a V4Args)."""
    from .v4.config import V4Args

    return V4Family if isinstance(args, V4Args) else V3Family
