"""A PROJECTION, not a measurement: DeepSeek-V4-Flash decode tok/s on one 24 GB, 48 GB and 80 GB GPU over PCIe 4
and PCIe 5, computed from measured parts and stated assumptions (no GPU has run this code yet).

Per decoded token (MTP off, batch 1), with the expert cache at the slots the README's memory table gives each card:
  uses U = 43 MoE layers x top-6 = 258 routed-expert uses, of which D are demand misses and the rest slot hits;
  P prefetch loads (the exact hash-layer prefetch) cross the link whatever happens;
  GPU    t_gpu  = (dense bytes read + hits x expert bytes) / (GPU bandwidth x roofline fraction)
  link   t_link = (P + demand misses fetched) x expert bytes / link bandwidth
  CPU    t_cpu  = demand misses computed on the CPU x one expert's CPU time (1 token)
  overlapped: max(t_gpu, t_link, t_cpu) (every part in parallel: an upper bound on tok/s);
  serial: t_gpu + the demand misses' own time, or t_link when the link is busier (a lower bound).
Demand misses go to the CPU or the link by the runtime's rule (`offload/runtime.CostModel`: whichever is faster
for one expert), or (`split`, not implemented) divided between them so both finish together.

    python benchmarks/v4_projection.py
    python benchmarks/v4_projection.py --roofline 0.8 --host-gbs 100 --dense fp8
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9

# Cache hit counts per token from benchmarks/cache_sim.py on V4-geometry traces (RESULTS.md, "DeepSeek-V4: exact
# prefetch from the hash layers"): slots -> (demand misses, prefetch loads) per token, for each trace and
# configuration; 258 uses a token.
SIM_SOURCE = ("python benchmarks/cache_sim.py --v4 /tmp/v4-geometry --tokens 256 --sizes 10,25 "
              "--slots 591,2518,5088 (2026-12-02)")
# Decayed-LFU with the exact hash-layer prefetch alone (its prefetches are exact: the link carries no wasted load),
# and with no prefetch at all (the hash layers' experts are demand misses too). With router prefetch too, the
# untimed count loads every prediction (1.4-2.1x the loads here at these sizes), where the runtime keeps 2
# prefetches in flight and drops stale ones: its effect is the copy-queue stall column of the same tables, not
# this arithmetic.
SIM = {   # trace -> configuration -> slots -> (demand misses / token, prefetch loads / token): loads less demand
    "synthetic": {      # learned layers Zipf(1.0) (assumed skew); hash layers from the demo model's text (exact)
        "hash prefetch": {591: (162.85, 14.85), 2518: (94.85, 9.35), 5088: (57.69, 5.21)},
        "no prefetch": {591: (175.31, 0.0), 2518: (103.93, 0.0), 5088: (62.91, 0.0)},
    },
    "engine": {         # the V4-geometry checkpoint's random-weight routing (not real routing)
        "hash prefetch": {591: (197.72, 14.98), 2518: (122.33, 9.97), 5088: (64.97, 5.93)},
        "no prefetch": {591: (210.24, 0.0), 2518: (132.05, 0.0), 5088: (70.81, 0.0)},
    },
}

CARDS = (  # name, slots the README's memory table plans at 32K context (scripts/memory_table.py), bandwidth (specs)
    ("24 GB (RTX 4090 class)", 591, 1008 * GB),
    ("48 GB (RTX 6000 Ada class)", 2518, 960 * GB),
    ("80 GB (H100 PCIe class)", 5088, 2000 * GB),
)
LINKS = (("PCIe 4", 25 * GB), ("PCIe 5", 50 * GB))    # effective pinned host-to-device (ANCHORS.md: Gen5 ~50 GB/s)

# measured here (benchmarks/RESULTS.md, "DeepSeek-V4: the MXFP4 CPU expert kernel"): one layer's call of 6 distinct
# V4-Flash MXFP4 experts at 1 token, 2 threads, 2.47 ms, on the 2-vCPU AMD EPYC (Zen 5) whose reads run at 40.1 GB/s
# on 2 threads (RESULTS.md, "Kimi-K2-Thinking / K2.5 as released"); one thread runs 6 at 4.32 ms (18.6 GB/s a core,
# compute-bound: RESULTS.md, the projection's section), so the assumed host's cores are enough to read at its rate
CPU_MS_6_EXPERTS = 2.47
HERE_READ_GBS = 40.1


@dataclass
class Parts:
    expert_bytes: int           # one routed expert as served (MXFP4 blob)
    dense_bytes: float          # non-expert weights a decode step reads (all but the embedding table)
    kv_bytes: float             # every cache object at the context, read once a step (an upper bound)
    uses: int                   # routed-expert uses a token


def parts(dense: str, ctx: int) -> Parts:
    """The byte counts from the format's layout and the network's sizes (V4-Flash's config.json)."""
    from dsv3lite.footprint import DENSE_WEIGHT_BYTES
    from dsv3lite.quant.mxfp4 import Mxfp4Format
    from dsv3lite.testing_v4 import flash_config
    from dsv3lite.v4.config import V4Args
    from dsv3lite.v4.sizes import kv_cache_bytes, resident_components

    a = V4Args.from_dict(flash_config())
    layout = Mxfp4Format.create().layout(a.moe_intermediate_size, a.hidden_size)
    # --dense fp8: the matrices --dense packs at FP8's bytes a weight (as released), the rest as kept
    res = resident_components(a, 2, mtp=False, weight_bytes=DENSE_WEIGHT_BYTES["fp8"] if dense == "fp8" else None)
    read = sum(v for k, v in res.items() if k != "embeddings")
    return Parts(layout.blob_bytes, read, kv_cache_bytes(a, ctx, False, 2),
                 a.num_hidden_layers * a.num_experts_per_tok)


def token_time(p: Parts, gpu_bps: float, link_bps: float, cpu_s: float, demand: float, prefetch: float,
               split: bool) -> tuple[float, float, float, float, float]:
    """-> (t_gpu, t_link, t_cpu, overlapped, serial) in seconds per token."""
    copy_s = p.expert_bytes / link_bps
    hits = p.uses - demand
    t_gpu = (p.dense_bytes + p.kv_bytes + hits * p.expert_bytes) / gpu_bps
    base_link = prefetch * copy_s
    if split:   # demand misses divided so that the CPU and the link (after its prefetches) end together
        on_cpu = min(demand, max(0.0, (demand * copy_s + base_link) / (cpu_s + copy_s)))
    else:
        on_cpu = demand if cpu_s < copy_s else 0.0
    t_cpu, t_link = on_cpu * cpu_s, base_link + (demand - on_cpu) * copy_s
    own = max(t_cpu, (demand - on_cpu) * copy_s) if split else t_cpu + (demand - on_cpu) * copy_s
    return t_gpu, t_link, t_cpu, max(t_gpu, t_link, t_cpu), max(t_gpu + own, t_link)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--roofline", type=float, default=0.6,
                    help="ASSUMED share of the GPU's memory bandwidth its decode kernels reach (none measured yet)")
    ap.add_argument("--host-gbs", type=float, default=64.0,
                    help="ASSUMED host read bandwidth, GB/s (dual-channel DDR5-6000: 96 peak, ~64 read)")
    ap.add_argument("--host-cores", type=int, default=8, help="ASSUMED cores computing misses (enough to saturate it)")
    ap.add_argument("--dense", choices=("bf16", "fp8"), default="bf16",
                    help="non-expert weights as dsv3lite keeps them by default (bf16) or with --dense fp8")
    ap.add_argument("--ctx", type=int, default=4096, help="context the KV read is counted at")
    ap.add_argument("--trace", default="synthetic", help="which simulated trace's hit counts: " + ", ".join(SIM))
    args = ap.parse_args()

    p = parts(args.dense, args.ctx)
    kernel_share = p.expert_bytes * 6 / (CPU_MS_6_EXPERTS / 1e3) / (HERE_READ_GBS * GB)
    cpu_s = p.expert_bytes / (args.host_gbs * GB * kernel_share)
    print("# PROJECTION (arithmetic on measured parts and stated assumptions; no GPU run): DeepSeek-V4-Flash decode, "
          "batch 1, MTP off")
    print(f"# expert bytes (MXFP4 layout, gate/up 2048x4096 + down 4096x2048, codes + ue8m0 scales): "
          f"{p.expert_bytes:,} ({p.expert_bytes / 2**20:.2f} MiB); uses a token: {p.uses}")
    print(f"# dense bytes read a token ({args.dense}; all non-expert weights but the embedding table): "
          f"{p.dense_bytes / 2**30:.2f} GiB; KV read at {args.ctx} tokens (upper bound): {p.kv_bytes / 2**20:.1f} MiB")
    print(f"# CPU miss: measured {CPU_MS_6_EXPERTS} ms per 6 experts at 1 token on 2 threads here = "
          f"{kernel_share:.2f} of this machine's {HERE_READ_GBS} GB/s read bandwidth; ASSUMED host: "
          f"{args.host_cores} cores, {args.host_gbs:.0f} GB/s read, the same share -> {cpu_s * 1e3:.3f} ms per expert")
    print(f"# GPU: ASSUMED {args.roofline:.0%} of the card's memory bandwidth (public specs); hit counts: "
          f"{args.trace} trace, {SIM_SOURCE}")
    head = ["card", "link", "slots", "configuration", "demand misses / token", "prefetch loads / token", "GPU ms",
            "link ms", "CPU ms", "tok/s, runtime's rule (serial - overlapped)", "tok/s, split (serial - overlapped)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for card, slots, bw in CARDS:
        for link, link_bps in LINKS:
            for config, by_slots in SIM[args.trace].items():
                demand, prefetch = by_slots[slots]
                g, l, c, over, serial = token_time(p, bw * args.roofline, link_bps, cpu_s, demand, prefetch, False)
                *_, s_over, s_serial = token_time(p, bw * args.roofline, link_bps, cpu_s, demand, prefetch, True)
                print(f"| {card} | {link} | {slots} | {config} | {demand:.1f} | {prefetch:.1f} | {g * 1e3:.1f} | "
                      f"{l * 1e3:.1f} | {c * 1e3:.1f} | {1 / serial:.1f} - {1 / over:.1f} | "
                      f"{1 / s_serial:.1f} - {1 / s_over:.1f} |")


if __name__ == "__main__":
    main()
