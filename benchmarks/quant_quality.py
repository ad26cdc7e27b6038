"""Quality of the routed-expert formats: validation perplexity and top-1 agreement against bf16 experts.

    python benchmarks/quant_quality.py                                  # the bundled demo model, scripts/data/val.txt
    python benchmarks/quant_quality.py --weights DIR --tokens 8192 --window 512

Each configuration goes through `dsv3lite quantize` (so the whole pipeline is measured, not just the formats) into
a temporary directory and is loaded with the runtime on CPU in float32. Only the routed experts differ between
rows: every row, the bf16 baseline included, has the same bf16 dense weights. Text: the first --tokens tokens of
the validation file, cut into windows of --window tokens (BOS + window - 1), every position scored.
Goals (relative perplexity increase over bf16 experts): fp8 <= 0.5%, int4 g128 <= 3%, nf4 <= 4%.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import dsv3lite
from dsv3lite.quant.checkpoint import quantize_checkpoint

REPO = Path(__file__).resolve().parent.parent
# (label, format, int4 group size, goal: max relative perplexity increase over bf16 experts)
CONFIGS = [
    ("bf16", "bf16", 128, None),
    ("fp8", "fp8", 128, 0.005),
    ("int4 g128", "int4", 128, 0.03),
    ("int4 g64", "int4", 64, None),
    ("int4 g32", "int4", 32, None),
    ("nf4", "nf4", 128, 0.04),
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_text(path: Path) -> str:
    if not path.exists():
        raise SystemExit(f"{path} not found: scripts/prepare_corpus.py writes it (or pass --data FILE)")
    return path.read_text(encoding="utf-8")


def windows(llm, text: str, n_tokens: int, window: int) -> torch.Tensor:
    """[n_windows, window] token ids: BOS + window - 1 tokens of running text each."""
    ids = llm.tokenizer.encode(text)[:n_tokens]
    step = window - 1
    n = len(ids) // step
    if n == 0:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    body = torch.tensor(ids[:n * step]).view(n, step)
    return torch.cat([torch.full((n, 1), llm.tokenizer.bos_id), body], dim=1)


@torch.no_grad()
def evaluate(engines: dict, batches: list[torch.Tensor]) -> dict:
    """Per engine: mean NLL, top-1 agreement with the first engine (bf16), mean KL(bf16 || engine)."""
    stats = {k: {"nats": 0.0, "agree": 0, "kl": 0.0, "n": 0} for k in engines}
    for x in batches:
        inp, tgt = x[:, :-1], x[:, 1:]
        ref_lp, ref_top = None, None
        for label, llm in engines.items():
            lp = F.log_softmax(llm.forward(inp), dim=-1)               # [B, T, V]
            s = stats[label]
            s["nats"] -= lp.gather(-1, tgt[..., None]).sum().item()
            top = lp.argmax(-1)
            if ref_lp is None:
                ref_lp, ref_top = lp, top
            s["agree"] += (top == ref_top).sum().item()
            s["kl"] += (ref_lp.exp() * (ref_lp - lp)).sum().item()
            s["n"] += tgt.numel()
    return {k: {"ppl": math.exp(s["nats"] / s["n"]), "agree": s["agree"] / s["n"], "kl": s["kl"] / s["n"],
                "tokens": s["n"]} for k, s in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", default=None, help="HF checkpoint directory (default: the bundled demo model)")
    ap.add_argument("--data", default=str(REPO / "scripts" / "data" / "val.txt"), help="validation text file")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens of validation text to score")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4, help="windows per forward")
    ap.add_argument("--configs", nargs="+", default=None, help="labels to run (default: all)")
    a = ap.parse_args()

    weights = Path(a.weights) if a.weights else dsv3lite.DEMO_DIR
    if not any(weights.glob("*.safetensors")):
        raise SystemExit(f"no weights in {weights} (the demo model is trained by scripts/train_tiny.py)")
    configs = [c for c in CONFIGS if a.configs is None or c[0] in a.configs or c[0] == "bf16"]
    work = Path(tempfile.mkdtemp(prefix="dsv3lite-qquality-"))
    engines, t_quant = {}, {}
    try:
        for label, fmt, group, _ in configs:
            t0 = time.perf_counter()
            dst = quantize_checkpoint(weights, work / label.replace(" ", "-"), experts=fmt, group_size=group,
                                      progress=False, log=lambda m: None)
            t_quant[label] = time.perf_counter() - t0
            engines[label] = dsv3lite.load(dst, device="cpu", dtype="float32", mtp=False, progress=False,
                                           log=lambda m: None)
            log(f"{label}: quantized in {t_quant[label]:.1f}s")
        first = next(iter(engines.values()))
        text = load_text(Path(a.data))
        x = windows(first, text, a.tokens, a.window)
        batches = list(x.split(a.batch))
        t0 = time.perf_counter()
        res = evaluate(engines, batches)
        log(f"scored {res['bf16']['tokens']} tokens x {len(engines)} configurations in {time.perf_counter() - t0:.0f}s")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    base = res["bf16"]["ppl"]
    print(f"{datetime.date.today()}, {weights.name or weights} ({weights}), {res['bf16']['tokens']} tokens of "
          f"{Path(a.data).name} in {len(x)} windows of "
          f"{a.window}, CPU float32, torch {torch.__version__}, {platform.machine()} x{os.cpu_count()}\n")
    print("| experts | perplexity | vs bf16 | goal | top-1 agreement with bf16 | mean KL(bf16 ‖ q) nats |")
    print("|---|---|---|---|---|---|")
    for label, _, _, goal in configs:
        r = res[label]
        rel = r["ppl"] / base - 1
        verdict = "" if goal is None else (f"<= +{goal:.1%} " + ("met" if rel <= goal else "**missed**"))
        print(f"| {label} | {r['ppl']:.4f} | {rel:+.2%} | {verdict} | {r['agree']:.2%} | {r['kl']:.5f} |")


if __name__ == "__main__":
    main()
