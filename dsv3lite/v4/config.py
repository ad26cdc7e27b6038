"""V4Args: the one description of a DeepSeek-V4 network (V4-Flash, V4-Pro), read from a checkpoint's config.json.

Both config styles are accepted (docs/dsv4-math.md §1.3): DeepSeek's official keys (`compress_ratios`,
`num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, `compress_rope_theta`, top-level `expert_dtype`) and the keys
transformers' save_pretrained writes (`layer_types`, `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`,
`rope_parameters`, `quantization_config.expert_dtype`). Checkpoints whose MTP block is replaced by the DSpark drafter
(V4-Flash-0731, V4-Pro-0813) load as their backbone with MTP off.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..errors import UserError
from .kinds import ATTN_KINDS, CSA, HCA, SLIDING

_RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}     # official compress_ratios entries
_TYPE_KINDS = {"sliding_attention": SLIDING, "compressed_sparse_attention": CSA,
               "heavily_compressed_attention": HCA}  # transformers' layer_types / compress_rates keys
_KIND_TYPES = {v: k for k, v in _TYPE_KINDS.items()}
_MLP_TYPES = ("hash_moe", "moe")
EXPERT_DTYPES = ("fp4", "fp8")


@dataclass
class V4Args:
    model_type: str = "deepseek_v4"
    vocab_size: int = 129280
    hidden_size: int = 4096                 # residual width D (each of the hc_mult streams)
    num_hidden_layers: int = 43             # main layers; the MTP block is extra
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    torch_dtype: str | None = None          # the checkpoint's declared dtype
    max_position_embeddings: int = 1048576
    # attention: MQA over one head_dim-wide key = value row per token
    num_attention_heads: int = 64
    head_dim: int = 512
    qk_rope_head_dim: int = 64              # RoPE on the LAST qk_rope_head_dim dims (interleaved pairs)
    q_lora_rank: int = 1024
    o_groups: int = 8                       # grouped low-rank output projection: groups of heads ...
    o_lora_rank: int = 1024                 # ... each projected to this width
    sliding_window: int = 128               # raw kv every query sees (its own token included)
    attn_kinds: list[str] = field(default_factory=list)   # per layer, then the MTP block: sliding | csa | hca
    compress_rate_csa: int = 4              # tokens per compressed entry (CSA windows overlap: width 2m, stride m)
    compress_rate_hca: int = 128
    index_n_heads: int = 64                 # the CSA layers' lightning indexer
    index_head_dim: int = 128
    index_topk: int = 512
    # moe: every layer, sqrt-softplus scores, no groups; the first num_hash_layers route by token id (tid2eid)
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048       # routed and shared experts
    num_hash_layers: int = 3
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0              # SwiGLU clamp: silu(min(gate, L)) * clamp(up, -L, L)
    # mHC: the residual is hc_mult streams
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # rope: main (sliding layers, MTP) and compress (CSA / HCA layers, YaRN without an attention factor)
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    compress_rope_type: str = "yarn"        # yarn | default
    rope_factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # mtp
    num_nextn_predict_layers: int = 1
    drafter: str | None = None              # "dspark": the checkpoint's drafter replaces MTP and is not run
    # quantization
    fp8_block_size: tuple[int, int] | None = None   # dense weights FP8 e4m3 with block scales (`.scale`)
    expert_dtype: str | None = None         # routed experts: "fp4" (MXFP4), "fp8"; None: as the dense weights
    # derived in __post_init__
    mtp_layer_id: int = field(init=False)

    def __post_init__(self):
        n = self.num_hidden_layers
        if len(self.attn_kinds) != n + 1 or not set(self.attn_kinds) <= set(ATTN_KINDS):
            raise UserError(f"config: attention kinds must name one of {', '.join(ATTN_KINDS)} for each of the {n} "
                            f"layers and the MTP block")
        if not 0 <= self.num_hash_layers <= n:
            raise UserError(f"config: num_hash_layers {self.num_hash_layers} is outside 0..{n}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise UserError("config: num_experts_per_tok exceeds n_routed_experts")
        if self.n_shared_experts != 1:
            raise UserError(f"config: DeepSeek-V4 has one shared expert, config says {self.n_shared_experts}")
        r = self.qk_rope_head_dim
        if r <= 0 or r % 2 or r > self.head_dim or (CSA in self.attn_kinds and r > self.index_head_dim):
            raise UserError(f"config: qk_rope_head_dim {r} must be even and at most head_dim {self.head_dim} "
                            f"(and index_head_dim {self.index_head_dim})")
        if self.num_attention_heads % self.o_groups:
            raise UserError(f"config: num_attention_heads {self.num_attention_heads} is not divisible by o_groups "
                            f"{self.o_groups}")
        for name in ("sliding_window", "compress_rate_csa", "compress_rate_hca", "index_topk", "hc_mult",
                     "hc_sinkhorn_iters"):
            if getattr(self, name) < 1:
                raise UserError(f"config: {name} must be at least 1, got {getattr(self, name)}")
        if self.compress_rope_type not in ("yarn", "default"):
            raise UserError(f"config: unsupported compress rope type {self.compress_rope_type!r} (yarn or default)")
        if self.expert_dtype is not None and self.expert_dtype not in EXPERT_DTYPES:
            raise UserError(f"config: unsupported expert_dtype {self.expert_dtype!r} ({' or '.join(EXPERT_DTYPES)})")
        self.mtp_layer_id = n

    # --- layer structure -------------------------------------------------------------------
    def attn_kind(self, layer_id: int) -> str:
        """sliding | csa | hca of a main layer, or of the MTP block (layer_id == num_hidden_layers)."""
        return self.attn_kinds[layer_id]

    def compress_ratio(self, layer_id: int) -> int:
        """Tokens per compressed entry of the layer (0: sliding window only)."""
        kind = self.attn_kinds[layer_id]
        return 0 if kind == SLIDING else self.compress_rate_csa if kind == CSA else self.compress_rate_hca

    def is_hash_layer(self, layer_id: int) -> bool:
        """Whether the layer routes by token id (tid2eid); never the MTP block."""
        return layer_id < self.num_hash_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return True                                   # every V4 layer is MoE

    @property
    def moe_layer_ids(self) -> list[int]:
        """Main-model MoE layers (all of them; the MTP block is not included)."""
        return list(range(self.num_hidden_layers))

    @property
    def released_experts(self) -> str | None:
        """The expert format the checkpoint's routed experts are stored in and served as, without a dense form
        ("mxfp4" for expert_dtype fp4); None: FP8 (Base) or float experts."""
        return "mxfp4" if self.expert_dtype == "fp4" else None

    @property
    def has_mtp(self) -> bool:
        return self.num_nextn_predict_layers >= 1

    @property
    def kv_bytes_per_token(self) -> int:
        """Cache bytes each token adds, over the main layers (§4.1: compressed entries and index keys, bf16)."""
        from .cache import cache_class
        return sum(cache_class(self.attn_kind(i)).bytes_per_token(self) for i in range(self.num_hidden_layers))

    @property
    def kv_fixed_bytes(self) -> int:
        """Cache bytes whatever the length: each block's window ring (the MTP block's included) and compressor
        state (§4.1)."""
        from .cache import cache_class
        blocks = range(self.num_hidden_layers + int(self.has_mtp))
        return sum(cache_class(self.attn_kind(i)).fixed_bytes(self) for i in blocks)

    def stop_ids(self) -> set[int]:
        ids = self.eos_token_id
        if ids is None:
            return set()
        return set(ids) if isinstance(ids, list) else {int(ids)}

    def load_notes(self) -> list[str]:
        """Lines to say when this checkpoint loads (what of it is not run)."""
        if self.drafter == "dspark":
            return ["note: this checkpoint's DSpark drafter (mtp.0-2) is not supported; its backbone runs with MTP "
                    "speculative decoding off"]
        return []

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict) -> "V4Args":
        """From a config.json of either style (official or transformers-written)."""
        if cfg.get("model_type") != "deepseek_v4":
            raise UserError(f"config: model_type {cfg.get('model_type')!r} is not deepseek_v4")
        known = {f.name for f in fields(cls) if f.init}
        kw = {k: v for k, v in cfg.items() if k in known and v is not None and k not in ("attn_kinds", "drafter")}
        if cfg.get("num_key_value_heads", 1) != 1:
            raise UserError(f"config: DeepSeek-V4 attention has one key-value head, config says "
                            f"{cfg['num_key_value_heads']}")
        for key, want in (("scoring_func", "sqrtsoftplus"), ("hidden_act", "silu")):
            if cfg.get(key, want) != want:
                raise UserError(f"config: unsupported {key} {cfg[key]!r} for deepseek_v4 ({want})")
        if "dtype" in cfg and "torch_dtype" not in cfg:
            kw["torch_dtype"] = cfg["dtype"]
        n = int(cfg.get("num_hidden_layers", cls.num_hidden_layers))
        kw["attn_kinds"], dspark = _attn_kinds(cfg, n)
        kw.update(_compress_rates(cfg))
        kw["num_hash_layers"] = _hash_layers(cfg, n)
        if "qk_rope_head_dim" not in cfg and cfg.get("partial_rotary_factor") is not None:
            kw["qk_rope_head_dim"] = int(int(cfg.get("head_dim", cls.head_dim)) * cfg["partial_rotary_factor"])
        kw.update(_rope_fields(cfg))
        if dspark:
            kw.update(drafter="dspark", num_nextn_predict_layers=0)
        kw.update(_quant_fields(cfg))
        try:
            return cls(**kw)
        except TypeError as e:
            raise UserError(f"config.json: {e}") from None


def _attn_kinds(cfg: dict, n: int) -> tuple[list[str], bool]:
    """(kind per main layer + the MTP block, whether a DSpark drafter replaces MTP)."""
    dspark = any(k.startswith("dspark_") for k in cfg)
    ratios, types = cfg.get("compress_ratios"), cfg.get("layer_types")
    if ratios is None and types is None:
        raise UserError("config: a deepseek_v4 config.json needs compress_ratios or layer_types (the attention kind "
                        "of each layer)")
    kinds = []
    if ratios is not None:
        if not isinstance(ratios, list) or any(r not in _RATIO_KINDS for r in ratios):
            raise UserError("config: compress_ratios entries must be 0 (sliding), 4 (CSA) or 128 (HCA)")
        dspark = dspark or len(ratios) == n + 3
        if len(ratios) not in (n, n + 1) and not dspark:
            raise UserError(f"config: compress_ratios has {len(ratios)} entries for {n} layers (expected {n + 1}: "
                            f"one per layer and one for the MTP block)")
        kinds = [_RATIO_KINDS[r] for r in ratios[:n + 1]]
    if types is not None:                             # wins for the main layers, as in transformers
        if not isinstance(types, list) or any(t not in _TYPE_KINDS for t in types) or len(types) < n:
            raise UserError(f"config: layer_types must list one of {', '.join(_TYPE_KINDS)} for each of the {n} "
                            f"layers")
        kinds = [_TYPE_KINDS[t] for t in types[:n]] + kinds[n:]
    if len(kinds) == n:
        kinds.append(SLIDING)                         # the MTP block (transformers drops its entry)
    if dspark:
        kinds[n] = SLIDING                            # no MTP block is built: the entry only keeps n + 1 kinds
    return kinds, dspark


def _compress_rates(cfg: dict) -> dict:
    out = {}
    rates = cfg.get("compress_rates") or {}
    if not isinstance(rates, dict) or not set(rates) <= set(_TYPE_KINDS):
        raise UserError(f"config: compress_rates must map {', '.join(_TYPE_KINDS)} to ratios")
    for kind in (CSA, HCA):
        value = cfg.get(f"compress_rate_{kind}", rates.get(_KIND_TYPES[kind]))   # the scalars override
        if value is not None:
            out[f"compress_rate_{kind}"] = int(value)
    return out


def _hash_layers(cfg: dict, n: int) -> int:
    types = cfg.get("mlp_layer_types")                # wins over num_hash_layers, as in transformers
    if types is None:
        k = cfg.get("num_hash_layers")
        return 3 if k is None else int(k)             # 3: transformers' default
    k = sum(t == "hash_moe" for t in types) if isinstance(types, list) else -1
    if k < 0 or len(types) != n or types != ["hash_moe"] * k + ["moe"] * (n - k):
        raise UserError(f"config: mlp_layer_types must be {n} entries, 'hash_moe' layers first, then 'moe'")
    return k


def _rope_fields(cfg: dict) -> dict:
    """main theta, and the compress rotary: theta plus YaRN (official `rope_scaling`, or transformers'
    `rope_parameters` {main, compress}; a flat `rope_parameters` is the compress block)."""
    params = cfg.get("rope_parameters") or {}
    out = {}
    if isinstance(params.get("main"), dict):
        main, compress = params["main"], params.get("compress") or {}
        if main.get("rope_theta") is not None:
            out["rope_theta"] = float(main["rope_theta"])
    else:
        compress = params or cfg.get("rope_scaling") or {}
        compress = dict(compress, rope_theta=cfg.get("compress_rope_theta", compress.get("rope_theta")))
    if compress.get("rope_theta") is not None:
        out["compress_rope_theta"] = float(compress["rope_theta"])
    rtype = compress.get("rope_type") or compress.get("type") or "default"
    out["compress_rope_type"] = rtype
    if rtype == "yarn":
        if compress.get("attention_factor", 1.0) not in (1, 1.0, None):
            raise UserError(f"config: the compress rotary's attention_factor must be 1 for deepseek_v4, got "
                            f"{compress['attention_factor']}")
        for key, name in (("factor", "rope_factor"), ("original_max_position_embeddings",
                          "original_max_position_embeddings"), ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
            if compress.get(key) is not None:
                out[name] = compress[key]
    return out


def _quant_fields(cfg: dict) -> dict:
    quant = cfg.get("quantization_config") or {}
    out = {}
    expert_dtype = cfg.get("expert_dtype", quant.get("expert_dtype"))
    if expert_dtype is not None:
        out["expert_dtype"] = str(expert_dtype)
    if quant:
        if quant.get("quant_method") != "fp8":
            raise UserError(f"unsupported quantization_config.quant_method {quant.get('quant_method')!r} "
                            f"(fp8 block checkpoints only)")
        block = tuple(quant.get("weight_block_size") or (128, 128))
        if block != (128, 128):
            raise UserError(f"unsupported FP8 weight_block_size {list(block)} (128x128 only)")
        out["fp8_block_size"] = block
    return out
