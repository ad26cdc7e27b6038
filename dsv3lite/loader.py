"""Checkpoint loading: HF safetensors (bf16/fp16/fp32, DeepSeek FP8 block-scaled) into a `Transformer`; a
multimodal checkpoint (Kimi-K2.5) gives its language model.

The model is built on the meta device and filled tensor by tensor, so nothing is allocated twice. Names,
shards and tensor reads come from `hf_checkpoint` (the one table of checkpoint names lives there). With
`dense=` (`--dense`) each non-expert Linear weight is packed as it is read (dense.PackedLinear.from_weight): the
float copy of all of them never exists at once, and an FP8 checkpoint's weights with dense="fp8" keep their bytes.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

from .config import ModelArgs
from .dense import PackedLinear, check_dense, packable
from .errors import UserError
from .hf_checkpoint import (FP32_MODULE_SUFFIXES, CheckpointIndex, TensorReader,
                            checkpoint_name, is_scale_name, map_name, mtp_status, unplaced_note, unscaled_integer)
from .model import Transformer
from .quant.fp8 import fp8_block_dequant
from .utils import format_bytes

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


class Loader:
    """Fills a meta-device Transformer from an HF safetensors directory. A family with a network and checkpoint
    names of its own overrides the hooks below (DeepSeek-V4: dsv3lite/v4/loader.py)."""

    def __init__(self, root: str | Path, device: torch.device, dtype: torch.dtype, progress: bool = True,
                 log=None, dense: str | None = None):
        """dense: pack the non-expert Linear weights to this --dense dtype while loading (dense.py)."""
        self.root = Path(root)
        self.device, self.dtype, self.progress = device, dtype, progress
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.dense = dense
        self.packed = dict(count=0, kept=0, before=0, after=0, seconds=0.0)   # what packing did (the log line)

    # --- the family's hooks ---------------------------------------------------------------------------------
    decodes_released = False    # whether the loader decodes the checkpoint's released expert format to dense experts

    def build(self, args, with_mtp: bool) -> nn.Module:
        """The network, built on the meta device by the caller."""
        return Transformer(args, with_mtp=with_mtp)

    def mtp_status(self, index: CheckpointIndex, args) -> tuple[bool, str | None]:
        return mtp_status(index, args)

    def map_name(self, name: str, args):
        return map_name(name, args)

    def checkpoint_name(self, module_name: str, args, expert="<e>") -> str:
        return checkpoint_name(module_name, args, expert)

    def tensor_dtype(self, module_name: str) -> torch.dtype:
        """The dtype a module tensor is kept in."""
        return torch.float32 if module_name.endswith(FP32_MODULE_SUFFIXES) else self.dtype

    def dequant(self, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A quantized weight with its scale (TensorReader.weight) -> floats."""
        return dequant_fp8(weight, scale)

    def load(self, args: ModelArgs | None = None, expert_provider=None, mtp: bool = True) -> Transformer:
        """expert_provider(layer_id) -> module: when given, routed experts come from it (a quantized store,
        the offloading runtime) and the checkpoint's per-expert tensors are not read. mtp=False leaves the MTP
        layer out (none of its tensors is read)."""
        check_dense(self.dense, torch.device(self.device))
        args = args or ModelArgs.from_dir(self.root)
        index = CheckpointIndex.open(self.root)
        with_mtp, notice = self.mtp_status(index, args)       # (the family's checks of the checkpoint's depth)
        if not mtp:
            with_mtp, notice = False, None
        self.skip_mtp = not with_mtp
        for note in (notice, index.skipped_note(), unplaced_note(index, args, self.map_name)):
            if note:
                self.log(note)
        with torch.device("meta"):
            model = self.build(args, with_mtp)
        if expert_provider is None and args.released_experts and not self.decodes_released:
            raise UserError(f"the routed experts of {self.root} are stored as {args.released_experts}, which has no "
                            f"dense form here: they load as stored through dsv3lite.load (builder.load_network)")
        self.external_experts = expert_provider is not None
        if expert_provider is not None:
            for moe in model.moe_modules():
                moe.experts = expert_provider(moe.layer_id)
        expected = expected_tensors(model)
        filled: set[str] = set()
        experts_seen: dict[str, set[int]] = {}
        by_shard: dict = {}
        for n, f in index.files.items():              # one pass (V3 has 163 shards and ~90k tensors)
            by_shard.setdefault(f, []).append(n)
        with TensorReader(index) as reader:
            for shard in index.shards():
                self._load_shard(model, args, reader, shard, by_shard.get(shard, []), expected, filled,
                                 experts_seen)
        self._finish(model, args, expected, filled, experts_seen)
        if self.dense is not None:
            p = self.packed
            kept = f", {p['kept']} of them the checkpoint's fp8 bytes as they are" if p["kept"] else ""
            self.log(f"packed {p['count']} dense weight matrices to {self.dense} while loading{kept} "
                     f"({p['seconds']:.1f}s): {format_bytes(p['before'])} in {str(self.dtype).replace('torch.', '')} "
                     f"-> {format_bytes(p['after'])}")
        model.eval()
        return model

    def _load_shard(self, model, args, reader, shard, names, expected, filled, experts_seen):
        from tqdm import tqdm

        wanted = []
        for name in names:
            if is_scale_name(name):
                continue
            target = self.map_name(name, args)
            if target is None or (target.expert is not None and self.external_experts) or (
                    self.skip_mtp and target.name.startswith("mtp.")):
                continue                              # not read: named by unplaced_note, or left out on purpose
            wanted.append((name, target))
        targets = dict(wanted)
        bar = tqdm(total=len(wanted), desc=f"loading {shard.name}", unit="tensor", file=sys.stderr,
                   disable=not self.progress or None, leave=False)
        # the next tensors are read while this one is dequantized, packed and placed
        for name, weight, scale in reader.weights(targets):
            bar.update()
            target = targets[name]
            if self.dense is not None and target.expert is None and packable(model, target.name):
                self._place_packed(model, args, name, shard, target, weight, scale, expected, filled)
                continue
            if scale is not None:     # on a GPU the FP8 bytes cross and are dequantized there
                on = self.device if self.device.type == "cuda" else weight.device
                tensor = self.dequant(weight.to(on), scale.to(on))
            else:
                tensor = weight
                if not tensor.dtype.is_floating_point and self.tensor_dtype(target.name).is_floating_point:
                    raise unscaled_integer(name, tensor.dtype)
            self._place(model, args, name, shard, target, tensor, expected, filled, experts_seen)
        bar.close()

    @staticmethod
    def _checked_shape(args, name, shard, target, tensor, expected) -> tuple[int, ...]:
        full_shape = expected.get(target.name)
        if full_shape is None:
            raise UserError(f"checkpoint tensor {name} ({shard.name}) has no place in a {args.model_type} model "
                            f"with this config")
        shape = full_shape[1:] if target.expert is not None else full_shape
        if tuple(tensor.shape) != tuple(shape):
            raise UserError(f"tensor {name} in {shard.name} has shape {tuple(tensor.shape)}, "
                            f"expected {tuple(shape)} from config.json")
        return full_shape

    def _pack_into(self, model, module_name: str, weight, scale, dtype) -> None:
        """Replace the Linear `module_name` by a PackedLinear of `weight` (an FP8 one with its scale_inv)."""
        t0 = time.perf_counter()
        packed = PackedLinear.from_weight(weight, self.dense, scale, value_dtype=dtype, device=self.device)
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, packed)
        p = self.packed
        p["count"] += 1
        p["kept"] += int(scale is not None and self.dense == "fp8")
        p["before"] += weight.numel() * torch.empty((), dtype=dtype).element_size()
        p["after"] += packed.nbytes
        p["seconds"] += time.perf_counter() - t0

    def _place_packed(self, model, args, name, shard, target, weight, scale, expected, filled):
        self._checked_shape(args, name, shard, target, weight, expected)
        dtype = self.tensor_dtype(target.name)
        self._pack_into(model, target.name.rpartition(".")[0], weight, scale, dtype)
        filled.add(target.name)

    def _place(self, model, args, name, shard, target, tensor, expected, filled, experts_seen):
        full_shape = self._checked_shape(args, name, shard, target, tensor, expected)
        dtype = self.tensor_dtype(target.name)
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
            if self.dense is not None and packable(model, "head.weight"):
                self._pack_into(model, "head", model.embed.weight, None, self.dtype)
            else:
                model.head.weight = model.embed.weight
            filled.add("head.weight")
        for name, shape in expected.items():
            if name in experts_seen:
                missing = set(range(shape[0])) - experts_seen[name]
                if missing:
                    e = min(missing)
                    raise UserError(f"checkpoint is missing tensor {self.checkpoint_name(name, args, e)} "
                                    f"(expected shape {shape[1:]})")
                continue
            if name not in filled:
                if name.endswith("ffn.gate.bias"):
                    # V3-style router without a stored correction bias: zero, as transformers initialises it
                    set_module_tensor(model, name, torch.zeros(shape, dtype=torch.float32, device=self.device))
                    continue
                raise UserError(f"checkpoint is missing tensor {self.checkpoint_name(name, args)} "
                                f"(expected shape {shape})")


def load_model(root: str | Path, device: torch.device, dtype: torch.dtype, progress: bool = True,
               log=None, dense: str | None = None) -> Transformer:
    return Loader(root, device, dtype, progress, log, dense=dense).load()
