"""Checkpoint reading: HF safetensors (bf16/fp16/fp32, DeepSeek FP8 block-scaled) into a `Transformer`.

The model is built on the meta device and filled tensor by tensor, so nothing is allocated twice.
`CHECKPOINT_NAMES` is the one table from checkpoint names to module names.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .config import ModelArgs
from .errors import UserError
from .model import Transformer
from .quant.fp8 import fp8_block_dequant, scale_grid_shape

# checkpoint suffix (inside model.layers.N.) -> module suffix (inside layers.N.)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_layernorm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn.wkv_a.weight",
    "self_attn.kv_a_layernorm.weight": "attn.kv_norm.weight",
    "self_attn.kv_b_proj.weight": "attn.wkv_b.weight",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "mlp.gate_proj.weight": "ffn.w1.weight",
    "mlp.up_proj.weight": "ffn.w3.weight",
    "mlp.down_proj.weight": "ffn.w2.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
# routed experts: model.layers.N.mlp.experts.E.<proj>.weight -> layers.N.ffn.experts.<w>[E]
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
# parts of the MTP layer that are not a decoder block
MTP_NAMES = {
    "enorm.weight": "mtp.enorm.weight",
    "hnorm.weight": "mtp.hnorm.weight",
    "eh_proj.weight": "mtp.eh_proj.weight",
    "shared_head.norm.weight": "mtp.head_norm.weight",
}
# copies of the main embedding / head inside the MTP layer: the main tensors are used instead
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
TOP_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "head.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
# kept in fp32 whatever the compute dtype (as transformers does)
_FP32_SUFFIXES = ("ffn.gate.weight", "ffn.gate.bias")


@dataclass
class Target:
    """Where a checkpoint tensor goes: a module tensor, or one expert's slice of a stacked tensor."""
    name: str
    expert: int | None = None


def map_name(ckpt_name: str, args: ModelArgs) -> Target | None:
    """Checkpoint name -> Target; None for tensors that are deliberately not loaded (MTP copies)."""
    if ckpt_name in TOP_NAMES:
        return Target(TOP_NAMES[ckpt_name])
    m = _LAYER_RE.match(ckpt_name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= args.num_hidden_layers + args.num_nextn_predict_layers:
        return None
    if layer == args.mtp_layer_id:
        if rest in MTP_NAMES:
            return Target(MTP_NAMES[rest])
        if rest in MTP_SHARED:
            return None
        prefix = "mtp.block."
    elif layer > args.mtp_layer_id:
        return None                                   # further MTP modules are not used
    else:
        prefix = f"layers.{layer}."
    e = _EXPERT_RE.match(rest)
    if e:
        return Target(prefix + "ffn.experts." + EXPERT_NAMES[e.group(2)], int(e.group(1)))
    if rest in LAYER_NAMES:
        return Target(prefix + LAYER_NAMES[rest])
    return None


@dataclass
class CheckpointIndex:
    """Which file holds each tensor of an HF safetensors checkpoint."""
    root: Path
    files: dict[str, Path] = field(default_factory=dict)        # tensor name -> file

    @classmethod
    def open(cls, root: Path) -> "CheckpointIndex":
        idx = cls(root)
        index_file = root / "model.safetensors.index.json"
        if index_file.exists():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"corrupt {index_file}: {e}") from None
            for name, fname in weight_map.items():
                idx.files[name] = root / fname
            for f in set(idx.files.values()):
                if not f.exists():
                    raise UserError(f"{index_file.name} names {f.name}, which is missing from {root}")
            return idx
        shards = sorted(root.glob("*.safetensors"))
        if not shards:
            raise UserError(f"no *.safetensors files in {root}")
        for f in shards:
            for name in read_header(f):
                idx.files[name] = f
        return idx

    def shards(self) -> list[Path]:
        return sorted(set(self.files.values()))


