"""Replay routing traces against expert-cache policies: LRU, LFU, decayed-LFU (the default), the default
with router-predicted prefetch, and Belady's MIN (the offline optimum), at cache sizes of 10-50% of all
routed experts. Every expert load counts: demand misses plus prefetches, wasted ones included (prefetching
columns also show the demand misses among them: the loads a step waits for). With --mtp the MTP layer is traced
too, and the next-token sources (the next token's first MoE layers predicted from the last main layer or from the
MTP layer) get columns and recall rows of their own.

With --v4 DIR: DeepSeek-V4's routing geometry (43 layers, 256 experts, top-6, 3 hash layers; the checkpoint is
written at DIR when absent, random weights), traced on text the demo model writes (its token frequencies are
those of the Shakespeare it was trained on) fed one token a step; and a synthetic trace beside it: the same
text's hash-layer experts, learned layers drawn from a Zipf popularity. Per layer kind (hash: experts known from
the token id; learned: router-predicted), loads and demand misses per token with and without the exact
prefetch of the hash layers, a token-frequency prior for them, and Belady's MIN (v4_main).

    python benchmarks/cache_sim.py                          # traces the bundled demo model first
    python benchmarks/cache_sim.py --trace t.jsonl [--trace u.jsonl ...]
    python benchmarks/cache_sim.py --v4 /tmp/v4-geometry --tokens 256 --sizes 10,25
    dsv3lite trace -p "ROMEO:" -m 300 -o t.jsonl            # how a trace is made by hand
"""
from __future__ import annotations

import argparse
import json
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
                         "moe_layers": [m.layer_id for m in llm.model.moe_modules()], "lookahead": lookahead,
                         "token_layers": sorted(llm.model.token_route_tables())})
        rec.detach()
        paths.append(path)
    return paths


def predictor_recall(trace, layers=None) -> dict[int, float]:
    """distance or next-token source -> recall of the router predictions (of `layers` only, when given)."""
    hit, total = {}, {}
    actual = {}
    for step, keys in trace.accesses:
        if keys:
            actual[(step, keys[0][0])] = {e for _, e in keys}
    for (step, layer), by_d in trace.predictions.items():
        act = actual.get((step, layer)) if layers is None or layer in layers else None
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
    ap.add_argument("--layer-ms", type=float, help="device time of one MoE layer (copy-queue model; default 0.35, "
                    "V4: 0.5, a 4090-class card's share of V4-Flash's bf16 dense reads at 60%% of its bandwidth)")
    ap.add_argument("--copy-ms", type=float,
                    help="one expert over PCIe (copy-queue model; default 0.47, a DeepSeek-V3 int4 expert at 50 GB/s; "
                         "V4: 0.27, a V4-Flash MXFP4 expert at 50 GB/s)")
    ap.add_argument("--v4", metavar="DIR", help="DeepSeek-V4 geometry tables (the checkpoint written at DIR if absent)")
    ap.add_argument("--slots", default="", help="V4: slot counts to simulate besides --sizes (e.g. a plan's)")
    ap.add_argument("--keep", metavar="DIR", help="V4: keep the texts and engine traces in DIR, reused when there")
    ap.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the synthetic V4 trace's learned layers")
    ap.add_argument("--noise", type=float, default=0.25,
                    help="share of each router prediction that is wrong in the synthetic V4 trace")
    args = ap.parse_args()
    if args.v4:
        return v4_main(args)

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
        copy_queue_table(traces, meta, total_experts, sizes, (args.layer_ms or 0.35) / 1e3,
                         (args.copy_ms or 0.47) / 1e3)
    recall = {}
    for t in traces:
        for d, r in predictor_recall(t).items():
            recall.setdefault(d, []).append(r)
    print()
    print("| lookahead (layers) or next-token source | predictor recall |")
    print("|---|---|")
    for d, rs in sorted(recall.items(), key=lambda kv: distance_order(kv[0])):
        print(f"| {d} | {sum(rs) / len(rs):.1%} |")


# --- DeepSeek-V4: hash layers (experts known from the token id) beside learned ones ------------------------------

