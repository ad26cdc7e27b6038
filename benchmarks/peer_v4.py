"""DeepSeek-V4's tables of benchmarks/cpu_peer.py (`--tables ABC`): dsv3lite against llama.cpp on this CPU, side by
side in alternating rounds, same threads.

  (A) one V4-Flash routed expert in MXFP4 (gate/up 2048x4096, down 4096x2048, 12.75 MiB) at batch 1, weights
      rotated past the caches: dsv3lite's kernel (int8 and fp32 activations; one expert a call, and 6 a call as a
      decode step does) next to ggml's MXFP4 through its CPU backend (cpu_peer's ggml program), in ms, GB/s and
      fraction of the measured read bandwidth;
  (B) the real-width V4-Flash slice (dsv3lite.testing_v4: 3 layers, sliding / CSA / HCA, 16 MXFP4 experts, FP8
      dense as released), prefill and decode: dsv3lite (experts as released, dense fp8 as released or int8) against
      llama.cpp's GGUF of the same checkpoint (its converter: MXFP4 experts, the dense in Q8_0);
  (C) host time per token at V4-Flash's geometry (43 layers, 256 experts, top-6, released compression ratios, tiny
      widths): dsv3lite resident against llama.cpp on the same weights, and offloaded on the simulated device tier
      at ~10% and ~25% of the experts in slots against resident.
"""
from __future__ import annotations

import statistics

import torch

from cpu_peer import ExpertPool, ggml_expert, log, read_bandwidth

FLASH_I, FLASH_D, FLASH_K = 2048, 4096, 6          # V4-Flash's routed expert and its experts per token
MX_ROWS = (("mxfp4", "int8"), ("mxfp4", "fp32"))    # dsv3lite's kernel: the activation formats


def table_a(threads: list[int], rounds: int) -> dict:
    """(A): per thread count, the read bandwidth, dsv3lite's MXFP4 expert per activation format (1 and 6 experts a
    call) and ggml's MXFP4 expert, medians of alternating rounds."""
    from dsv3lite.kernels import cpu_build

    log(f"CPU kernels: {cpu_build.status()}")
    pools = {act: ExpertPool(name, FLASH_I, FLASH_D, act=act) for name, act in MX_ROWS}
    res = {"threads": {}}
    for t in threads:
        torch.set_num_threads(t)
        bw = statistics.median(read_bandwidth(t) for _ in range(3))
        ours = {f"{act} x{k}": [] for act in pools for k in (1, FLASH_K)}
        theirs, used = [], None
        for _ in range(rounds):
            for act, pool in pools.items():
                for k in (1, FLASH_K):
                    ours[f"{act} x{k}"].append(pool.time(k))
            ms, nbytes, used = ggml_expert("mxfp4", t, inter=FLASH_I, dim=FLASH_D)
            theirs.append(ms / 1e3)
        res["threads"][t] = {"bandwidth_gbs": bw, "ours": {k: statistics.median(v) for k, v in ours.items()},
                             "ggml": statistics.median(theirs), "ggml_bytes": nbytes, "buffer": used,
                             "bytes": next(iter(pools.values())).layout.blob_bytes}
    res["errors"] = {act: p.error() for act, p in pools.items()}
    return res


def print_a(res: dict) -> None:
    print("\n### (A) one DeepSeek-V4-Flash routed expert in MXFP4 (gate/up 2048x4096, down 4096x2048), batch 1 "
          "(median ms; GB/s of weight bytes; fraction of read bandwidth)\n")
    for t, r in res["threads"].items():
        bw = r["bandwidth_gbs"]
        print(f"{t} thread(s), read bandwidth {bw:.1f} GB/s\n")
        print("| | bytes | ms | GB/s | of bandwidth | vs ggml |")
        print("|---|---|---|---|---|---|")
        for k, s in r["ours"].items():
            act, n = k.split()
            gbs = r["bytes"] / s / 1e9
            label = f"dsv3lite mxfp4, {act} activations" + (f" ({n[1:]} experts a call)" if n != "x1" else "")
            print(f"| {label} | {r['bytes'] / 1e6:.1f} MB | {s * 1e3:.2f} | {gbs:.1f} | {gbs / bw:.2f} | "
                  f"{r['ggml'] / s:.2f}x |")
        gbs = r["ggml_bytes"] / r["ggml"] / 1e9
        print(f"| ggml MXFP4 ({r['buffer']} buffer) | {r['ggml_bytes'] / 1e6:.1f} MB | {r['ggml'] * 1e3:.2f} | "
              f"{gbs:.1f} | {gbs / bw:.2f} | 1.00x |\n")
    print("kernel output against the exact product of its weights (relative error): " +
          ", ".join(f"{act} activations {e:.2e}" for act, e in res["errors"].items()) + "\n")
