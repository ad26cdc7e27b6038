"""Tiny checkpoints in the layout Kimi-K2-Thinking and Kimi-K2.5 are released in (routed experts as compressed-tensors
`pack-quantized` int4, packed by the compressed-tensors package itself; everything else BF16), and their dequantized
copies that transformers loads as the oracle. For tests and benchmarks; compressed-tensors and transformers are dev
dependencies, imported here only.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from .testing import (KIMI_CHAT_TEMPLATE, KIMI_TOKENS, _KIMI_TEXT, _split_expert_tensors, hf_model,
                      write_kimi_k25_checkpoint, write_tokenizer)

# the quantization_config Kimi-K2-Thinking's config.json declares; for Kimi-K2.5 (inside text_config) the same
# scheme with an ignore list of regular expressions that also names the vision tower and projector
KIMI_INT4_QUANT = {
    "config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 32, "num_bits": 4,
                    "observer": "minmax", "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                    "type": "int"}}},
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
KIMI_K25_INT4_QUANT = dict(KIMI_INT4_QUANT, ignore=[
    "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "re:.*lm_head.*",
    "re:.*vision_tower.*", "re:.*mm_projector.*"])
# a Kimi-K2 text model (the K2.5 test's widths) with 3 groups of 32 along the experts' intermediate size: an odd
# group count for the CPU kernel's tail
KIMI_K2_INT4 = {k: v for k, v in _KIMI_TEXT.items() if k not in (
    "model_type", "vocab_size", "num_key_value_heads", "tie_word_embeddings", "bos_token_id", "eos_token_id")}
KIMI_K2_INT4["moe_intermediate_size"] = 96
_ROUTED = re.compile(r"mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")


def ct_pack(weight):
    """weight [N, K] bf16 -> {weight_packed, weight_scale, weight_shape}: compressed-tensors' own min/max observer,
    quantize and int32 packing (symmetric int4, group 32), as Kimi's checkpoints hold a routed-expert matrix."""
    import torch
    from compressed_tensors.compressors import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    groups = weight.view(weight.shape[0], -1, 32)
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    codes = quantize(weight, scale, zero, args, dtype=torch.int8)
    return {"weight_packed": pack_to_int32(codes, 4), "weight_scale": scale.contiguous(),
            "weight_shape": torch.tensor(list(weight.shape))}


def ct_unpack(packed, scale, shape):
    """compressed-tensors' own unpacking and dequantization of one packed weight -> bf16 [N, K]."""
    import torch
    from compressed_tensors.compressors import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, dequantize

    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    codes = unpack_from_int32(packed, 4, torch.Size(shape))
    return dequantize(codes, scale, torch.zeros_like(scale), args)


def _pack_routed(tensors: dict) -> dict:
    """Every routed-expert weight of a checkpoint's tensors (bf16) as compressed-tensors' packed triple."""
    out = {}
    for name, t in tensors.items():
        if _ROUTED.search(name):
            for part, v in ct_pack(t).items():
                out[name.removesuffix("weight") + part] = v
        else:
            out[name] = t
    return out


def write_kimi_k2_int4_checkpoint(path, seed: int = 0) -> Path:
    """A tiny Kimi-K2-Thinking: a Kimi-K2 text model (model_type kimi_k2, DeepseekV3ForCausalLM) in BF16 with its
    routed experts packed by compressed-tensors (KIMI_INT4_QUANT), and a tokenizer with Kimi's chat template."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = hf_model("v3", seed=seed, **KIMI_K2_INT4).to(torch.bfloat16)
    tensors = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    for layer in range(model.config.num_hidden_layers):
        _split_expert_tensors(tensors, layer)
    save_file(_pack_routed(tensors), path / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], dtype="bfloat16",
               num_nextn_predict_layers=0, quantization_config=KIMI_INT4_QUANT)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(path, vocab_size=model.config.vocab_size, chat_template=KIMI_CHAT_TEMPLATE, template_file=True,
                    extra_special_tokens=KIMI_TOKENS)
    return path


def write_kimi_k25_int4_checkpoint(path, seed: int = 0) -> Path:
    """A tiny Kimi-K2.5 as released: write_kimi_k25_checkpoint's layout (language_model.*, a vision tower) in BF16,
    its routed experts packed by compressed-tensors and the quantization_config inside text_config."""
    import torch
    from safetensors.torch import load_file, save_file

    path = write_kimi_k25_checkpoint(path, seed)
    tensors = {n: t.to(torch.bfloat16) if t.is_floating_point() else t
               for n, t in load_file(path / "model.safetensors").items()}
    save_file(_pack_routed(tensors), path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = KIMI_K25_INT4_QUANT
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def write_dequantized_copy(src, dst) -> Path:
    """`src` with every packed weight dequantized by compressed-tensors (bf16 `X.weight`) and no quantization_config:
    the checkpoint transformers loads as the oracle for `src`."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    raw = {}
    for f in sorted(src.glob("*.safetensors")):
        raw.update(load_file(f))
    out = {}
    for name, t in raw.items():
        if name.endswith("weight_packed"):
            stem = name.removesuffix("weight_packed")
            out[stem + "weight"] = ct_unpack(t, raw[stem + "weight_scale"], raw[stem + "weight_shape"].tolist())
        elif not name.endswith(("weight_scale", "weight_shape")):
            out[name] = t
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    cfg.get("text_config", {}).pop("quantization_config", None)
    if cfg["model_type"] == "kimi_k2":
        cfg["model_type"] = "deepseek_v3"                  # transformers' class for Kimi-K2's network
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return dst
