"""The --gpu-mem planner: what stays resident on the device, and how many expert slots the rest buys.

Works from shapes alone (the model's args + the expert blob size), so `dsv3lite plan` reads no weights.
Resident: embeddings, lm_head, attention, norms, routers, shared experts, dense MLPs, MTP non-expert
parts, the KV cache for --ctx-size (the latents, and on V3.2 the indexer's keys beside them; DeepSeek-V4: its
cache objects), and a workspace for activations. The rest of the budget becomes equal-size expert slots in one
global pool. The sizes come from the model's family (family.py: the V3 family's are in footprint.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ModelArgs
from ..errors import UserError
from ..family import family_of
from ..footprint import SLACK_BYTES, decode_graph_bytes, resident_components, workspace_bytes  # noqa: F401 (re-exported)
from ..utils import format_bytes

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
    kv_label: str = "latent KV cache"   # what the KV cache holds, as the table names it
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
        cache = self.kv_label
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


def make_plan(a: ModelArgs, budget: int, ctx_size: int, slot_bytes: int, expert_format: str,
              dense_bytes: int = 2, mtp: bool = True, kv_bytes: int | None = None,
              weight_bytes: float | None = None) -> OffloadPlan:
    """Place everything resident; the rest of `budget` becomes expert slots. Too small -> UserError.
    weight_bytes: bytes per non-expert weight when they are packed (`--dense`), else dense_bytes."""
    family = family_of(a)
    if weight_bytes is not None and not family.packs_dense:
        raise UserError(f"--dense is not supported for {family.name} checkpoints yet")
    mtp = mtp and a.num_nextn_predict_layers > 0
    kv = family.kv_cache_bytes(a, ctx_size, mtp, kv_bytes or dense_bytes)
    comps = family.resident_components(a, dense_bytes, mtp, weight_bytes)
    n_moe = len(a.moe_layer_ids) + (1 if mtp else 0)
    plan = OffloadPlan(budget=budget, components=comps, kv_cache=kv,
                       workspace=family.workspace_bytes(a, ctx_size, dense_bytes), slot_bytes=slot_bytes, n_slots=0,
                       total_experts=n_moe * a.n_routed_experts, expert_format=expert_format, ctx_size=ctx_size,
                       kv_label=family.kv_label(a))
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
