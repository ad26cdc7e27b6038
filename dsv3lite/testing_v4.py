"""DeepSeek-V4 checkpoints for tests and benchmarks, random and local (nothing is downloaded).

- tiny ones from transformers' DeepseekV4ForCausalLM (the oracle): `v4_hf_model`, and `write_v4_pair`, which writes
  the same weights twice: in transformers' save_pretrained layout (fp32) and in the released layout (official
  names, FP8 e4m3 dense weights with ue8m0 `.scale` grids, MXFP4 experts, BF16 / F32 / I32 elsewhere, plus a random
  MTP block), the fp32 copy holding exactly the values the released one decodes to;
- `write_v4_official`: any config in the released layout, tensor by tensor (bounded memory): the V4-geometry
  checkpoint (`v4_geometry_config`: 43 layers, 256 experts, top-6, 3 hash layers, the real compress_ratios, tiny
  widths) and the real-width V4-Flash slice (`v4_flash_slice_config`).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

_YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1}

# official-style configs (window 8, CSA 4, HCA 16: ~70 tokens cover every compression path; >= 8 index heads)
V4_VARIANTS = {
    "tiny": dict(vocab_size=320, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
                 head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, sliding_window=8,
                 compress_ratios=[0, 4, 128, 4, 128, 0], compress_rate_hca=16, index_n_heads=8, index_head_dim=16,
                 index_topk=4, n_routed_experts=8, num_experts_per_tok=2, num_hash_layers=2, swiglu_limit=0.5),
    # odd widths everywhere, CSA every 3, HCA every 10, a 7-token window, 9 index heads
    "odd": dict(vocab_size=301, hidden_size=48, moe_intermediate_size=20, num_hidden_layers=4, num_attention_heads=6,
                head_dim=24, qk_rope_head_dim=8, q_lora_rank=20, o_groups=3, o_lora_rank=12, sliding_window=7,
                compress_ratios=[4, 0, 128, 4, 0], compress_rate_csa=3, compress_rate_hca=10, index_n_heads=9,
                index_head_dim=12, index_topk=3, n_routed_experts=7, num_experts_per_tok=3, num_hash_layers=1,
                swiglu_limit=0.4),
}
_COMMON = dict(model_type="deepseek_v4", rope_theta=10000.0, compress_rope_theta=160000.0, rope_scaling=_YARN,
               max_position_embeddings=4096, rms_norm_eps=1e-6, routed_scaling_factor=1.5, n_shared_experts=1,
               hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, num_nextn_predict_layers=1, bos_token_id=0,
               eos_token_id=1, tie_word_embeddings=False, num_key_value_heads=1, scoring_func="sqrtsoftplus",
               hidden_act="silu")
INIT_STD = 0.06

# released dtypes by official name (docs/dsv4-math.md §5.1)
_FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.ffn\.shared_experts\.w[123]|"
                  r"^mtp\.0\.(e_proj|h_proj))\.weight$")
_MXFP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
_F32 = re.compile(r"(hc_(head|attn|ffn)_(fn|base|scale)|\.ape|\.attn_sink|\.ffn\.gate\.bias)$")
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
                "weight_block_size": [128, 128]}


def v4_config(variant: str = "tiny", **overrides) -> dict:
    """An official-style config.json dict of a tiny variant."""
    return {**_COMMON, **V4_VARIANTS[variant], **overrides}


def release_dtype(name: str) -> str:
    """How the released checkpoint stores the tensor of official name `name`: fp8 | mxfp4 | f32 | i32 | bf16."""
    if _MXFP4.search(name):
        return "mxfp4"
    if _FP8.search(name):
        return "fp8"
    if _F32.search(name):
        return "f32"
    return "i32" if name.endswith("tid2eid") else "bf16"


# --- transformers models (the oracle) ----------------------------------------------------------------------

def v4_hf_model(variant: str = "tiny", seed: int = 0, **overrides):
    """A random transformers DeepseekV4ForCausalLM (fp32) with every parameter that init leaves trivial made
    non-trivial: tid2eid distinct random experts per token, sinks, ape, mHC bases and scales, router bias, norms."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    spec = v4_config(variant, **overrides)
    spec.pop("model_type")
    config = DeepseekV4Config(initializer_range=INIT_STD, **spec)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    _perturb(model, seed)
    return model


