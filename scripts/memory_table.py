"""The README's memory block: what DeepSeek-V3, Kimi-K2, Moonlight and DeepSeek-V2-Lite need in each expert format (and
Kimi-K2-Thinking / K2.5 in the int4 they are released in), DeepSeek-V4-Flash / V4-Pro with their MXFP4 experts as
released (and what a 24 / 48 / 80 GB card holds of them), from their published config.json values (written here, V4's
in dsv3lite/testing_v4.py) and the same planner `dsv3lite plan` uses; reads no weights. Also the README's 22 GB
example (DeepSeek-V3, int4 experts and --dense int4, ctx 8192).

    python scripts/memory_table.py            # the README's block, between its markers (tests/test_readme.py
                                              # fails when the README's copy differs)
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


from dsv3lite.config import ModelArgs
from dsv3lite.footprint import DENSE_WEIGHT_BYTES
from dsv3lite.offload.planner import make_plan
from dsv3lite.offload.setup import CUDA_RESERVE_BYTES
from dsv3lite.quant.formats import get_format
from dsv3lite.testing_int4 import KIMI_INT4_QUANT
from dsv3lite.testing_v4 import flash_config, pro_config
from dsv3lite.utils import format_bytes

_MLA = dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rms_norm_eps=1e-6,
            tie_word_embeddings=False, hidden_act="silu")
_YARN_V3 = dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                mscale=1.0, mscale_all_dim=1.0)
_V3 = dict(
    _MLA, model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256,
    n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, routed_scaling_factor=2.5, scoring_func="sigmoid",
    topk_method="noaux_tc", norm_topk_prob=True, num_nextn_predict_layers=1, rope_theta=10000,
    rope_scaling=_YARN_V3, max_position_embeddings=163840,
    quantization_config=dict(quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128]))
MODELS = {
    "DeepSeek-V3 / R1 (671B)": _V3,
    # Kimi-K2: DeepSeek-V3's architecture with more experts in one group, half the heads, no MTP, another RoPE
    "Kimi-K2 (1T)": dict(
        _V3, model_type="kimi_k2", vocab_size=163840, first_k_dense_replace=1, n_routed_experts=384, n_group=1,
        topk_group=1, num_attention_heads=64, num_key_value_heads=64, routed_scaling_factor=2.827,
        num_nextn_predict_layers=0, rope_theta=50000, rope_scaling=dict(_YARN_V3, factor=32, beta_fast=1),
        max_position_embeddings=131072),
    # Kimi-K2-Thinking and K2.5's language model: Kimi-K2 with its routed experts released as compressed-tensors int4
    "Kimi-K2-Thinking / K2.5 (1T)": dict(
        _V3, model_type="kimi_k2", vocab_size=163840, first_k_dense_replace=1, n_routed_experts=384, n_group=1,
        topk_group=1, num_attention_heads=64, num_key_value_heads=64, routed_scaling_factor=2.827,
        num_nextn_predict_layers=0, rope_theta=50000, rope_scaling=dict(_YARN_V3, factor=64, beta_fast=1),
        max_position_embeddings=262144, quantization_config=KIMI_INT4_QUANT),
    "Moonlight-16B-A3B": dict(
        _MLA, model_type="deepseek_v3", vocab_size=163840, hidden_size=2048, intermediate_size=11264,
        moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, routed_scaling_factor=2.446, scoring_func="sigmoid",
        topk_method="noaux_tc", norm_topk_prob=True, num_nextn_predict_layers=0, rope_theta=50000,
        max_position_embeddings=8192),
    "DeepSeek-V2-Lite (16B)": dict(
        _MLA, model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, first_k_dense_replace=1, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1, num_attention_heads=16,
        num_key_value_heads=16, q_lora_rank=None, routed_scaling_factor=1.0, scoring_func="softmax",
        topk_method="greedy", norm_topk_prob=False, rope_theta=10000, max_position_embeddings=163840,
        rope_scaling=dict(_YARN_V3, beta_fast=32)),
}
FORMATS = ("fp8", "int4", "nf4", "bf16")
RELEASED_ONLY = ("Kimi-K2-Thinking / K2.5 (1T)",)     # served in the format they are released in
GPU_DENSE = (None, "fp8", "int4")       # the non-expert weights on the GPU: bf16, --dense fp8, --dense int4
CTX = 4096
BEGIN, END = "<!-- scripts/memory_table.py: begin -->", "<!-- scripts/memory_table.py: end -->"
CARD = dict(budget=22 * 2**30, ctx=8192, experts="int4", dense="int4")     # the 22 GB example
V4_MODELS = {"DeepSeek-V4-Flash (284B)": flash_config(), "DeepSeek-V4-Pro (1.6T)": pro_config()}
CARDS_GB = (24, 48, 80)                 # a card's memory: a --gpu-mem auto budget of that much, less the CUDA reserve
CARD_CTX = 32768


def rows():
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in MODELS.items():
            root = Path(tmp) / name.split()[0]
            root.mkdir()
            (root / "config.json").write_text(json.dumps(cfg))
            a = ModelArgs.from_dir(root)
            mtp = a.num_nextn_predict_layers >= 1
            layers = len(a.moe_layer_ids) + (1 if mtp else 0)
            for fmt in (a.released_experts,) if name in RELEASED_ONLY else FORMATS:
                blob = get_format(fmt).layout(a.moe_intermediate_size, a.hidden_size).blob_bytes
                host = layers * a.n_routed_experts * blob
                gpu = [make_plan(a, 1 << 50, CTX, blob, fmt, dense_bytes=2, mtp=mtp,
                                 weight_bytes=DENSE_WEIGHT_BYTES[d] if d else None).resident
                       for d in GPU_DENSE]
                cpu = make_plan(a, 1 << 50, CTX, blob, fmt, dense_bytes=4, mtp=mtp,
                                weight_bytes=DENSE_WEIGHT_BYTES["int8"]).resident
                out.append((name, fmt, host, gpu, host + cpu))
    return out


def card_slots() -> tuple[int, int]:
    """Expert slots of DeepSeek-V3 in CARD's budget: as `plan --device cpu` plans the whole budget, and as a CUDA run
    keeps after the CUDA context's reserve."""
    a = ModelArgs.from_dict(json.loads(json.dumps(MODELS["DeepSeek-V3 / R1 (671B)"])))
    blob = get_format(CARD["experts"]).layout(a.moe_intermediate_size, a.hidden_size).blob_bytes
    return tuple(make_plan(a, budget, CARD["ctx"], blob, CARD["experts"], dense_bytes=2, mtp=True,
                           weight_bytes=DENSE_WEIGHT_BYTES[CARD["dense"]]).n_slots
                 for budget in (CARD["budget"], CARD["budget"] - CUDA_RESERVE_BYTES))


