"""`dsv3lite quantize` throughput and peak memory on a synthetic DeepSeek-V3-shaped source.

    python benchmarks/quantize_speed.py                          # 32 experts of 7168x2048, bf16 and fp8 sources
    python benchmarks/quantize_speed.py --experts 8 --formats int4 fp8 --sources bf16 --workdir /big/disk
    python benchmarks/quantize_speed.py --threads 1                # steadier on a shared machine

Writes an HF-style checkpoint first (one MoE layer of DeepSeek-V3 width: hidden 7168, moe_intermediate 2048,
--experts routed experts, a shared expert, MLA projections at 2 heads; random weights, sharded with an index),
once as bf16 and once as FP8 block-scaled (DeepSeek's layout). Each (source, format) runs in a fresh child
process that reports wall time and its peak RSS (ru_maxrss), so memory figures are not polluted by the parent.
The source was just written, so reads come from the page cache: this measures the quantizer, not the disk.
Everything lives under --workdir and is deleted at the end (about 6 GB at 32 experts).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HIDDEN, INTER = 7168, 2048
FORMATS = ("bf16", "fp8", "int4", "nf4")
BF16_EXPERT = 3 * INTER * HIDDEN * 2       # bytes of one DeepSeek-V3 routed expert in bf16


def synthetic_config(n_experts: int) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256,
            "hidden_size": HIDDEN, "intermediate_size": 18432, "moe_intermediate_size": INTER,
            "num_hidden_layers": 1, "first_k_dense_replace": 0, "moe_layer_freq": 1,
            "num_attention_heads": 2, "num_key_value_heads": 2, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": n_experts, "n_shared_experts": 1, "num_experts_per_tok": min(8, n_experts),
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "num_nextn_predict_layers": 0,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16"}


def synthetic_tensors(cfg: dict):
    """(name, shape, is_projection) of every tensor, in file order (dense first, then experts)."""
    d, i, h = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    p = "model.layers.0."
    out = [("model.embed_tokens.weight", (cfg["vocab_size"], d), False), ("model.norm.weight", (d,), False),
           ("lm_head.weight", (cfg["vocab_size"], d), False),
           (p + "input_layernorm.weight", (d,), False), (p + "post_attention_layernorm.weight", (d,), False),
           (p + "self_attn.q_a_proj.weight", (cfg["q_lora_rank"], d), True),
           (p + "self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],), False),
           (p + "self_attn.q_b_proj.weight", (h * qk, cfg["q_lora_rank"]), True),
           (p + "self_attn.kv_a_proj_with_mqa.weight", (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], d), True),
           (p + "self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],), False),
           (p + "self_attn.kv_b_proj.weight", (h * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                                               cfg["kv_lora_rank"]), True),
           (p + "self_attn.o_proj.weight", (d, h * cfg["v_head_dim"]), True),
           (p + "mlp.gate.weight", (cfg["n_routed_experts"], d), False),
           (p + "mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],), False)]
    for proj, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
        out.append((p + f"mlp.shared_experts.{proj}.weight", shape, True))
    for e in range(cfg["n_routed_experts"]):
        for proj, shape in (("gate_proj", (i, d)), ("up_proj", (i, d)), ("down_proj", (d, i))):
            out.append((p + f"mlp.experts.{e}.{proj}.weight", shape, True))
    return out


def write_source(root: Path, n_experts: int, fp8: bool, experts_per_shard: int = 8) -> Path:
    """Stream a synthetic checkpoint to disk shard by shard, one tensor in memory at a time."""
    from dsv3lite.quant.fp8 import fp8_block_quantize, scale_grid_shape
    from dsv3lite.quant.tensorfile import TensorFileWriter

    root.mkdir(parents=True)
    cfg = synthetic_config(n_experts)
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    shards: dict[str, list] = {}
    for name, shape, proj in synthetic_tensors(cfg):
        e = int(name.split(".")[5]) if ".mlp.experts." in name else -1
        shards.setdefault(f"model-{e // experts_per_shard + 2 if e >= 0 else 1:05d}.safetensors", []).append(
            (name, shape, proj))
    gen = torch.Generator().manual_seed(0)
    weight_map = {}
    for shard, items in shards.items():
        entries = []
        for name, shape, proj in items:
            if fp8 and proj:
                entries += [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", scale_grid_shape(*shape))]
            else:
                entries.append((name, "F32" if name.endswith("bias") else "BF16", shape))
        with TensorFileWriter.create(root / shard, entries, {"format": "pt"}) as w:
            for name, shape, proj in items:
                if len(shape) == 1:
                    t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
                    t = t if name.endswith("bias") else t.to(torch.bfloat16)
                else:
                    t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
                if fp8 and proj:
                    q, scale = fp8_block_quantize(t)
                    w.write(name, q)
                    w.write(name + "_scale_inv", scale)
                else:
                    w.write(name, t)
        weight_map.update({n: shard for n, _, _ in entries})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


def child(src: str, dst: str, fmt: str, threads: str) -> None:
    """Run one quantize in this process and print one JSON line with its figures."""
    import psutil

    if int(threads):
        torch.set_num_threads(int(threads))

    from dsv3lite.quant.checkpoint import DENSE_FILE, EXPERTS_FILE, plan_quantize, quantize_checkpoint

    base_rss = psutil.Process().memory_info().rss
    plan = plan_quantize(src, dst, fmt)
    src_bytes = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
    t0 = time.perf_counter()
    quantize_checkpoint(src, dst, experts=fmt, progress=False, log=lambda m: None)
    seconds = time.perf_counter() - t0
    out_bytes = (Path(dst) / EXPERTS_FILE).stat().st_size + (Path(dst) / DENSE_FILE).stat().st_size
    print(json.dumps({"seconds": seconds, "src_bytes": src_bytes, "out_bytes": out_bytes,
                      "experts": plan.args.n_routed_experts, "expert_src_bytes": plan.expert_src_bytes,
                      "base_rss": base_rss, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=32, help="routed experts in the synthetic layer")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--sources", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--workdir", default=None, help="where the synthetic checkpoints go (default: a temp dir)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each quantize (0: torch's default)")
    ap.add_argument("--child", nargs=4, metavar=("SRC", "DST", "FMT", "THREADS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return child(*a.child)

    work = Path(tempfile.mkdtemp(prefix="dsv3lite-qspeed-", dir=a.workdir))
    rows, a.load_before = [], os.getloadavg()[0]
    try:
        for source in a.sources:
            t0 = time.perf_counter()
            src = write_source(work / f"src-{source}", a.experts, fp8=source == "fp8")
            print(f"wrote the {source} source ({a.experts} experts of {INTER}x{HIDDEN}) in "
                  f"{time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
            for fmt in a.formats:
                dst = work / f"out-{source}-{fmt}"
                res = subprocess.run([sys.executable, __file__, "--child", str(src), str(dst), fmt, str(a.threads)],
                                     capture_output=True, text=True)
                if res.returncode:
                    sys.exit(f"quantize {source} -> {fmt} failed:\n{res.stderr}")
                r = json.loads(res.stdout.strip().splitlines()[-1])
                rows.append((source, fmt, r))
                print(row_text(source, fmt, r), file=sys.stderr, flush=True)
                shutil.rmtree(dst)
            shutil.rmtree(src)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    a.load_after = os.getloadavg()[0]
    print(table(rows, a))


def row_text(source, fmt, r) -> str:
    gib = 2 ** 30
    return (f"| {source} | {fmt}{' (passthrough)' if source == fmt == 'fp8' else ''} | {r['src_bytes'] / gib:.2f} "
            f"| {r['seconds']:.1f} | {r['src_bytes'] / r['seconds'] / 1e9:.3f} "
            f"| {r['experts'] / r['seconds']:.2f} | {r['peak_rss'] / gib:.2f} "
            f"| {(r['peak_rss'] - r['base_rss']) / gib:.2f} | {(r['peak_rss'] - r['base_rss']) / BF16_EXPERT:.1f} |")


def table(rows, a) -> str:
    cpu = platform.processor() or platform.machine()
    head = (f"{a.experts} experts of {INTER}x{HIDDEN} (one expert: {BF16_EXPERT / 2**20:.0f} MiB bf16), "
            f"torch {torch.__version__}, {a.threads or torch.get_num_threads()} of {os.cpu_count()} CPU threads "
            f"({cpu}), page cache warm, load average "
            f"{a.load_before:.1f} before / {a.load_after:.1f} after\n\n"
            "| source | experts | source GiB | s | GB/s (source) | experts/s | peak RSS GiB | RSS above imports GiB "
            "| RSS above imports, in bf16 experts |\n|---|---|---|---|---|---|---|---|---|")
    return head + "\n" + "\n".join(row_text(s, f, r) for s, f, r in rows)


if __name__ == "__main__":
    main()
