"""Parameter counts and bytes per component, from a model's args alone (no weights read).

Used by `dsv3lite info` and by the offloading planner. `footprint` answers for every family (family.py); the
functions here count the V3 family's network (DeepSeek-V4's: v4/sizes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelArgs


def attention_params(a: ModelArgs) -> int:
    """One layer's attention (V3.2: its indexer included) and its two norms."""
    h, d = a.num_attention_heads, a.hidden_size
    q = (d * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * h * a.qk_head_dim) if a.q_lora_rank else d * h * a.qk_head_dim
    kv = d * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank + a.kv_lora_rank * h * (a.qk_nope_head_dim + a.v_head_dim)
    return q + kv + h * a.v_head_dim * d + 2 * d + indexer_params(a)          # + attn_norm and ffn_norm


def indexer_params(a: ModelArgs) -> int:
    """V3.2's lightning indexer of one layer: wq_b, wk, k_norm (weight and bias), weights_proj; 0 without one."""
    if not a.has_indexer:
        return 0
    return a.q_lora_rank * a.index_n_heads * a.index_head_dim + a.hidden_size * a.index_head_dim \
        + 2 * a.index_head_dim + indexer_fp32_params(a)


def indexer_fp32_params(a: ModelArgs) -> int:
    """The part of one layer's indexer kept in fp32 whatever the compute dtype (weights_proj, as transformers)."""
    return a.hidden_size * a.index_n_heads if a.has_indexer else 0


def expert_params(a: ModelArgs) -> int:
    """One routed expert: gate, up, down."""
    return 3 * a.hidden_size * a.moe_intermediate_size


def router_params(a: ModelArgs) -> int:
    return a.n_routed_experts * a.hidden_size + (a.n_routed_experts if a.has_gate_bias else 0)


def shared_expert_params(a: ModelArgs) -> int:
    return 3 * a.hidden_size * a.n_shared_experts * a.moe_intermediate_size


@dataclass
class Footprint:
    """Parameter counts per component (the MTP layer reported apart from the main model)."""
    embed: int
    head: int
    attention: int                # all main layers, norms included
    dense_mlp: int
    routers: int
    shared_experts: int
    routed_experts: int
    mtp_dense: int                # MTP layer minus its routed experts
    mtp_routed_experts: int
    final_norm: int
    active: int                   # per token, main model: everything but the unchosen routed experts

    @property
    def total(self) -> int:
        return (self.embed + self.head + self.attention + self.dense_mlp + self.routers + self.shared_experts
                + self.routed_experts + self.final_norm)

    @property
    def non_expert(self) -> int:
        return self.total - self.routed_experts


def footprint(a) -> Footprint:
    """Parameter counts of the network `a` describes (a ModelArgs or a V4Args: its family's count)."""
    from .family import family_of

    return family_of(a).footprint(a)


def v3_footprint(a: ModelArgs) -> Footprint:
    n_moe = len(a.moe_layer_ids)
    n_dense = a.num_hidden_layers - n_moe
    routed = n_moe * a.n_routed_experts * expert_params(a)
    mtp_dense = mtp_routed = 0
    if a.num_nextn_predict_layers:
        d = a.hidden_size
        mtp_dense = 2 * d * d + 3 * d + attention_params(a) + router_params(a) + shared_expert_params(a)
        mtp_routed = a.n_routed_experts * expert_params(a)
    fp = Footprint(
        embed=a.vocab_size * a.hidden_size,
        head=0 if a.tie_word_embeddings else a.vocab_size * a.hidden_size,
        attention=a.num_hidden_layers * attention_params(a),
        dense_mlp=n_dense * 3 * a.hidden_size * a.intermediate_size,
        routers=n_moe * router_params(a),
        shared_experts=n_moe * shared_expert_params(a),
        routed_experts=routed,
        mtp_dense=mtp_dense,
        mtp_routed_experts=mtp_routed,
        final_norm=a.hidden_size,
        active=0,
    )
    fp.active = fp.total - routed + n_moe * a.num_experts_per_tok * expert_params(a)
    return fp


# --- non-expert weights packed (`--dense`, dsv3lite/dense.py: CPU every dtype, CUDA fp8 / int4 / bf16) ----------

# bytes per weight, scales included, as PackedLinear holds them on either device: int8 and int4 carry 4 bytes of
# scale (and zero) per group of 128 along K, fp8 one fp32 scale per 128x128 block (an FP8 checkpoint's own
# weight_scale_inv with --dense fp8)
DENSE_WEIGHT_BYTES = {"int8": 1 + 4 / 128, "int4": 0.5 + 4 / 128, "fp8": 1 + 4 / 128 ** 2, "bf16": 2.0}
DENSE_DTYPES = tuple(DENSE_WEIGHT_BYTES)      # the --dense vocabulary (`quantize --dense` stores bf16 or fp8 of it)


def unpacked_attention_params(a: ModelArgs) -> int:
    """Per layer, the attention parameters `--dense` leaves in the compute dtype: wkv_b (the absorbed attention
    reads it as a tensor), the latent norms and the layer's two norms."""
    wkv_b = a.kv_lora_rank * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim)
    return wkv_b + a.kv_lora_rank + (a.q_lora_rank or 0) + 2 * a.hidden_size
