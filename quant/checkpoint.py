"""`dsv3lite quantize`: an HF checkpoint -> a directory with every routed expert as one packed blob, and
the runtime's side of such a directory (manifest, zero-copy blob maps, quantize-at-load).

Output directory (DST):
  config.json, tokenizer files   copied verbatim
  model.safetensors              every tensor but the routed experts, under its HF name: routers fp32, the rest
                                 bf16; with --dense fp8 an FP8 source's FP8 weights and weight_scale_inv as they are
  experts.safetensors            per MoE layer (the MTP layer too when present) one uint8 tensor
                                 model.layers.{i}.mlp.experts.blobs [n_routed_experts, blob_bytes], row e = expert e
  dsv3lite_manifest.json         format, group size, blob layout, dense dtype, MoE layers, source hash, versions

Both safetensors headers are known before any weight is read, so the files are sized up front and filled in place,
one tensor or one expert at a time: memory stays near a few experts whatever the model size. Experts are read and
quantized on worker threads (one per CPU thread, or on a GPU) while the main thread writes them in order. Work happens in
DST.partial/ (progress.json there records the finished layers) and is renamed to DST only when complete.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import json
import os
import re
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..config import ModelArgs
from ..errors import UserError
from ..family import family_of
from ..hf_checkpoint import (CheckpointIndex, TensorReader, blob_name, check_fp8_scale, expert_names, is_scale_name,
                             scale_names)
from ..utils import checkpoint_dir, format_bytes, resolve_device, terminal_bar_fits, write_problem
from .compressed_tensors import packed_entry_bytes, read_packed
from .formats import format_for_layout, get_format
from .fp8 import fp8_block_dequant
from .int4g32 import int4g32_dequant
from .layout import MATRICES, BlobLayout, ExpertFormat
from .mxfp4 import mxfp4_dequant
from .tensorfile import DTYPES, TensorFileWriter, entry_nbytes, read_header, tensor_spans

MANIFEST = "dsv3lite_manifest.json"
MANIFEST_VERSION = 1
DENSE_FILE = "model.safetensors"
EXPERTS_FILE = "experts.safetensors"
PROGRESS = "progress.json"          # inside DST.partial/ only
EXPERTS_ONLY = "none"               # the dense dtype of a directory holding only the routed experts (an expert cache)
SIDE_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json", "special_tokens_map.json", "tiktoken.model")
SOURCE_FLOAT_DTYPES = ("BF16", "F16", "F32", "F8_E4M3")
# test hook: stop (sleep) once this many MoE layers are finished, so a test can interrupt at a known point
PAUSE_ENV = "DSV3LITE_TEST_PAUSE_AFTER_LAYERS"


class QuantizeInterrupted(UserError):
    """Ctrl-C during quantize: DST.partial/ is consistent and `--resume` continues it."""


class QuantizeWriteFailed(UserError):
    """The output's disk filled up or failed part way: DST.partial/ is consistent up to its last finished layer and
    `--resume` continues it once there is room."""


def _natural_key(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


# ---- packing experts from the source (read one tensor at a time by hf_checkpoint.TensorReader) ----------------

def read_expert(reader: TensorReader, layer_id: int, expert: int, layout: BlobLayout, reuse: bool = False,
                names=expert_names):
    """(weight, scale) of gate, up and down of one routed expert, shapes checked: a float weight and None, an FP8
    weight and its scale_inv, compressed-tensors' int4 words (int32) and bf16 scales (Kimi-K2-Thinking / K2.5), or
    MXFP4 codes and their scales (DeepSeek-V4). reuse: read into this thread's scratch buffers (valid until its
    next read_expert with reuse); names(layer, expert): the checkpoint's names (its family's)."""
    out = []
    for name, m in zip(names(layer_id, expert), MATRICES):
        shape, scratch = layout.matrix_shape(m), ("expert", m) if reuse else None
        out.append(read_packed(reader, name, shape, scratch) or reader.weight(name, shape, scratch=scratch))
    return out


# the expert encodings a checkpoint may store, by the dtype of the weights read: the expert format that keeps them
# as they are (a repack), and their exact decoding to bf16 for any other format
RELEASED_ENCODINGS = {
    torch.int32: ("int4g32", lambda w, s: int4g32_dequant(w, s, w.shape[1] * 8, torch.bfloat16)),  # compressed-tensors
    torch.int8: ("mxfp4", lambda w, s: mxfp4_dequant(w, s, torch.bfloat16)),                        # MXFP4 (V4)
}


def pack_weights(weights, fmt: ExpertFormat, layout: BlobLayout, out: torch.Tensor | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """One expert's `read_expert` weights as a blob of `fmt` (on the CPU, in `out` if given). FP8 source + fp8
    format, or a released encoding + the format that stores it (compressed-tensors int4 + int4g32, MXFP4 codes +
    mxfp4): bytes and scales copied verbatim; otherwise FP8 weights are dequantized the project's one way
    (bf16(fp32(w) * s)), released encodings exactly, and then quantized, the arithmetic on `device` (default: the
    CPU)."""
    encodings = [RELEASED_ENCODINGS.get(w.dtype) for w, _ in weights]
    if encodings[0] is not None and all(e is encodings[0] for e in encodings) and fmt.name == encodings[0][0]:
        (gw, gs), (uw, us), (dw, ds) = weights
        return fmt.pack_prequantized(gw, gs, uw, us, dw, ds, out=out)
    weights = [(e[1](w, s), None) if e is not None else (w, s) for e, (w, s) in zip(encodings, weights)]
    if fmt.fp8_passthrough and all(s is not None for _, s in weights):
        (gw, gs), (uw, us), (dw, ds) = weights
        return fmt.pack_prequantized(gw, gs, uw, us, dw, ds, out=out)
    on_device = device is not None and device.type != "cpu"
    if on_device:
        weights = [(w.to(device), None if s is None else s.to(device)) for w, s in weights]
    if hasattr(fmt, "pack_fp8") and all(s is not None for _, s in weights):
        blob = fmt.pack_fp8(weights, out=None if on_device else out)    # dequantized inside, chunk by chunk
    else:
        dense = [w if s is None else fp8_block_dequant(w, s, torch.bfloat16) for w, s in weights]
        blob = fmt.pack(*dense, out=None if on_device else out)
    if not on_device:
        return blob
    return blob.cpu() if out is None else out.copy_(blob)


def pack_expert(reader: TensorReader, layer_id: int, expert: int, fmt: ExpertFormat, layout: BlobLayout,
                out: torch.Tensor | None = None, device: torch.device | None = None,
                names=expert_names) -> torch.Tensor:
    """One expert of the source as a blob of `fmt` (see pack_weights; names: read_expert's)."""
    return pack_weights(read_expert(reader, layer_id, expert, layout, names=names), fmt, layout, out, device)


def pack_experts(reader: TensorReader, jobs, fmt: ExpertFormat, layout: BlobLayout, device: torch.device | None = None,
                 workers: int = 1, outs=None, names=expert_names):
    """Yield ((layer, expert), blob) for each of `jobs` [(layer, expert), ...] in order. With workers > 1, that
    many experts are read and quantized at once in threads (torch ops and pread release the GIL) while the caller
    writes the blobs already yielded; `outs(layer, expert)` gives the tensor to fill, else each blob is new.
    Every blob is what pack_expert gives: the threads change the order of work, never its arithmetic. names:
    read_expert's."""
    out_for = outs or (lambda layer, e: None)
    if workers <= 1:
        for layer, e in jobs:
            yield (layer, e), pack_expert(reader, layer, e, fmt, layout, out_for(layer, e), device, names)
        return
    read_lock = threading.Lock()               # one reader at a time: TensorReader opens shards lazily

    def job(layer, e):
        with read_lock:               # into the worker's own buffers: the expert is packed before its next read
            weights = read_expert(reader, layer, e, layout, reuse=True, names=names)
        return pack_weights(weights, fmt, layout, out_for(layer, e), device)

    todo, pending = iter(jobs), collections.deque()
    pool = ThreadPoolExecutor(workers, thread_name_prefix="quantize")
    try:
        # finished blobs wait for the writer while the workers go on (a layer's fsync does not stall them)
        for j in itertools.islice(todo, 2 * workers + 1):
            pending.append((j, pool.submit(job, *j)))
        while pending:
            j, future = pending.popleft()
            blob = future.result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(job, *nxt)))
            yield j, blob
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def default_workers(device: torch.device) -> int:
    """Experts in flight: one per torch CPU thread on the CPU; two on a GPU (one reads while one computes)."""
    return torch.get_num_threads() if device.type == "cpu" else 2