def demo_text(count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` token sequences the demo model writes (prompt plus `tokens` sampled at 0.8, never stopped): text
    with the token frequencies of its training corpus, in the vocabulary the V4-geometry checkpoint shares."""
    import dsv3lite

    llm = dsv3lite.load(None, device="cpu", mtp=False, progress=False, log=lambda m: None)
    llm.stop_ids = set()
    out = []
    for i in range(count):
        prompt = PROMPTS[i % len(PROMPTS)]
        llm.reset()
        ids = llm.tokenizer.encode(prompt)
        out.append(ids + [c.token_id for c in llm.generate(prompt, max_tokens=tokens, temperature=0.8,
                                                            seed=seed + i)])
    return out


def load_token_tables(path: Path) -> dict:
    """The hash layers' tid2eid tables of the V4 checkpoint at `path` (layer -> int64 [vocab, top_k])."""
    import torch
    from safetensors import safe_open

    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    tables = {}
    for name, shard in index.items():
        if name.endswith(".ffn.gate.tid2eid"):
            with safe_open(path / shard, "pt") as f:
                tables[int(name.split(".")[1])] = f.get_tensor(name).to(torch.int64)
    return dict(sorted(tables.items()))


def v4_engine_traces(path: Path, texts: list[list[int]], prompt: int, lookahead: int, paths: list[Path]):
    """Route `texts` through the V4 checkpoint at `path`, the first `prompt` tokens as one prefill and the rest
    one token a step (the text's tokens, not sampled ones: its random weights would write noise), a trace written
    to each of `paths` -> the hash layers' tid2eid tables."""
    import torch

    from dsv3lite.offload.trace import TraceRecorder
    from dsv3lite.testing_v4 import load_v4

    model = load_v4(path, released_experts=True, mtp=False)
    a = model.args
    tables = {l: t.to(torch.int64) for l, t in model.token_route_tables().items()}
    meta = {"weights": str(path), "n_experts": a.n_routed_experts, "top_k": a.num_experts_per_tok,
            "moe_layers": [m.layer_id for m in model.moe_modules()], "lookahead": lookahead,
            "token_layers": sorted(tables), "text": "the demo model's, one token a step"}
    with torch.inference_mode():
        for ids, out in zip(texts, paths):
            rec = TraceRecorder(model, lookahead)
            cache = model.new_cache(len(ids) + 8, torch.float32, torch.device("cpu"))
            model.hidden(torch.tensor([ids[:prompt]]), 0, cache)
            rec.phase = "decode"
            for pos in range(prompt, len(ids)):
                model.hidden(torch.tensor([ids[pos:pos + 1]]), pos, cache)
            rec.write(out, meta)
            rec.detach()
    return tables


def zipf_v4_trace(texts: list[list[int]], prompt: int, tables, meta: dict, skew: float, noise: float,
                  seed: int):
    """Synthetic decode traces at the same geometry: the hash layers' experts from the texts' tokens through the
    checkpoint's tid2eid (exact), each learned layer top-k of a Zipf(skew) popularity over a random permutation
    of its experts (Gumbel top-k, independent per token), router predictions 1..lookahead layers ahead keeping each
    true expert with probability 1 - noise and filled up with random ones."""
    import numpy as np

    from dsv3lite.offload.trace import Trace

    rng = np.random.default_rng(seed)
    n, k, d_max = meta["n_experts"], meta["top_k"], meta["lookahead"]
    learned = [l for l in meta["moe_layers"] if l not in tables]
    logp = -skew * np.log(np.arange(1, n + 1))
    perms = {l: rng.permutation(n) for l in learned}
    out = []
    for ids in texts:
        accesses, predictions = [], {}
        for step, tok in enumerate(ids[prompt:]):
            for l in meta["moe_layers"]:
                if l in tables:
                    used = sorted(set(tables[l][tok].tolist()))
                else:
                    used = sorted(perms[l][np.argpartition(-(logp + rng.gumbel(size=n)), k)[:k]].tolist())
                    for d in range(1, d_max + 1):
                        if l - d in meta["moe_layers"]:
                            keep = [e for e in used if rng.random() >= noise]
                            fill = rng.choice(n, k - len(keep), replace=False).tolist()
                            predictions.setdefault((step, l), {})[d] = set(keep) | set(fill)
                accesses.append((step, [(l, e) for e in used]))
        out.append(Trace(dict(meta, text="synthetic: Zipf learned layers"), accesses, predictions))
    return out


def token_prior(tables, texts: list[list[int]], n_experts: int, vocab: int, weight: float) -> dict:
    """(hash layer, expert) -> `weight` x its expected uses per token under the unigram frequencies of `texts`
    (add-one smoothed): a hash layer's expert popularity is the frequency of the tokens that map to it."""
    import torch

    freq = torch.bincount(torch.tensor([t for ids in texts for t in ids]), minlength=vocab).double() + 1
    freq /= freq.sum()
    prior = {}
    for layer, table in tables.items():
        uses = torch.zeros(n_experts, dtype=torch.float64).index_add_(
            0, table.flatten(), freq.repeat_interleave(table.shape[1]))
        prior.update({(layer, e): weight * u for e, u in enumerate(uses.tolist()) if u > 0})
    return prior


def hash_first_out(token_layers):
    """Decayed-LFU whose hash-layer keys go first (they can always be prefetched exactly): their layers' group
    biases lowered far below every other's."""
    from dsv3lite.offload.policy import DecayedLFU

    class HashFirstOut(DecayedLFU):
        name = "decayed-lfu, hash keys first out"

        def __init__(self):
            super().__init__()
            self._shifted: dict[int, tuple] = {}      # id of the base row -> (that row, the shifted row)

        def biases(self, n_groups):
            row = super().biases(n_groups)
            kept = self._shifted.get(id(row))
            if kept is None or kept[0] is not row:    # the same tuple object while the base row is the same
                kept = self._shifted[id(row)] = (row, tuple(b - 1e6 if g in token_layers else b
                                                            for g, b in enumerate(row)))
            return kept[1]
    return HashFirstOut()


def v4_rows(traces, meta, slots: int, prior: dict, token_layers, steps: int, timing) -> list[list[str]]:
    """One table row per configuration at `slots` slots: per token, loads (demand misses) of the hash layers, of
    the learned ones, and in all; the hit rate (uses served from a slot); the stall per token of the copy-queue
    model `timing` (every miss fetched, one copy engine, the runtime's PREFETCH_BATCH)."""
    from dsv3lite.offload.trace import simulate

    layers = meta["moe_layers"]
    learned = [l for l in layers if l not in token_layers]
    pct = 100 * slots / (len(layers) * meta["n_experts"])
    configs = [
        ("decayed-LFU, no prefetch", dict(policy="decayed-lfu")),
        ("+ router prefetch@2 (learned layers)", dict(policy="decayed-lfu", prefetch_distance=2)),
        ("exact hash prefetch alone", dict(policy="decayed-lfu", token_layers=token_layers)),
        ("router prefetch@2 + exact hash prefetch (the runtime)", dict(policy="decayed-lfu", prefetch_distance=2,
                                                                      token_layers=token_layers)),
        ("+ token-frequency prior on hash keys", dict(policy="decayed-lfu", prefetch_distance=2,
                                                      token_layers=token_layers, prior=prior)),
        ("+ the prior at a quarter weight", dict(policy="decayed-lfu", prefetch_distance=2, token_layers=token_layers,
                                                 prior={k: v / 4 for k, v in prior.items()})),
        ("+ hash keys first out", dict(policy=None, prefetch_distance=2, token_layers=token_layers)),
        ("Belady's MIN (demand paging)", dict(policy="belady")),
    ]
    rows = []
    for label, kw in configs:
        results = [simulate(t, slots, kw["policy"] or hash_first_out(set(token_layers)),
                            **{k: v for k, v in kw.items() if k != "policy"}) for t in traces]

        def cell(which) -> str:
            _, demand, pre = (sum(r.layers_sum(which)[i] for r in results) for i in range(3))
            return f"{(demand + pre) / steps:.1f} ({demand / steps:.2f})"
        uses = sum(r.uses for r in results)
        demand = sum(r.demand_loads for r in results)
        stall = "-"
        if kw["policy"] != "belady":
            timed = [simulate(t, slots, kw["policy"] or hash_first_out(set(token_layers)), timing=timing,
                              **{k: v for k, v in kw.items() if k != "policy"}) for t in traces]
            stall = f"{sum(r.stall_s for r in timed) / steps * 1e3:.1f}"
        rows.append([f"{pct:.0f}%", str(slots), label, cell(token_layers), cell(learned), cell(layers),
                     f"{1 - demand / uses:.1%}", stall])
    return rows


def v4_main(args) -> None:
    """The --v4 tables: the checkpoint, texts and engine traces made (or reused from --keep), the synthetic trace
    and the prior built, then per trace the router recall and one table of v4_rows per cache size."""
    from dsv3lite.offload.runtime import PREFETCH_BATCH
    from dsv3lite.offload.trace import CopyTiming, read_trace
    from dsv3lite.testing_v4 import v4_geometry_config, write_v4_official

    path = Path(args.v4)
    if not (path / "config.json").is_file():
        print(f"# writing the V4-geometry checkpoint to {path}", file=sys.stderr)
        write_v4_official(path, v4_geometry_config())
    prompt, count = 16, len(PROMPTS)
    keep = Path(args.keep or tempfile.mkdtemp(prefix="dsv3lite-v4traces-"))
    keep.mkdir(parents=True, exist_ok=True)
    saved = keep / f"texts-{args.tokens}.json"
    if saved.is_file():
        texts, reference = json.loads(saved.read_text())
    else:
        print(f"# the demo model writes {count} texts of {args.tokens} tokens (and {count} more for the prior)",
              file=sys.stderr)
        texts = demo_text(count, args.tokens, seed=0)
        reference = demo_text(count, args.tokens, seed=100)           # the prior's token counts: other text
        saved.write_text(json.dumps([texts, reference]))
    paths = [keep / f"v4trace-{args.tokens}-{i}.jsonl" for i in range(count)]
    if all(p.is_file() for p in paths):
        tables = load_token_tables(path)
    else:
        print(f"# routing them through {path}", file=sys.stderr)
        tables = v4_engine_traces(path, texts, prompt, args.lookahead, paths)
    engine = [read_trace(p) for p in paths]
    meta = engine[0].meta
    token_layers = meta["token_layers"]
    synthetic = zipf_v4_trace(texts, prompt, tables, meta, args.skew, args.noise, seed=0)
    vocab = max(t.shape[0] for t in tables.values())
    prior = token_prior(tables, reference, meta["n_experts"], vocab, weight=1.0)
    learned = [l for l in meta["moe_layers"] if l not in token_layers]
    timing = CopyTiming((args.layer_ms or 0.5) / 1e3, (args.copy_ms or 0.27) / 1e3, PREFETCH_BATCH)
    print(f"# copy queue: {timing.layer_s * 1e3:.2f} ms per MoE layer, {timing.copy_s * 1e3:.2f} ms per expert copy, "
          f"{PREFETCH_BATCH} prefetches on the engine at a time")
    n_keys = len(meta["moe_layers"]) * meta["n_experts"]
    sizes = [round(n_keys * int(s) / 100) for s in args.sizes.split(",") if s] + \
        [int(s) for s in args.slots.split(",") if s]
    print(f"# DeepSeek-V4 geometry: {len(meta['moe_layers'])} MoE layers x {meta['n_experts']} experts "
          f"(top-{meta['top_k']}), hash layers {token_layers}; {count} texts x {len(texts[0]) - prompt} decode steps")
    for name, traces in (("engine (random weights)", engine),
                         (f"synthetic (Zipf {args.skew}, {args.noise:.0%} of predictions wrong)", synthetic)):
        steps = sum(len({s for s, _ in t.accesses}) for t in traces)
        recall = {}
        for t in traces:
            for d, r in predictor_recall(t, set(learned)).items():
                recall.setdefault(d, []).append(r)
        cells = ", ".join(f"{d} ahead {sum(rs) / len(rs):.1%}" for d, rs in recall.items() if d in (1, 2))
        print()
        print(f"## {name}: router recall (learned layers) {cells}; hash layers: exact (the token's tid2eid row)")
        print("| cache | slots | configuration | hash layers: loads/token (demand) | learned: loads/token (demand) "
              "| all: loads/token (demand) | hit rate | stall ms/token |")
        print("|---|---|---|---|---|---|---|---|")
        for slots in sizes:
            for row in v4_rows(traces, meta, slots, prior, token_layers, steps, timing):
                print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