def v4_rows():
    """(name, expert format, host tier, GPU minimum at CTX, [experts resident on each card at CARD_CTX], CPU-only)."""
    from dsv3lite.errors import UserError

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in V4_MODELS.items():
            root = Path(tmp) / name.split()[0]
            root.mkdir()
            (root / "config.json").write_text(json.dumps(cfg))
            a = ModelArgs.from_dir(root)
            fmt = a.released_experts
            blob = get_format(fmt).layout(a.moe_intermediate_size, a.hidden_size).blob_bytes
            host = (len(a.moe_layer_ids) + 1) * a.n_routed_experts * blob
            gpu = make_plan(a, 1 << 50, CTX, blob, fmt, dense_bytes=2).resident
            cards = []
            for gb in CARDS_GB:
                try:
                    p = make_plan(a, gb * 2**30 - CUDA_RESERVE_BYTES, CARD_CTX, blob, fmt, dense_bytes=2)
                    cards.append(f"{p.n_slots:,} ({p.fraction_resident:.0%})")
                except UserError:
                    cards.append("does not fit")
            cpu = make_plan(a, 1 << 50, CTX, blob, fmt, dense_bytes=4, weight_bytes=DENSE_WEIGHT_BYTES["int8"]).resident
            out.append((name, fmt, host, gpu, cards, host + cpu))
    return out