def read_header(path: Path) -> dict:
    """The safetensors header of `path` (name -> {dtype, shape, data_offsets}); a clear error when it is damaged."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("file is shorter than a safetensors header")
            n = int.from_bytes(raw, "little")
            size = path.stat().st_size
            if n > size - 8 or n > 100 * 2**20:
                raise ValueError(f"header length {n} does not fit a {size}-byte file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: tensors need {8 + n + end} bytes, file has {size}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    header.pop("__metadata__", None)
    return header


def dequant_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """bf16(fp32(w) * s[i // 128, j // 128]): one fp32 multiply, one bf16 rounding; partial edge blocks allowed."""
    return fp8_block_dequant(weight, scale_inv, torch.bfloat16)


def get_module_tensor(model: nn.Module, name: str) -> torch.Tensor:
    mod_name, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(mod_name), attr)


def set_module_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if attr in mod._parameters:
        mod._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        mod._buffers[attr] = value


def expected_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must provide, with its shape (stacked expert tensors included)."""
    out = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for mod_name, mod in model.named_modules():
        for b, t in mod._buffers.items():
            if t is not None and b not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{b}" if mod_name else b] = tuple(t.shape)
    return out


def ckpt_name_for(target_name: str, args: ModelArgs) -> str:
    """Best-effort reverse of map_name, for error messages."""
    if target_name.startswith("mtp.block."):
        layer, rest = args.mtp_layer_id, target_name[len("mtp.block."):]
    elif target_name.startswith("mtp."):
        rev = {v: k for k, v in MTP_NAMES.items()}
        return f"model.layers.{args.mtp_layer_id}.{rev.get(target_name, target_name)}"
    elif target_name.startswith("layers."):
        _, layer, rest = target_name.split(".", 2)
    else:
        return {v: k for k, v in TOP_NAMES.items()}.get(target_name, target_name)
    rev = {v: k for k, v in LAYER_NAMES.items()}
    if rest.startswith("ffn.experts."):
        proj = {v: k for k, v in EXPERT_NAMES.items()}[rest.rsplit(".", 1)[1]]
        return f"model.layers.{layer}.mlp.experts.<e>.{proj}.weight"
    return f"model.layers.{layer}.{rev.get(rest, rest)}"


def mtp_status(index: CheckpointIndex, args: ModelArgs) -> tuple[bool, str | None]:
    """(load MTP?, notice). A wholly absent MTP layer turns MTP off; a partly present one is an error."""
    if args.num_nextn_predict_layers < 1:
        return False, None
    prefix = f"model.layers.{args.mtp_layer_id}."
    present = {n for n in index.files if n.startswith(prefix)}
    if not present:
        return False, (f"note: config declares {args.num_nextn_predict_layers} MTP layer(s) but the checkpoint has no "
                       f"model.layers.{args.mtp_layer_id}.* tensors; MTP speculative decoding is off")
    for name in MTP_NAMES:
        if prefix + name not in present:
            raise UserError(f"checkpoint has a partial MTP layer: {prefix + name} is missing")
    return True, None


class Loader:
    """Fills a meta-device Transformer from an HF safetensors directory."""

    def __init__(self, root: str | Path, device: torch.device, dtype: torch.dtype, progress: bool = True,
                 log=None):
        self.root = Path(root)
        self.device, self.dtype, self.progress = device, dtype, progress
        self.log = log or (lambda msg: print(msg, file=sys.stderr))

    def load(self, args: ModelArgs | None = None, expert_provider=None) -> Transformer:
        """expert_provider(layer_id) -> module: when given, routed experts come from it (a quantized store,
        the offloading runtime) and the checkpoint's per-expert tensors are not read."""
        args = args or ModelArgs.from_dir(self.root)
        index = CheckpointIndex.open(self.root)
        with_mtp, notice = mtp_status(index, args)
        if notice:
            self.log(notice)
        with torch.device("meta"):
            model = Transformer(args, with_mtp=with_mtp)
        self.external_experts = expert_provider is not None
        if expert_provider is not None:
            for moe in model.moe_modules():
                moe.experts = expert_provider(moe.layer_id)
        expected = expected_tensors(model)
        filled: set[str] = set()
        experts_seen: dict[str, set[int]] = {}
        ignored = []
        for shard in index.shards():
            names = [n for n, f in index.files.items() if f == shard]
            self._load_shard(model, args, shard, names, expected, filled, experts_seen, ignored)
        self._finish(model, args, expected, filled, experts_seen)
        model.eval()
        return model

    def _load_shard(self, model, args, shard, names, expected, filled, experts_seen, ignored):
        from safetensors import safe_open
        from tqdm import tqdm

        read_header(shard)
        try:
            f = safe_open(str(shard), framework="pt", device="cpu")
        except Exception as e:   # safetensors raises its own error types
            raise UserError(f"cannot read {shard}: {e}") from None
        with f:
            bar = tqdm(names, desc=f"loading {shard.name}", unit="tensor", file=sys.stderr,
                       disable=not self.progress or None, leave=False)
            for name in bar:
                if name.endswith("_scale_inv"):
                    continue
                target = map_name(name, args)
                if target is None or (target.expert is not None and self.external_experts):
                    ignored.append(name)
                    continue
                tensor = self._read(f, name, shard, model, args)
                self._place(model, args, name, shard, target, tensor, expected, filled, experts_seen)

    def _read(self, f, name, shard, model, args) -> torch.Tensor:
        try:
            t = f.get_tensor(name)
        except Exception as e:
            raise UserError(f"cannot read tensor {name} from {shard.name}: {e}") from None
        if t.dtype == torch.float8_e4m3fn:
            scale_name = name + "_scale_inv"
            if scale_name not in f.keys():
                raise UserError(f"FP8 tensor {name} in {shard.name} has no {scale_name}")
            scale = f.get_tensor(scale_name)
            grid = scale_grid_shape(*t.shape)
            if tuple(scale.shape) != grid:
                raise UserError(f"{scale_name} in {shard.name} has shape {tuple(scale.shape)}, expected {grid} "
                                f"for a {tuple(t.shape)} weight with 128x128 blocks")
            t = dequant_fp8(t, scale)
        return t

    def _place(self, model, args, name, shard, target, tensor, expected, filled, experts_seen):
        full_shape = expected.get(target.name)
        if full_shape is None:
            raise UserError(f"checkpoint tensor {name} ({shard.name}) has no place in a {args.model_type} model "
                            f"with this config")
        shape = full_shape[1:] if target.expert is not None else full_shape
        if tuple(tensor.shape) != tuple(shape):
            raise UserError(f"tensor {name} in {shard.name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(shape)} from config.json")
        dtype = torch.float32 if target.name.endswith(_FP32_SUFFIXES) else self.dtype
        if target.expert is None:
            set_module_tensor(model, target.name, tensor.to(device=self.device, dtype=dtype))
            filled.add(target.name)
            return
        if target.expert >= full_shape[0]:
            raise UserError(f"{name}: expert index {target.expert} >= n_routed_experts {full_shape[0]}")
        current = get_module_tensor(model, target.name)
        if current.is_meta:
            current = torch.empty(full_shape, dtype=dtype, device=self.device)
            set_module_tensor(model, target.name, current)
            current = get_module_tensor(model, target.name)
        with torch.no_grad():
            current[target.expert].copy_(tensor)
        experts_seen.setdefault(target.name, set()).add(target.expert)

    def _finish(self, model, args, expected, filled, experts_seen):
        if "head.weight" not in filled and args.tie_word_embeddings and "embed.weight" in filled:
            model.head.weight = model.embed.weight
            filled.add("head.weight")
        for name, shape in expected.items():
            if name in experts_seen:
                missing = set(range(shape[0])) - experts_seen[name]
                if missing:
                    e = min(missing)
                    raise UserError(f"checkpoint is missing tensor {ckpt_name_for(name, args).replace('<e>', str(e))} "
                                    f"(expected shape {shape[1:]})")
                continue
            if name not in filled:
                if name.endswith("ffn.gate.bias"):
                    # V3-style router without a stored correction bias: zero, as transformers initialises it
                    set_module_tensor(model, name, torch.zeros(shape, dtype=torch.float32, device=self.device))
                    continue
                raise UserError(f"checkpoint is missing tensor {ckpt_name_for(name, args)} (expected shape {shape})")


def load_model(root: str | Path, device: torch.device, dtype: torch.dtype, progress: bool = True,
               log=None) -> Transformer:
    return Loader(root, device, dtype, progress, log).load()


def checkpoint_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's tensors under HF checkpoint names (the inverse of `map_name`): routed experts are split
    per expert and the MTP layer is written as model.layers.{num_hidden_layers}.* (without the copies of
    the embedding and head, which readers take from the main model)."""
    args = model.args
    layer_rev = {v: k for k, v in LAYER_NAMES.items()}
    expert_rev = {v: k for k, v in EXPERT_NAMES.items()}
    mtp_rev = {v: k for k, v in MTP_NAMES.items()}
    top_rev = {v: k for k, v in TOP_NAMES.items()}
    out: dict[str, torch.Tensor] = {}
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if b is not None and not n.startswith("rotary")})
    for name, t in tensors.items():
        t = t.detach()
        if name in top_rev:
            out[top_rev[name]] = t
        elif name in mtp_rev:
            out[f"model.layers.{args.mtp_layer_id}.{mtp_rev[name]}"] = t
        else:
            if name.startswith("mtp.block."):
                layer, rest = args.mtp_layer_id, name[len("mtp.block."):]
            else:
                _, layer, rest = name.split(".", 2)
            if rest.startswith("ffn.experts."):
                proj = expert_rev[rest.rsplit(".", 1)[1]]
                for e in range(t.shape[0]):
                    out[f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"] = t[e]
            else:
                out[f"model.layers.{layer}.{layer_rev[rest]}"] = t
    if args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
