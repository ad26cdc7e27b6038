"""CUDA graphs of the decode step against the eager step, at DeepSeek-V3's routing geometry.

A checkpoint with V3's depth and routing (61 layers, first 3 dense, 256 experts, top-8 in 4 of 8 groups) at tiny
widths (`dsv3lite.testing.write_geometry_checkpoint`), so the step is all host time: each engine decodes the same
greedy tokens with its decode graphs (dsv3lite/graphs.py) and with them set aside (the eager step), in alternating
rounds, resident (bf16 expert blobs through the fused kernel: one graph a step) and offloaded at 25% of the
experts (one graph per MoE layer, the runtime between them). Reports tok/s, host ms per token and per layer, the
graphs per step, whether the tokens match, and why graphs turned off if they did.

    python benchmarks/gpu_graphs.py RESULTS_DIR [--tokens 64] [--rounds 3]
    python benchmarks/gpu_graphs.py RESULTS_DIR --device cpu      # logic check here (stand-in capture)
Writes RESULTS_DIR/graphs.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

PROMPT = list(range(5, 21))


def engines(path: Path, device: str, ctx: int, log) -> dict:
    import dsv3lite
    from dsv3lite.offload.setup import CUDA_RESERVE_BYTES
    from dsv3lite.testing import offload_budget

    kw = dict(device=device, ctx_size=ctx, experts="bf16", progress=False, log=log, mtp=False)
    out = {"resident": dsv3lite.load(path, **kw)}
    total = 58 * 256
    slots = total // 4
    budget = offload_budget(path, slots, "bf16", ctx=ctx, mtp=False)
    if device == "cuda":
        budget += CUDA_RESERVE_BYTES
    offloaded = dsv3lite.load(path, gpu_mem=budget, **kw)
    n_slots = offloaded.offload.cache.n_slots if offloaded.offload is not None else total
    out[f"offloaded ({n_slots} slots, {n_slots / total:.0%} of the experts)"] = offloaded
    for llm in out.values():
        llm.stop_ids = set()
        if device != "cuda":                    # the logic check: the stand-in capture
            from dsv3lite.graphs import DecodeGraphs, eager_capture
            llm.graphs = DecodeGraphs(llm.model, log=log, capture=eager_capture)
    return out


def decode(llm, n: int) -> tuple[list[int], float]:
    llm.reset()
    tokens = [c.token_id for c in llm.generate(PROMPT, max_tokens=n)]
    return tokens, llm.stats()["decode_tok_s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_graphs.py: no CUDA device (use --device cpu for a logic check)")
    from dsv3lite.testing import write_geometry_checkpoint

    a.out.mkdir(parents=True, exist_ok=True)
    logs: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_geometry_checkpoint(Path(tmp) / "geometry")
        engs = engines(path, a.device, 256, logs.append)
        rows = []
        for name, llm in engs.items():
            runner = llm.graphs
            if runner is None:
                rows.append((name, None, None, "graphs not built (DSV3LITE_GRAPHS=0, or no Triton)", None))
                continue
            decode(llm, 4)                      # warm-up: compiles, captures, the second-step check
            speeds = {"eager": [], "graphs": []}
            tokens = {}
            for _ in range(a.rounds):
                for mode in ("eager", "graphs"):
                    llm.graphs = runner if mode == "graphs" else None
                    tokens[mode], tok_s = decode(llm, a.tokens)
                    speeds[mode].append(tok_s)
            llm.graphs = runner
            eager, graphed = (statistics.median(speeds[m]) for m in ("eager", "graphs"))
            stats = runner.stats()
            rows.append((name, eager, graphed, stats["off"] or "", tokens["eager"] == tokens["graphs"],
                         stats["graphs_per_step"]))
            print(f"{name}: eager {eager:.1f} tok/s, graphs {graphed:.1f} tok/s, {stats}", flush=True)
    lines = [f"# Decode step: CUDA graphs vs eager ({a.device}, V3 routing geometry, tiny widths, bf16 experts, "
             f"{a.tokens} tokens x {a.rounds} alternating rounds, medians)", "",
             "| engine | eager tok/s | graphs tok/s | speedup | host ms / token (eager -> graphs) | ms / layer "
             "(graphs) | graphs per step | tokens equal | graphs off because |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, eager, graphed, off, equal, *per_step in rows:
        if eager is None:
            lines.append(f"| {name} |  |  |  |  |  |  |  | {off} |")
            continue
        lines.append(f"| {name} | {eager:.1f} | {graphed:.1f} | {graphed / eager:.2f}x | {1e3 / eager:.2f} -> "
                     f"{1e3 / graphed:.2f} | {1e3 / graphed / 61:.3f} | {per_step[0]} | {equal} | {off} |")
    about = [m for m in logs if "graph" in m.lower()]
    if about:
        lines += ["", "Engine log lines about graphs:", ""] + [f"- {m}" for m in about]
    (a.out / "graphs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
