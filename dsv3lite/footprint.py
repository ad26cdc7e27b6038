"""Parameter counts and bytes per component, from a model's args alone (no weights read).

Used by `dsv3lite info` and by the offloading planner (which asks a model's family for them: family.py): here the V3
family's parameter counts and a plan's bytes (resident components, workspace); DeepSeek-V4's are in v4/sizes.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelArgs

SLACK_BYTES = 64 * 2**20     # a plan's allowance for allocator rounding and small temporaries


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


def footprint(a: ModelArgs) -> Footprint:
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


def packed_info_bytes(a: ModelArgs, weight_bytes: float, params: dict[str, int], fp: Footprint) -> dict[str, int]:
    """`info --dense`: the bytes of the components --dense packs (MLA's wkv_b, the latent norms and the layers'
    norms stay in bf16; embeddings and routers are not packed); params: info's parameters per component."""
    kept = unpacked_attention_params(a)
    out = {k: round(params[k] * weight_bytes) for k in ("lm_head", "dense MLPs", "shared experts")}
    out["attention+norms"] = round((fp.attention - a.num_hidden_layers * kept) * weight_bytes
                                   + a.num_hidden_layers * kept * 2)
    if "MTP (non-expert)" in params:
        out["MTP (non-expert)"] = round((fp.mtp_dense - kept) * weight_bytes + kept * 2)
    return out


# --- what `dsv3lite info` says of the network ------------------------------------------------------------

MTP_OFF = "declared in config.json, absent from the checkpoint (MTP off)"     # `info`, every family


def info_lines(a: ModelArgs, with_mtp: bool) -> list[str]:
    """The architecture lines of `dsv3lite info` (its parameters and bytes follow them); with_mtp: whether a run has
    its MTP layer (offload.setup.expert_tier)."""
    mtp = "present" if with_mtp else MTP_OFF if a.num_nextn_predict_layers else "none"
    return [
        f"  model_type {a.model_type}: {a.num_hidden_layers} layers ({len(a.moe_layer_ids)} MoE), hidden "
        f"{a.hidden_size}, {a.num_attention_heads} heads, vocab {a.vocab_size}",
        f"  MLA: q_lora_rank {a.q_lora_rank}, kv_lora_rank {a.kv_lora_rank}, rope {a.qk_rope_head_dim} "
        f"({a.rope_type}{f' x{a.rope_factor:g}' if a.rope_type == 'yarn' else ''}), softmax scale "
        f"{a.softmax_scale:.6f}",
        f"  MoE: {a.n_routed_experts} routed experts of {a.moe_intermediate_size} (top-{a.num_experts_per_tok}, "
        f"{a.scoring_func}/{a.topk_method}, groups {a.n_group}/{a.topk_group}), {a.n_shared_experts} shared",
        f"  MTP layer: {mtp}; FP8 checkpoint: {'yes' if a.fp8_block_size else 'no'}"]


def kv_lines(a: ModelArgs) -> list[str]:
    """`dsv3lite info`'s KV cache line."""
    from .utils import format_bytes

    values = f"{a.latent_dim} latent" + (f" + {a.index_dim} indexer-key" if a.index_dim else "")
    return [f"  KV cache: {values} values/token/layer = {format_bytes(a.kv_bytes_per_token)} per token "
            f"(bf16, {a.num_hidden_layers} layers)"]


# --- a --gpu-mem plan's bytes (offload/planner.py) ---------------------------------------------------------

def resident_components(a: ModelArgs, dense_bytes: int, mtp: bool, weight_bytes: float | None = None) -> dict[str, int]:
    """Bytes per resident component. weight_bytes: bytes per packed weight matrix entry (`--dense`); the embeddings,
    norms and wkv_b stay at dense_bytes (the compute dtype)."""
    fp = footprint(a)
    comps = {
        "embeddings": fp.embed, "lm_head": fp.head, "attention + norms": fp.attention + fp.final_norm,
        "dense MLPs": fp.dense_mlp, "shared experts": fp.shared_experts,
    }
    out = {k: v * dense_bytes for k, v in comps.items()}
    kept = 0
    if weight_bytes is not None:
        kept = unpacked_attention_params(a)
        out = {k: round(v * (dense_bytes if k == "embeddings" else weight_bytes)) for k, v in comps.items()}
        out["attention + norms"] += round(a.num_hidden_layers * kept * (dense_bytes - weight_bytes))
    out["routers (fp32)"] = fp.routers * 4
    # V3.2's indexer weights_proj stays fp32: its extra bytes over the compute dtype
    fp32_extra = indexer_fp32_params(a) * max(4 - dense_bytes, 0)
    out["attention + norms"] += a.num_hidden_layers * fp32_extra
    if mtp and fp.mtp_dense:
        out["MTP (non-expert)"] = fp.mtp_dense * dense_bytes + fp32_extra
        if weight_bytes is not None:
            out["MTP (non-expert)"] += round((fp.mtp_dense - kept) * (weight_bytes - dense_bytes))
    return out


