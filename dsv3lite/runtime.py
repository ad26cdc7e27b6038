"""Assembles an Engine from user-level options: weights dir, device, dtype, context, MTP, experts, budgets."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from .config import ModelArgs
from .errors import UserError
from .utils import format_bytes, parse_size, resolve_device, resolve_dtype


def resolve_weights(weights) -> Path:
    from . import DEMO_DIR

    if weights is None:
        if not (DEMO_DIR / "config.json").exists():
            raise UserError(f"the bundled demo model is missing from {DEMO_DIR} (reinstall dsv3lite or pass --weights)")
        return DEMO_DIR
    path = Path(weights).expanduser()
    if not path.exists():
        raise UserError(f"weights directory not found: {path}")
    if not path.is_dir():
        raise UserError(f"--weights must be a checkpoint directory, got a file: {path}")
    if not (path / "config.json").exists():
        raise UserError(f"no config.json in {path}: not a checkpoint directory")
    return path


def build_engine(weights=None, device="auto", gpu_mem=None, dtype=None, ctx_size: int = 4096, mtp: bool = True,
                 experts=None, cpu_mem=None, progress: bool = True, log=None, **options):
    from .generate import Engine
    from .loader import Loader
    from .tokenizer import Tokenizer

    log = log or (lambda msg: print(msg, file=sys.stderr))
    root = resolve_weights(weights)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    args = ModelArgs.from_dir(root)
    ctx_size = int(ctx_size)
    if ctx_size < 2:
        raise UserError(f"--ctx-size must be at least 2, got {ctx_size}")
    if ctx_size > args.max_position_embeddings:
        log(f"note: --ctx-size {ctx_size} exceeds the model's max_position_embeddings "
            f"({args.max_position_embeddings}); using {args.max_position_embeddings}")
        ctx_size = args.max_position_embeddings
    if gpu_mem is not None and str(gpu_mem) != "auto":
        parse_size(gpu_mem)
    if cpu_mem is not None:
        parse_size(cpu_mem)
    tokenizer = Tokenizer.from_dir(root)
    t0 = time.perf_counter()
    model = Loader(root, dev, dt, progress=progress, log=log).load(args)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"loaded {root.name or root} in {time.perf_counter() - t0:.1f}s: {format_bytes(n_bytes)} on {dev} as "
        f"{str(dt).replace('torch.', '')}")
    return Engine(model, tokenizer, dev, dt, ctx_size=ctx_size, mtp=mtp, weights=str(root), log=log)
