"""The HF checkpoint layout, in one place: tensor names (and their reverse), which shard holds what, one
safetensors reader (headers, dtypes and shapes, FP8 scale grids) and whether the MTP layer is present.

The loader, `quantize` and the planner all read checkpoints through this module.
"""
from __future__ import annotations

import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import TEXT_MODEL_PREFIX, ModelArgs
from .errors import UserError
from .quant.fp8 import scale_grid_shape
from .quant.tensorfile import DTYPES, TensorSpan, entry_nbytes, read_header, tensor_spans

# ---- names: checkpoint name <-> module name -------------------------------------------------------------

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
    # V3.2: the lightning indexer of each layer
    "self_attn.indexer.wq_b.weight": "attn.indexer.wq_b.weight",
    "self_attn.indexer.wk.weight": "attn.indexer.wk.weight",
    "self_attn.indexer.k_norm.weight": "attn.indexer.k_norm.weight",
    "self_attn.indexer.k_norm.bias": "attn.indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "attn.indexer.weights_proj.weight",
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
PROJECTIONS = tuple(EXPERT_NAMES)              # gate, up, down: the order of quant.layout.MATRICES
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
# kept in fp32 whatever the compute dtype (as transformers does): module and checkpoint suffixes
FP32_MODULE_SUFFIXES = ("ffn.gate.weight", "ffn.gate.bias", "attn.indexer.weights_proj.weight")
FP32_CHECKPOINT_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "self_attn.indexer.weights_proj.weight")

_REVERSE = {table_id: {v: k for k, v in t.items()} for table_id, t in
            (("layer", LAYER_NAMES), ("expert", EXPERT_NAMES), ("mtp", MTP_NAMES), ("top", TOP_NAMES))}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclass
class Target:
    """Where a checkpoint tensor goes: a module tensor, or one expert's slice of a stacked tensor."""
    name: str
    expert: int | None = None


def expert_tensor_name(layer_id: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer_id}.mlp.experts.{expert}.{proj}.weight"


def expert_names(layer_id: int, expert: int) -> tuple[str, str, str]:
    """The checkpoint names of one routed expert's gate, up and down weights (quant.layout.MATRICES' order)."""
    return tuple(expert_tensor_name(layer_id, expert, p) for p in PROJECTIONS)


def stored_dtype(name: str) -> str:
    """The safetensors dtype `quantize` writes a non-expert tensor in with --dense bf16: routers fp32, else bf16."""
    return "F32" if name.endswith(FP32_CHECKPOINT_SUFFIXES) else "BF16"


EXPERT_BLOBS = "mlp.experts.blobs"     # a quantized directory's routed experts of layer i: model.layers.{i}.<this>
BLOBS_SUFFIX = "." + EXPERT_BLOBS


def blob_name(layer_id: int) -> str:
    """The uint8 [n_experts, blob_bytes] tensor of one MoE layer's blobs in a quantized directory (quant/)."""
    return f"model.layers.{layer_id}.{EXPERT_BLOBS}"


