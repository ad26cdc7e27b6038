"""Replay routing traces against expert-cache policies: LRU, LFU, decayed-LFU (the default), the default
with router-predicted prefetch, and Belady's MIN (the offline optimum), at cache sizes of 10-50% of all
routed experts. Every expert load counts: demand misses plus prefetches, wasted ones included (prefetching
columns also show the demand misses among them: the loads a step waits for). With --mtp the MTP layer is traced
too, and the next-token sources (the next token's first MoE layers predicted from the last main layer or from the
MTP layer) get columns and recall rows of their own.

    python benchmarks/cache_sim.py                          # traces the bundled demo model first
    python benchmarks/cache_sim.py --trace t.jsonl [--trace u.jsonl ...]
    dsv3lite trace -p "ROMEO:" -m 300 -o t.jsonl            # how a trace is made by hand
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROMPTS = [
    "ROMEO:\nBut soft, what light through yonder window breaks?",
    "KING HENRY:\nOnce more unto the breach, dear friends, once more;",
    "Good morrow, my lord. What news from the court?",
    "HAMLET:\nTo be, or not to be, that is the question:",
]


def make_traces(weights, tokens: int, lookahead: int, out_dir: Path, mtp: bool = False) -> list[Path]:
    import dsv3lite
    from dsv3lite.offload.trace import TraceRecorder

    llm = dsv3lite.load(weights, device="cpu", mtp=mtp, mtp_adaptive=False, progress=False, log=lambda m: None)
    paths = []
    for i, prompt in enumerate(PROMPTS):
        rec = TraceRecorder(llm.model, lookahead)
        llm.reset()
        for j, _ in enumerate(llm.generate(prompt, max_tokens=tokens, temperature=0.8, seed=i)):
            if j == 0:
                rec.phase = "decode"
        a = llm.args
        path = out_dir / f"trace{i}.jsonl"
        rec.write(path, {"weights": llm.weights, "n_experts": a.n_routed_experts, "top_k": a.num_experts_per_tok,
                         "moe_layers": [m.layer_id for m in llm.model.moe_modules()], "lookahead": lookahead})
        rec.detach()
        paths.append(path)
    return paths


def predictor_recall(trace) -> dict[int, float]:
    hit, total = {}, {}
    actual = {}
    for step, keys in trace.accesses:
        if keys:
            actual[(step, keys[0][0])] = {e for _, e in keys}
    for (step, layer), by_d in trace.predictions.items():
        act = actual.get((step, layer))
        if not act:
            continue
        for d, pred in by_d.items():
            hit[d] = hit.get(d, 0) + len(pred & act)
            total[d] = total.get(d, 0) + len(act)
    return {d: hit[d] / total[d] for d in total}


def copy_queue_table(traces, meta, total_experts, sizes, layer_s, copy_s, batches=(1, 2, 4, 8)) -> None:
    """Stall per token (ms) under decayed-LFU with prefetch two layers ahead, one copy engine in issue order."""
    from dsv3lite.offload.trace import CopyTiming, simulate

    steps = sum(len({s for s, _ in t.accesses}) for t in traces)
    print()
    print(f"# copy queue: {layer_s * 1e3:.2f} ms per MoE layer, {copy_s * 1e3:.2f} ms per expert copy; stall per "
          f"token in ms (demand misses per token)")
    head = ["cache", "slots", "no prefetch", "all at once, ahead of demand"] + [f"batch {b}, behind demand"
                                                                              for b in batches]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for pct in sizes:
        slots = max(meta["top_k"], round(total_experts * pct / 100))
        cells = []
        for d, batch in [(0, None), (2, None)] + [(2, b) for b in batches]:
            rs = [simulate(t, slots, "decayed-lfu", prefetch_distance=d, timing=CopyTiming(layer_s, copy_s, batch))
                  for t in traces]
            cells.append(f"{sum(r.stall_s for r in rs) / steps * 1e3:.1f} ({sum(r.demand_loads for r in rs) / steps:.1f})")
        print("| " + " | ".join([f"{pct}%", str(slots)] + cells) + " |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", help="trace file(s) from `dsv3lite trace` (default: make them)")
    ap.add_argument("--weights", default=None, help="model to trace when no --trace is given (default: demo)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens generated per prompt when tracing")
    ap.add_argument("--sizes", default="10,20,25,30,40,50", help="cache sizes, percent of all routed experts")
    ap.add_argument("--lookahead", type=int, default=3)
    ap.add_argument("--mtp", action="store_true", help="trace with MTP drafting (the MTP layer's experts too)")
    ap.add_argument("--copy-queue", action="store_true",
                    help="also model one copy engine in time: stall per token with prefetches queued all at once "
                         "ahead of demand copies vs in batches behind them")
    ap.add_argument("--layer-ms", type=float, default=0.35, help="device time of one MoE layer (copy-queue model)")
    ap.add_argument("--copy-ms", type=float, default=0.47,
                    help="one expert over PCIe (copy-queue model; default: a DeepSeek-V3 int4 expert at 50 GB/s)")
    args = ap.parse_args()

    from dsv3lite.offload.predictor import NEXT_TOKEN_SOURCES, distance_order
    from dsv3lite.offload.trace import read_trace, simulate

    if args.trace:
        paths = [Path(p) for p in args.trace]
    else:
        tmp = Path(tempfile.mkdtemp(prefix="dsv3lite-traces-"))
        print(f"# tracing {args.weights or 'the demo model'}: {len(PROMPTS)} prompts x {args.tokens} tokens",
              file=sys.stderr)
        paths = make_traces(args.weights, args.tokens, args.lookahead, tmp, args.mtp)
    traces = [read_trace(p) for p in paths]
    meta = traces[0].meta
    total_experts = len(meta["moe_layers"]) * meta["n_experts"]
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = ["lru", "lfu", "decayed-lfu"]
    prefetch = [1, 2]
    uses = sum(sum(len(k) for _, k in t.accesses) for t in traces)
    print(f"# {len(traces)} traces, {uses} expert uses over {len(meta['moe_layers'])} MoE layers x "
          f"{meta['n_experts']} experts (top-{meta['top_k']}); loads summed over traces")
    sources = [s for s in NEXT_TOKEN_SOURCES if any(s in by for t in traces for by in t.predictions.values())]
    head = ["cache", "slots"] + policies + [f"decayed-lfu+prefetch@{d}" for d in prefetch] + \
        [f"prefetch@2+{s}" for s in sources] + ["belady (MIN)", "default / MIN"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for pct in sizes:
        slots = max(meta["top_k"], round(total_experts * pct / 100))
        loads = {}
        for p in policies:
            loads[p] = sum(simulate(t, slots, p).loads for t in traces)
        def with_demand(results) -> str:                 # all loads (the demand misses among them)
            results = list(results)
            return f"{sum(r.loads for r in results)} ({sum(r.demand_loads for r in results)})"

        for d in prefetch:
            loads[f"pf{d}"] = with_demand(simulate(t, slots, "decayed-lfu", prefetch_distance=d) for t in traces)
        for src in sources:
            loads[src] = with_demand(simulate(t, slots, "decayed-lfu", prefetch_distance=2, next_token=src)
                                     for t in traces)
        loads["belady"] = sum(simulate(t, slots, "belady").loads for t in traces)
        row = [f"{pct}%", str(slots)] + [str(loads[p]) for p in policies] + [str(loads[f"pf{d}"]) for d in prefetch]
        row += [str(loads[src]) for src in sources]
        row += [str(loads["belady"]), f"{loads['decayed-lfu'] / max(loads['belady'], 1):.2f}x"]
        print("| " + " | ".join(row) + " |")
    if args.copy_queue:
        copy_queue_table(traces, meta, total_experts, sizes, args.layer_ms / 1e3, args.copy_ms / 1e3)
    recall = {}
    for t in traces:
        for d, r in predictor_recall(t).items():
            recall.setdefault(d, []).append(r)
    print()
    print("| lookahead (layers) or next-token source | predictor recall |")
    print("|---|---|")
    for d, rs in sorted(recall.items(), key=lambda kv: distance_order(kv[0])):
        print(f"| {d} | {sum(rs) / len(rs):.1%} |")


if __name__ == "__main__":
    main()
