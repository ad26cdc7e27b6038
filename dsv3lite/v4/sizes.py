"""DeepSeek-V4's sizes from a V4Args alone (no weights read), for `info` and the --gpu-mem planner: parameter counts
per component, counted on blocks built on the meta device (one per attention kind and router kind, so the counts
follow the network itself), the resident bytes (each tensor in the dtype the loader keeps it in), the KV cache of
every block's cache object, and the workspace of a prefill chunk and of the decode graphs."""
from __future__ import annotations

import torch

from ..dense import packable
from ..footprint import MTP_OFF, SLACK_BYTES, Footprint
from ..limits import ABSORB_MAX_TOKENS, MAX_DRAFT_TOKENS, PREFILL_CHUNK
from .attention import SCORE_ELEMENTS, Rotary
from .cache import cache_class
from .config import V4Args
from .loader import kept_dtype
from .model import Block, HyperHead

# parameter groups of a block, by module name prefix (the rest is attention, its mHC and the block's norms)
GROUPS = (("ffn.experts.", "routed"), ("ffn.shared_experts.", "shared"), ("ffn.gate.", "router"))


def _group(name: str) -> str:
    return next((g for prefix, g in GROUPS if name.startswith(prefix)), "attention")


def _tensors(module: torch.nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def block_params(a: V4Args, layer_id: int) -> dict[str, int]:
    """Parameters of one block per group (routed: all its experts), from the block built on the meta device."""
    with torch.device("meta"):
        block = Block(a, layer_id, Rotary(a, False), Rotary(a, True))
    out = dict.fromkeys(("attention", "routed", "shared", "router"), 0)
    for name, t in _tensors(block):
        out[_group(name)] += t.numel()
    return out


def block_bytes(a: V4Args, layer_id: int, dtype: torch.dtype, prefix: str,
                weight_bytes: float | None = None) -> dict[str, int]:
    """Bytes of one block's non-expert groups as the loader keeps them (fp32 mHC, norms and router, int32 tid2eid,
    the rest in `dtype`; with weight_bytes, --dense's bytes per weight of every matrix it packs); prefix: the
    block's module name prefix (layers.N. or mtp.block.)."""
    with torch.device("meta"):
        block = Block(a, layer_id, Rotary(a, False), Rotary(a, True))
    out = dict.fromkeys(("attention", "shared", "router"), 0)
    for name, t in _tensors(block):
        group = _group(name)
        if group == "routed":
            continue
        if weight_bytes is not None and packable(block, name):
            out[group] += round(t.numel() * weight_bytes)
        else:
            out[group] += t.numel() * kept_dtype(prefix + name, dtype).itemsize
    return out


def _by_kind(a: V4Args, fn, layers) -> list[dict]:
    """fn(layer) for each of `layers`, computed once per (attention kind, hash routing) pair."""
    seen: dict = {}
    out = []
    for i in layers:
        key = (a.attn_kind(i), a.is_hash_layer(i))
        if key not in seen:
            seen[key] = fn(i)
        out.append(seen[key])
    return out


def _head_mix_params(a: V4Args) -> int:
    """An hc_head's parameters (the model's, and the MTP block's own)."""
    with torch.device("meta"):
        return sum(t.numel() for _, t in _tensors(HyperHead(a)))


def _with_mtp(a: V4Args, mtp: bool = True) -> bool:
    return mtp and a.has_mtp and a.drafter is None


def footprint(a: V4Args) -> Footprint:
    """Parameter counts per component (the MTP block apart; V4 has no dense MLP layers; final_norm: the norm and
    hc_head)."""
    blocks = _by_kind(a, lambda i: block_params(a, i), range(a.num_hidden_layers))
    total = {g: sum(b[g] for b in blocks) for g in ("attention", "routed", "shared", "router")}
    d, mix = a.hidden_size, _head_mix_params(a)
    mtp_dense = mtp_routed = 0
    if _with_mtp(a):
        mtp = block_params(a, a.mtp_layer_id)
        mtp_dense = mtp["attention"] + mtp["shared"] + mtp["router"] + 2 * d * d + 3 * d + mix
        mtp_routed = mtp["routed"]
    fp = Footprint(embed=a.vocab_size * d, head=0 if a.tie_word_embeddings else a.vocab_size * d,
                   attention=total["attention"], dense_mlp=0, routers=total["router"], shared_experts=total["shared"],
                   routed_experts=total["routed"], mtp_dense=mtp_dense, mtp_routed_experts=mtp_routed,
                   final_norm=d + mix, active=0)
    fp.active = fp.total - fp.routed_experts + \
        a.num_hidden_layers * a.num_experts_per_tok * 3 * d * a.moe_intermediate_size
    return fp


def resident_components(a: V4Args, dense_bytes: int, mtp: bool, weight_bytes: float | None = None) -> dict[str, int]:
    """Bytes per resident component of a plan: every non-expert tensor as the loader keeps it (the compute dtype
    of `dense_bytes`, fp32 where the network keeps fp32). weight_bytes: bytes per weight of the matrices --dense
    packs (dense.packable: the projections, the shared experts, the head, the MTP block's e_proj / h_proj)."""
    dtype = {2: torch.bfloat16, 4: torch.float32}[dense_bytes]
    blocks = _by_kind(a, lambda i: block_bytes(a, i, dtype, f"layers.{i}.", weight_bytes), range(a.num_hidden_layers))
    d, vocab, mix = a.hidden_size, a.vocab_size, _head_mix_params(a)
    matrix = dense_bytes if weight_bytes is None else weight_bytes          # a packed Linear's bytes per weight
    out = {"embeddings": vocab * d * dense_bytes, "lm_head": 0 if a.tie_word_embeddings else round(vocab * d * matrix),
           "attention + mHC + norms": sum(b["attention"] for b in blocks) + (d + mix) * 4,
           "shared experts": sum(b["shared"] for b in blocks),
           "routers (fp32)": sum(b["router"] for b in blocks)}
    if _with_mtp(a, mtp):        # its block, e_proj and h_proj, three norms and an hc_head (fp32)
        own = block_bytes(a, a.mtp_layer_id, dtype, "mtp.block.", weight_bytes)
        out["MTP (non-expert)"] = sum(own.values()) + round(2 * d * d * matrix) + (3 * d + mix) * 4
    return out


def packed_info_bytes(a: V4Args, weight_bytes: float, params: dict[str, int], fp: Footprint) -> dict[str, int]:
    """`info --dense`: the bytes of the components --dense packs, as a run keeps them (inventory.py)."""
    comps = resident_components(a, 2, "MTP (non-expert)" in params, weight_bytes)
    out = {"lm_head": comps["lm_head"], "shared experts": comps["shared experts"],
           "attention+norms": comps["attention + mHC + norms"]}
    if "MTP (non-expert)" in params:
        out["MTP (non-expert)"] = comps["MTP (non-expert)"]
    return out


def kv_cache_bytes(a: V4Args, ctx_size: int, mtp: bool, value_bytes: int) -> int:
    """Every block's cache object at `ctx_size` tokens (ring, entries and index keys in values of `value_bytes`,
    the compressors' state in fp32)."""
    blocks = range(a.num_hidden_layers + int(_with_mtp(a, mtp)))
    kinds = [cache_class(a.attn_kind(i)) for i in blocks]
    return sum(k.bytes_per_token(a, value_bytes) * ctx_size + k.fixed_bytes(a, value_bytes) for k in kinds)


def workspace_bytes(a: V4Args, ctx_size: int, dense_bytes: int) -> int:
    """Activations of one prefill chunk (an estimate from the shapes, not measured at V4's widths): the streams and
    their fp32 mixes, the heads' queries and outputs, the attention and indexer scores (the fp32 scores of a block
    of queries, bounded by SCORE_ELEMENTS, a few copies live), the chosen experts' intermediates, and the logits of
    a verify pass."""
    chunk = min(PREFILL_CHUNK, ctx_size)
    entries = ctx_size // min(a.compress_rate_csa, a.compress_rate_hca)
    streams = chunk * a.hc_mult * a.hidden_size * 4 * 6
    heads = chunk * a.num_attention_heads * a.head_dim * dense_bytes * 4
    scores = min(SCORE_ELEMENTS, chunk * a.num_attention_heads * (a.sliding_window + entries))
    scores += min(SCORE_ELEMENTS, chunk * a.index_n_heads * ctx_size // a.compress_rate_csa)
    experts = chunk * a.num_experts_per_tok * 3 * a.moe_intermediate_size * 4
    logits = (MAX_DRAFT_TOKENS + 1) * a.vocab_size * 4 * 2
    return streams + heads + 3 * 4 * scores + experts + logits + decode_graph_bytes(a, ctx_size, dense_bytes) + \
        SLACK_BYTES


def decode_graph_bytes(a: V4Args, ctx_size: int, dense_bytes: int) -> int:
    """The CUDA graphs' memory pools (dsv3lite/executors/graphs.py), which stay allocated: one per decode step size
    in use (every size up to ABSORB_MAX_TOKENS), each holding every block's outputs (the attention's streams, the
    router input, shared and routed outputs, the new streams; the fp32 mHC mix, routing weights, ids and scores)
    and one block's temporaries: the fp32 mixes of the streams, the shared expert's intermediates, the queries and
    the attention kernel's partial outputs at its most splits, the indexer's fp32 scores over the cache's capacity
    of keys and their top-k."""
    from ..kernels.mla_decode import max_splits

    n, d = a.hc_mult, a.hidden_size
    keys = ctx_size // a.compress_rate_csa
    attention = a.num_attention_heads * a.head_dim * dense_bytes * (3 + max_splits(a.sliding_window + keys)) + \
        a.index_n_heads * a.index_head_dim * dense_bytes + keys * 4 * 3 + a.index_topk * 8 * 2
    total = 0
    for tokens in range(1, ABSORB_MAX_TOKENS + 1):
        per_block = (2 * n + 4) * d * dense_bytes + (n + n * n + a.num_experts_per_tok + a.n_routed_experts) * 4 + \
            a.num_experts_per_tok * 8
        temporaries = 4 * n * d * 4 + 3 * a.moe_intermediate_size * dense_bytes + attention
        total += tokens * (a.num_hidden_layers * per_block + temporaries)
    return total


# --- what `dsv3lite info` says of a V4 network -------------------------------------------------------------

def kv_by_kind(a: V4Args) -> dict[str, dict]:
    """Per attention kind: the blocks of that kind (the MTP block's included), the bytes a token adds to each and
    the bytes each holds whatever the context (bf16 values, fp32 compressor state)."""
    blocks = range(a.num_hidden_layers + int(_with_mtp(a)))
    out: dict[str, dict] = {}
    for i in blocks:
        kind = a.attn_kind(i)
        cls = cache_class(kind)
        row = out.setdefault(kind, {"blocks": 0, "bytes_per_token": cls.bytes_per_token(a),
                                    "fixed_bytes": cls.fixed_bytes(a)})
        row["blocks"] += 1
    return out


def info_lines(a: V4Args, with_mtp: bool) -> list[str]:
    """The architecture lines of `dsv3lite info` for a V4 network (its parameters and bytes follow them); with_mtp:
    whether a run has its MTP block (offload.setup.expert_tier)."""
    kinds = [a.attn_kind(i) for i in range(a.num_hidden_layers)]
    n = {k: kinds.count(k) for k in ("sliding", "csa", "hca")}
    experts = {"fp4": "MXFP4, served as released", "fp8": "FP8"}.get(a.expert_dtype or "", None) or \
        ("FP8" if a.fp8_block_size else "as the dense weights")
    return [
        f"  model_type {a.model_type}: {a.num_hidden_layers} layers (all MoE), hidden {a.hidden_size} x {a.hc_mult} "
        f"mHC streams, {a.num_attention_heads} heads, vocab {a.vocab_size}",
        f"  attention: one {a.head_dim}-wide key = value per token (RoPE on {a.qk_rope_head_dim}), q_lora_rank "
        f"{a.q_lora_rank}, {a.o_groups} output groups of {a.o_lora_rank}; a {a.sliding_window}-token window in every "
        f"layer; {n['sliding']} sliding only, {n['csa']} CSA (an entry per {a.compress_rate_csa} tokens, indexer "
        f"{a.index_n_heads} x {a.index_head_dim}, top-{a.index_topk}), {n['hca']} HCA (an entry per "
        f"{a.compress_rate_hca} tokens)",
        f"  MoE: {a.n_routed_experts} routed experts of {a.moe_intermediate_size} (top-{a.num_experts_per_tok}, "
        f"sqrt-softplus, the first {a.num_hash_layers} layers routed by token id), {a.n_shared_experts} shared, SwiGLU "
        f"clamped at {a.swiglu_limit:g}; routed experts {experts}",
        f"  MTP block: {a.attn_kind(a.mtp_layer_id) if with_mtp else MTP_OFF if a.has_mtp else 'none'}"
        + (f" ({a.load_notes()[0][6:]})" if a.drafter else "")
        + f"; FP8 checkpoint: {'yes' if a.fp8_block_size else 'no'}",
    ]


def kv_lines(a: V4Args) -> list[str]:
    """`dsv3lite info`'s KV cache line: each attention kind's cache object."""
    from ..utils import format_bytes

    per_kind = ", ".join(f"{k} {v['bytes_per_token']} B/token + {format_bytes(v['fixed_bytes'])} (x{v['blocks']})"
                         for k, v in kv_by_kind(a).items())
    return [f"  KV cache per layer kind (bf16, compressor state fp32): {per_kind}; {a.kv_bytes_per_token:,} B per "
            f"token + {format_bytes(a.kv_fixed_bytes)} in all"]


def info_json(a: V4Args) -> dict:
    """`dsv3lite info --json`'s V4 keys: the KV cache per layer kind."""
    return {"kv_fixed_bytes": a.kv_fixed_bytes, "kv_by_layer_kind": kv_by_kind(a)}