def _perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)

    def noise(t, std):
        return torch.randn(t.shape, generator=gen) * std

    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("tid2eid"):
                k, e = t.shape[1], model.config.n_routed_experts
                t.copy_(torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t.shape[0])]))
            elif name.endswith(("sinks", "position_bias")):
                t.copy_(noise(t, 0.5))
            elif name.endswith(("hc.base", "hc_base")):
                t.copy_(noise(t, 0.3))
            elif name.endswith(("hc.scale", "hc_scale")):
                t.copy_(1 + noise(t, 0.2))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(noise(t, 0.1))
            elif "norm" in name and name.endswith("weight"):
                t.copy_(1 + noise(t, 0.1))


def write_v4_hf(path, variant: str = "tiny", seed: int = 0, tokenizer: bool = True, dtype=None,
                **overrides) -> Path:
    """A tiny transformers-layout checkpoint (save_pretrained, fp32, or `dtype`: torch.bfloat16) and a tokenizer."""
    from .testing import write_tokenizer

    path = Path(path)
    model = v4_hf_model(variant, seed, **overrides)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path)
    if tokenizer:
        write_tokenizer(path, vocab_size=min(400, model.config.vocab_size))
    return path


def write_v4_pair(official_dir, hf_dir, variant: str = "tiny", seed: int = 0, mtp: bool = True,
                  base: bool = False) -> tuple[Path, Path]:
    """The same tiny network twice: `official_dir` in the released layout and dtypes (plus a random MTP block when
    `mtp`), `hf_dir` in transformers' layout in fp32 holding exactly the values the released tensors decode to.
    base: as the Base releases (§5.5): FP8 experts with float32 128x128 scales, no expert_dtype."""
    from safetensors.torch import load_file, save_file

    from .v4.checkpoint import official_name

    official_dir, hf_dir = write_v4_hf(official_dir, variant, seed), Path(hf_dir)
    hf_dir.mkdir(parents=True, exist_ok=True)
    saved = load_file(official_dir / "model.safetensors")
    released, decoded = {}, {}
    for name, t in saved.items():
        out, decoded[name] = _release(official_name(name), t, base)
        released.update(out)
    if mtp:
        released.update(_mtp_block(variant, seed + 1, base))
    save_file(decoded, hf_dir / "model.safetensors", metadata={"format": "pt"})
    for f in official_dir.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "config.json":
            (hf_dir / f.name).write_bytes(f.read_bytes())
    (hf_dir / "config.json").write_bytes((official_dir / "config.json").read_bytes())
    (official_dir / "model.safetensors").unlink()
    save_file(released, official_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = v4_config(variant, quantization_config=QUANT_CONFIG, **({} if base else {"expert_dtype": "fp4"}))
    (official_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return official_dir, hf_dir


def _mtp_block(variant: str, seed: int, base: bool = False) -> dict[str, torch.Tensor]:
    """A random MTP block (mtp.0.*) in the released layout: a one-layer sliding, learned-routing V4 block from
    transformers plus its own projections, norms and hc_head."""
    from .v4.checkpoint import official_name

    cfg = V4_VARIANTS[variant]
    hf = v4_hf_model(variant, seed, num_hidden_layers=1, compress_ratios=[0, 0], num_hash_layers=0)
    tensors = _saved_state(hf)
    d = cfg["hidden_size"]
    gen = torch.Generator().manual_seed(seed)
    own = {"e_proj.weight": torch.randn(d, d, generator=gen) * INIT_STD,
           "h_proj.weight": torch.randn(d, d, generator=gen) * INIT_STD,
           **{f"{n}.weight": 1 + 0.1 * torch.randn(d, generator=gen) for n in ("enorm", "hnorm", "norm")},
           "hc_head_fn": tensors["model.hc_head.hc_fn"], "hc_head_base": tensors["model.hc_head.hc_base"],
           "hc_head_scale": tensors["model.hc_head.hc_scale"]}
    for name, t in tensors.items():
        official = official_name(name)
        if official.startswith("layers.0."):
            own[official[len("layers.0."):]] = t
    out = {}
    for name, t in own.items():
        out.update(_release("mtp.0." + name, t, base)[0])
    return out


def _saved_state(hf) -> dict[str, torch.Tensor]:
    """transformers' save_pretrained tensors of a model, in memory."""
    import tempfile

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        return load_file(Path(tmp) / "model.safetensors")


def _release(name: str, t: torch.Tensor, base: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({official name: released tensor(s)}, the fp32 values they decode to: the loader's bf16(fp32(q) * s) for
    FP8) for one tensor of official name; base: experts as FP8 with float32 scales."""
    from .quant.fp8 import fp8_block_dequant, fp8_block_quantize
    from .quant.mxfp4 import mxfp4_dequant, mxfp4_quantize

    kind = release_dtype(name)
    if kind == "mxfp4" and base:
        q, s = fp8_block_quantize(t)
        return {name: q, name[:-len("weight")] + "scale": s}, fp8_block_dequant(q, s).float()
    if kind == "fp8":
        q, s = fp8_quantize_ue8m0(t)
        return {name: q, name[:-len("weight")] + "scale": s}, fp8_block_dequant(q, s.float()).float()
    if kind == "mxfp4":
        codes, scales = mxfp4_quantize(t)
        return ({name: codes.view(torch.int8), name[:-len("weight")] + "scale": scales.view(torch.float8_e8m0fnu)},
                mxfp4_dequant(codes, scales))
    if kind == "f32":
        return {name: t.float().contiguous()}, t.float()
    if kind == "i32":
        return {name: t.to(torch.int32).contiguous()}, t
    b = t.to(torch.bfloat16).contiguous()
    return {name: b}, b.float()


def fp8_quantize_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 [N, K], F8_E8M0 scales [ceil(N/128), ceil(K/128)]): per 128x128 block the smallest
    power-of-two scale with amax / scale <= 448 (DeepSeek-V4's scale_fmt ue8m0)."""
    from .quant.fp8 import FP8_MAX, expand_block_scales, fp8_block_quantize

    _, s = fp8_block_quantize(w)                     # amax / 448 per block (1 for an all-zero block)
    s = torch.exp2(torch.ceil(torch.log2(s))).clamp_(2.0 ** -127, 2.0 ** 127)
    q = (w.float() / expand_block_scales(s, *w.shape)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.to(torch.float8_e8m0fnu)


# --- checkpoints drawn tensor by tensor -------------------------------------------------------------------

def official_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(official name, logical shape) of every tensor of a config's network, MTP block included, from the network
    itself (built on the meta device) and the name table."""
    from .loader import expected_tensors
    from .v4.checkpoint import checkpoint_name
    from .v4.config import V4Args
    from .v4.model import Transformer

    args = V4Args.from_dict(cfg)
    with torch.device("meta"):
        model = Transformer(args, with_mtp=args.has_mtp)
    out = []
    for name, shape in expected_tensors(model).items():
        if ".ffn.experts." in name:
            out += [(checkpoint_name(name, args, e), shape[1:]) for e in range(shape[0])]
        else:
            out.append((checkpoint_name(name, args), shape))
    return out


def _released_entries(name: str, shape) -> list[tuple[str, str, tuple[int, ...]]]:
    kind = release_dtype(name)
    scale = name[:-len("weight")] + "scale"
    if kind == "fp8":
        return [(name, "F8_E4M3", shape), (scale, "F8_E8M0", (-(-shape[0] // 128), -(-shape[1] // 128)))]
    if kind == "mxfp4":
        return [(name, "I8", (shape[0], shape[1] // 2)), (scale, "F8_E8M0", (shape[0], shape[1] // 32))]
    return [(name, {"f32": "F32", "i32": "I32", "bf16": "BF16"}[kind], shape)]


def _draw_mxfp4(name: str, shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random released MXFP4 codes and scales of a [N, K] expert matrix drawn as bytes (no quantization: fast),
    the weights' magnitude about K^-1/2."""
    n, k = shape
    exponent = 127 + round(math.log2(k ** -0.5 / 3))                 # e2m1 magnitudes average about 3
    scales = exponent + torch.randint(-1, 2, (n, k // 32), generator=gen)
    return {name: torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, generator=gen),
            name[:-len("weight")] + "scale": scales.to(torch.uint8).view(torch.float8_e8m0fnu)}


def _draw(name: str, shape, cfg: dict, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("tid2eid"):
        return torch.stack([torch.randperm(cfg["n_routed_experts"], generator=gen)[:shape[1]]
                            for _ in range(shape[0])])
    if name.endswith(("attn_sink", ".ape", "_base", "gate.bias")):
        return torch.randn(shape, generator=gen) * 0.1
    if name.endswith("_scale"):
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    if "norm" in name:
        return 1 + 0.1 * torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5


def write_v4_official(path, cfg: dict, seed: int = 0, tokenizer_from=None, layers_per_shard: int = 4) -> Path:
    """A random checkpoint of config `cfg` in the released layout and dtypes, each tensor drawn (seeded by its
    index), released and written before the next (memory: one tensor at a time); shards of `layers_per_shard`
    layers with an index. tokenizer_from: a directory whose tokenizer files are copied (default the demo's)."""
    from .demo import DEMO_DIR
    from .quant.tensorfile import TensorFileWriter

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = official_tensors(cfg)
    shard_of = {}
    for name, _ in tensors:
        m = re.match(r"layers\.(\d+)\.", name)
        shard_of[name] = int(m.group(1)) // layers_per_shard + 1 if m else 0
    n_shards = max(shard_of.values()) + 1
    files = [f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]
    weight_map = {}
    for shard in range(n_shards):
        mine = [(i, n, s) for i, (n, s) in enumerate(tensors) if shard_of[n] == shard]
        entries = [e for _, n, s in mine for e in _released_entries(n, s)]
        weight_map.update({e[0]: files[shard] for e in entries})
        with TensorFileWriter.create(path / files[shard], entries, {"format": "pt"}) as out:
            for i, name, shape in mine:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
                released = _draw_mxfp4(name, shape, gen) if release_dtype(name) == "mxfp4" else \
                    _release(name, _draw(name, shape, cfg, gen))[0]
                for n, t in released.items():
                    out.write(n, t.contiguous())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    source = Path(tokenizer_from) if tokenizer_from is not None else DEMO_DIR
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / f).is_file():
            (path / f).write_bytes((source / f).read_bytes())
    return path


FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4] + [0]      # V4-Flash's compress_ratios (43 layers + the MTP block)


def flash_config() -> dict:
    """V4-Flash's config.json (official keys; docs/dsv4-math.md §1.1)."""
    return dict(_COMMON, vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
                num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8,
                o_lora_rank=1024, sliding_window=128, compress_ratios=FLASH_RATIOS, index_n_heads=64,
                index_head_dim=128, index_topk=512, n_routed_experts=256, num_experts_per_tok=6, num_hash_layers=3,
                routed_scaling_factor=1.5, swiglu_limit=10.0, max_position_embeddings=1048576, topk_method="noaux_tc",
                norm_topk_prob=True, rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings":
                                                   65536, "beta_fast": 32, "beta_slow": 1},
                expert_dtype="fp4", quantization_config=QUANT_CONFIG)


def pro_config() -> dict:
    """V4-Pro's config.json (reported values; docs/dsv4-math.md §1.1)."""
    return dict(flash_config(), hidden_size=7168, moe_intermediate_size=3072, num_hidden_layers=61,
                num_attention_heads=128, q_lora_rank=1536, o_groups=16, compress_ratios=[128, 128] + [4, 128] * 29 +
                [4] + [0], index_topk=1024, n_routed_experts=384, routed_scaling_factor=2.5)


def v4_geometry_config(vocab_size: int = 4096) -> dict:
    """V4-Flash's routing geometry (43 layers, 256 experts, top-6, 3 hash layers, its compress_ratios) at tiny
    widths; HCA every 16 tokens so short prompts reach it."""
    return dict(flash_config(), vocab_size=vocab_size, hidden_size=64, moe_intermediate_size=32,
                num_attention_heads=4, head_dim=32, qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                sliding_window=8, index_n_heads=8, index_head_dim=16, index_topk=8, compress_rate_hca=16,
                max_position_embeddings=4096)


def v4_flash_slice_config(layers: int = 3, experts: int = 16, vocab_size: int = 4096) -> dict:
    """V4-Flash at its real widths (hidden 4096, 64 heads x 512, q_lora 1024, 8 x 1024 output groups, experts 2048
    wide in MXFP4, 64 index heads of 128) with few layers (sliding, CSA, HCA, ... as Flash's schedule continues
    after its first layer), few experts and a small vocabulary; layer 0 hash-routed."""
    ratios = [0] + [4, 128] * layers
    return dict(flash_config(), vocab_size=vocab_size, num_hidden_layers=layers, n_routed_experts=experts,
                compress_ratios=ratios[:layers] + [0], num_hash_layers=1)


def load_v4(root, device="cpu", dtype=torch.float32, mtp: bool = True, progress: bool = False, log=None,
            released_experts: bool = False):
    """A deepseek_v4 checkpoint directory -> its resident network (no engine): routed experts dequantized to
    `dtype`, or with `released_experts` served as released (MXFP4 blobs repacked from the checkpoint, as
    dsv3lite.load serves them; on the CPU through the packed kernel)."""
    from .builder import load_network
    from .errors import UserError
    from .v4.config import V4Args
    from .v4.loader import V4Loader

    if not released_experts:
        return V4Loader(root, torch.device(device), dtype, progress=progress, log=log).load(mtp=mtp)
    if V4Args.from_dict(json.loads((Path(root) / "config.json").read_text())).released_experts is None:
        raise UserError(f"the routed experts of {root} are not MXFP4 (no expert_dtype fp4): nothing to serve as "
                        f"released")
    return load_network(root, device, dtype, progress, log, mtp=mtp)