@contextlib.contextmanager
def _one_torch_thread_each(workers: int, device: torch.device):
    """Workers on the CPU each run their ops on one thread (their own core) rather than all sharing torch's pool."""
    threads = torch.get_num_threads()
    if workers > 1 and device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _check_layout(fmt: ExpertFormat, layout: BlobLayout, args: ModelArgs) -> None:
    if fmt.layout(args.moe_intermediate_size, args.hidden_size) != layout:
        raise ValueError(f"layout {layout.format}/{layout.group_size} ({layout.inter}x{layout.hidden}) is not what "
                         f"{fmt!r} builds for this model")


def quantize_layer_from_hf(root_or_index, args: ModelArgs, layer_id: int, fmt: ExpertFormat,
                           layout: BlobLayout) -> torch.Tensor:
    """All routed experts of `layer_id` from an HF checkpoint, quantized at load (released MXFP4 experts into mxfp4:
    repacked): uint8 [E, blob_bytes] in RAM. The same per-expert code as `quantize`, so the bytes equal that layer's
    rows of experts.safetensors."""
    index = root_or_index if isinstance(root_or_index, CheckpointIndex) else CheckpointIndex.open(Path(root_or_index))
    _check_layout(fmt, layout, args)
    blobs = torch.empty(args.n_routed_experts, layout.blob_bytes, dtype=torch.uint8)
    with TensorReader(index) as reader:
        for _ in pack_experts(reader, [(layer_id, e) for e in range(args.n_routed_experts)], fmt, layout,
                              outs=lambda layer, e: blobs[e], names=family_of(args).expert_names(args, index)):
            pass
    return blobs