def map_name(ckpt_name: str, args: ModelArgs) -> Target | None:
    """Checkpoint name -> Target; None for tensors that are deliberately not loaded (MTP copies)."""
    if ckpt_name in TOP_NAMES:
        return Target(TOP_NAMES[ckpt_name])
    m = _LAYER_RE.match(ckpt_name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer == args.mtp_layer_id and args.num_nextn_predict_layers >= 1:
        if rest in MTP_NAMES:
            return Target(MTP_NAMES[rest])
        if rest in MTP_SHARED:
            return None
        prefix = "mtp.block."
    elif layer >= args.mtp_layer_id:
        return None                                   # further MTP modules are not used
    else:
        prefix = f"layers.{layer}."
    e = _EXPERT_RE.match(rest)
    if e:
        return Target(prefix + "ffn.experts." + EXPERT_NAMES[e.group(2)], int(e.group(1)))
    if rest in LAYER_NAMES:
        return Target(prefix + LAYER_NAMES[rest])
    return None


def component_of(ckpt_name: str, args, names=map_name) -> str | None:
    """The footprint component a checkpoint tensor (or its FP8 scale, or a quantized layer's expert blobs) counts
    in: embeddings | lm_head | attention+norms | dense MLPs | routers | shared experts | routed experts |
    MTP (non-expert) | MTP routed experts; None for a tensor the model does not read. Any family: `names` is its
    name table (family.py's map_name), whose module names use the same words in every family."""
    base = ckpt_name.removesuffix("_scale_inv")
    if base.endswith(BLOBS_SUFFIX):
        m = _LAYER_RE.match(base)
        return "MTP routed experts" if m and int(m.group(1)) == args.mtp_layer_id else "routed experts"
    target = names(base, args)
    if target is None:
        return None
    name = target.name
    in_mtp = name.startswith("mtp.")
    if target.expert is not None:
        return "MTP routed experts" if in_mtp else "routed experts"
    if in_mtp:
        return "MTP (non-expert)"
    if name in ("embed.weight", "head.weight"):
        return "embeddings" if name == "embed.weight" else "lm_head"
    if ".ffn.gate." in name:
        return "routers"
    if ".ffn.shared_experts." in name:
        return "shared experts"
    return "dense MLPs" if ".ffn." in name else "attention+norms"


def checkpoint_name(module_name: str, args: ModelArgs, expert: int | str = "<e>") -> str:
    """The reverse of `map_name`: module tensor name -> checkpoint name (routed experts: of expert `expert`)."""
    if module_name in _REVERSE["top"]:
        return _REVERSE["top"][module_name]
    if module_name in _REVERSE["mtp"]:
        return f"model.layers.{args.mtp_layer_id}.{_REVERSE['mtp'][module_name]}"
    if module_name.startswith("mtp.block."):
        layer, rest = args.mtp_layer_id, module_name[len("mtp.block."):]
    elif module_name.startswith("layers."):
        _, layer, rest = module_name.split(".", 2)
    else:
        return module_name
    if rest.startswith("ffn.experts."):
        return expert_tensor_name(int(layer), expert, _REVERSE["expert"][rest.rsplit(".", 1)[1]])
    return f"model.layers.{layer}.{_REVERSE['layer'].get(rest, rest)}"


def checkpoint_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's tensors under HF checkpoint names: routed experts are split per expert and the MTP layer is
    written as model.layers.{num_hidden_layers}.* (without the copies of the embedding and head, which readers
    take from the main model)."""
    args = model.args
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if b is not None and not n.startswith("rotary")})
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        t = t.detach()
        if ".ffn.experts." in name:
            for e in range(t.shape[0]):
                out[checkpoint_name(name, args, e)] = t[e]
        else:
            out[checkpoint_name(name, args)] = t
    if args.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


# ---- which shard holds what ----------------------------------------------------------------------------

@dataclass
class CheckpointIndex:
    """Which file holds each tensor of a safetensors checkpoint directory.

    Names are the text model's: in a multimodal checkpoint (Kimi-K2.5) the TEXT_MODEL_PREFIX is dropped from the
    language model's names, and the other towers' tensors (vision, projector) are left out and listed in `skipped`.
    """
    root: Path
    files: dict[str, Path] = field(default_factory=dict)        # tensor name -> file
    stored: dict[str, str] = field(default_factory=dict)       # tensor name -> its name in the file, where they differ
    skipped: list[str] = field(default_factory=list)           # tensors of other towers, not indexed

    @classmethod
    def open(cls, root: Path) -> "CheckpointIndex":
        root = Path(root)
        idx = cls(root)
        index_file = root / "model.safetensors.index.json"
        if index_file.exists():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"corrupt {index_file}: {e}") from None
            for name, fname in weight_map.items():
                idx.files[name] = root / fname
            for f in set(idx.files.values()):
                if not f.exists():
                    raise UserError(f"{index_file.name} names {f.name}, which is missing from {root}")
        else:
            shards = sorted(root.glob("*.safetensors"))
            if not shards:
                raise UserError(f"no *.safetensors files in {root}")
            for f in shards:
                for name in read_header(f):
                    idx.files[name] = f
        idx._text_model_only()
        return idx

    def _text_model_only(self) -> None:
        if not any(n.startswith(TEXT_MODEL_PREFIX) for n in self.files):
            return
        files, self.files = self.files, {}
        for name, f in files.items():
            if name.startswith(TEXT_MODEL_PREFIX):
                self.files[name[len(TEXT_MODEL_PREFIX):]] = f
                self.stored[name[len(TEXT_MODEL_PREFIX):]] = name
            else:
                self.skipped.append(name)

    def skipped_note(self) -> str | None:
        """One line on the towers left out (None when nothing was)."""
        if not self.skipped:
            return None
        towers = sorted({n.split(".", 1)[0] for n in self.skipped})
        return (f"note: dsv3lite runs the language model only; the checkpoint's {', '.join(towers)} "
                f"({len(self.skipped)} tensors) are not loaded, so images and video are not understood")

    def shards(self) -> list[Path]:
        return sorted(set(self.files.values()))

    def headers(self) -> dict[str, dict]:
        """name -> {dtype, shape, data_offsets} for every tensor the index places in a shard, checked to be there."""
        meta: dict[str, dict] = {}
        names = {self.stored.get(n, n): n for n in self.files}
        for shard in self.shards():
            header = read_header(shard)
            meta.update({names[n]: v for n, v in header.items() if n in names and self.files[names[n]] == shard})
        for name in self.files:
            if name not in meta:
                raise UserError(f"the checkpoint index names {self.stored.get(name, name)}, but "
                                f"{self.files[name].name} does not hold it")
        return meta


def check_layer_count(index: CheckpointIndex, args: ModelArgs) -> None:
    """config.json's num_hidden_layers must be the checkpoint's decoder depth: the first layer holding MTP tensors
    (enorm, eh_proj, ...), else the highest layer + 1. Otherwise an MTP layer would run as a decoder layer, or a
    decoder layer be skipped, and print garbage."""
    layers, mtp = set(), set()
    for name in index.files:
        m = _LAYER_RE.match(name)
        if m:
            layers.add(int(m.group(1)))
            if m.group(2) in MTP_NAMES:
                mtp.add(int(m.group(1)))
    if not layers:
        return
    depth = min(mtp) if mtp else max(layers) + 1
    if depth != args.num_hidden_layers:
        where = f"its MTP layer is model.layers.{depth}" if mtp else f"its last layer is model.layers.{depth - 1}"
        raise UserError(f"config.json says num_hidden_layers {args.num_hidden_layers}, but the checkpoint's decoder "
                        f"has {depth} layers ({where})")


def unplaced_note(index: CheckpointIndex, args: ModelArgs, names=map_name) -> str | None:
    """One line naming the checkpoint tensors that have no place in the model (not read), or None. The MTP layer's
    copies of the embedding and head, and MTP layers past the first, are left out on purpose and not named.
    names: the family's name table (map_name's signature)."""
    unplaced = []
    for name in index.files:
        if is_scale_name(name) or name.endswith(BLOBS_SUFFIX) or names(name, args) is not None:
            continue                          # (a quantized directory's expert blobs have their own reader)
        m = _LAYER_RE.match(name)
        if m and int(m.group(1)) >= args.mtp_layer_id:
            continue
        unplaced.append(name)
    if not unplaced:
        return None
    shown = ", ".join(sorted(unplaced)[:3]) + (", ..." if len(unplaced) > 3 else "")
    return (f"note: {len(unplaced)} checkpoint tensor{'s have' if len(unplaced) > 1 else ' has'} no place in a "
            f"{args.model_type} model and {'are' if len(unplaced) > 1 else 'is'} not loaded: {shown}")


def mtp_status(index: CheckpointIndex, args: ModelArgs) -> tuple[bool, str | None]:
    """(MTP layer present?, notice). A wholly absent MTP layer turns MTP off; a partly present one is an error.
    Works for HF and dsv3lite-quantized directories alike (both keep the MTP layer's own tensors by HF name).
    The config's layer count is checked against the checkpoint first (check_layer_count)."""
    check_layer_count(index, args)
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


def has_weights(root: Path) -> bool:
    """Whether `root` holds any safetensors weights (or an index naming them) at all."""
    root = Path(root)
    return (root / "model.safetensors.index.json").exists() or any(root.glob("*.safetensors"))


# ---- reading tensors --------------------------------------------------------------------------------------

# a weight's scale: `<name>_scale_inv` (DeepSeek-V3, float32), or `<stem>.scale` for `<stem>.weight` (DeepSeek-V4,
# F8_E8M0 or float32): FP8 128x128 blocks, or for an I8 weight (two MXFP4 codes a byte) one per 32 weights of a row
SCALE_SUFFIXES = ("_scale_inv", ".scale")


def unscaled_integer(name: str, dtype: torch.dtype) -> UserError:
    """The error for an integer weight whose scale is nowhere (casting it to float would be silently wrong)."""
    return UserError(f"tensor {name} is {str(dtype).replace('torch.', '')}, and config.json declares no quantization "
                     f"that gives its scale (an integer weight needs one): dsv3lite reads float, FP8 block-scaled and "
                     f"MXFP4 weights, and its own quantized directories")


def is_scale_name(name: str) -> bool:
    """Whether a checkpoint name is another tensor's scale (read with its weight, never placed itself)."""
    return name.endswith(SCALE_SUFFIXES)


def scale_names(name: str) -> tuple[str, ...]:
    """Where the scale of weight `name` may be stored."""
    return (name + "_scale_inv",) + ((name[:-len("weight")] + "scale",) if name.endswith(".weight") else ())


def check_fp8_scale(name: str, weight_shape, scale_shape, scale_name: str | None = None) -> None:
    grid = scale_grid_shape(*weight_shape)
    if tuple(scale_shape) != grid:
        raise UserError(f"{scale_name or name + '_scale_inv'} has shape {tuple(scale_shape)}, expected {grid} "
                        f"for a {tuple(weight_shape)} weight with 128x128 blocks")


READ_AHEAD_BYTES = 512 * 2**20     # how far TensorReader.weights reads ahead of its caller


class TensorReader:
    """Tensors of a checkpoint read one at a time with pread at the offsets of the safetensors headers, into
    memory of their own. (safetensors' safe_open maps the shard, and every page a read touches stays in the
    process's RSS until the handle closes: +1 expert per expert read, measured.)"""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._shards: dict[Path, tuple[int, dict[str, TensorSpan]]] = {}   # shard -> (fd, name -> span)
        self._lock = threading.Lock()
        self._local = threading.local()                   # per-thread scratch buffers (get(scratch=...))

    def _locate(self, name: str) -> tuple[int, TensorSpan, Path]:
        shard = self.index.files.get(name)
        if shard is None:
            raise UserError(f"checkpoint is missing tensor {name}")
        with self._lock:                                   # the read-ahead thread opens shards too
            if shard not in self._shards:
                spans = tensor_spans(shard)
                try:
                    self._shards[shard] = (os.open(shard, os.O_RDONLY), spans)
                except OSError as e:
                    raise UserError(f"cannot read {shard}: {e.strerror}") from None
            fd, spans = self._shards[shard]
        stored = self.index.stored.get(name, name)
        if stored not in spans:
            raise UserError(f"{shard.name} does not hold {stored}, which the checkpoint index places there")
        return fd, spans[stored], shard

    def has(self, name: str) -> bool:
        return name in self.index.files

    def get(self, name: str, scratch=None) -> torch.Tensor:
        """The tensor `name`, in memory of its own; with `scratch` (a key), in this thread's buffer of that key,
        reused by the next read with the same key on this thread (no fresh pages to fault in per tensor)."""
        fd, span, shard = self._locate(name)
        dtype = DTYPES.get(span.dtype)
        if dtype is None or span.nbytes != entry_nbytes(span.dtype, span.shape):
            raise UserError(f"tensor {name} in {shard.name}: unsupported dtype {span.dtype} or inconsistent size")
        buf = torch.empty(span.nbytes, dtype=torch.uint8) if scratch is None else self._scratch(scratch, span.nbytes)
        view, offset = memoryview(buf.numpy()), span.start
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise UserError(f"cannot read tensor {name}: {shard.name} is truncated")
            view, offset = view[n:], offset + n
        return buf.view(dtype).view(span.shape)

    def _scratch(self, key, nbytes: int) -> torch.Tensor:
        bufs = self._local.__dict__.setdefault("bufs", {})
        buf = bufs.get(key)
        if buf is None or buf.numel() < nbytes:
            buf = bufs[key] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes]

    def scale_of(self, name: str) -> str | None:
        """The name of weight `name`'s scale in this checkpoint (SCALE_SUFFIXES), or None."""
        return next((s for s in scale_names(name) if self.has(s)), None)

    def weight(self, name: str, shape: tuple[int, ...] | None = None,
               scratch=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, its scale in fp32, or None for a float weight), shapes checked (`shape`: the logical [N, K]): an
        FP8 weight's block scale grid, or an I8 weight's (two MXFP4 codes a byte, DeepSeek-V4's experts) scales per
        32 weights [N, K/32] (ue8m0 decoded exactly). `scratch`: read the weight into this thread's buffer of that
        key (see `get`); valid until the next read with that key."""
        w = self.get(name, scratch)
        if shape is not None and w.dtype == torch.int8 and len(shape) == 2:
            shape = (shape[0], shape[1] // 2)                    # MXFP4 codes: two a byte
        if shape is not None and tuple(w.shape) != tuple(shape):
            raise UserError(f"tensor {name} has shape {tuple(w.shape)}, expected {tuple(shape)} from config.json")
        if w.dtype not in (torch.float8_e4m3fn, torch.int8):
            return w, None                    # a float weight, or an integer table (its reader checks where it goes)
        scale = self.scale_of(name)
        if scale is None:
            if w.dtype != torch.float8_e4m3fn:
                raise unscaled_integer(name, w.dtype)
            raise UserError(f"FP8 tensor {name} has no {' or '.join(scale_names(name))}")
        s = self.get(scale)
        if w.dtype == torch.float8_e4m3fn:
            check_fp8_scale(name, w.shape, s.shape, scale)
        elif w.dim() != 2 or tuple(s.shape) != (w.shape[0], w.shape[1] * 2 // 32):
            raise UserError(f"{scale} has shape {tuple(s.shape)}, expected {(w.shape[0], w.shape[1] * 2 // 32)} for "
                            f"MXFP4 codes {tuple(w.shape)} (one scale per 32 weights)")
        return w, s.float()

    def weights(self, names, ahead_bytes: int | None = None):
        """(name, weight, scale) of each of `names` in order, as `weight` gives them, read by a background thread
        up to `ahead_bytes` (default READ_AHEAD_BYTES; 0: one tensor at a time) ahead of the caller (reads overlap
        what the caller does with each tensor: dequantize, pack, place). Errors surface at the tensor they belong
        to; leaving the loop early stops the reads."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        ahead_bytes = READ_AHEAD_BYTES if ahead_bytes is None else ahead_bytes
        names = list(names)
        pending: deque = deque()
        queued = 0
        with ThreadPoolExecutor(1, thread_name_prefix="dsv3lite-read") as pool:
            try:
                nxt = 0
                while nxt < len(names) or pending:
                    while nxt < len(names) and (not pending or queued < ahead_bytes):
                        try:
                            size = self.nbytes(names[nxt])
                        except UserError:
                            size = 0                     # its read raises the same error, at its turn
                        pending.append((names[nxt], size, pool.submit(self.weight, names[nxt])))
                        queued += size
                        nxt += 1
                    name, size, future = pending.popleft()
                    queued -= size
                    w, scale = future.result()
                    yield name, w, scale
            finally:
                for _, _, future in pending:
                    future.cancel()

    def nbytes(self, name: str) -> int:
        """Bytes `weight(name)` reads (its scale included)."""
        _, span, _ = self._locate(name)
        n = span.nbytes
        scale = self.scale_of(name) if span.dtype in ("F8_E4M3", "I8") else None
        if scale is not None:
            n += self._locate(scale)[1].nbytes
        return n

    def close(self) -> None:
        for fd, _ in self._shards.values():
            os.close(fd)
        self._shards.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
