"""Bytes moved to the device tier by one long prompt's prefill, layer-major (the engine's order) against chunk-major
(PREFILL_CHUNK tokens through every layer, then the next chunk), on the DeepSeek-V3-geometry checkpoint (61 layers,
58 MoE layers x 256 experts, top-8; tiny widths) offloaded with 11% of its experts in slots, CPU simulated tier.
Copies are counted by the runtime; bytes are given for the checkpoint's own blobs and for DeepSeek-V3's int4 experts
(the same number of copies at V3's real blob size).

    python benchmarks/prefill_bytes.py [--tokens 4096] [--slots-pct 11]
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def run(path: Path, tokens: int, slots_pct: float, layer_major: bool) -> dict:
    import dsv3lite
    from dsv3lite import generate
    from dsv3lite.config import ModelArgs
    from dsv3lite.limits import LAYER_MAJOR_TOKENS, PREFILL_CHUNK
    from dsv3lite.testing import offload_budget

    a = ModelArgs.from_dir(path)
    total = len(a.moe_layer_ids) * a.n_routed_experts
    slots = round(total * slots_pct / 100)
    ctx = tokens + 16
    generate.LAYER_MAJOR_TOKENS = LAYER_MAJOR_TOKENS if layer_major else PREFILL_CHUNK
    llm = dsv3lite.load(path, device="cpu", experts="bf16", ctx_size=ctx, mtp=False, progress=False,
                        gpu_mem=offload_budget(path, slots, "bf16", ctx=ctx, mtp=False), miss_policy="fetch",
                        log=lambda m: None)
    rt = llm.offload
    seen = {}
    end_prefill = rt.end_prefill

    def counted():
        seen["copies"] = rt.cache.counts.h2d_copies
        seen["distinct"] = len(rt.prefill_counts)
        end_prefill()

    rt.end_prefill = counted
    ids = torch.randint(3, a.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.perf_counter()
    list(llm.generate(ids, max_tokens=1))                 # the prefill, and one token
    generate.LAYER_MAJOR_TOKENS = LAYER_MAJOR_TOKENS
    return dict(copies=seen["copies"], distinct=seen["distinct"], blob=rt.layout.blob_bytes, slots=slots,
                seconds=time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--slots-pct", type=float, default=11)
    args = ap.parse_args()

    from dsv3lite.quant.formats import get_format
    from dsv3lite.testing import write_geometry_checkpoint
    from dsv3lite.utils import format_bytes

    v3_int4 = get_format("int4").layout(2048, 7168).blob_bytes
    with tempfile.TemporaryDirectory() as tmp:
        path = write_geometry_checkpoint(Path(tmp) / "geometry", max_position_embeddings=args.tokens + 64)
        print(f"# {args.tokens}-token prompt, V3 geometry, {args.slots_pct:g}% of experts in slots")
        print("| order | expert copies | distinct experts used | copies / distinct | bytes (this checkpoint) | "
              "bytes at V3 int4 | prefill s (CPU) |")
        print("|---|---|---|---|---|---|---|")
        for name, layer_major in (("chunk-major (before)", False), ("layer-major (now)", True)):
            r = run(path, args.tokens, args.slots_pct, layer_major)
            print(f"| {name} | {r['copies']} | {r['distinct']} | {r['copies'] / r['distinct']:.2f} | "
                  f"{format_bytes(r['copies'] * r['blob'])} | {format_bytes(r['copies'] * v3_int4)} | "
                  f"{r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
