"""The --gpu-mem planner: what stays resident on the device, and how many expert slots the rest buys.

Works from shapes alone (ModelArgs + the expert blob size), so `dsv3lite plan` reads no weights.
Resident: embeddings, lm_head, attention, norms, routers, shared experts, dense MLPs, MTP non-expert
parts, the KV cache for --ctx-size (the latents, and on V3.2 the indexer's keys beside them), and a
workspace for activations. The rest of the budget becomes equal-size expert slots in one global pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ModelArgs
from ..errors import UserError
from ..footprint import footprint, indexer_fp32_params, unpacked_attention_params
from ..kernels.mla_decode import max_splits
from ..limits import ABSORB_MAX_TOKENS, LAYER_MAJOR_TOKENS, PREFILL_CHUNK
from ..attention import INDEX_SCORE_ELEMENTS
from ..utils import format_bytes


SLACK_BYTES = 64 * 2**20     # allocator rounding and small temporaries
MIN_SLOTS_PER_TOPK = 2       # slots >= 2 * top-k: a 2-token MTP verify may touch 2K experts of one layer


@dataclass
class OffloadPlan:
    budget: int
    components: dict[str, int]          # resident bytes per component
    kv_cache: int
    workspace: int
    slot_bytes: int
    n_slots: int
    total_experts: int                  # routed experts of every MoE layer (MTP included when on)
    expert_format: str
    ctx_size: int
    indexer_keys: bool = False          # the KV cache also holds V3.2's indexer keys
    notes: list[str] = field(default_factory=list)

    @property
    def resident(self) -> int:
        return sum(self.components.values()) + self.kv_cache + self.workspace

    @property
    def slots_total(self) -> int:
        return self.n_slots * self.slot_bytes

    @property
    def host_bytes(self) -> int:
        """The host tier: every routed expert as one blob, allocated exactly (offload/host_memory.py)."""
        return self.total_experts * self.slot_bytes

    @property
    def fraction_resident(self) -> float:
        return min(self.n_slots / self.total_experts, 1.0) if self.total_experts else 1.0

    @property
    def all_resident(self) -> bool:
        return self.n_slots >= self.total_experts

    def table(self) -> str:
        cache = "KV cache: latents + indexer keys" if self.indexer_keys else "latent KV cache"
        rows = [(k, v) for k, v in self.components.items() if v] + [
            (f"{cache} ({self.ctx_size} tokens)", self.kv_cache), ("workspace", self.workspace),
            (f"expert slots ({self.n_slots} x {format_bytes(self.slot_bytes)}, {self.expert_format})", self.slots_total)]
        width = max(len(k) for k, _ in rows)
        lines = [f"  {k:<{width}}  {format_bytes(v):>12}  {100 * v / self.budget:5.1f}%" for k, v in rows]
        used = self.resident + self.slots_total
        lines.append(f"  {'total':<{width}}  {format_bytes(used):>12}  {100 * used / self.budget:5.1f}%  "
                     f"of --gpu-mem {format_bytes(self.budget)}")
        lines.append(f"  experts resident: {min(self.n_slots, self.total_experts)} / {self.total_experts} "
                     f"({self.fraction_resident:.1%})")
        if not self.all_resident:
            lines.append(f"  host tier: {format_bytes(self.host_bytes)} of expert blobs in host memory (pinned when "
                         f"RAM and --cpu-mem allow, else mapped from disk)")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


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


def workspace_bytes(a: ModelArgs, ctx_size: int, dense_bytes: int) -> int:
    """Activations of one prefill chunk: logits, MLP intermediates, expanded K/V for the naive attention."""
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
    splits = max_splits(ctx_size)
    total = 0
    for tokens in range(1, ABSORB_MAX_TOKENS + 1):
        rows = tokens * a.num_attention_heads
        attention = rows * (splits * (a.kv_lora_rank + 1) * 4 + (a.qk_head_dim + 2 * a.latent_dim) * dense_bytes)
        per_layer = tokens * (7 * a.hidden_size * dense_bytes + 3 * a.n_routed_experts * 4)
        total += attention + a.num_hidden_layers * per_layer
    return total


def make_plan(a: ModelArgs, budget: int, ctx_size: int, slot_bytes: int, expert_format: str,
              dense_bytes: int = 2, mtp: bool = True, kv_bytes: int | None = None,
              weight_bytes: float | None = None) -> OffloadPlan:
    """Place everything resident; the rest of `budget` becomes expert slots. Too small -> UserError.
    weight_bytes: bytes per non-expert weight when they are packed (`--dense`), else dense_bytes."""
    mtp = mtp and a.num_nextn_predict_layers > 0
    n_blocks = a.num_hidden_layers + (1 if mtp else 0)
    kv = n_blocks * ctx_size * a.cache_dim * (kv_bytes or dense_bytes)
    comps = resident_components(a, dense_bytes, mtp, weight_bytes)
    n_moe = len(a.moe_layer_ids) + (1 if mtp else 0)
    plan = OffloadPlan(budget=budget, components=comps, kv_cache=kv, workspace=workspace_bytes(a, ctx_size, dense_bytes),
                slot_bytes=slot_bytes, n_slots=0, total_experts=n_moe * a.n_routed_experts,
                expert_format=expert_format, ctx_size=ctx_size, indexer_keys=a.has_indexer)
    free = budget - plan.resident
    plan.n_slots = max(min(free // slot_bytes, plan.total_experts), 0) if slot_bytes else 0
    min_slots = min(MIN_SLOTS_PER_TOPK * a.num_experts_per_tok, plan.total_experts)
    if plan.n_slots < min_slots:
        need = plan.resident + min_slots * slot_bytes
        biggest = max(comps.items(), key=lambda kv_: kv_[1])
        raise UserError(
            f"--gpu-mem {format_bytes(budget)} is too small: the resident set needs {format_bytes(plan.resident)} "
            f"(largest: {biggest[0]} {format_bytes(biggest[1])}, KV cache for --ctx-size {ctx_size} "
            f"{format_bytes(kv)}, workspace {format_bytes(plan.workspace)}) plus {min_slots} expert slots of {format_bytes(slot_bytes)}; minimum --gpu-mem is "
            f"{format_bytes(need)} (or lower --ctx-size, use a smaller --experts format, or --no-mtp)")
    return plan
