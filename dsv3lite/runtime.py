"""Assembles an Engine from user-level options: weights dir, device, dtype, context, MTP, experts, budgets."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .config import ModelArgs
from .errors import UserError
from .utils import checkpoint_dir, format_bytes, parse_size, resolve_device, resolve_dtype


DEFAULT_CTX_SIZE = 4096


def resolve_weights(weights) -> Path:
    from . import DEMO_DIR

    if weights is None:
        if not (DEMO_DIR / "config.json").exists():
            raise UserError(f"the bundled demo model is missing from {DEMO_DIR} (reinstall dsv3lite or pass --weights)")
        return DEMO_DIR
    return checkpoint_dir(weights, "weights directory")


def expert_provider(root: Path, args: ModelArgs, experts: str | None, device: torch.device, log):
    """Routed experts for the Loader: a quantized dir's mapped blobs, or an HF dir's experts quantized at load
    (`experts` = bf16 | fp8 | int4 | nf4); None keeps the dense experts of an HF dir."""
    from .experts import BlobExperts
    from .loader import CheckpointIndex
    from .quant.checkpoint import is_quantized_dir, open_layer_blobs, quantize_layer_from_hf, read_manifest
    from .quant.formats import get_format

    if is_quantized_dir(root):
        manifest = read_manifest(root)
        if experts is not None and experts != manifest.format:
            raise UserError(f"{root} holds {manifest.format} experts; --experts {experts} needs the HF checkpoint "
                            f"(quantize it again, or drop --experts)")
        fmt, layout = manifest.expert_format(), manifest.layout
        return lambda layer: BlobExperts(open_layer_blobs(root, manifest, layer).to(device), fmt, layout)
    if experts is None:
        return None
    fmt = get_format(experts)
    layout = fmt.layout(args.moe_intermediate_size, args.hidden_size)
    index = CheckpointIndex.open(root)
    log(f"quantizing routed experts to {experts} at load")
    return lambda layer: BlobExperts(quantize_layer_from_hf(index, args, layer, fmt, layout).to(device), fmt, layout)


def build_engine(weights=None, device="auto", gpu_mem=None, dtype=None, ctx_size: int | None = None, mtp: bool = True,
                 experts=None, cpu_mem=None, progress: bool = True, log=None, **options):
    from .generate import Engine
    from .loader import Loader
    from .tokenizer import Tokenizer

    log = log or (lambda msg: print(msg, file=sys.stderr))
    root = resolve_weights(weights)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    args = ModelArgs.from_dir(root)
    if ctx_size is None:                       # the default: 4096, or less when the model is shorter
        ctx_size = min(DEFAULT_CTX_SIZE, args.max_position_embeddings)
    ctx_size = int(ctx_size)
    if ctx_size < 2:
        raise UserError(f"--ctx-size must be at least 2, got {ctx_size}")
    if ctx_size > args.max_position_embeddings:
        log(f"note: --ctx-size {ctx_size} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings}); using {args.max_position_embeddings}")
        ctx_size = args.max_position_embeddings
    if cpu_mem is not None:
        parse_size(cpu_mem)
    tokenizer = Tokenizer.from_dir(root)
    t0 = time.perf_counter()
    offload = None
    if gpu_mem is not None or dev.type == "cuda":
        from .offload.setup import build_offload

        offload = build_offload(root, args, experts, gpu_mem, ctx_size, dev, dt, mtp, cpu_mem=cpu_mem,
                                lookahead=options.get("lookahead", 2), miss_policy=options.get("miss_policy", "auto"),
                                cache_policy=options.get("cache_policy", "decayed-lfu"), log=log)
    if offload is not None:
        provider = offload.provider
    else:
        provider = expert_provider(root, args, experts, dev, log)
    model = Loader(root, dev, dt, progress=progress, log=log).load(args, expert_provider=provider)
    if offload is not None:
        offload.attach(model)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"loaded {root.name or root} in {time.perf_counter() - t0:.1f}s: {format_bytes(n_bytes)} on {dev} as "
        f"{str(dt).replace('torch.', '')}")
    engine = Engine(model, tokenizer, dev, dt, ctx_size=ctx_size, mtp=mtp, weights=str(root), log=log,
                    num_draft_tokens=options.get("num_draft_tokens", 1),
                    mtp_adaptive=options.get("mtp_adaptive", True))
    engine.offload = offload
    return engine