def kv_cache_bytes(a: ModelArgs, ctx_size: int, mtp: bool, value_bytes: int) -> int:
    """Every block's latent cache (the MTP layer's too when it runs) at `ctx_size` tokens."""
    return (a.num_hidden_layers + int(mtp)) * ctx_size * a.cache_dim * value_bytes


def workspace_bytes(a: ModelArgs, ctx_size: int, dense_bytes: int) -> int:
    """Activations of one prefill chunk: logits, MLP intermediates, expanded K/V for the naive attention."""
    from .limits import INDEX_SCORE_ELEMENTS, LAYER_MAJOR_TOKENS, PREFILL_CHUNK     # (they import torch)

    chunk = min(PREFILL_CHUNK, ctx_size)
    logits = chunk * a.vocab_size * 4 * 2                            # logits + fp32 copy
    hidden = chunk * (8 * a.hidden_size + 3 * max(a.intermediate_size, a.moe_intermediate_size)) * 4
    # the naive prefill attention (model.MLA._attend_naive) holds wkv_b's output [ctx, H, dn + dv] and the
    # concatenated K [ctx, H, dn + dr] at once (measured: tests/test_budget.py), and the chunk's Q [chunk, H, dqk]
    expanded_kv = (ctx_size * a.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim + a.qk_head_dim)
                   + chunk * a.num_attention_heads * a.qk_head_dim) * dense_bytes
    scores = chunk * a.num_attention_heads * min(ctx_size, 4 * chunk) * 4
    if a.has_indexer:   # the indexer's fp32 scores (blocks of queries, ~3 live copies) and the chunk's sparse mask
        block = min(chunk * a.index_n_heads * ctx_size, max(INDEX_SCORE_ELEMENTS, a.index_n_heads * ctx_size))
        scores += 3 * 4 * block + 2 * chunk * ctx_size
    # a layer-major prefill group's hidden states, held across each layer (dsv3lite/prefill.py): the residual,
    # its norm, the routed output and the observers' concatenated copy
    group = min(LAYER_MAJOR_TOKENS, ctx_size) * a.hidden_size * dense_bytes * 4 if ctx_size > chunk else 0
    return logits + hidden + expanded_kv + scores + group + decode_graph_bytes(a, ctx_size, dense_bytes) + SLACK_BYTES


def decode_graph_bytes(a: ModelArgs, ctx_size: int, dense_bytes: int) -> int:
    """The CUDA graphs' memory pools (dsv3lite/graphs.py), which stay allocated: one per decode step size in use
    (a plain step, an MTP verification, a short prompt or one near the end of the context: every size up to
    ABSORB_MAX_TOKENS), each holding one layer's attention work at its most KV splits (fp32 partial outputs, the
    absorbed queries) and every layer's outputs (hidden states, norms, routing, shared-expert output) and copied
    inputs (routed-expert output)."""
    from .kernels.mla_decode import max_splits
    from .limits import ABSORB_MAX_TOKENS

    splits = max_splits(ctx_size)
    total = 0
    for tokens in range(1, ABSORB_MAX_TOKENS + 1):
        rows = tokens * a.num_attention_heads
        attention = rows * (splits * (a.kv_lora_rank + 1) * 4 + (a.qk_head_dim + 2 * a.latent_dim) * dense_bytes)
        per_layer = tokens * (7 * a.hidden_size * dense_bytes + 3 * a.n_routed_experts * 4)
        total += attention + a.num_hidden_layers * per_layer
    return total
