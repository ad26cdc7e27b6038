"""Loading a DeepSeek-V3 slice at real widths (hub FP8 layout, shards with an index, the MTP layer): load time against
reading its files once, peak RSS against the tensors the run keeps (the mapped expert blobs included), then decode
tok/s resident and offloaded and whether their tokens agree; the anonymous memory held after the load (the
dense weights: the mapped expert blobs are page cache) and, with --cpu-mem, the mapped pages left resident. Each load runs in a fresh process (its own peak RSS),
with a temporary expert cache that the first one writes. CPU.

    python benchmarks/realwidth_load.py [--dir /tmp/slice] [--layers 3] [--experts 16] [--cold]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import sys
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, torch
import dsv3lite
from dsv3lite.testing import offload_budget
path, mode, variant = sys.argv[1], sys.argv[2], sys.argv[3]
if variant == "twin":                      # the PyTorch dequant the compiled kernel replaced
    import dsv3lite.loader as L
    from dsv3lite.quant.fp8 import fp8_block_dequant_ref
    L.fp8_block_dequant = fp8_block_dequant_ref
if variant == "no-read-ahead":             # each tensor read when the loader reaches it
    import dsv3lite.hf_checkpoint as H
    H.READ_AHEAD_BYTES = 0
kw = dict(device="cpu", dtype="bfloat16", ctx_size=256, progress=False, log=lambda m: None)
if mode == "offload":
    kw.update(experts="fp8", gpu_mem=offload_budget(path, 64, "fp8", ctx=256, mtp=False), mtp=False)
else:
    kw.update(experts="fp8", mtp=False)
if variant.startswith("cpu-mem="):
    kw.update(cpu_mem=variant.split("=")[1])

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

t0 = time.perf_counter()
llm = dsv3lite.load(path, **kw)
load_s = time.perf_counter() - t0
anon_after_load = status("RssAnon")
kept = sum(t.numel() * t.element_size() for t in list(llm.model.parameters()) + list(llm.model.buffers()))
llm.stop_ids = set()
ids = list(range(3, 19))
t0 = time.perf_counter()
toks = [c.token_id for c in llm.generate(ids, max_tokens=16)]
s = llm.stats()
print(json.dumps(dict(load_s=load_s, rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, kept=kept,
                      anon=anon_after_load, file_after_decode=status("RssFile"),
                      decode_tok_s=s["decode_tok_s"], tokens=toks)))
"""


def child(path: Path, mode: str, variant: str, cache: Path) -> dict:
    env = dict(os.environ, DSV3LITE_EXPERT_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode, variant], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def evict(*dirs: Path) -> None:
    """Drop the files under `dirs` from the page cache (posix_fadvise DONTNEED: clean pages, no privileges)."""
    for d in dirs:
        for f in Path(d).rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd) if os.access(f, os.W_OK) else None
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def read_once(path: Path) -> tuple[float, int]:
    t0, n = time.perf_counter(), 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while True:
                b = fh.read(64 << 20)
                if not b:
                    break
                n += len(b)
    return time.perf_counter() - t0, n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="an existing slice (default: write one to a temporary folder)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--cpu-mem", default="512M", help="the --cpu-mem of the capped row")
    ap.add_argument("--cold", action="store_true", help="drop the files from the page cache before each read")
    args = ap.parse_args()
    from dsv3lite.utils import format_bytes

    path = Path(args.dir) if args.dir else None
    if path is None or not (path / "config.json").exists():
        from dsv3lite.testing_realwidth import write_realwidth_checkpoint
        path = path or Path(tempfile.mkdtemp(prefix="dsv3lite-slice-")) / "v3"
        write_realwidth_checkpoint(path, layers=args.layers, dense_layers=1, experts=args.experts, dtype="fp8",
                                   shards=3, mtp=True)
    if args.cold:
        evict(path)
    read_s, nbytes = read_once(path)
    print(f"# {path}: {format_bytes(nbytes)} of safetensors, read once in {read_s:.1f} s "
          f"({nbytes / read_s / 1e9:.2f} GB/s, page cache {'cold' if args.cold else 'warm'})")
    print("| run | load s | load / read | peak RSS | tensors kept | RSS / (kept + 1 GiB) | anonymous RSS after load "
          "| mapped RSS after decode | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    results = {}
    cache = Path(tempfile.mkdtemp(prefix="dsv3lite-expert-cache-"))
    for name, mode, variant in (("first launch: writes the expert cache", "resident", ""),
                                ("resident, fp8 dequant by the PyTorch twin", "resident", "twin"),
                                ("resident, reads one tensor at a time", "resident", "no-read-ahead"),
                                ("resident (reads ahead, CPU-kernel dequant)", "resident", ""),
                                (f"resident, --cpu-mem {args.cpu_mem}", "resident", f"cpu-mem={args.cpu_mem}"),
                                ("offloaded, 64 slots", "offload", "")):
        if args.cold:
            evict(path, cache)            # every load reads the checkpoint and the expert cache from the disk
        r = results[name] = child(path, mode, variant, cache)
        print(f"| {name} | {r['load_s']:.1f} | {r['load_s'] / read_s:.1f}x | {format_bytes(r['rss'])} | "
              f"{format_bytes(r['kept'])} | {r['rss'] / (r['kept'] + 2**30):.2f} | {format_bytes(r['anon'])} | "
              f"{format_bytes(r['file_after_decode'])} | {r['decode_tok_s']:.2f} |", flush=True)
    toks = [r["tokens"] for r in results.values()]
    print(f"\ntokens identical across the runs: {all(t == toks[0] for t in toks)}")
    import shutil
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
