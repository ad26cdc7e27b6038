"""Assembles an Engine from user-level options: weights dir, device, dtype, context, MTP, experts, budgets."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .config import ModelArgs
from .errors import UserError
from .family import family_of
from .utils import checkpoint_dir, format_bytes, resolve_device, resolve_dtype

DEFAULT_CTX_SIZE = 4096


def resolve_weights(weights) -> Path:
    from .demo import DEMO_DIR

    if weights is None:
        if not (DEMO_DIR / "config.json").exists():
            raise UserError(f"the bundled demo model is missing from {DEMO_DIR} (reinstall dsv3lite or pass --weights)")
        return DEMO_DIR
    return checkpoint_dir(weights, "weights directory")


def kernel_blobs_at_load(args: ModelArgs, experts: str | None, device: torch.device) -> str | None:
    """Where an HF checkpoint's resident experts (no --experts) are packed at load as blobs in their own precision
    (bf16, or fp8 for an FP8 checkpoint) for a kernel, the kernel's name; None keeps them dense. On CPU, a model
    past the tiny-model size (generate.decode_threads' rule), for the CPU expert kernel, where it runs; on a GPU
    with the Triton kernels, for the fused MoE kernel: a decode step then reads no routing back to the host (one
    CUDA graph a step, graphs.py), and the experts take the bytes the --gpu-mem plan counted for them (an FP8
    checkpoint's dense experts would be bf16, twice its fp8 blobs)."""
    from .generate import SINGLE_THREAD_DECODE_MAX_ACTIVE_PARAMS
    from .kernels import cpu_build, dispatch

    if experts is not None:
        return None
    if device.type == "cuda":
        return "the fused MoE kernel" if dispatch.use_kernels(device) else None
    large = family_of(args).footprint(args).active > SINGLE_THREAD_DECODE_MAX_ACTIVE_PARAMS
    return "the CPU expert kernel" if device.type == "cpu" and large and cpu_build.library() is not None else None


def resident_experts(source, args: ModelArgs, experts: str | None, kernel: str | None, device: torch.device, log,
                     cpu_mem: int | None = None):
    """The Loader's expert provider when nothing is offloaded: packed blobs on `device` (a quantized dir's mapped
    blobs, an HF dir's experts quantized at load, or packed in their own precision for `kernel`:
    kernel_blobs_at_load), or None to keep an HF dir's dense experts. source: experts.expert_source's answer.
    cpu_mem (--cpu-mem, bytes, CPU): bounds the mapped blobs' resident pages; blobs packed in memory must fit it."""
    from .experts import BlobExperts

    if source is not None and not source.mapped and experts is None and kernel is None and not source.released:
        source = None                             # an HF checkpoint nothing asks to pack: its dense experts
    if source is None:
        if cpu_mem is not None:
            log("note: --cpu-mem bounds packed expert blobs; this run keeps the checkpoint's dense experts")
        return None
    if not (kernel and not source.mapped):
        source = source.cached(log)               # --experts on an HF checkpoint: its expert cache on disk
    cap = resident_cap(source, args, device, cpu_mem, log)
    if kernel and not source.mapped and not source.released:
        log(f"routed experts as {source.fmt.name} blobs for {kernel} (--experts int4 | fp8 to quantize)")
    elif source.released:
        log(f"repacking the checkpoint's {source.fmt.name} routed experts into blobs at load (as released)")
    elif not source.mapped:
        log(f"quantizing routed experts to {source.fmt.name} at load")
    limit = family_of(args).swiglu_limit(args)
    return lambda layer: BlobExperts(source.layer_blobs(layer).to(device), source.fmt, source.layout, cap, limit)


def resident_cap(source, args: ModelArgs, device: torch.device, cpu_mem: int | None, log):
    """--cpu-mem for resident experts: on CPU a ResidentCap over mapped blobs (None without a cap); blobs packed
    in memory that exceed it are a one-line error; on a GPU the blobs live on the device and the cap has no use."""
    if cpu_mem is None:
        return None
    if device.type != "cpu":
        log("note: --cpu-mem caps host memory for offloaded experts; nothing is offloaded in this run")
        return None
    total = len(args.moe_layer_ids) * args.n_routed_experts * source.layout.blob_bytes
    from .offload.host_memory import ResidentCap, check_packed_fits

    if not source.mapped:
        check_packed_fits(cpu_mem, total, source.fmt.name)
        return None

    log(f"routed experts: {format_bytes(total)} of {source.fmt.name} blobs, mmap; --cpu-mem {format_bytes(cpu_mem)} "
        f"bounds their resident pages (the least recently used are dropped)")
    return ResidentCap(cpu_mem, source.layout.blob_bytes)


def choose_dense(root: Path, args: ModelArgs, dense: str | None, device: torch.device, budget: int, ctx_size: int,
                 experts: str | None, mtp: bool, dtype: torch.dtype, log, source=None) -> str | None:
    """The --dense of a CUDA run: `dense` when given; else, when the plan with the non-expert weights in `dtype`
    does not fit `budget` (too small for the resident set and the minimum of expert slots): "fp8" for an FP8
    checkpoint (128x128 blocks) whose plan fits with them kept in fp8, said in one log line; failing that, a note
    when --dense int4 would fit (the budget error follows). Else None."""
    if dense is not None or device.type != "cuda" or not family_of(args).packs_dense:
        return dense
    from .offload.setup import plan_for

    def plan(d):
        try:
            p = plan_for(root, args, budget, ctx_size, experts, mtp, dtype, d, source)[0]
        except UserError:
            return None
        return p if p.n_slots > 0 else None

    if plan(None) is not None:
        return None
    packed = plan("fp8") if tuple(args.fp8_block_size or ()) == (128, 128) else None
    if packed is not None:
        log(f"--dense fp8: the non-expert weights in {str(dtype).replace('torch.', '')} do not fit --gpu-mem "
            f"{format_bytes(budget)} with expert slots; keeping the FP8 checkpoint's own fp8 weights on the GPU "
            f"({packed.n_slots} expert slots; --dense int4 or a larger --gpu-mem to choose otherwise)")
        return "fp8"
    packed = plan("int4")
    if packed is not None:       # the offload setup's budget error follows
        log(f"note: with --dense int4 (non-expert weights as 4-bit groups) --gpu-mem {format_bytes(budget)} holds "
            f"the resident set and {packed.n_slots} expert slots")
    return None


def load_network(weights, device="cpu", dtype=torch.float32, progress: bool = False, log=None, mtp: bool = True):
    """The network of a checkpoint as dsv3lite.load builds it resident, without an engine: its family's loader, the
    routed experts as a resident run serves them (a quantized directory's blobs; a checkpoint's released format,
    e.g. Kimi's int4 or DeepSeek-V4's MXFP4, repacked as stored and clamped as its family says; else dense)."""
    from .experts import BlobExperts, expert_source

    root, dev = resolve_weights(weights), resolve_device(device)
    args = ModelArgs.from_dir(root)
    family = family_of(args)
    source = expert_source(root, args, None, blobs_required=False)
    provider = None
    if source is not None and (source.mapped or source.released):
        limit = family.swiglu_limit(args)
        provider = lambda layer: BlobExperts(source.layer_blobs(layer).to(dev), source.fmt, source.layout,  # noqa: E731
                                             limit=limit)
    return family.loader(root, dev, dtype, progress=progress, log=log).load(args, expert_provider=provider, mtp=mtp)


def build_engine(weights=None, device="auto", gpu_mem=None, dtype=None, ctx_size: int | None = None, mtp: bool = True,
                 experts=None, cpu_mem=None, progress: bool = True, log=None, dense=None, **options):
    """See dsv3lite.load. options: the OffloadOptions fields (lookahead, miss_policy, cache_policy), the MTP
    settings num_draft_tokens, mtp_adaptive, cuda_graphs (False: decode steps eagerly on a GPU) and threads
    (thread_policy_for). dense: the
    non-expert weights packed to this dtype while loading (dense.py; on CUDA an FP8 checkpoint that needs it gets
    fp8, `choose_dense`)."""
    from .dense import PackedLinear, check_dense
    from .experts import expert_source
    from .generate import Engine
    from .offload.options import OffloadOptions
    from .tokenizer import Tokenizer

    log = log or (lambda msg: print(msg, file=sys.stderr))
    offload_options = OffloadOptions.take({**options, "cpu_mem": cpu_mem})
    threads = options.pop("threads", None)
    engine_options = {k: options[k] for k in ("num_draft_tokens", "mtp_adaptive", "cuda_graphs") if k in options}
    unknown = set(options) - set(engine_options) - {f for f in OffloadOptions.__dataclass_fields__}
    if unknown:
        raise UserError(f"unknown option {sorted(unknown)[0]!r} for dsv3lite.load")
    root = resolve_weights(weights)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    check_dense(dense, dev)
    thread_policy = thread_policy_for(threads, dev)
    args = ModelArgs.from_dir(root)           # the family's args (family.py)
    family = family_of(args)
    if dense is not None and not family.packs_dense:
        raise UserError(f"--dense is not supported for {family.name} checkpoints yet")
    if ctx_size is None:                       # the default: 4096, or less when the model is shorter
        ctx_size = min(DEFAULT_CTX_SIZE, args.max_position_embeddings)
    ctx_size = int(ctx_size)
    if ctx_size < 2:
        raise UserError(f"--ctx-size must be at least 2, got {ctx_size}")
    if ctx_size > args.max_position_embeddings:
        log(f"note: --ctx-size {ctx_size} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings}); using {args.max_position_embeddings}")
        ctx_size = args.max_position_embeddings
    tokenizer = None
    if (root / "tokenizer.json").is_file() or (root / "tiktoken.model").is_file():
        tokenizer = Tokenizer.from_dir(root, log=log)
    else:
        log(f"note: {root} has no tokenizer.json: the model takes and returns token ids only")
    t0 = time.perf_counter()
    offload = None
    offloading = gpu_mem is not None or dev.type == "cuda"
    kernel = kernel_blobs_at_load(args, experts, dev)
    # where the routed experts come from, resolved once for the plan, the host tier and the resident provider
    source = expert_source(root, args, experts, blobs_required=offloading or kernel is not None)
    if offloading:
        from .offload.setup import build_offload, resolve_budget

        if dev.type == "cuda" and dense is None:
            dense = choose_dense(root, args, dense, dev, resolve_budget(gpu_mem, dev), ctx_size, experts, mtp, dt, log,
                                 source)
        offload = build_offload(root, args, experts, gpu_mem, ctx_size, dev, dt, mtp, offload_options, log=log,
                                dense=dense, source=source)
    provider = offload.provider if offload is not None else \
        resident_experts(source, args, experts, kernel, dev, log, offload_options.cpu_mem_bytes)
    model = family.loader(root, dev, dt, progress=progress, log=log, dense=dense).load(args, expert_provider=provider,
                                                                                       mtp=mtp)
    packed = sum(m.nbytes for m in model.modules() if isinstance(m, PackedLinear))
    if offload is not None:
        offload.attach(model)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + packed
    log(f"loaded {root.name or root} in {time.perf_counter() - t0:.1f}s: {format_bytes(n_bytes)} on {dev} as "
        f"{str(dt).replace('torch.', '')}")
    return Engine(model, tokenizer, dev, dt, ctx_size=ctx_size, mtp=mtp, weights=str(root), log=log,
                  offload=offload, threads=thread_policy, **engine_options)


def thread_policy_for(threads: int | None, device: torch.device):
    """threads (--threads): fixed at N, applied to every parallel region from now on; None: torch's count, and on
    a CPU-only run decode steps adapt it when other programs take cores (threads.ThreadPolicy)."""
    from . import threads as thread_rules

    if threads is not None:
        thread_rules.apply(thread_rules.resolve(threads))
    return thread_rules.ThreadPolicy(torch.get_num_threads(), adaptive=threads is None and device.type == "cpu")
