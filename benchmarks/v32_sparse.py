"""DeepSeek-V3.2 decode on CPU: ms per token at growing context, dense attention vs the sparse (DSA) path.

    python benchmarks/v32_sparse.py                        # contexts 1K/4K/16K, V3.2's attention geometry
    python benchmarks/v32_sparse.py --contexts 1024,4096,16384,32768 --steps 10 --threads 2

One decoder layer with V3.2's real attention shapes (hidden 7168, 128 heads, q_lora 1536, latent 512 + rope 64,
indexer 64 heads x 128, index_topk 2048) and a small dense MLP and vocabulary, random fp32 weights; its cache is
filled with random latents and indexer keys (a decode step's cost does not depend on their values, and a 16K
prefill on 2 cores would take minutes). Each row times one decode step (absorbed attention) at that context:
"dense" attends to every cached token (the model with index_topk raised past the context), "sparse" is V3.2 as
it runs (the indexer scores every token, attention reads the top 2048). Within index_topk both are dense.
The attention columns time the part that grows with context alone (absorbed attention over the cached rows;
sparse: the indexer's scoring + top-k, then attention over the 2048 rows it keeps); the rest of a step (the
projections: ~190M weights per layer) is the same at every context. Fastest of --steps rounds after a warm-up,
every measurement of a context interleaved with the others.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import time

import torch


def v32_layer_args(layers: int):
    from dsv3lite.config import ModelArgs

    return ModelArgs.from_dict(dict(
        model_type="deepseek_v32", vocab_size=1024, hidden_size=7168, intermediate_size=512,
        num_hidden_layers=layers, first_k_dense_replace=layers, num_attention_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
        num_experts_per_tok=2, index_topk=2048, index_n_heads=64, index_head_dim=128,
        max_position_embeddings=163840, num_nextn_predict_layers=0,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}))


def timed(fns: dict, steps: int) -> dict:
    """Fastest ms of each function over `steps` rounds, run interleaved (one of each per round) so that load from
    elsewhere on the machine falls on all of them alike; the fastest round is the least disturbed one (as timeit
    reports). One warm-up round first (RoPE tables, allocator)."""
    times = {name: [] for name in fns}
    for round_ in range(steps + 1):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - t0)
    return {name: 1000 * min(t) for name, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads (default: torch's)")
    opts = ap.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)

    from dsv3lite.kernels.mla_decode import mla_attend
    from dsv3lite.model import Transformer, init_weights

    args = v32_layer_args(opts.layers)
    torch.manual_seed(0)
    with torch.no_grad():
        model = init_weights(Transformer(args)).eval()
    contexts = [int(c) for c in opts.contexts.split(",")]
    cache = torch.randn(args.num_hidden_layers, 1, max(contexts) + 1, args.cache_dim)
    token = torch.tensor([[7]])
    topk = args.index_topk
    attn = model.layers[0].attn
    rows = []
    with torch.inference_mode():
        for ctx in contexts:
            x = torch.randn(1, 1, args.hidden_size)
            q = torch.randn(1, 1, args.num_attention_heads, args.latent_dim)       # an absorbed query
            cos, sin = (t[:, None] for t in model.rotary(ctx, 1, x.device))
            q_latent = attn.q_norm(attn.wq_a(x))
            kv, keys = cache[0, :, :ctx + 1, :args.latent_dim], cache[0, :, :ctx + 1, args.latent_dim:]
            sparse = ctx + 1 > topk
            selected = attn.indexer.select(x, q_latent, keys, cos, sin) if sparse else None

            def step(dense: bool):   # one decode step at position ctx (writes row ctx, reads rows 0..ctx)
                args.index_topk = 10 ** 9 if dense else topk
                model(token, ctx, cache, absorb=True)
                args.index_topk = topk

            fns = {"dense step": lambda: step(True), "sparse step": lambda: step(False),
                   "dense attention": lambda: mla_attend(q, kv, args.softmax_scale, args.kv_lora_rank)}
            if sparse:
                fns["indexer"] = lambda: attn.indexer.select(x, q_latent, keys, cos, sin)
                fns["top-k attention"] = lambda: mla_attend(q, kv, args.softmax_scale, args.kv_lora_rank, selected)
            ms = timed(fns, opts.steps)
            indexer = ms.get("indexer", 0.0)
            sparse_attention = indexer + ms["top-k attention"] if sparse else ms["dense attention"]
            rows.append((ctx, ms["dense step"], ms["sparse step"], ms["dense attention"], sparse_attention, indexer))
            print(f"context {ctx}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()), flush=True)

    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"\n{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}, {opts.layers} layer(s), fp32, fastest of {opts.steps} rounds\n")
    print("| context | decode step, dense (ms) | decode step, sparse (ms) | attention over the cache, dense (ms) | "
          "attention, sparse: indexer + top-2048 (ms) | of which indexer |")
    print("|---|---|---|---|---|---|")
    for ctx, dense, sparse, dense_core, sparse_core, indexer in rows:
        print(f"| {ctx} | {dense:.1f} | {sparse:.1f} | {dense_core:.1f} | {sparse_core:.1f} | {indexer:.1f} |")


if __name__ == "__main__":
    main()
