"""ModelArgs: the one description of a DeepSeek-V3-family network, read from a checkpoint's config.json.

Covers model_type deepseek_v3 (V3/R1/V3.1, Moonlight), deepseek_v32 (V3.2: V3 plus the lightning indexer of
DeepSeek Sparse Attention), kimi_k2, kimi_k25 (Kimi-K2.5: its text_config, a Kimi-K2 / V3 network; the vision
tower is not run) and deepseek_v2 (V2, V2.5, V2-Lite). Derived values (softmax scale, latent and cache widths,
which layers are MoE, the MTP layer index) live in __post_init__ so nothing else recomputes them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import config_rules
from .errors import UserError

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_k25", "deepseek_v2", "deepseek_v4")
# multimodal checkpoints whose language model is a text_config of one of the types above
_TEXT_CONFIG_TYPES = {"kimi_k25": ("kimi_k2", "deepseek_v3")}
# ... and whose checkpoint holds the language model's tensors under this prefix (the other towers' are not run)
TEXT_MODEL_PREFIX = "language_model."

# Per-family defaults for fields a config.json may leave out (the values transformers' config classes use).
_FAMILY_DEFAULTS = {
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True},
    "deepseek_v32": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
                     "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128},
    "kimi_k2": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True},
    "kimi_k25": {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True},
    "deepseek_v2": {"scoring_func": "softmax", "topk_method": "greedy", "norm_topk_prob": False},
}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude factor m(s, mu) = 0.1 * mu * ln(s) + 1 (1 when s <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass
class ModelArgs:
    model_type: str = "deepseek_v3"
    vocab_size: int = 129280
    hidden_size: int = 7168                 # residual width D
    num_hidden_layers: int = 61             # main decoder layers; the MTP layer is extra
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str | None = None          # the checkpoint's declared dtype
    # dense MLP (layers < first_k_dense_replace)
    intermediate_size: int = 18432
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    mlp_layer_types: list[str] | None = None   # "dense" | "sparse" per main layer (transformers' V3.2); wins when given
    # mla
    num_attention_heads: int = 128
    q_lora_rank: int | None = 1536          # None: a single q_proj (V2-Lite, Moonlight)
    kv_lora_rank: int = 512                 # latent width d_c (cached)
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # dsa: the lightning indexer of V3.2 (index_topk 0: no indexer, dense attention everywhere)
    index_topk: int = 0                     # each query attends to the top index_topk earlier tokens
    index_n_heads: int = 64
    index_head_dim: int = 128               # its first qk_rope_head_dim dims carry (NeoX-style) RoPE
    # moe
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"           # sigmoid (V3) | softmax (V2)
    topk_method: str = "noaux_tc"           # noaux_tc | greedy | group_limited_greedy
    # rope / yarn
    rope_theta: float = 10000.0
    rope_type: str = "default"              # default | yarn
    rope_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    rope_attention_factor: float | None = None
    rope_interleave: bool = True            # RoPE pairs are adjacent dims (2i, 2i+1)
    max_position_embeddings: int = 4096
    # mtp
    num_nextn_predict_layers: int = 0
    # fp8 checkpoints
    fp8_block_size: tuple[int, int] | None = None
    # routed experts stored in an expert format of their own (compressed-tensors int4: "int4g32"), served as stored
    released_experts: str | None = None
    # derived in __post_init__
    qk_head_dim: int = field(init=False)
    latent_dim: int = field(init=False)
    index_dim: int = field(init=False)      # indexer key values cached per token and layer (0 without an indexer)
    cache_dim: int = field(init=False)      # cached values per token and layer: [latent | indexer key]
    softmax_scale: float = field(init=False)
    cos_sin_scale: float = field(init=False)
    mtp_layer_id: int = field(init=False)

    def __post_init__(self):
        config_rules.check(self)               # type and range of every field read (config_rules.py's table)
        if self.model_type != "deepseek_v32":
            self.index_topk = 0
        elif self.index_topk < 1:
            raise UserError(f"config: index_topk must be at least 1, got {self.index_topk}")
        if self.index_topk:
            if not self.q_lora_rank:
                raise UserError("config: deepseek_v32 needs q_lora_rank (its indexer reads the query latent)")
            if not self.qk_rope_head_dim <= self.index_head_dim:
                raise UserError(f"config: index_head_dim {self.index_head_dim} is smaller than qk_rope_head_dim "
                                f"{self.qk_rope_head_dim}")
        if self.mlp_layer_types is not None and (len(self.mlp_layer_types) != self.num_hidden_layers or
                                                 not set(self.mlp_layer_types) <= {"dense", "sparse"}):
            raise UserError(f"config: mlp_layer_types must list 'dense' or 'sparse' for each of the "
                            f"{self.num_hidden_layers} layers")
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.latent_dim = self.kv_lora_rank + self.qk_rope_head_dim
        self.index_dim = self.index_head_dim if self.index_topk else 0
        self.cache_dim = self.latent_dim + self.index_dim
        scale = self.qk_head_dim ** -0.5
        cos_sin = 1.0
        if self.rope_type == "yarn":
            if self.mscale_all_dim:
                scale *= yarn_mscale(self.rope_factor, self.mscale_all_dim) ** 2
            if self.rope_attention_factor is not None:
                cos_sin = self.rope_attention_factor
            elif self.mscale and self.mscale_all_dim:
                cos_sin = yarn_mscale(self.rope_factor, self.mscale) / yarn_mscale(self.rope_factor, self.mscale_all_dim)
            else:
                cos_sin = yarn_mscale(self.rope_factor)
        self.softmax_scale = scale
        self.cos_sin_scale = cos_sin
        self.mtp_layer_id = self.num_hidden_layers

    # --- layer structure -------------------------------------------------------------------
    def is_moe_layer(self, layer_id: int) -> bool:
        """MTP layers (id >= num_hidden_layers) are always MoE; main layers follow first_k_dense_replace/freq."""
        if layer_id >= self.num_hidden_layers:
            return True
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer_id] == "sparse"
        return layer_id >= self.first_k_dense_replace and layer_id % max(self.moe_layer_freq, 1) == 0

    @property
    def moe_layer_ids(self) -> list[int]:
        """Main-model MoE layers (the MTP layer is not included)."""
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def has_gate_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @property
    def has_indexer(self) -> bool:
        """V3.2: every layer has a lightning indexer (sparse attention beyond index_topk tokens)."""
        return self.index_topk > 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes per token for all main layers at 2 bytes/value: the latent, plus the indexer's key on V3.2."""
        return self.cache_dim * 2 * self.num_hidden_layers

    def stop_ids(self) -> set[int]:
        ids = self.eos_token_id
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, list) else {int(ids)}

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelArgs":
        model_type = cfg.get("model_type")
        if model_type == "deepseek_v4":            # a family of its own (dsv3lite/v4)
            from .v4.config import V4Args
            return V4Args.from_dict(cfg)
        if model_type in _TEXT_CONFIG_TYPES:
            cfg = _text_config(cfg, model_type)
        if model_type not in SUPPORTED_MODEL_TYPES:
            what = " (DeepSeek-V4.1, a different architecture)" if model_type == "deepseek_v41" else ""
            raise UserError(f"unsupported model_type {model_type!r}{what}: dsv3lite runs "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        known = {f.name for f in fields(cls) if f.init}
        kw = {k: v for k, v in _FAMILY_DEFAULTS[model_type].items()}
        kw.update({k: v for k, v in cfg.items() if k in known and v is not None})
        kw["model_type"] = model_type
        if cfg.get("q_lora_rank", "absent") is None:
            kw["q_lora_rank"] = None
        if "num_mtp_layers" in cfg and "num_nextn_predict_layers" not in cfg:
            kw["num_nextn_predict_layers"] = cfg["num_mtp_layers"] or 0
        if "dtype" in cfg and "torch_dtype" not in cfg:
            kw["torch_dtype"] = cfg["dtype"]
        # V2 configs may say n_group/topk_group null with greedy routing
        kw["n_group"] = cfg.get("n_group") or 1
        kw["topk_group"] = cfg.get("topk_group") or 1
        kw.update(_rope_fields(cfg))
        quant = cfg.get("quantization_config") or {}
        if quant.get("quant_method") == "compressed-tensors":      # Kimi-K2-Thinking / K2.5's int4 experts
            from .quant.compressed_tensors import expert_format

            kw["released_experts"] = expert_format(quant, TEXT_MODEL_PREFIX if model_type in _TEXT_CONFIG_TYPES else "",
                                                   mtp=bool(kw.get("num_nextn_predict_layers")))
        elif quant:
            if quant.get("quant_method") != "fp8":
                raise UserError(f"unsupported quantization_config.quant_method {quant.get('quant_method')!r} (fp8 block "
                                f"or compressed-tensors int4 checkpoints only)")
            block = quant.get("weight_block_size") or (128, 128)
            if not (isinstance(block, (list, tuple)) and len(block) == 2 and
                    all(config_rules.POSITIVE_INT.problem(b) is None for b in block)):
                raise UserError(f"config: quantization_config.weight_block_size must be two integers >= 1, got "
                                f"{block!r}")
            kw["fp8_block_size"] = tuple(block)
        try:
            return cls(**kw)
        except TypeError as e:
            raise UserError(f"config.json: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelArgs":
        path = Path(path)
        if not path.exists():
            raise UserError(f"weights directory not found: {path}")
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise UserError(f"no config.json in {path}")
        try:
            cfg = json.loads(file.read_bytes())
        except OSError as e:
            raise UserError(f"cannot read {file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise UserError(f"{file} is not a JSON text file (it is not UTF-8): is this a checkpoint's "
                            f"config.json?") from None
        except ValueError as e:               # json.JSONDecodeError
            raise UserError(f"{file} is not valid JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise UserError(f"{file} does not hold a JSON object")
        return cls.from_dict(cfg)


def _text_config(cfg: dict, model_type: str) -> dict:
    """The language model's config of a multimodal checkpoint (Kimi-K2.5: `text_config`, a Kimi-K2 config), with
    the top level's token ids, tying and quantization where the text config leaves them out."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise UserError(f"config: a {model_type} config.json needs a text_config object (the language model)")
    inner = text.get("model_type", _TEXT_CONFIG_TYPES[model_type][0])
    if inner not in _TEXT_CONFIG_TYPES[model_type]:
        raise UserError(f"config: {model_type} text_config has model_type {inner!r}; dsv3lite runs "
                        f"{' or '.join(_TEXT_CONFIG_TYPES[model_type])} there")
    out = dict(text)
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings", "quantization_config", "dtype", "torch_dtype"):
        if out.get(key) is None and cfg.get(key) is not None:
            out[key] = cfg[key]
    out["model_type"] = model_type
    return out


def _rope_fields(cfg: dict) -> dict:
    """Flatten `rope_scaling` (HF 4.x, hub files) or `rope_parameters` (HF 5.x) into ModelArgs fields."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    out = {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    if theta is not None:
        out["rope_theta"] = theta
    rtype = rope.get("rope_type") or rope.get("type") or "default"
    if rtype not in ("default", "yarn"):
        raise UserError(f"unsupported rope type {rtype!r} (default or yarn)")
    out["rope_type"] = rtype
    if rtype == "yarn":
        max_pos = cfg.get("max_position_embeddings", 4096)
        orig = rope.get("original_max_position_embeddings", 4096)
        factor = rope.get("factor")                   # (config_rules checks them: 0 must not become a default)
        if factor is None and config_rules.POSITIVE_INT.problem(orig) is None and isinstance(max_pos, (int, float)):
            factor = max_pos / orig
        out.update(rope_factor=factor, original_max_position_embeddings=orig,
                   beta_fast=_given(rope.get("beta_fast"), 32.0), beta_slow=_given(rope.get("beta_slow"), 1.0),
                   mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                   rope_attention_factor=rope.get("attention_factor"))
    return out


def _given(value, default):
    return default if value is None else value