# ---- the manifest and reading a quantized directory -----------------------------------------------------------

@dataclass
class Manifest:
    format: str                     # bf16 | fp8 | int4 | nf4
    group_size: int | None
    layout: BlobLayout
    dense_dtype: str                # bf16 | fp8
    moe_layers: list[int]           # layer ids with blobs in experts.safetensors (MTP layer included)
    n_experts: int
    source_hash: str                # sha256 over the source's config.json and safetensors headers
    dsv3lite_version: str
    manifest_version: int = MANIFEST_VERSION
    experts_file: str = EXPERTS_FILE

    def to_json(self) -> dict:
        return {"manifest_version": self.manifest_version, "dsv3lite_version": self.dsv3lite_version,
                "format": self.format, "group_size": self.group_size, "dense_dtype": self.dense_dtype,
                "n_experts": self.n_experts, "moe_layers": list(self.moe_layers), "experts_file": self.experts_file,
                "source_hash": self.source_hash, "layout": self.layout.to_json()}

    @classmethod
    def from_json(cls, d: dict) -> "Manifest":
        layout = BlobLayout.from_json(d["layout"])
        m = cls(format=str(d["format"]), group_size=None if d["group_size"] is None else int(d["group_size"]),
                layout=layout, dense_dtype=str(d["dense_dtype"]), moe_layers=[int(i) for i in d["moe_layers"]],
                n_experts=int(d["n_experts"]), source_hash=str(d["source_hash"]),
                dsv3lite_version=str(d["dsv3lite_version"]), manifest_version=int(d["manifest_version"]),
                experts_file=str(d.get("experts_file", EXPERTS_FILE)))
        if Path(m.experts_file).name != m.experts_file:
            raise ValueError(f"experts_file must be a file name inside the directory, got {m.experts_file!r}")
        if m.format != layout.format or m.group_size != layout.group_size:
            raise ValueError(f"format {m.format}/{m.group_size} disagrees with its layout "
                             f"{layout.format}/{layout.group_size}")
        return m

    def expert_format(self) -> ExpertFormat:
        return format_for_layout(self.layout)


def is_quantized_dir(root) -> bool:
    """True for a directory written by `dsv3lite quantize` (or what is left of one: blobs without a manifest)."""
    root = Path(root)
    return (root / MANIFEST).exists() or (root / EXPERTS_FILE).exists()


def read_manifest(root) -> Manifest:
    """The manifest of a quantized directory, checked against its config.json; UserError (one line) when it is
    missing, damaged or from an incompatible version."""
    root = Path(root)
    path = root / MANIFEST
    if not path.exists():
        raise UserError(f"{root} has no {MANIFEST}: not a complete dsv3lite-quantized directory "
                        f"(quantize it again)")
    try:
        d = json.loads(path.read_text())
        version = d["manifest_version"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"corrupt {path}: {type(e).__name__}: {e} (quantize it again)") from None
    if version != MANIFEST_VERSION:
        newer = isinstance(version, int) and version > MANIFEST_VERSION
        raise UserError(f"{path} has manifest version {version!r}; this dsv3lite reads version {MANIFEST_VERSION}"
                        + (": upgrade dsv3lite or quantize again" if newer else ": quantize again"))
    try:
        m = Manifest.from_json(d)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"corrupt {path}: {type(e).__name__}: {e} (quantize it again)") from None
    args = ModelArgs.from_dir(root)
    if (m.layout.inter, m.layout.hidden, m.n_experts) != (args.moe_intermediate_size, args.hidden_size,
                                                          args.n_routed_experts):
        raise UserError(f"{path} describes {m.n_experts} experts of {m.layout.inter}x{m.layout.hidden}, but "
                        f"config.json has {args.n_routed_experts} of {args.moe_intermediate_size}x{args.hidden_size}")
    return m