def readme_block() -> str:
    """The README's block: the table, what its columns mean, and the 22 GB example."""
    lines = [BEGIN, "| model | experts | expert blobs (host RAM, or the page cache) | GPU minimum | with `--dense fp8` | "
             "with `--dense int4` | CPU-only run, `--dense int8` |", "|---|---|---|---|---|---|---|"]
    for name, fmt, host, gpu, cpu in rows():
        lines.append(f"| {name} | {fmt} | {format_bytes(host)} | {' | '.join(format_bytes(g) for g in gpu)} | "
                     f"{format_bytes(cpu)} |")
    plan_slots, card = card_slots()
    lines += ["", f"GPU minimum: every non-expert weight resident (bf16, or packed with --dense: MLA's wkv_b, norms, "
              f"embeddings and routers stay as they are), the latent KV cache for {CTX} tokens and the prefill "
              f"workspace (`dsv3lite plan` prints it); every byte of --gpu-mem above it, less the 1.5 GiB kept for the "
              f"CUDA context, holds expert slots. CPU-only: the expert blobs plus the non-expert weights packed to "
              f"int8, fp32 activations and KV. Kimi-K2-Thinking / K2.5: their routed experts as released (int4g32: "
               f"4-bit codes and a bf16 scale per 32 weights), served without re-quantizing.",
              "",
              f"So DeepSeek-V3 runs on a 24 GB card with `--dense fp8` (an FP8 checkpoint keeps its own fp8 bytes; a "
              f"CUDA run picks it when its budget needs it, and says so), and within `--gpu-mem 22G` with `--dense "
              f"int4` and int4 experts (`dsv3lite plan --gpu-mem 22G --experts int4 --dense int4 --ctx-size "
              f"{CARD['ctx']} --device cuda`: {card} expert slots after the 1.5 GiB kept for the CUDA context; "
              f"{plan_slots} with `--device cpu --dtype bfloat16`, which plans the whole budget). On a GPU the packed "
              f"weights go through the W8A16 / W4A16 kernels; this path has not run on GPU hardware yet."]
    cards = " / ".join(f"{g} GiB" for g in CARDS_GB)
    lines += ["", f"| model | experts | expert blobs (host RAM, or the page cache) | GPU minimum | experts resident, "
              f"{cards} card ({CARD_CTX // 1024}K context) | CPU-only run, `--dense int8` |",
              "|---|---|---|---|---|---|"]
    for name, fmt, host, gpu, cards, cpu in v4_rows():
        lines.append(f"| {name} | {fmt} (as released) | {format_bytes(host)} | {format_bytes(gpu)} | "
                     f"{' / '.join(cards)} | {format_bytes(cpu)} |")
    lines += ["", "DeepSeek-V4: the routed experts served as released (MXFP4: 4-bit codes and a power-of-two scale per "
              f"32 weights), the MTP block included; the non-expert weights resident in bf16 (fp32 where the network "
              f"keeps them: mHC, norms, routers), the KV cache of every block's cache object (V4-Flash: 6,880 B per "
              f"token; V4-Pro 9,848), the workspace (estimated from the shapes); a card's budget is its memory less the "
              f"1.5 GiB CUDA reserve. CPU-only: the expert blobs plus the non-expert weights packed to int8 (mHC, "
              f"norms, routers and embeddings as they are), fp32 activations and caches.", END]
    return "\n".join(lines)


def main() -> int:
    print(readme_block())
    return 0


if __name__ == "__main__":
    sys.exit(main())
