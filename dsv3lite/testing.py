"""Tiny checkpoints for tests and benchmarks, written with transformers (the oracle) and `tokenizers`.

Nothing here downloads anything: models are random, tokenizers are trained on a built-in text.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]

# DeepSeek-V3-style template: system text first, then User/Assistant turns; assistant turns end with EOS.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{% set ns.system = ns.system + message['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step.
To be, or not to be, that is the question. All the world's a stage, and all the men and women merely players.
Mixture-of-experts models route every token to a few experts; the router picks them by score.
Numbers like 12345 and 3.14159 appear in text, as do symbols: #, $, %, &, (parentheses) and "quotes".
Ünïcödé text: café, naïve, 東京, Москва, emoji 🙂 and accents é à ü ö ß.
"""


def write_tokenizer(path: str | os.PathLike, vocab_size: int = 400, chat_template: str = CHAT_TEMPLATE,
                    template_file: bool = False, extra_special_tokens: tuple[str, ...] = ()) -> Path:
    """Train a small byte-level BPE with DeepSeek-style special tokens and write tokenizer files into `path`.

    template_file=True writes the chat template to chat_template.jinja instead of tokenizer_config.json;
    extra_special_tokens are added after DeepSeek's (a chat template's own markers).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TRAINING_TEXT.splitlines() * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 16384,
    }
    if template_file:
        (path / "chat_template.jinja").write_text(chat_template)
    else:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    return path


# --- tiny HF checkpoints ------------------------------------------------------------------------------

_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}

VARIANTS = {
    # DeepSeek-V3 shape: q_lora, sigmoid noaux_tc with groups (n_group > topk_group > 1), yarn RoPE
    "v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
               num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
               routed_scaling_factor=2.5, rope_scaling=_YARN, max_position_embeddings=256),
    # DeepSeek-V2-Lite shape: no q_lora, softmax greedy, 2 shared experts, yarn with mscale 0.707
    "v2lite": dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16,
                   n_shared_experts=2, num_experts_per_tok=4, topk_method="greedy", norm_topk_prob=False,
                   routed_scaling_factor=1.0, first_k_dense_replace=1,
                   rope_scaling=dict(_YARN, mscale=0.707, mscale_all_dim=0.707), max_position_embeddings=256),
    # DeepSeek-V2 shape: softmax group_limited_greedy
    "v2": dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=2,
               num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4, topk_group=2,
               norm_topk_prob=False, routed_scaling_factor=16.0, first_k_dense_replace=1,
               rope_scaling=_YARN, max_position_embeddings=256),
    # Moonlight shape: no q_lora, sigmoid without groups, plain RoPE theta 50000, eps 1e-5
    "moonlight": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                      num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16,
                      n_shared_experts=1, num_experts_per_tok=4, n_group=1, topk_group=1,
                      routed_scaling_factor=2.446, first_k_dense_replace=1, rope_theta=50000.0,
                      rms_norm_eps=1e-5, max_position_embeddings=256),
    # DeepSeek-V3.2 shape: V3 plus the lightning indexer; index_topk below the test prompts (sparse path)
    "v32": dict(model_type="deepseek_v32", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
                num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                routed_scaling_factor=2.5, rope_scaling=_YARN, max_position_embeddings=256,
                index_topk=8, index_n_heads=16, index_head_dim=16),
    # for FP8: dims that are not multiples of 128 and larger than one block
    "v3fp8": dict(model_type="deepseek_v3", hidden_size=192, intermediate_size=200, moe_intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, q_lora_rank=160, kv_lora_rank=136,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.5, rope_scaling=_YARN, max_position_embeddings=256),
}


def hf_model(variant: str = "v3", seed: int = 0, vocab_size: int = 400, init_std: float = 0.08, **overrides):
    """A random transformers DeepseekV3/V32/V2ForCausalLM (fp32) with a non-zero router correction bias."""
    import torch
    import transformers

    spec = dict(VARIANTS[variant], **overrides)
    model_type = spec.pop("model_type")
    family = {"deepseek_v3": "DeepseekV3", "deepseek_v32": "DeepseekV32", "deepseek_v2": "DeepseekV2"}[model_type]
    config_cls = getattr(transformers, family + "Config")
    model_cls = getattr(transformers, family + "ForCausalLM")
    spec.setdefault("num_key_value_heads", spec["num_attention_heads"])
    config = config_cls(vocab_size=vocab_size, initializer_range=init_std, bos_token_id=0, eos_token_id=1,
                        tie_word_embeddings=False, **spec)
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _perturb(model)
    return model


def _perturb(model) -> None:
    """Random init leaves the router correction bias at 0 and norms at 1: make both non-trivial, so a missing bias
    or a wrong norm placement shows up."""
    import torch

    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)


def write_checkpoint(path: str | os.PathLike, variant: str = "v3", seed: int = 0, dtype=None,
                     tokenizer: bool = True, **overrides) -> Path:
    """Write a tiny random HF checkpoint (save_pretrained: hub tensor names) plus a tokenizer into `path`."""
    path = Path(path)
    model = hf_model(variant, seed=seed, **overrides)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    if "num_nextn_predict_layers" not in cfg and "num_mtp_layers" not in cfg:
        # transformers' V3.2 config has no MTP field; DeepSeek's config.json declares its MTP layer
        cfg["num_nextn_predict_layers"] = 1
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    if tokenizer:
        write_tokenizer(path, vocab_size=min(400, model.config.vocab_size))
    return path


# DeepSeek-V3's routing geometry: 61 layers of which the first 3 dense, 256 routed experts, top-8 within the best 4 of
# 8 groups, sigmoid noaux_tc with a correction bias (the "v3" variant's router and, by default, its tiny widths)
V3_GEOMETRY = dict(num_hidden_layers=61, first_k_dense_replace=3, n_routed_experts=256, num_experts_per_tok=8,
                   n_group=8, topk_group=4, routed_scaling_factor=2.5)
LAYERS_PER_SHARD = 4      # the hub's V3 keeps a few layers per shard; a reader of one layer parses a small header


def geometry_model(seed: int = 0, vocab_size: int = 400, **overrides):
    """The random transformers DeepseekV3ForCausalLM (fp32) that write_geometry_checkpoint writes for the same
    arguments: V3_GEOMETRY at the "v3" variant's widths, `overrides` changing either."""
    return hf_model("v3", seed=seed, vocab_size=vocab_size, **dict(V3_GEOMETRY, **overrides))


