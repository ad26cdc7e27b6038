"""dsv3lite: run DeepSeek-V3-family mixture-of-experts models on one machine whose GPU is too small for them."""
from __future__ import annotations

from .demo import DEMO_DIR
from .version import __version__


def load(weights=None, device="auto", gpu_mem=None, dtype=None, ctx_size: int | None = None, mtp: bool = True,
         experts=None, cpu_mem=None, progress: bool = True, log=None, dense=None, **options):
    """Load a checkpoint (None -> the bundled demo model) and return an Engine.

    ctx_size None means 4096 tokens, or the model's max_position_embeddings when that is smaller.
    dense: "int8" | "int4" | "fp8" | "bf16" packs the non-expert weights for the CPU kernels (CPU only).

    llm.generate(prompt, ...), llm.chat(messages, ...), llm.forward(ids), llm.tokenizer, llm.stats().
    """
    from .builder import build_engine

    return build_engine(weights=weights, device=device, gpu_mem=gpu_mem, dtype=dtype, ctx_size=ctx_size,
                        mtp=mtp, experts=experts, cpu_mem=cpu_mem, progress=progress, log=log, dense=dense,
                        **options)


__all__ = ["load", "DEMO_DIR", "__version__"]