def open_layer_blobs(root, manifest: Manifest, layer_id: int) -> torch.Tensor:
    """Layer `layer_id`'s blobs as uint8 [n_experts, blob_bytes], mapped from experts.safetensors (no copy:
    pages are read on first touch; copy-on-write, so the file is never modified)."""
    path = Path(root) / manifest.experts_file
    if not path.exists():
        raise UserError(f"{path} is missing: the quantized directory is incomplete (quantize it again)")
    span = tensor_spans(path).get(blob_name(layer_id))
    if span is None:
        raise UserError(f"{path} has no blobs for layer {layer_id} (it has layers {manifest.moe_layers})")
    if span.dtype != "U8" or span.shape != (manifest.n_experts, manifest.layout.blob_bytes):
        raise UserError(f"{blob_name(layer_id)} in {path} is {span.dtype} {list(span.shape)}, expected U8 "
                        f"[{manifest.n_experts}, {manifest.layout.blob_bytes}] from the manifest")
    arr = np.memmap(path, dtype=np.uint8, mode="c", offset=span.start, shape=span.shape)
    return torch.from_numpy(arr)


# ---- planning: everything is decided (and every input checked) before anything is written ---------------------

@dataclass
class DenseEntry:
    name: str                   # output name = source name
    dtype: str                  # output safetensors dtype
    shape: tuple[int, ...]
    copy: bool                  # bytes copied as they are (FP8 weights and scales with --dense fp8)


@dataclass
class QuantizePlan:
    src: Path
    dst: Path
    args: ModelArgs
    index: CheckpointIndex
    fmt: ExpertFormat
    layout: BlobLayout
    dense: str
    moe_layers: list[int]
    dense_entries: list[DenseEntry]
    source_hash: str
    expert_src_bytes: int       # source bytes read per expert (for GB/s)
    notes: list[str] = field(default_factory=list)

    @property
    def layers_label(self) -> str:
        """"5 MoE layers + the MTP layer", as `info` counts them."""
        main = sum(1 for i in self.moe_layers if i != self.args.mtp_layer_id)
        return f"{main} MoE layer{'s' if main != 1 else ''}" + (
            " + the MTP layer" if self.args.mtp_layer_id in self.moe_layers else "")

    @property
    def verb(self) -> str:
        """"repacking" where the source stores its experts in the output's format already, else "quantizing"."""
        return "repacking" if self.args.released_experts == self.fmt.name else "quantizing"

    @property
    def partial(self) -> Path:
        dst = Path(os.path.abspath(self.dst))
        return dst.parent / (dst.name + ".partial")

    def options(self) -> dict:
        return {"experts": self.fmt.name, "group_size": self.fmt.group_size, "dense": self.dense,
                "clip_search": getattr(self.fmt, "clip_search", None) is not False}

    def dense_file_entries(self):
        return [(e.name, e.dtype, e.shape) for e in self.dense_entries]

    def experts_file_entries(self):
        return [(blob_name(i), "U8", (self.args.n_routed_experts, self.layout.blob_bytes)) for i in self.moe_layers]

    def experts_metadata(self) -> dict:
        return {"dsv3lite": "expert-blobs", "format": self.fmt.name, "blob_bytes": str(self.layout.blob_bytes)}

    def manifest(self) -> Manifest:
        from ..version import __version__

        return Manifest(self.fmt.name, self.fmt.group_size, self.layout, self.dense, list(self.moe_layers),
                        self.args.n_routed_experts, self.source_hash, __version__)


