"""Loading a DeepSeek-V3 slice at real widths (hub FP8 layout, shards with an index, the MTP layer): load time against
reading its files once, peak RSS against the tensors the run keeps (the mapped expert blobs included), then decode
tok/s resident and offloaded and whether their tokens agree. Each load runs in a fresh process (its own peak RSS),
with a temporary expert cache that the first one writes. CPU.

    python benchmarks/realwidth_load.py [--dir /tmp/slice] [--layers 3] [--experts 16]
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
path, mode, twin = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if twin:                                   # the PyTorch dequant the compiled kernel replaced
    import dsv3lite.loader as L
    from dsv3lite.quant.fp8 import fp8_block_dequant_ref
    L.fp8_block_dequant = fp8_block_dequant_ref
kw = dict(device="cpu", dtype="bfloat16", ctx_size=256, progress=False, log=lambda m: None)
if mode == "offload":
    kw.update(experts="fp8", gpu_mem=offload_budget(path, 64, "fp8", ctx=256, mtp=False), mtp=False)
else:
    kw.update(experts="fp8", mtp=False)
t0 = time.perf_counter()
llm = dsv3lite.load(path, **kw)
load_s = time.perf_counter() - t0
kept = sum(t.numel() * t.element_size() for t in list(llm.model.parameters()) + list(llm.model.buffers()))
llm.stop_ids = set()
ids = list(range(3, 19))
t0 = time.perf_counter()
toks = [c.token_id for c in llm.generate(ids, max_tokens=16)]
s = llm.stats()
print(json.dumps(dict(load_s=load_s, rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, kept=kept,
                      decode_tok_s=s["decode_tok_s"], tokens=toks)))
"""


def child(path: Path, mode: str, twin: bool, cache: Path) -> dict:
    env = dict(os.environ, DSV3LITE_EXPERT_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode, "1" if twin else "0"], capture_output=True,
                         text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    args = ap.parse_args()
    from dsv3lite.utils import format_bytes

    path = Path(args.dir) if args.dir else None
    if path is None or not (path / "config.json").exists():
        from dsv3lite.testing_realwidth import write_realwidth_checkpoint
        path = path or Path(tempfile.mkdtemp(prefix="dsv3lite-slice-")) / "v3"
        write_realwidth_checkpoint(path, layers=args.layers, dense_layers=1, experts=args.experts, dtype="fp8",
                                   shards=3, mtp=True)
    read_s, nbytes = read_once(path)
    print(f"# {path}: {format_bytes(nbytes)} of safetensors, read once in {read_s:.1f} s "
          f"({nbytes / read_s / 1e9:.2f} GB/s, page cache warm)")
    print("| run | load s | load / read | peak RSS | tensors kept | RSS / (kept + 1 GiB) | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    cache = Path(tempfile.mkdtemp(prefix="dsv3lite-expert-cache-"))
    for name, mode, twin in (("first launch: writes the expert cache", "resident", False),
                             ("resident, fp8 dequant by the PyTorch twin", "resident", True),
                             ("resident, fp8 dequant by the CPU kernel", "resident", False),
                             ("offloaded, 64 slots", "offload", False)):
        r = results[name] = child(path, mode, twin, cache)
        print(f"| {name} | {r['load_s']:.1f} | {r['load_s'] / read_s:.1f}x | {format_bytes(r['rss'])} | "
              f"{format_bytes(r['kept'])} | {r['rss'] / (r['kept'] + 2**30):.2f} | {r['decode_tok_s']:.2f} |")
    toks = [r["tokens"] for r in results.values()]
    print(f"\ntokens identical across the runs: {all(t == toks[0] for t in toks)}")
    import shutil
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
