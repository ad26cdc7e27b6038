"""From user options to an offloading runtime: expert format, --gpu-mem budget, plan, host tier.

`plan_for` works from shapes only (it backs `dsv3lite plan`); `build_offload` also builds the host tier
(pinned blobs when host RAM allows, else the mmap'd quantized checkpoint) and the runtime.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelArgs
from ..errors import UserError
from ..utils import format_bytes, parse_size
from .planner import Plan, make_plan

CUDA_RESERVE_BYTES = 1536 * 2**20       # CUDA context, allocator fragmentation, library workspaces
HOST_RESERVE_BYTES = 4 * 2**30          # host RAM left to the OS and everything else


def expert_format_for(root: Path, args: ModelArgs, experts: str | None):
    """(format, layout, manifest or None) of the routed experts as they will be stored."""
    from ..quant.checkpoint import is_quantized_dir, read_manifest
    from ..quant.formats import get_format

    if is_quantized_dir(root):
        manifest = read_manifest(root)
        if experts is not None and experts != manifest.format:
            raise UserError(f"{root} holds {manifest.format} experts; --experts {experts} needs the HF checkpoint")
        return manifest.expert_format(), manifest.layout, manifest
    name = experts or ("fp8" if args.fp8_block_size else "bf16")
    fmt = get_format(name)
    return fmt, fmt.layout(args.moe_intermediate_size, args.hidden_size), None


def mtp_present(root: Path, args: ModelArgs) -> bool:
    from ..loader import CheckpointIndex
    from ..quant.checkpoint import is_quantized_dir

    if args.num_nextn_predict_layers < 1:
        return False
    prefix = f"model.layers.{args.mtp_layer_id}."
    if is_quantized_dir(root):
        from ..quant.checkpoint import read_manifest
        return args.mtp_layer_id in read_manifest(root).moe_layers
    return any(n.startswith(prefix) for n in CheckpointIndex.open(root).files)


def resolve_budget(gpu_mem, device: torch.device) -> int:
    """--gpu-mem as bytes. On CUDA 'auto' (or None) is free memory minus a reserve; more than the card has
    is an error. On CPU the budget sizes the simulated device tier and must be given."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if gpu_mem is None or gpu_mem == "auto":
            return max(free - CUDA_RESERVE_BYTES, 0)
        budget = parse_size(gpu_mem)
        if budget > total:
            raise UserError(f"--gpu-mem {format_bytes(budget)} exceeds this GPU's {format_bytes(total)}")
        if budget > free:
            raise UserError(f"--gpu-mem {format_bytes(budget)} exceeds the {format_bytes(free)} free on this GPU "
                            f"(other processes hold the rest)")
        return budget
    if gpu_mem is None or gpu_mem == "auto":
        raise UserError("--gpu-mem auto needs a CUDA GPU; on CPU give a size to simulate a device tier")
    return parse_size(gpu_mem)


def plan_for(root: Path, args: ModelArgs, budget: int, ctx_size: int, experts: str | None, mtp: bool,
             dtype: torch.dtype) -> tuple[Plan, object, object, object]:
    fmt, layout, manifest = expert_format_for(root, args, experts)
    with_mtp = mtp and mtp_present(root, args)
    dense_bytes = torch.empty((), dtype=dtype).element_size()
    plan = make_plan(args, budget, ctx_size, layout.blob_bytes, fmt.name, dense_bytes=dense_bytes, mtp=with_mtp)
    if not with_mtp and args.num_nextn_predict_layers and mtp:
        plan.notes.append("the checkpoint has no MTP weights: MTP is off")
    return plan, fmt, layout, manifest


def build_offload(root: Path, args: ModelArgs, experts: str | None, gpu_mem, ctx_size: int, device: torch.device,
                  dtype: torch.dtype, mtp: bool, cpu_mem=None, lookahead: int = 2, miss_policy: str = "auto",
                  cache_policy: str = "decayed-lfu", log=print):
    """-> an OffloadRuntime, or None when every expert fits in the budget (then nothing is offloaded)."""
    from .cache import HostStore
    from .runtime import OffloadRuntime

    budget = resolve_budget(gpu_mem, device)
    log(f"--gpu-mem budget {format_bytes(budget)}" + ("" if device.type == "cuda" else " (simulated device tier on CPU)"))
    plan, fmt, layout, manifest = plan_for(root, args, budget, ctx_size, experts, mtp, dtype)
    log(plan.table())
    if plan.all_resident:
        log("every routed expert fits in the budget: nothing is offloaded")
        return None
    layers = list(args.moe_layer_ids) + ([args.mtp_layer_id] if mtp and mtp_present(root, args) else [])
    total = len(layers) * args.n_routed_experts * layout.blob_bytes
    cap = parse_size(cpu_mem) if cpu_mem is not None else None
    blobs, mode = _host_blobs(root, args, layers, fmt, layout, manifest, device, total, cap, log)
    runtime = OffloadRuntime(HostStore(blobs, layout.blob_bytes, mode), fmt, layout, plan.n_slots, device, dtype,
                             lookahead=lookahead, miss_policy=miss_policy, policy=cache_policy, log=log)
    runtime.plan = plan
    c = runtime.cost
    log(f"cost model: H2D {c.h2d_bytes_per_s / 1e9:.1f} GB/s ({c.fetch_s() * 1e3:.2f} ms per expert), CPU "
        f"{c.cpu_s_per_token * 1e3:.2f} ms per expert-token; misses: {miss_policy}")
    return runtime


def _host_blobs(root, args, layers, fmt, layout, manifest, device, total, cap, log):
    """Per-layer [E, blob_bytes] host tensors: pinned on CUDA when RAM (and --cpu-mem) allow."""
    import psutil
    from tqdm import tqdm

    from ..loader import CheckpointIndex
    from ..quant.checkpoint import open_layer_blobs, quantize_layer_from_hf

    available = psutil.virtual_memory().available - HOST_RESERVE_BYTES
    pin = device.type == "cuda" and total <= available and (cap is None or total <= cap)
    if manifest is not None:
        source = lambda layer: open_layer_blobs(root, manifest, layer)
    else:
        index = CheckpointIndex.open(root)
        log(f"packing routed experts as {fmt.name} blobs in host memory ({format_bytes(total)})")
        source = lambda layer: quantize_layer_from_hf(index, args, layer, fmt, layout)
    blobs = {}
    for layer in tqdm(layers, desc="host tier", unit="layer", disable=None, leave=False):
        t = source(layer)
        if pin:
            pinned = torch.empty(t.shape, dtype=torch.uint8, pin_memory=True)
            pinned.copy_(t)
            t = pinned
        blobs[layer] = t
    if pin:
        mode = "pinned"
    elif manifest is not None:
        mode = "mmap"
        if device.type == "cuda":
            why = "--cpu-mem" if cap is not None and total > cap else "host RAM"
            log(f"note: {why} cannot hold the {format_bytes(total)} of expert blobs pinned: serving them from the "
                f"mmap'd checkpoint (pageable copies run at about half the H2D bandwidth)")
    else:
        mode = "memory"
    log(f"host tier: {format_bytes(total)} of expert blobs, {mode}")
    return blobs, mode
