"""From user options to an offloading runtime: expert source, --gpu-mem budget, plan, host tier.

`plan_for` works from shapes only (it backs `dsv3lite plan`); `build_offload` also builds the host tier
(pinned blobs when host RAM allows, else the mmap'd quantized checkpoint) and the runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelArgs
from ..errors import UserError
from ..experts import ExpertSource, expert_source
from ..family import family_of
from ..footprint import DENSE_WEIGHT_BYTES
from ..hf_checkpoint import CheckpointIndex, has_weights
from ..utils import format_bytes, parse_size
from .options import OffloadOptions
from .planner import OffloadPlan, make_plan

CUDA_RESERVE_BYTES = 1536 * 2**20       # CUDA context, allocator fragmentation, library workspaces


def resolve_budget(gpu_mem, device: torch.device) -> int:
    """--gpu-mem as the bytes the planner may fill. On CUDA the budget is what the process may hold on the card:
    CUDA_RESERVE_BYTES of it stay for the CUDA context, library workspaces and allocator slack, and it must fit
    in the card's free memory ('auto' or None: all of it; a plan for CUDA on a machine without a GPU needs a
    size and is not checked against a card). On CPU the budget sizes the simulated device tier and must be given."""
    auto = gpu_mem is None or gpu_mem == "auto"
    if device.type != "cuda":
        if auto:
            raise UserError("--gpu-mem auto needs a CUDA GPU; on CPU give a size to simulate a device tier")
        return parse_size(gpu_mem)
    if not torch.cuda.is_available():                     # `plan --device cuda` on any machine
        if auto:
            raise UserError("--gpu-mem auto is the free memory of a GPU, and this machine has none: give a size "
                            "to plan for (e.g. --gpu-mem 24G)")
        budget = parse_size(gpu_mem)
    else:
        free, total = torch.cuda.mem_get_info(device)
        budget = free if auto else parse_size(gpu_mem)
        if budget > free:
            where = "this GPU's total" if budget > total else "what is free on this GPU (other processes hold the rest)"
            raise UserError(f"--gpu-mem {format_bytes(budget)} exceeds {where}: the largest that works here is "
                            f"{format_bytes(free)} (or use --gpu-mem auto)")
    if budget <= CUDA_RESERVE_BYTES:
        raise UserError(f"--gpu-mem {format_bytes(budget)} leaves nothing once {format_bytes(CUDA_RESERVE_BYTES)} "
                        f"are kept for the CUDA context and library workspaces")
    return budget - CUDA_RESERVE_BYTES


@dataclass
class ExpertTier:
    """The routed experts a run keeps as blobs (offloaded, or counted by `info`): their source (format, layout),
    whether the MTP layer runs, and its MoE layers. `plan`, `info` and the runtime all take it from expert_tier,
    so they cannot disagree."""
    source: ExpertSource
    with_mtp: bool
    weights_here: bool
    layers: list[int]

    @property
    def bytes(self) -> int:
        return len(self.layers) * self.source.args.n_routed_experts * self.source.layout.blob_bytes


def expert_tier(root: Path, args: ModelArgs, experts: str | None, mtp: bool,
                source: ExpertSource | None = None) -> ExpertTier:
    """The blobs of `root`'s routed experts in `experts` (None: the checkpoint's own format, fp8 for an FP8
    checkpoint), with the MTP layer when `mtp` and the checkpoint has it (config.json alone when it has no
    weights). Reads no weights. source: the experts' source when the caller resolved it already."""
    if source is None:
        source = expert_source(root, args, experts, blobs_required=True)
    weights_here = has_weights(root)
    with_mtp = mtp and args.num_nextn_predict_layers >= 1
    if with_mtp and weights_here:                         # the checkpoint carries the MTP layer its config declares
        with_mtp = family_of(args).mtp_status(CheckpointIndex.open(root), args)[0]
    return ExpertTier(source, with_mtp, weights_here, tier_layers(args, with_mtp))


