"""MTP speculative decoding vs plain decoding on the same model, CPU, alternating runs in one process.

    python benchmarks/mtp_cpu.py                      # the bundled demo model
    python benchmarks/mtp_cpu.py --weights DIR --tokens 200 --rounds 3 [--gpu-mem 40M]

Prints acceptance (fraction of drafted tokens accepted), tokens per main-model forward, and decode tok/s
with and without MTP, greedy and sampled; greedy outputs are checked to be identical.
"""
from __future__ import annotations

import argparse
import platform
import statistics

import torch

PROMPTS = ["ROMEO:\n", "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\n", "KING LEAR:\n",
           "First Citizen:\nBefore we proceed any further, hear me speak.\n"]


def run(llm, prompt, tokens, temperature, seed):
    llm.reset()
    out = [c.token_id for c in llm.generate(prompt, max_tokens=tokens, temperature=temperature, seed=seed)]
    s = llm.stats()
    return out, s["decode_tok_s"], s["mtp"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=None)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--draft", type=int, default=1, help="MTP draft tokens per step")
    ap.add_argument("--gpu-mem", default=None, help="offload experts to a simulated device tier of this size")
    ap.add_argument("--experts", default=None)
    a = ap.parse_args()

    import dsv3lite

    common = dict(device="cpu", progress=False, log=lambda m: None, gpu_mem=a.gpu_mem, experts=a.experts)
    plain = dsv3lite.load(a.weights, mtp=False, **common)
    spec = dsv3lite.load(a.weights, mtp=True, num_draft_tokens=a.draft, mtp_adaptive=False, **common)
    if spec.model.mtp is None:
        raise SystemExit("this checkpoint has no MTP weights")
    for llm in (plain, spec):
        llm.stop_ids = set()
        run(llm, PROMPTS[0], 8, 0.0, 0)                     # warm-up
    rows = []
    for temperature in (0.0, 0.8):
        rates = {"plain": [], "mtp": []}
        acc, tpf, same = [], [], True
        for r in range(a.rounds):
            for i, prompt in enumerate(PROMPTS):
                seed = 100 * r + i
                out_p, rate_p, _ = run(plain, prompt, a.tokens, temperature, seed)
                out_s, rate_s, m = run(spec, prompt, a.tokens, temperature, seed)
                rates["plain"].append(rate_p)
                rates["mtp"].append(rate_s)
                acc.append(m["acceptance_rate"])
                tpf.append(m["tokens_per_forward"])
                if temperature == 0.0:
                    same &= out_p == out_s
        p, s = statistics.median(rates["plain"]), statistics.median(rates["mtp"])
        rows.append((temperature, statistics.mean(acc), statistics.mean(tpf), p, s, s / p,
                     ("identical" if same else "DIFFERENT") if temperature == 0.0 else "-"))
    print(f"# MTP on {spec.weights}: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{len(PROMPTS)} prompts x {a.rounds} rounds x {a.tokens} tokens, draft k={a.draft}"
          + (f", experts offloaded to {a.gpu_mem}" if a.gpu_mem else ""))
    print("| temperature | acceptance | tokens/forward | plain tok/s | MTP tok/s | speedup | greedy output |")
    print("|---|---|---|---|---|---|---|")
    for t, ac, tf, p, s, sp, same in rows:
        print(f"| {t} | {ac:.1%} | {tf:.2f} | {p:.1f} | {s:.1f} | {sp:.2f}x | {same} |")


if __name__ == "__main__":
    main()
