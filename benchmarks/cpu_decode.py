"""dsv3lite vs transformers generate() on the same checkpoint, same prompt, greedy, CPU, alternating runs.

    python benchmarks/cpu_decode.py                       # the bundled demo model
    python benchmarks/cpu_decode.py --weights DIR --tokens 128 --rounds 3

Prints prefill and decode tok/s of each and the ratio (dsv3lite / transformers). The main rows run fp32
with MTP off on both sides, so they do the same work per token; a last row adds dsv3lite as users run it
(MTP drafting on, its default, when the checkpoint has an MTP layer; greedy output is the same).

Both sides are timed alike, from outside, by the wall time of whole generations: prefill = the prompt's tokens
over the time of a 1-token generation (the prompt's forward and the first token), decode = the n - 1 further
tokens over the time of an n-token generation less that of the 1-token one. (Until 2026-12-02 dsv3lite's rows
were its own stats, timed inside the engine from the first token on, and transformers' its generate() time less
a separately timed forward: two clocks.)
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def timed(generate, prompt_ids, n_tokens):
    """(prefill tok/s, decode tok/s) of `generate(n)` (a whole greedy generation of exactly n tokens), from wall
    times: a 1-token generation gives the prefill, an n-token one less it the n - 1 decode steps."""
    t0 = time.perf_counter()
    generate(1)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(n_tokens)
    total = time.perf_counter() - t0
    return len(prompt_ids) / first, (n_tokens - 1) / max(total - first, 1e-9)


def run_dsv3lite(llm, prompt_ids, n_tokens):
    def generate(n):
        llm.reset()
        assert len(list(llm.generate(prompt_ids, max_tokens=n))) == n
    return timed(generate, prompt_ids, n_tokens)


def run_transformers(model, prompt_ids, n_tokens):
    ids = torch.tensor([prompt_ids])
    mask = torch.ones_like(ids)

    def generate(n):
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=None, eos_token_id=None)
        assert out.shape[1] - ids.shape[1] == n
    return timed(generate, prompt_ids, n_tokens)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=None, help="HF checkpoint dir (default: the bundled demo model)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import dsv3lite
    from transformers import AutoModelForCausalLM

    llm = dsv3lite.load(args.weights, device="cpu", dtype="float32", mtp=False, ctx_size=4096, progress=False)
    llm.stop_ids = set()
    spec = dsv3lite.load(args.weights, device="cpu", dtype="float32", mtp=True, ctx_size=4096, progress=False,
                         log=lambda m: None)
    spec.stop_ids = set()
    hf = AutoModelForCausalLM.from_pretrained(llm.weights, dtype=torch.float32).eval()
    text = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. " * 8
    prompt = llm.tokenizer.encode(text, add_bos=True)[: args.prompt_tokens]

    run_dsv3lite(llm, prompt, 8)                              # warm-up both
    run_transformers(hf, prompt, 8)
    run_dsv3lite(spec, prompt, 8)
    ours, theirs, mtp = [], [], []
    for _ in range(args.rounds):                             # alternate so drift hits all alike
        ours.append(run_dsv3lite(llm, prompt, args.tokens))
        theirs.append(run_transformers(hf, prompt, args.tokens))
        mtp.append(run_dsv3lite(spec, prompt, args.tokens))
    med = lambda rows, i: statistics.median(r[i] for r in rows)
    print(f"# CPU decode: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, weights {llm.weights}")
    print(f"# prompt {len(prompt)} tokens, {args.tokens} generated, greedy fp32, median of {args.rounds} alternating rounds")
    print("| engine | prefill tok/s | decode tok/s |")
    print("|---|---|---|")
    print(f"| dsv3lite | {med(ours, 0):.1f} | {med(ours, 1):.1f} |")
    print(f"| transformers | {med(theirs, 0):.1f} | {med(theirs, 1):.1f} |")
    print(f"| ratio | {med(ours, 0) / med(theirs, 0):.2f}x | {med(ours, 1) / med(theirs, 1):.2f}x |")
    if spec.model.mtp is not None:
        how = "MTP on" if spec.mtp_enabled else f"MTP turned itself off ({spec.mtp_off_reason})"
        print(f"| dsv3lite default: {how} | {med(mtp, 0):.1f} | {med(mtp, 1):.1f} |")
        print(f"| ratio, default | {med(mtp, 0) / med(theirs, 0):.2f}x | {med(mtp, 1) / med(theirs, 1):.2f}x |")


if __name__ == "__main__":
    main()