def _check_paths(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s:
        raise UserError("DST must differ from SRC")
    if s in d.parents:
        raise UserError(f"DST {dst} is inside SRC {src}: choose a directory outside the source checkpoint")
    if d in s.parents:
        raise UserError(f"SRC {src} is inside DST {dst}: choose another DST")


def plan_quantize(src, dst, experts: str = "int4", group_size: int = 128, dense: str = "bf16",
                  fast: bool = False) -> QuantizePlan:
    """Check every input and work out both output headers; reads only config.json and safetensors headers.
    `fast`: int4 without its clipping search (plain min/max ranges per group)."""
    src, dst = checkpoint_dir(src, "source checkpoint"), Path(dst).expanduser()
    if is_quantized_dir(src):
        raise UserError(f"{src} is already dsv3lite-quantized: quantize reads HF checkpoints")
    if not Path(os.path.abspath(dst)).name:
        raise UserError(f"DST must name a directory to create, got {dst}")
    _check_paths(src, dst)
    if dense not in ("bf16", "fp8", EXPERTS_ONLY):
        raise UserError(f"unknown dense dtype {dense!r}: use bf16 or fp8")
    fmt = get_format(experts, group_size)
    fmt.check_available()                        # fail now, not after the dense weights are written
    if fast and hasattr(fmt, "clip_search"):
        fmt.clip_search = False
    args = ModelArgs.from_dir(src)
    index = CheckpointIndex.open(src)
    layout = fmt.layout(args.moe_intermediate_size, args.hidden_size)

    digest = source_hash(src, index)
    meta = index.headers()                  # under the names the model reads (e.g. Kimi-K2.5's prefix removed)

    family = family_of(args)
    with_mtp, notice = family.mtp_status(index, args)
    moe_layers = args.moe_layer_ids + ([args.mtp_layer_id] if with_mtp else [])
    expert_bytes = _check_experts(meta, layout, moe_layers, args.n_routed_experts, family.expert_names(args, index))
    entries = _dense_entries(meta, args, dense)
    if dense == "fp8" and not any(e.dtype == "F8_E4M3" for e in entries):
        raise UserError(f"--dense fp8 keeps an FP8 checkpoint's FP8 weights, but {src} has none "
                        f"(it is not an FP8 checkpoint): use --dense bf16")
    notes = [f"note: {src} has no MTP layer, so the output has none"] if notice else []
    if args.released_experts and fmt.name != args.released_experts:
        notes.append(f"note: {src} stores its routed experts as {args.released_experts}, as released; --experts "
                     f"{fmt.name} dequantizes them and quantizes them again (--experts {args.released_experts} keeps "
                     f"them bit for bit)")
    if fast and not hasattr(fmt, "clip_search"):
        notes.append(f"note: --fast skips int4's clipping search; {fmt.name} has none, so it changes nothing")
    return QuantizePlan(src, dst, args, index, fmt, layout, dense, moe_layers, entries, digest, expert_bytes, notes)


def source_hash(src: Path, index: CheckpointIndex) -> str:
    """"sha256:..." over an HF checkpoint's config.json and its shards' names, sizes and headers (no weights read):
    what a quantized directory or an expert cache was made from."""
    digest = hashlib.sha256((Path(src) / "config.json").read_bytes())
    for shard in index.shards():
        digest.update(f"\0{shard.name}\0{shard.stat().st_size}\0".encode())
        digest.update(json.dumps(read_header(shard), sort_keys=True).encode())
    return "sha256:" + digest.hexdigest()


def _check_experts(meta: dict, layout: BlobLayout, moe_layers: list[int], n_experts: int, names) -> int:
    """Every routed expert tensor present with the config's shape (names(layer, expert): its family's checkpoint
    names): float, FP8 with its scale, or MXFP4 codes with theirs; returns the source bytes of one expert."""
    per_expert = None
    for layer in moe_layers:
        for e in range(n_experts):
            nbytes = 0
            for name, m in zip(names(layer, e), MATRICES):
                shape = layout.matrix_shape(m)
                packed = packed_entry_bytes(meta, name, shape) if name not in meta else None
                if packed is not None:                          # compressed-tensors int4 (Kimi's released experts)
                    nbytes += packed
                    continue
                v = meta.get(name)
                if v is None:
                    raise UserError(f"checkpoint is missing tensor {name}")
                stored = (shape[0], shape[1] // 2) if v["dtype"] == "I8" else shape    # MXFP4: two codes a byte
                if tuple(v["shape"]) != stored:
                    raise UserError(f"tensor {name} has shape {tuple(v['shape'])}, expected {stored} from config.json")
                if v["dtype"] not in SOURCE_FLOAT_DTYPES + ("I8",):
                    raise UserError(f"tensor {name} has dtype {v['dtype']}; expected one of "
                                    f"{', '.join(SOURCE_FLOAT_DTYPES)} or MXFP4 (I8 with a scale)")
                nbytes += entry_nbytes(v["dtype"], v["shape"])
                if v["dtype"] in ("F8_E4M3", "I8"):
                    scale = next((n for n in scale_names(name) if n in meta), None)
                    if scale is None:
                        raise UserError(f"{v['dtype']} tensor {name} has no {' or '.join(scale_names(name))}")
                    if v["dtype"] == "F8_E4M3":
                        check_fp8_scale(name, v["shape"], meta[scale]["shape"], scale)
                    nbytes += entry_nbytes(meta[scale]["dtype"], meta[scale]["shape"])
            per_expert = nbytes if per_expert is None else per_expert
    return per_expert or 0


def _dense_entries(meta: dict, args: ModelArgs, dense: str) -> list[DenseEntry]:
    """The output's non-expert tensors, under their source names, in the dtype the family keeps each in (bf16,
    fp32, integer tables as int32; with --dense fp8 an FP8 weight's bytes and scale as they are)."""
    out = []
    if dense == EXPERTS_ONLY:
        return out
    family = family_of(args)
    for name in sorted(meta, key=_natural_key):
        if is_scale_name(name):
            continue
        target = family.map_name(name, args)
        if target is None or target.expert is not None:
            continue                              # routed experts, MTP copies of embed/head, unused tensors
        v = meta[name]
        shape = tuple(v["shape"])
        if dense == "fp8" and v["dtype"] == "F8_E4M3":
            out.append(DenseEntry(name, "F8_E4M3", shape, copy=True))
            scale = next((n for n in scale_names(name) if n in meta), None)
            if scale is None:
                raise UserError(f"FP8 tensor {name} has no {' or '.join(scale_names(name))}")
            out.append(DenseEntry(scale, meta[scale]["dtype"], tuple(meta[scale]["shape"]), copy=True))
        else:
            out.append(DenseEntry(name, family.stored_dtype(name, target.name), shape, copy=False))
    return out


# ---- the quantize command -------------------------------------------------------------------------------------

def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr)


def quantize_checkpoint(src, dst, experts: str = "int4", group_size: int = 128, dense: str = "bf16",
                        force: bool = False, resume: bool = False, progress: bool = True, log=None,
                        fast: bool = False, device="auto", workers: int | None = None) -> Path:
    """Write HF checkpoint `src` to `dst` with routed experts as expert-major blobs (see the module docstring).

    Refuses an existing DST unless `force` (and never removes a directory it did not write); `resume` continues
    DST.partial/ after its last finished layer. Ctrl-C raises QuantizeInterrupted (a UserError) with one line.
    `fast`: int4 without the clipping search. `device`: where the quantization arithmetic runs (auto: CUDA when
    available); a GPU gives the CPU's blobs, up to int4 groups whose two best ranges tie to float32 rounding
    (its error sums add in another order). `workers`: experts quantized at once (default: one per
    torch CPU thread, two on a GPU); the blobs are the same for any number.
    """
    log = log or _stderr
    t_start = time.perf_counter()
    dev = resolve_device(device)
    workers = default_workers(dev) if workers is None else workers
    if workers < 1:
        raise UserError(f"workers must be at least 1, got {workers}")
    plan = plan_quantize(src, dst, experts, group_size, dense, fast)
    try:
        state = _prepare_dirs(plan, force, resume, log)
    except OSError as e:
        raise QuantizeWriteFailed(f"cannot write {e.filename or plan.partial}: {e.strerror or e}") from None
    for note in plan.notes:
        log(note)
    n_layers, n_experts = len(plan.moe_layers), plan.args.n_routed_experts
    try:
        for name in SIDE_FILES:
            if (plan.src / name).is_file():
                shutil.copyfile(plan.src / name, plan.partial / name)
        with TensorReader(plan.index) as reader:
            if not state["dense_done"] and plan.dense_entries:
                _write_dense(plan, reader, progress)
                state["dense_done"] = True
                _save_progress(plan.partial, state)
            _write_experts(plan, reader, state, progress, log, dev, workers)
        _atomic_write(plan.partial / MANIFEST, json.dumps(plan.manifest().to_json(), indent=2) + "\n")
        _finish(plan)
    except KeyboardInterrupt:
        done = len(state["layers_done"])
        raise QuantizeInterrupted(f"interrupted with {done} of {n_layers} MoE layers done in {plan.partial}: "
                                  f"run the same command with --resume to continue") from None
    except OSError as e:                  # the disk filled up or went read-only part way (reads raise UserError)
        done = len(state["layers_done"])
        raise QuantizeWriteFailed(f"cannot write {e.filename or plan.partial}: {e.strerror or e}, with {done} of "
                                  f"{n_layers} MoE layers done: make room and run the same command with --resume") \
            from None
    dense_bytes = sum(entry_nbytes(e.dtype, e.shape) for e in plan.dense_entries)
    log(f"wrote {plan.dst}: {plan.layers_label} x {n_experts} experts as {plan.fmt.label} "
        f"({format_bytes(n_layers * n_experts * plan.layout.blob_bytes)}), dense {plan.dense} "
        f"({format_bytes(dense_bytes)}), in {time.perf_counter() - t_start:.1f}s")
    return plan.dst


def _only_ours(path: Path) -> bool:
    """A real directory holding nothing but files quantize writes (so --force may remove it)."""
    ours = {MANIFEST, PROGRESS, DENSE_FILE, EXPERTS_FILE, *SIDE_FILES}
    return (path.is_dir() and not path.is_symlink()
            and all(p.is_file() and p.name.removesuffix(".tmp") in ours for p in path.iterdir()))


def _prepare_dirs(plan: QuantizePlan, force: bool, resume: bool, log) -> dict:
    """Checks DST and DST.partial; returns the progress state (fresh, or the one being resumed)."""
    dst, partial = plan.dst, plan.partial
    if dst.exists() or dst.is_symlink():
        if not force:
            raise UserError(f"{dst} already exists: pass --force to replace it")
        if not _only_ours(dst):
            raise UserError(f"{dst} exists and is not a dsv3lite-quantized directory: not replacing it "
                            f"(remove it yourself or choose another DST)")
    if resume:
        if not partial.is_dir():
            raise UserError(f"nothing to resume: {partial} does not exist (run without --resume)")
        state = _load_progress(partial)
        if state.get("source_hash") != plan.source_hash:
            raise UserError(f"cannot resume {partial}: the source checkpoint changed since it was started; "
                            f"start over with --force")
        if state.get("options") != plan.options():
            o = state.get("options") or {}
            fast = " --fast" if o.get("clip_search") is False else ""
            raise UserError(f"cannot resume {partial}: it was started with --experts {o.get('experts')} "
                            f"(group {o.get('group_size')}) --dense {o.get('dense')}{fast}; rerun with those or "
                            f"start over with --force")
        if plan.dense_entries:                       # (an expert cache has none: no dense file)
            TensorFileWriter.reopen(partial / DENSE_FILE, plan.dense_file_entries(), {"format": "pt"}).close()
        TensorFileWriter.reopen(partial / EXPERTS_FILE, plan.experts_file_entries(), plan.experts_metadata()).close()
        log(f"resuming {partial}: {len(state['layers_done'])} of {len(plan.moe_layers)} MoE layers done"
            + ("" if state["dense_done"] else ", dense weights to write"))
        return state
    if partial.exists() or partial.is_symlink():
        if not force:
            raise UserError(f"{partial} holds an interrupted run: add --resume to continue it or --force to "
                            f"start over")
        if not _only_ours(partial):
            raise UserError(f"{partial} is not a dsv3lite work directory: not removing it")
        shutil.rmtree(partial)
    dense_bytes = sum(entry_nbytes(e.dtype, e.shape) for e in plan.dense_entries)
    expert_bytes = len(plan.moe_layers) * plan.args.n_routed_experts * plan.layout.blob_bytes
    parent = partial.parent
    problem = write_problem(parent)
    if problem:
        raise UserError(f"cannot write in {parent}: {problem}")
    free = shutil.disk_usage(parent).free
    if dense_bytes + expert_bytes > free:
        raise UserError(f"not enough disk space in {parent}: the output needs "
                        f"{format_bytes(dense_bytes + expert_bytes)}, {format_bytes(free)} is free")
    partial.mkdir()
    if plan.dense_entries:
        TensorFileWriter.create(partial / DENSE_FILE, plan.dense_file_entries(), {"format": "pt"}).close()
    TensorFileWriter.create(partial / EXPERTS_FILE, plan.experts_file_entries(), plan.experts_metadata()).close()
    state = {"version": 1, "source_hash": plan.source_hash, "options": plan.options(), "dense_done": False,
             "layers_done": []}
    _save_progress(partial, state)
    log(f"{plan.verb} {plan.src} -> {plan.dst}: {plan.layers_label} x {plan.args.n_routed_experts} "
        f"experts as {plan.fmt.label} ({format_bytes(plan.layout.blob_bytes)} "
        f"per expert), dense {plan.dense}")
    return state


def _write_dense(plan: QuantizePlan, reader: TensorReader, progress: bool) -> None:
    from tqdm import tqdm

    total = sum(entry_nbytes(e.dtype, e.shape) for e in plan.dense_entries)
    with TensorFileWriter.reopen(plan.partial / DENSE_FILE, plan.dense_file_entries(), {"format": "pt"}) as out, \
            tqdm(total=total, desc="dense weights", unit="B", unit_scale=True, file=sys.stderr,
                 disable=not progress or None, leave=False) as bar:
        for e in plan.dense_entries:
            if e.copy:
                t = reader.get(e.name)
            else:
                w, s = reader.weight(e.name, e.shape)
                t = (w if s is None else fp8_block_dequant(w, s, torch.bfloat16)).to(DTYPES[e.dtype])
            out.write(e.name, t)
            bar.update(entry_nbytes(e.dtype, e.shape))
            del t
        out.sync()


def format_duration(seconds: float) -> str:
    """"45 s", "12 min", "3 h 05 min"."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 90 else f"{minutes // 60} h {minutes % 60:02d} min"


class Eta:
    """Seconds left of `total` items, at the rate measured after the first `warm` of them: their time holds one-off
    costs (the first reads from a cold disk, thread and kernel start-up) that made a first ETA 4-15x too long."""

    def __init__(self, total: int, warm: int, clock=time.perf_counter):
        self.total, self.warm, self.clock = total, min(warm, total), clock
        self.t0 = clock()
        self.mark: tuple[float, int] | None = None        # (clock, done) when the warm-up ended
        self.per_item = 0.0

    def update(self, done: int) -> float:
        """The ETA once `done` items are finished; `per_item` holds the seconds per item it assumes."""
        now = self.clock()
        if self.mark is None and done >= self.warm:
            self.mark = (now, done)
        if self.mark is None or done == self.mark[1]:
            self.per_item = (now - self.t0) / max(done, 1)
        else:
            self.per_item = (now - self.mark[0]) / (done - self.mark[1])
        return (self.total - done) * self.per_item

    def first(self, done: int) -> bool:
        """Whether `done` items are the point to state the ETA up front (as many again past the warm-up)."""
        return done == min(self.total, 2 * self.warm)


def _write_experts(plan: QuantizePlan, reader: TensorReader, state: dict, progress: bool, log,
                   device: torch.device, workers: int) -> None:
    from tqdm import tqdm

    n_experts = plan.args.n_routed_experts
    todo = [i for i in plan.moe_layers if i not in state["layers_done"]]
    total = len(todo) * n_experts
    bar_fits = terminal_bar_fits()
    pause_after = int(os.environ.get(PAUSE_ENV) or -1)
    jobs = [(layer, e) for layer in todo for e in range(n_experts)]
    where = f"{workers} worker{'s' if workers != 1 else ''} on {device.type}"
    t0, done, done_bytes = time.perf_counter(), 0, 0
    eta_clock = Eta(total, max(workers, 2))
    with TensorFileWriter.reopen(plan.partial / EXPERTS_FILE, plan.experts_file_entries(),
                                 plan.experts_metadata()) as out, \
            tqdm(total=len(plan.moe_layers) * n_experts, initial=len(state["layers_done"]) * n_experts,
                 desc=f"{plan.fmt.name} experts", unit="expert", file=sys.stderr, dynamic_ncols=True,
                 disable=not (progress and bar_fits)) as bar, \
            _one_torch_thread_each(workers, device):
        say = bar.write if progress and bar_fits else log
        names = family_of(plan.args).expert_names(plan.args, plan.index)
        for (layer, e), blob in pack_experts(reader, jobs, plan.fmt, plan.layout, device, workers, names=names):
            out.write_row(blob_name(layer), e, blob)
            done, done_bytes = done + 1, done_bytes + plan.expert_src_bytes
            elapsed = time.perf_counter() - t0
            eta = eta_clock.update(done)
            if eta_clock.first(done):             # the first experts timed: the ETA up front
                say(f"{plan.fmt.label} experts: {eta_clock.per_item:.2f} s per expert ({where}), {total} to pack: "
                    f"ETA {format_duration(eta)}")
            bar.set_postfix_str(f"layer {layer}, {format_bytes(done_bytes / elapsed)}/s, "
                                f"ETA {format_duration(eta)}", refresh=False)
            bar.update(1)
            if e < n_experts - 1:
                continue
            out.sync()                            # the layer is on disk before progress.json says so
            state["layers_done"].append(layer)
            _save_progress(plan.partial, state)
            if progress and not bar_fits:          # no bar in a log file or a zero-width terminal: one line per layer
                k = len(state["layers_done"])
                log(f"layer {layer} done ({k}/{len(plan.moe_layers)}), {format_bytes(done_bytes / elapsed)}/s, "
                    f"ETA {format_duration(eta)}")
            if len(state["layers_done"]) == pause_after:
                log(f"{PAUSE_ENV}: paused after {pause_after} layer(s)")
                time.sleep(3600)


def _finish(plan: QuantizePlan) -> None:
    """DST.partial -> DST (an existing DST that --force replaces goes only now, once the new one is complete)."""
    if plan.dst.exists():
        shutil.rmtree(plan.dst)
    os.replace(plan.partial, plan.dst)
    (plan.dst / PROGRESS).unlink(missing_ok=True)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _save_progress(partial: Path, state: dict) -> None:
    _atomic_write(partial / PROGRESS, json.dumps(state, indent=1) + "\n")


def _load_progress(partial: Path) -> dict:
    path = partial / PROGRESS
    try:
        state = json.loads(path.read_text())
        if not (isinstance(state.get("layers_done"), list) and isinstance(state.get("dense_done"), bool)):
            raise ValueError("unexpected content")
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(f"cannot resume: {path} is missing or damaged ({e}); start over with --force") from None
    return state
