"""A real-width DeepSeek-V4-Flash slice on the CPU: write it (released layout, tensor by tensor), load it with the
routed experts served as released (MXFP4 blobs through the packed kernel), prefill and decode through the cache
objects, two ways in alternating rounds: the eager network (dsv3lite/v4's batched operators) and the compiled CPU
step (kernels/cpu_v4.layers: every main layer in one kernel call, for the prompt as for each decode step).

    python benchmarks/v4_slice.py --dir /tmp/v4-flash-slice          # writes the slice there once
    python benchmarks/v4_slice.py --dir /tmp/v4-flash-slice --layers 3 --experts 16 --prompt 64 --tokens 16
    python benchmarks/v4_slice.py --dense int8       # the dense weights packed (dense.pack_dense; not a CLI option
                                                     # for V4 yet): what the compiled step reads instead of fp32

Prints write and load seconds, peak RSS after each, prefill and decode tok/s (medians of --rounds).
"""
from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path

import torch


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def run(model, ids: torch.Tensor, prompt: int, tokens: int, compiled: bool) -> tuple[float, float]:
    """(prefill s, decode s) of the prompt, then `tokens` single steps at the following positions."""
    from dsv3lite.kernels import cpu_v4

    def forward(span: torch.Tensor, start: int) -> torch.Tensor:
        if not compiled:
            return model.hidden(span, start, cache)
        out = cpu_v4.layers(model, model.prologue(span), start, cache, span)
        assert out is not None, "the compiled step declined"
        return out

    cache = model.new_cache(prompt + tokens, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.logits(forward(ids[:, :prompt], 0)[:, -1:])
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        for p in range(prompt, prompt + tokens):
            model.logits(forward(ids[:, p:p + 1], p))
        decode = time.perf_counter() - t0
    return prefill, decode


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp/v4-flash-slice")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dense", default=None, help="pack the non-expert weights to this format (int8, fp8, bf16, int4)")
    args = ap.parse_args()
    from dsv3lite.kernels import cpu_build
    from dsv3lite.testing_v4 import load_v4, v4_flash_slice_config, write_v4_official

    torch.set_num_threads(args.threads)
    path = Path(args.dir)
    print(f"# CPU kernels: {cpu_build.status()}; {args.threads} threads")
    if not (path / "config.json").exists():
        t0 = time.perf_counter()
        write_v4_official(path, v4_flash_slice_config(args.layers, args.experts))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        print(f"write: {time.perf_counter() - t0:.1f} s, {size / 2 ** 30:.2f} GiB, peak RSS {peak_rss_gib():.2f} GiB")
    t0 = time.perf_counter()
    model = load_v4(path, released_experts=True, log=lambda m: None)
    if args.dense:
        from dsv3lite.dense import pack_dense
        pack_dense(model, args.dense)
    print(f"load: {time.perf_counter() - t0:.1f} s, peak RSS {peak_rss_gib():.2f} GiB, dense {args.dense or 'fp32'}")
    a = model.args
    ids = torch.randint(0, a.vocab_size, (1, args.prompt + args.tokens), generator=torch.Generator().manual_seed(0))
    ways = {"eager network": False, "compiled step": True}
    for compiled in ways.values():                    # first calls (plans, buffers) out of the timing
        run(model, ids, 8, 2, compiled)
    times = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, compiled in ways.items():
            times[name].append(run(model, ids, args.prompt, args.tokens, compiled))
    print(f"| layers | experts | way | prefill tok/s ({args.prompt}) | decode tok/s ({args.tokens}) | peak RSS GiB |")
    print("|---|---|---|---|---|---|")
    for name, runs in times.items():
        prefill, decode = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(f"| {a.num_hidden_layers} ({', '.join(a.attn_kinds[:a.num_hidden_layers])}) | {a.n_routed_experts} | "
              f"{name} | {args.prompt / prefill:.1f} | {args.tokens / decode:.2f} | {peak_rss_gib():.2f} |")


if __name__ == "__main__":
    main()