def write_geometry_checkpoint(path: str | os.PathLike, mtp: bool = False, seed: int = 0, vocab_size: int = 400,
                              **overrides) -> Path:
    """An HF checkpoint of geometry_model(seed, vocab_size, **overrides) with the hub's tensor names (per-expert
    tensors), sharded LAYERS_PER_SHARD layers a shard with an index, and a tokenizer: per-layer host costs at V3's
    depth and expert count for tests and benchmarks. mtp=True adds a random MTP layer (layer num_hidden_layers),
    else the config declares none."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = geometry_model(seed, vocab_size, **overrides)
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    n_layers = model.config.num_hidden_layers
    for layer in range(n_layers):
        _split_expert_tensors(tensors, layer)
    cfg = model.config.to_dict()
    cfg.update(architectures=["DeepseekV3ForCausalLM"], dtype="float32", num_nextn_predict_layers=int(mtp))
    if mtp:
        tensors.update(_mtp_tensors(cfg, seed + 1))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    shards: dict[int, dict] = {}
    for name, t in tensors.items():
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        shards.setdefault(int(layer.group(1)) // LAYERS_PER_SHARD + 1 if layer else 0, {})[name] = t
    weight_map = {}
    for i, key in enumerate(sorted(shards)):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shards[key], path / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shards[key], fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_tokenizer(path, vocab_size=min(400, vocab_size))
    return path


# not FP8 in DeepSeek's checkpoints (V3.2's indexer weights_proj included)
# --- Kimi-K2.5: a multimodal checkpoint whose language model is a Kimi-K2 (V3) network ------------------------

KIMI_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>")
# Kimi's chat format: <|im_ROLE|>ROLE<|im_middle|>content<|im_end|> per message, the assistant prompt at the end
KIMI_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set role = message['role'] if message['role'] in ('system', 'user') else 'assistant' -%}"
    "{{ '<|im_' + role + '|>' + role + '<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_assistant|>assistant<|im_middle|>' }}{%- endif -%}"
)
_KIMI_TEXT = dict(model_type="kimi_k2", vocab_size=400, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
                  num_experts_per_tok=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                  routed_scaling_factor=2.827, rope_theta=50000.0, max_position_embeddings=256,
                  rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                "beta_fast": 1, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                  num_nextn_predict_layers=0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
_KIMI_VISION = dict(patch_size=14, num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                    pos_emb_height=4, pos_emb_width=4, pos_emb_time=2)
# in-memory (transformers) prefix -> the hub checkpoint's
_KIMI_HUB_NAMES = (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                   ("model.vision_tower.", "vision_tower."), ("model.mm_projector.", "mm_projector."))


def kimi_k25_model(seed: int = 0, init_std: float = 0.08):
    """A random transformers Kimi_K25ForConditionalGeneration (fp32): a tiny Kimi-K2 text model and vision tower."""
    import torch
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = dict(_KIMI_TEXT, initializer_range=init_std)
    config = Kimi_K25Config(text_config=text, vision_config=dict(_KIMI_VISION), projection_hidden_size=32,
                            tie_word_embeddings=False, initializer_range=init_std)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    _perturb(model)
    return model


def write_kimi_k25_checkpoint(path: str | os.PathLike, seed: int = 0) -> Path:
    """A tiny Kimi-K2.5 checkpoint laid out as the hub's: config.json holding the language model in text_config
    (model_type kimi_k2), its tensors under language_model.*, per-expert tensors, a vision tower and projector
    (vision_tower.*, mm_projector.*), and a tokenizer with Kimi's chat template."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = kimi_k25_model(seed)
    text_tensors, other = {}, {}
    for name, t in model.state_dict().items():
        t = t.detach().clone().contiguous()
        if name.startswith("model.language_model."):
            text_tensors["model." + name[len("model.language_model."):]] = t
        elif name == "lm_head.weight":
            text_tensors[name] = t
        else:
            other[name] = t
    for layer in range(_KIMI_TEXT["num_hidden_layers"]):
        _split_expert_tensors(text_tensors, layer)
    tensors = {"language_model." + n: t for n, t in text_tensors.items()}
    for name, t in other.items():
        old, new = next(p for p in _KIMI_HUB_NAMES if name.startswith(p[0]))
        tensors[new + name[len(old):]] = t
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["text_config"]["model_type"] = "kimi_k2"           # as the hub's config.json says
    cfg["architectures"] = ["KimiK25ForConditionalGeneration"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(path, vocab_size=_KIMI_TEXT["vocab_size"], chat_template=KIMI_CHAT_TEMPLATE,
                    template_file=True, extra_special_tokens=KIMI_TOKENS)
    return path


FP8_SKIP = ("norm", "mlp.gate.weight", "embed_tokens", "lm_head", "eh_proj", "e_score_correction_bias",
            "indexer.weights_proj")


def write_fp8_copy(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Copy an HF checkpoint with every projection weight as FP8 e4m3 + weight_scale_inv (DeepSeek's layout)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from .quant.fp8 import fp8_block_quantize

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in FP8_SKIP):
            out[name], out[name + "_scale_inv"] = fp8_block_quantize(t)
        else:
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("generation_config.json", "chat_template.jinja"):
            shutil.copy(f, dst / f.name)
    return dst


def hf_reference_for_fp8(fp8_dir: str | os.PathLike, variant: str = "v3fp8"):
    """transformers model (fp32) holding the FP8 checkpoint's weights dequantized the reference way."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from .loader import dequant_fp8

    fp8_dir = Path(fp8_dir)
    raw = load_file(fp8_dir / "model.safetensors")
    state = {}
    for name, t in raw.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequant_fp8(t, raw[name + "_scale_inv"])
        state[name] = t.float()
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg.pop("quantization_config")
    tmp = fp8_dir.parent / (fp8_dir.name + "-hf-ref")
    tmp.mkdir(exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, experts_implementation="eager").eval()


def add_mtp_weights(path: str | os.PathLike, seed: int = 1, init_std: float = 0.08) -> Path:
    """Give a tiny checkpoint a random MTP layer (model.layers.{num_hidden_layers}.*: a full MoE decoder
    layer plus enorm, hnorm, eh_proj and shared_head.norm), as DeepSeek-V3 checkpoints carry one."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    tensors = load_file(path / "model.safetensors")
    tensors.update(_mtp_tensors(cfg, seed, init_std))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _mtp_tensors(cfg: dict, seed: int, init_std: float = 0.08) -> dict:
    """A random MTP layer for a checkpoint of config `cfg`, under the hub's names (per-expert tensors)."""
    import torch

    n = cfg["num_hidden_layers"]
    variant_model = hf_model_from_config(cfg, seed=seed, init_std=init_std, num_hidden_layers=1,
                                         first_k_dense_replace=0)
    tensors = {}
    d = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    for name, t in variant_model.state_dict().items():
        if name.startswith("model.layers.0."):
            tensors[f"model.layers.{n}." + name[len("model.layers.0."):]] = t.detach().clone().contiguous()
    _split_expert_tensors(tensors, n)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{n}.{norm}.weight"] = 1.0 + 0.1 * torch.randn(d, generator=gen)
    tensors[f"model.layers.{n}.eh_proj.weight"] = init_std * torch.randn(d, 2 * d, generator=gen)
    return tensors


def hf_model_from_config(cfg: dict, seed: int = 0, init_std: float = 0.08, **overrides):
    """A random transformers model with the shapes of an existing config.json (plus overrides)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    if "num_hidden_layers" in overrides:      # per-layer lists (V3.2's) are derived again for the new depth
        for key in ("mlp_layer_types", "layer_types"):
            spec.pop(key, None)
    spec.update(overrides, initializer_range=init_std)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    _perturb(model)
    return model


def _split_expert_tensors(tensors: dict, layer: int) -> None:
    """transformers keeps experts fused in memory (gate_up_proj [E, 2I, D], down_proj [E, D, I]); checkpoints
    store them per expert. Split the fused tensors of `layer` into hub names."""
    prefix = f"model.layers.{layer}.mlp.experts."
    gate_up = tensors.pop(prefix + "gate_up_proj", None)
    down = tensors.pop(prefix + "down_proj", None)
    if gate_up is None:
        return
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        tensors[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter].contiguous()
        tensors[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:].contiguous()
        tensors[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()


def hf_mtp_logits(hf, path: str | os.PathLike, input_ids):
    """Oracle for the MTP head: transformers' MtpLayer with the checkpoint's MTP weights copied in by hand
    (its own lookup assumes layer 61). Returns logits [B, T-1, V] for pairs (h_i, t_{i+1}), i < T-1."""
    import torch
    from safetensors.torch import load_file
    from transformers.masking_utils import create_causal_mask
    from transformers.modeling_layers import MtpLayer

    cfg = hf.config
    n = cfg.num_hidden_layers
    if getattr(cfg, "num_mtp_layers", None) is not None:
        mtp_cfg = cfg.get_mtp_config()
    else:   # V3.2: transformers declares no MTP config; the MTP block is one more (MoE, indexed) decoder layer
        import copy

        mtp_cfg = copy.deepcopy(cfg)
        mtp_cfg.num_hidden_layers, mtp_cfg.first_k_dense_replace = 1, 0
        mtp_cfg.layer_types, mtp_cfg.mlp_layer_types = cfg.layer_types[:1], ["sparse"]
    layer_cls = type(hf.model.layers[-1])
    norm_cls = type(hf.model.norm)
    mtp = MtpLayer(mtp_cfg, layer_cls, norm_cls, 0).eval()
    tensors = load_file(Path(path) / "model.safetensors")
    prefix = f"model.layers.{n}."
    state = {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest.startswith(("embed_tokens", "shared_head.head")):
            continue
        rest = rest.replace("shared_head.norm", "post_norm")
        if rest.split(".")[0] not in ("enorm", "hnorm", "eh_proj", "post_norm"):
            rest = "mtp_block." + rest
        state[rest] = t
    # fuse per-expert weights into transformers' in-memory layout
    experts = sorted({int(k.split(".")[3]) for k in state if k.startswith("mtp_block.mlp.experts.")})
    if experts:
        p = "mtp_block.mlp.experts."
        gate = [state.pop(f"{p}{e}.gate_proj.weight") for e in experts]
        up = [state.pop(f"{p}{e}.up_proj.weight") for e in experts]
        down = [state.pop(f"{p}{e}.down_proj.weight") for e in experts]
        state[p + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        state[p + "down_proj"] = torch.stack(down)
    missing, unexpected = mtp.load_state_dict(state, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    mtp.mtp_block.mlp.experts.config._experts_implementation = "eager"
    with torch.no_grad():
        hidden = hf.model(input_ids).last_hidden_state                 # after model.norm
        emb = hf.model.embed_tokens(input_ids[:, 1:])
        prev = hidden[:, :-1]
        pos = torch.arange(1, input_ids.shape[1], device=input_ids.device)[None]   # HF's i+1 convention
        pe = hf.model.rotary_emb(emb, pos)
        mask = create_causal_mask(config=mtp_cfg, inputs_embeds=emb, attention_mask=None, cache=None,
                                  position_ids=pos, allow_is_causal_skip=False)   # V3.2's indexer reads the mask
        out = mtp(emb, prev, position_embeddings=pe, attention_mask=mask, position_ids=pos, cache=None)
        return hf.lm_head(out)


def offload_budget(path, slots: int, experts: str, ctx: int = 160, mtp: bool = True) -> int:
    """A --gpu-mem (bytes, float32 compute) that buys exactly `slots` expert slots for checkpoint `path`."""
    import torch

    from .config import ModelArgs
    from .offload.setup import plan_for

    plan, *_ = plan_for(Path(path), ModelArgs.from_dir(path), 1 << 40, ctx, experts, mtp, torch.float32)
    return plan.resident + slots * plan.slot_bytes


def paced(generate, seconds_per_token: float):
    """Wrap an Engine's generate so it yields at most one chunk per `seconds_per_token` (tests of Stop and of
    client disconnects then do not depend on how fast the machine decodes). Closing the wrapper closes the
    inner generation."""
    import time

    def wrapped(ids, **kw):
        inner = generate(ids, **kw)

        def gen():
            try:
                for chunk in inner:
                    time.sleep(seconds_per_token)
                    yield chunk
            finally:
                inner.close()
        return gen()

    return wrapped


class KernelSpy:
    """Counts the calls of a compiled CPU step's sub-step functions (kernels/cpu_decode.py, cpu_v4.py) that ran (a
    result) and those left to the eager path (None), patched in through a test's monkeypatch."""

    def __init__(self, monkeypatch, kernels, names=("layers", "attention", "feed_forward")):
        self.ran = {name: 0 for name in names}
        self.declined = dict(self.ran)
        for name in names:
            monkeypatch.setattr(kernels, name, self._wrap(name, getattr(kernels, name)))

    def _wrap(self, name, real):
        def call(*a, **kw):
            out = real(*a, **kw)
            (self.ran if out is not None else self.declined)[name] += 1
            return out
        return call


# operators a CUDA graph cannot hold, and that sync a step: reads of tensor data to the host, data-dependent shapes,
# tensors made from host values
HOST_READS = ("aten._local_scalar_dense", "aten.item", "aten.equal", "aten.is_nonzero", "aten.nonzero",
              "aten.argwhere", "aten.masked_select", "aten._unique", "aten.unique", "aten.bincount",
              "aten.repeat_interleave.Tensor", "aten.lift_fresh")


class HostReads:
    """Records the operators that a CUDA graph cannot hold, run under it: reads of tensor data to the host
    (.item(), .tolist(), bool(t)), data-dependent shapes, and tensors made from host values (a copy from
    pageable memory inside a capture). `with probe.mode(): ...` records into probe.found."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        found = self.found = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = str(func)
                if name.startswith(HOST_READS):
                    found.append(name)
                return func(*args, **(kwargs or {}))
        self.mode = Mode

    def capture(self, fn):
        """A stand-in capture for dsv3lite.executors.graphs (static outputs, a replay that rewrites them), under the probe."""
        with self.mode():
            static = {k: v.clone() for k, v in fn().items()}

        def replay():
            with self.mode():
                for k, v in fn().items():
                    static[k].copy_(v)
        return static, replay