def tier_layers(args: ModelArgs, with_mtp: bool) -> list[int]:
    """The MoE layers whose routed experts are blobs: the main model's, and the MTP layer's when it runs."""
    return list(args.moe_layer_ids) + ([args.mtp_layer_id] if with_mtp else [])


def plan_for(root: Path, args: ModelArgs, budget: int, ctx_size: int, experts: str | None, mtp: bool,
             dtype: torch.dtype, dense: str | None = None,
             source: ExpertSource | None = None) -> tuple[OffloadPlan, ExpertSource, bool]:
    """(plan, where the experts come from, whether the MTP layer runs) for a budget, without reading weights.
    dense: the `--dense` dtype the non-expert weights are packed to (None: they stay in `dtype`). source: the
    experts' source when the caller resolved it already (builder.build_engine: once per load)."""
    tier = expert_tier(root, args, experts, mtp, source)
    source, with_mtp = tier.source, tier.with_mtp
    dense_bytes = torch.empty((), dtype=dtype).element_size()
    plan = make_plan(args, budget, ctx_size, source.layout.blob_bytes, source.fmt.name, dense_bytes=dense_bytes,
                     mtp=with_mtp, weight_bytes=DENSE_WEIGHT_BYTES[dense] if dense else None)
    assert plan.host_bytes == tier.bytes
    if not tier.weights_here:
        plan.notes.append(f"no weights in {root}: planned from config.json alone"
                          + (" (with the MTP layer the config declares)" if with_mtp else ""))
    elif not with_mtp and args.num_nextn_predict_layers and mtp:
        plan.notes.append("the checkpoint has no MTP weights: MTP is off")
    return plan, source, with_mtp


def build_offload(root: Path, args: ModelArgs, experts: str | None, gpu_mem, ctx_size: int, device: torch.device,
                  dtype: torch.dtype, mtp: bool, options: OffloadOptions = OffloadOptions(), log=print,
                  dense: str | None = None, source: ExpertSource | None = None):
    """-> an OffloadRuntime, or None when every expert fits in the budget (then nothing is offloaded). source: as
    plan_for's."""
    from .cache import HostStore
    from .runtime import OffloadRuntime

    budget = resolve_budget(gpu_mem, device)
    log(f"--gpu-mem budget {format_bytes(budget)}" + ("" if device.type == "cuda" else " (simulated device tier on CPU)"))
    plan, source, with_mtp = plan_for(root, args, budget, ctx_size, experts, mtp, dtype, dense, source)
    log(plan.table())
    if plan.all_resident:
        log("every routed expert fits in the budget: nothing is offloaded")
        return None
    layers, total = tier_layers(args, with_mtp), plan.host_bytes
    source = source.cached(log)                   # an HF checkpoint's experts: its expert cache on disk
    tier = host_tier(source, layers, device, total, options.cpu_mem_bytes, log)
    runtime = OffloadRuntime(HostStore(tier.blobs, source.layout.blob_bytes, tier.mode, tier.resident_cap),
                             source.fmt, source.layout, plan.n_slots, device, dtype, options=options, plan=plan,
                             log=log, limit=family_of(args).swiglu_limit(args))
    log(f"cost model: {runtime.cost.describe()}; misses: {options.miss_policy}")
    if tier.pin_layers:
        from .host_memory import BackgroundPinner

        runtime.pinner = BackgroundPinner(runtime.host, layers, log=log)
    elif tier.hot_capacity:
        from .host_memory import HotExperts

        runtime.hot = HotExperts(runtime.host, tier.hot_capacity, fence=runtime.cache.fence, log=log)
    return runtime


