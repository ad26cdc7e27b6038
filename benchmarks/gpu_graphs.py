"""CUDA graphs of the decode step against the eager step, at DeepSeek-V3's and DeepSeek-V4-Flash's routing geometry.

Checkpoints with the models' depth and routing at tiny widths, so the step is all host time: V3 (61 layers, first 3
dense, 256 experts, top-8 in 4 of 8 groups; `dsv3lite.testing.write_geometry_checkpoint`, bf16 expert blobs) and
V4-Flash (43 layers, 256 MXFP4 experts as released, top-6, 3 hash layers, its compress ratios;
`dsv3lite.testing_v4.v4_geometry_config`). Each engine decodes the same greedy tokens with its decode graphs
(dsv3lite/executors/graphs.py) and with them set aside (the eager step), in alternating rounds, resident (the fused
kernel inside the graphs: one graph a step) and offloaded at 25% of the experts (one graph per MoE layer, the
runtime between them). Reports tok/s, host ms per token and per layer,
the graphs per step, whether the tokens match, and why graphs turned off if they did.

    python benchmarks/gpu_graphs.py RESULTS_DIR [--tokens 64] [--rounds 3] [--models v3,v4]
    python benchmarks/gpu_graphs.py RESULTS_DIR --device cpu      # logic check here (stand-in capture)
    python benchmarks/gpu_graphs.py RESULTS_DIR --dry-run         # arguments and imports only
Writes RESULTS_DIR/graphs.md, rewritten after each engine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import traceback
from pathlib import Path

import torch

PROMPT = list(range(5, 21))


# model -> (layers, routed experts in all, --experts (None: as released))
MODELS = {"v3": (61, 58 * 256, "bf16"), "v4": (43, 43 * 256, None)}


def write_checkpoint(model: str, root: Path) -> Path:
    if model == "v3":
        from dsv3lite.testing import write_geometry_checkpoint
        return write_geometry_checkpoint(root / "v3-geometry")
    from dsv3lite.testing_v4 import v4_geometry_config, write_v4_official
    return write_v4_official(root / "v4-geometry", v4_geometry_config())


def engine_builders(model: str, path: Path, device: str, ctx: int, log) -> list:
    """(name, build) for the resident and the offloaded engine; built one at a time, so one that fails to load
    still leaves the other measured."""
    import dsv3lite
    from dsv3lite.offload.setup import CUDA_RESERVE_BYTES
    from dsv3lite.testing import offload_budget

    _, total, experts = MODELS[model]
    kw = dict(device=device, ctx_size=ctx, progress=False, log=log, mtp=False)
    if experts is not None:
        kw["experts"] = experts
    budget = offload_budget(path, total // 4, experts, ctx=ctx, mtp=False)
    if device == "cuda":
        budget += CUDA_RESERVE_BYTES

    def prepared(llm):
        llm.stop_ids = set()
        if device != "cuda":                    # the logic check: the stand-in capture
            from dsv3lite.executors.graphs import DecodeGraphs, eager_capture
            llm.graphs = DecodeGraphs(llm.model, log=log, capture=eager_capture)
        return llm
    name = {"v3": "DeepSeek-V3", "v4": "DeepSeek-V4-Flash"}[model]
    return [(f"{name}, resident", lambda: prepared(dsv3lite.load(path, **kw))),
            (f"{name}, offloaded, 25% of the experts in slots",
             lambda: prepared(dsv3lite.load(path, gpu_mem=budget, **kw)))]


def decode(llm, n: int) -> tuple[list[int], float]:
    llm.reset()
    tokens = [c.token_id for c in llm.generate(PROMPT, max_tokens=n)]
    return tokens, llm.stats()["decode_tok_s"]


def measure(llm, tokens: int, rounds: int) -> dict:
    runner = llm.graphs
    if runner is None:
        return {"off": "graphs not built (--no-cuda-graphs, DSV3LITE_GRAPHS=0, or no Triton)"}
    decode(llm, 4)                              # warm-up: compiles, captures, the second-step check
    speeds = {"eager": [], "graphs": []}
    out = {}
    for _ in range(rounds):
        for mode in ("eager", "graphs"):
            llm.graphs = runner if mode == "graphs" else None
            out[mode], tok_s = decode(llm, tokens)
            speeds[mode].append(tok_s)
    llm.graphs = runner
    stats = runner.stats()
    slots = llm.offload.cache.n_slots if llm.offload is not None else None
    return {"eager": statistics.median(speeds["eager"]), "graphs": statistics.median(speeds["graphs"]),
            "equal": out["eager"] == out["graphs"], "per_step": stats["graphs_per_step"], "off": stats["off"] or "",
            "slots": slots, "layers": len(llm.model.layers)}


def table(rows: list, a) -> str:
    lines = [f"# Decode step: CUDA graphs vs eager ({a.device}, routing geometry at tiny widths: V3 with bf16 "
             f"experts, V4-Flash with MXFP4; {a.tokens} tokens x {a.rounds} alternating rounds, medians)", "",
             "| engine | eager tok/s | graphs tok/s | speedup | host ms / token (eager -> graphs) | ms / layer "
             "(graphs) | graphs per step | tokens equal | graphs off because |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows:
        if "eager" not in r:
            lines.append(f"| {name} |  |  |  |  |  |  |  | {r['off']} |")
            continue
        if r["slots"] is not None:
            name = f"{name} ({r['slots']} slots)"
        e, g = r["eager"], r["graphs"]
        lines.append(f"| {name} | {e:.1f} | {g:.1f} | {g / e:.2f}x | {1e3 / e:.2f} -> {1e3 / g:.2f} | "
                     f"{1e3 / g / r['layers']:.3f} | {r['per_step']} | {r['equal']} | {r['off']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", default="v3,v4", help="comma-separated, in this order: v3, v4")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and imports, measure nothing")
    a = ap.parse_args()
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        sys.exit(f"gpu_graphs.py: --models takes {', '.join(MODELS)}; got {a.models!r}")
    if a.dry_run:
        import dsv3lite.executors.graphs  # noqa: F401
        from dsv3lite.testing import write_geometry_checkpoint  # noqa: F401
        from dsv3lite.testing_v4 import write_v4_official  # noqa: F401

        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "graphs.md").write_text(f"# graphs (dry run): {a.tokens} tokens x {a.rounds} rounds\n")
        print("gpu_graphs.py: dry run")
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_graphs.py: no CUDA device (use --device cpu for a logic check)")
    a.out.mkdir(parents=True, exist_ok=True)
    logs: list[str] = []
    rows: list = []
    failed = False
    with tempfile.TemporaryDirectory() as tmp:
        builders = ((name, build) for model in models         # each checkpoint written when its turn comes
                    for name, build in engine_builders(model, write_checkpoint(model, Path(tmp)), a.device, 256,
                                                       logs.append))
        for name, build in builders:
            try:
                llm = build()
                rows.append((name, measure(llm, a.tokens, a.rounds)))
                del llm
            except Exception:                   # recorded, and the other engine still measured
                failed = True
                last = traceback.format_exc().strip().splitlines()[-1]
                rows.append((name, {"off": f"error: {last}"}))
                traceback.print_exc()
            text = table(rows, a)
            about = [m for m in logs if "graph" in m.lower()]
            if about:
                text += "\nEngine log lines about graphs:\n\n" + "".join(f"- {m}\n" for m in about)
            (a.out / "graphs.md").write_text(text)
            print(text, flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
