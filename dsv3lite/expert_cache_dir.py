"""The one-time expert-major cache of an HF checkpoint's routed experts on disk.

Serving an HF directory's experts as packed blobs (`--experts int4`, or offloading) used to quantize or repack all
of them at every launch, into RAM. Instead the first launch writes them once, with `quantize`'s own code and
layout (an experts-only quantized directory: `quant.checkpoint.EXPERTS_ONLY`), under

    $DSV3LITE_EXPERT_CACHE (default: the dsv3lite cache folder's experts/, see utils.cache_root)
        <source hash>-<format>[-g<group>]/   config.json, experts.safetensors, dsv3lite_manifest.json

keyed by the source checkpoint (its config and shard headers) and the format; later launches map it (pages read
on first touch, served from the page cache). `DSV3LITE_EXPERT_CACHE=off` turns it off (quantize at load, in RAM);
`dsv3lite cache` lists the entries and `dsv3lite cache --clear` removes them. A launch interrupted while writing
leaves DIR.partial, which the next launch resumes; a cache is never used half-written.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .utils import cache_root, format_bytes, write_problem

ENV = "DSV3LITE_EXPERT_CACHE"
OFF = ("off", "0", "none", "false")
DISK_MARGIN = 1.02                  # free disk needed: the blobs plus this much (headers, the file system's own)


def cache_location() -> Path | None:
    """Where expert caches live; None when turned off."""
    value = os.environ.get(ENV)
    if value is not None and value.strip().lower() in OFF:
        return None
    return Path(value).expanduser() if value else cache_root() / "experts"


def entry_name(source_hash: str, fmt) -> str:
    digest = source_hash.split(":", 1)[-1][:20]
    return f"{digest}-{fmt.name}" + (f"-g{fmt.group_size}" if fmt.group_size else "")


@dataclass
class Entry:
    path: Path
    format: str
    bytes: int
    source_hash: str


def entries(location: Path | None = None) -> list[Entry]:
    """The complete caches under `location` (default: cache_location())."""
    from .quant.checkpoint import EXPERTS_ONLY, MANIFEST, read_manifest

    location = location or cache_location()
    out = []
    if location is None or not location.is_dir():
        return out
    for d in sorted(location.iterdir()):
        if not (d / MANIFEST).is_file():
            continue
        try:
            m = read_manifest(d)
        except UserError:
            continue
        if m.dense_dtype != EXPERTS_ONLY:
            continue
        out.append(Entry(d, m.format, _size(d), m.source_hash))
    return out


def clear(location: Path | None = None) -> tuple[int, int]:
    """Remove every cache (complete or partial) under `location`; -> (directories removed, bytes freed). Only
    directories this module writes are touched."""
    from .quant.checkpoint import EXPERTS_FILE, MANIFEST, PROGRESS, SIDE_FILES

    location = location or cache_location()
    if location is None or not location.is_dir():
        return 0, 0
    ours = {MANIFEST, PROGRESS, EXPERTS_FILE, "model.safetensors", *SIDE_FILES}
    removed = freed = 0
    for d in sorted(location.iterdir()):
        if d.is_dir() and not d.is_symlink() and all(
                f.is_file() and f.name.removesuffix(".tmp") in ours for f in d.iterdir()):
            freed += _size(d)
            shutil.rmtree(d)
            removed += 1
        elif d.suffix == ".lock" and d.is_file():
            d.unlink()
    return removed, freed


@contextlib.contextmanager
def _locked(path: Path):
    """One writer per cache entry across processes (a second launch waits for the first one's cache)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure(source, log, progress: bool = True):
    """The cached copy of ExpertSource `source` (an HF directory's experts in `source.fmt`): its directory and
    manifest, written now when missing; None when the cache is off, or cannot be written (no room, read-only, the
    disk filling up part way: then the caller quantizes at load, as before), with a line saying so."""
    from .hf_checkpoint import mtp_status
    from .quant.checkpoint import (EXPERTS_ONLY, QuantizeInterrupted, QuantizeWriteFailed, quantize_checkpoint,
                                   read_manifest, source_hash)

    location = cache_location()
    if location is None:
        return None
    index = source.index()
    digest = source_hash(source.root, index)
    path = location / entry_name(digest, source.fmt)
    args, layout = source.args, source.layout
    n_layers = len(args.moe_layer_ids) + (1 if mtp_status(index, args)[0] else 0)
    need = n_layers * args.n_routed_experts * layout.blob_bytes
    problem = write_problem(location)
    if problem:                                           # a read-only cache still serves what it holds
        found = _complete(path, digest, layout, need, source.fmt, log)
        if found is None:
            log(f"expert cache: cannot write under {location}: {problem} ({ENV}=DIR elsewhere): quantizing at "
                f"load instead")
        return found
    with _locked(path.with_name(path.name + ".lock")):
        found = _complete(path, digest, layout, need, source.fmt, log)
        if found is not None:
            return found
        if path.is_dir():
            shutil.rmtree(path)                           # another source or layout under the same key
        partial = path.with_name(path.name + ".partial")
        free = shutil.disk_usage(location).free + (_size(partial) if partial.is_dir() else 0)
        if free < need * DISK_MARGIN:
            log(f"expert cache: {format_bytes(need)} of {source.fmt.label} experts do not fit in the "
                f"{format_bytes(free)} free under {location} ({ENV}=DIR elsewhere): quantizing at load instead")
            return None
        log(f"expert cache: writing {source.fmt.label} experts once to {path} ({format_bytes(need)}; later "
            f"launches map it, `dsv3lite cache --clear` removes it)")
        def write(resume: bool) -> None:
            quantize_checkpoint(source.root, path, experts=source.fmt.name, group_size=source.fmt.group_size,
                                dense=EXPERTS_ONLY, resume=resume, progress=progress, log=log)

        try:
            try:
                write(resume=partial.is_dir())
            except (QuantizeInterrupted, QuantizeWriteFailed):
                raise
            except UserError:
                if not partial.is_dir():
                    raise
                shutil.rmtree(partial)                    # a partial cache that cannot be resumed: start over
                write(resume=False)
        except QuantizeInterrupted:
            raise UserError(f"interrupted while writing the expert cache {path}: the next launch resumes it") \
                from None
        except QuantizeWriteFailed as e:
            log(f"expert cache: {e}; quantizing at load instead (`dsv3lite cache --clear` removes what was written)")
            return None
        return path, read_manifest(path)


def _complete(path: Path, digest: str, layout, need: int, fmt, log):
    """(path, manifest) of the finished cache at `path` for this source and layout (said in one line), or None."""
    from .quant.checkpoint import read_manifest

    if not path.is_dir():
        return None
    manifest = read_manifest(path)
    if manifest.source_hash != digest or manifest.layout != layout:
        return None
    log(f"expert cache: mapping {fmt.label} experts from {path} ({format_bytes(need)})")
    return path, manifest


def _size(d: Path) -> int:
    """Bytes of the files directly in `d`."""
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())