@dataclass
class HostTier:
    """What `host_tier` decided: per-layer [E, blob_bytes] host tensors and how they are served."""
    blobs: dict
    mode: str                       # "pinned" | "memory" | "mmap"
    pin_layers: bool = False        # a mapped tier that fits: pinned layer by layer in the background
    hot_capacity: int = 0           # CUDA, --cpu-mem below the tier: the most used experts pinned, up to this many
    resident_cap: object = None     # CPU, --cpu-mem: host_memory.ResidentCap on the mapped blobs


def host_tier(source: ExpertSource, layers, device, total: int, cap: int | None, log) -> HostTier:
    """The host tier within host RAM and --cpu-mem (`cap`). Blobs packed at load live in memory (pinned on CUDA
    when they fit), so they must fit the cap. A mapped source is served from its mapping at once; on CUDA it is
    pinned in the background, whole when it fits, else its most used experts up to the cap; on the CPU the cap
    bounds the mapped blobs' resident pages."""
    from .host_memory import host_ram_budget

    available = host_ram_budget()
    cuda = device.type == "cuda"
    blob_bytes = source.layout.blob_bytes
    if not source.mapped:
        from .host_memory import check_packed_fits

        check_packed_fits(cap, total, source.fmt.name)
        return _packed_tier(source, layers, total, pin=cuda and total <= available, log=log)
    blobs = {layer: source.layer_blobs(layer) for layer in layers}
    fits = total <= available and (cap is None or total <= cap)
    if cuda and fits:
        log(f"host tier: {format_bytes(total)} of expert blobs, mmap; pinning them in the background, layer by "
            f"layer (the stats say how much is pinned)")
        return HostTier(blobs, "mmap", pin_layers=True)
    if cuda and cap is not None and min(cap, available) >= blob_bytes:
        n = min(cap, available) // blob_bytes
        log(f"host tier: {format_bytes(total)} of expert blobs, mmap; --cpu-mem {format_bytes(cap)}: the {n:,} most "
            f"used experts ({format_bytes(n * blob_bytes)}) pinned in the background after each prompt, the rest "
            f"served from the map" + ("" if cap <= available else f" (host RAM allows {format_bytes(available)})"))
        return HostTier(blobs, "mmap", hot_capacity=n)
    if cuda:
        log(f"note: host RAM cannot hold the {format_bytes(total)} of expert blobs pinned: serving them from the "
            f"mmap'd checkpoint (pageable copies run at about half the H2D bandwidth; --cpu-mem SIZE pins the most "
            f"used experts up to SIZE)")
        log(f"host tier: {format_bytes(total)} of expert blobs, mmap")
        return HostTier(blobs, "mmap")
    resident_cap = None
    if cap is not None:
        from .host_memory import ResidentCap

        resident_cap = ResidentCap(cap, blob_bytes)
        log(f"host tier: {format_bytes(total)} of expert blobs, mmap; --cpu-mem {format_bytes(cap)} bounds their "
            f"resident pages (the least recently used are dropped)")
    else:
        log(f"host tier: {format_bytes(total)} of expert blobs, mmap")
    return HostTier(blobs, "mmap", resident_cap=resident_cap)


def _packed_tier(source: ExpertSource, layers, total: int, pin: bool, log) -> HostTier:
    """Blobs quantized or repacked at load into host memory, each layer in exactly-sized pinned memory if `pin`."""
    from tqdm import tqdm

    from .host_memory import pinned_empty

    log(f"packing routed experts as {source.fmt.name} blobs in host memory ({format_bytes(total)})")
    blobs = {}
    for layer in tqdm(layers, desc="host tier", unit="layer", disable=None, leave=False):
        t = source.layer_blobs(layer)
        if pin:
            pinned = pinned_empty(tuple(t.shape))             # exactly the blobs' bytes (no power-of-two rounding)
            pinned.copy_(t)
            t = pinned
        blobs[layer] = t
    mode = "pinned" if pin else "memory"
    log(f"host tier: {format_bytes(total)} of expert blobs, {mode}")
    return HostTier(blobs, mode)
