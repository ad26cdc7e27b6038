"""A slice of DeepSeek-V3 at its real widths as an HF checkpoint, for benchmarks (never downloaded: random).

DeepSeek-V3's widths (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, dense intermediate 18432, routed and
shared experts of 2048) with few layers, few routed experts and a small vocabulary, written as the hub writes
them: bf16, or DeepSeek's FP8 block layout (e4m3 weights + float32 weight_scale_inv per 128x128 block, the
tensors the hub keeps in bf16 left so), in one or several shards with an index, with or without the MTP layer.
Memory stays bounded: the header of each shard is written first and tensors are drawn and written one at a time
(quant.tensorfile), so the largest live tensor is one dense MLP matrix. Deterministic: tensor i is drawn from a
generator seeded with (seed, i), whatever the shard count.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .config import ModelArgs
from .hf_checkpoint import EXPERT_NAMES, LAYER_NAMES, MTP_NAMES, MTP_SHARED, TOP_NAMES
from .quant.fp8 import fp8_block_quantize, scale_grid_shape
from .quant.tensorfile import TensorFileWriter

V3_WIDTHS = dict(
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_attention_heads=128,
    num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    v_head_dim=128, n_shared_experts=1, num_experts_per_tok=8, routed_scaling_factor=2.5, norm_topk_prob=True,
    scoring_func="sigmoid", topk_method="noaux_tc", rope_theta=10000.0, rms_norm_eps=1e-6,
    max_position_embeddings=163840,
    rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
)
# hub tensors kept in bf16 in DeepSeek's FP8 checkpoints (checkpoint-name fragments)
BF16_IN_FP8 = ("norm", "mlp.gate.weight", "embed_tokens", "lm_head", "eh_proj", "e_score_correction_bias",
               "shared_head.head")
INIT_STD = 0.02


def realwidth_config(layers: int = 3, dense_layers: int = 1, experts: int = 16, vocab: int = 4096,
                     mtp: bool = False, fp8: bool = False, widths: dict | None = None) -> dict:
    """config.json of the slice: DeepSeek-V3's widths (`widths` overrides some, for tests), `layers` decoder layers
    of which the first `dense_layers` dense, `experts` routed experts (top-8 in 8 groups, top-4 groups, as V3,
    when 8 divides them)."""
    groups = 8 if experts % 8 == 0 and experts >= 16 else 1
    cfg = dict(V3_WIDTHS, **(widths or {}))
    cfg = dict(cfg, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=vocab,
               num_hidden_layers=layers, first_k_dense_replace=dense_layers, moe_layer_freq=1,
               n_routed_experts=experts, n_group=groups, topk_group=4 if groups > 1 else 1,
               num_experts_per_tok=(widths or {}).get("num_experts_per_tok", min(8, experts)),
               num_nextn_predict_layers=1 if mtp else 0,
               hidden_act="silu", attention_bias=False, attention_dropout=0.0, tie_word_embeddings=False,
               bos_token_id=0, eos_token_id=1, initializer_range=INIT_STD, use_cache=True, torch_dtype="bfloat16")
    if fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}
    return cfg


def _layer_shapes(a: ModelArgs, layer: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint suffix (inside model.layers.N.) -> shape, for one decoder layer."""
    d, h = a.hidden_size, a.num_attention_heads
    shapes = {
        "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,),
        "self_attn.q_a_proj.weight": (a.q_lora_rank, d), "self_attn.q_a_layernorm.weight": (a.q_lora_rank,),
        "self_attn.q_b_proj.weight": (h * a.qk_head_dim, a.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": (a.kv_lora_rank + a.qk_rope_head_dim, d),
        "self_attn.kv_a_layernorm.weight": (a.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (h * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        "self_attn.o_proj.weight": (d, h * a.v_head_dim),
    }
    if not a.is_moe_layer(layer):
        i = a.intermediate_size
        shapes.update({"mlp.gate_proj.weight": (i, d), "mlp.up_proj.weight": (i, d), "mlp.down_proj.weight": (d, i)})
        return shapes
    i, shared = a.moe_intermediate_size, a.n_shared_experts * a.moe_intermediate_size
    shapes.update({"mlp.gate.weight": (a.n_routed_experts, d), "mlp.gate.e_score_correction_bias": (a.n_routed_experts,),
                   "mlp.shared_experts.gate_proj.weight": (shared, d), "mlp.shared_experts.up_proj.weight": (shared, d),
                   "mlp.shared_experts.down_proj.weight": (d, shared)})
    for e in range(a.n_routed_experts):
        for proj in EXPERT_NAMES:
            shapes[f"mlp.experts.{e}.{proj}.weight"] = (d, i) if proj == "down_proj" else (i, d)
    return shapes


def hub_tensors(a: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every tensor of the slice, in writing order (the MTP layer last)."""
    d, v = a.hidden_size, a.vocab_size
    top = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    assert set(top) == set(TOP_NAMES)
    out = [("model.embed_tokens.weight", top["model.embed_tokens.weight"])]
    for layer in range(a.num_hidden_layers + a.num_nextn_predict_layers):
        shapes = _layer_shapes(a, layer)
        assert all(k in LAYER_NAMES or k.startswith("mlp.experts.") for k in shapes)
        if layer >= a.num_hidden_layers:                            # the MTP layer's own parts and shared copies
            shapes.update({"enorm.weight": (d,), "hnorm.weight": (d,), "eh_proj.weight": (d, 2 * d),
                           "shared_head.norm.weight": (d,), "embed_tokens.weight": (v, d),
                           "shared_head.head.weight": (v, d)})
            assert all(k in MTP_NAMES or k in MTP_SHARED for k in list(shapes)[-6:])
        out += [(f"model.layers.{layer}.{k}", s) for k, s in shapes.items()]
    return out + [("model.norm.weight", top["model.norm.weight"]), ("lm_head.weight", top["lm_head.weight"])]


def _draw(name: str, shape: tuple[int, ...], seed: int, index: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=gen) * 0.05
    if "norm" in name:
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * INIT_STD


def _entries(name: str, shape, fp8: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    if name.endswith("e_score_correction_bias"):
        return [(name, "F32", shape)]
    if fp8 and len(shape) == 2 and not any(s in name for s in BF16_IN_FP8):
        return [(name, "F8_E4M3", shape), (name + "_scale_inv", "F32", scale_grid_shape(*shape))]
    return [(name, "BF16", shape)]


def write_realwidth_checkpoint(path, layers: int = 3, dense_layers: int = 1, experts: int = 16, vocab: int = 4096,
                               mtp: bool = False, dtype: str = "bf16", shards: int = 1, seed: int = 0,
                               tokenizer_from=None, widths: dict | None = None) -> Path:
    """Write the slice into `path` (config.json, shards, model.safetensors.index.json when shards > 1, and the
    tokenizer files of `tokenizer_from`, default the bundled demo's, whose 4096 tokens fit the default vocab)."""
    from .demo import DEMO_DIR

    if dtype not in ("bf16", "fp8"):
        raise ValueError(f"dtype must be bf16 or fp8, got {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = realwidth_config(layers, dense_layers, experts, vocab, mtp, dtype == "fp8", widths)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    args = ModelArgs.from_dir(path)
    tensors = hub_tensors(args)
    sizes = [torch.Size(s).numel() for _, s in tensors]
    per_shard, shard_of, acc = sum(sizes) / shards, [], 0
    for n in sizes:                                   # contiguous runs of tensors of about equal bytes
        shard_of.append(min(int(acc // per_shard), shards - 1))
        acc += n
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
             for i in range(shards)]
    weight_map = {}
    for shard in range(shards):
        mine = [(i, n, s) for i, (n, s) in enumerate(tensors) if shard_of[i] == shard]
        entries = [e for _, n, s in mine for e in _entries(n, s, dtype == "fp8")]
        with TensorFileWriter.create(path / names[shard], entries, {"format": "pt"}) as out:
            for i, name, shape in mine:
                t = _draw(name, shape, seed, i)
                kinds = _entries(name, shape, dtype == "fp8")
                if kinds[0][1] == "F8_E4M3":
                    q, s = fp8_block_quantize(t)
                    out.write(name, q)
                    out.write(name + "_scale_inv", s)
                else:
                    out.write(name, t if kinds[0][1] == "F32" else t.to(torch.bfloat16))
                del t
        weight_map.update({e[0]: names[shard] for e in entries})
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    source = Path(tokenizer_from) if tokenizer_from is not None else DEMO_DIR
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / f).is_file():
            shutil.copy(source / f, path / f)
    return path


def realwidth_moe_block(seed: int = 0, n_experts: int = 4):
    """(one MoE Block at DeepSeek-V3's widths in fp32, its ModelArgs): hidden 7168, 128 heads, lora 1536 / 512,
    2048-wide experts, `n_experts` routed experts in 2 groups (top-2, 1 group kept) so it fits a test; weights
    uniform at 1/sqrt(fan-in), norms around 1, a small router bias. For tests and benchmarks of one layer's math."""
    from .model import Block

    args = ModelArgs(num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=n_experts, num_experts_per_tok=2,
                     n_group=2, topk_group=1, vocab_size=64)
    torch.manual_seed(seed)
    block = Block(args, 1)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.uniform_(-1, 1).mul_(1.0 if "norm" in name else p.shape[-1] ** -0.5)
        block.ffn.gate.bias.uniform_(-0.05, 0.05)
    return block, args
