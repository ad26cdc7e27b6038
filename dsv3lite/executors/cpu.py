"""The compiled CPU decode step: a decode step (batch 1, up to ABSORB_MAX_TOKENS tokens, fp32) through a family's
kernels, one per sub-step, strung together here; the V3 family's (kernels/cpu_decode.py) in `CpuStep`,
DeepSeek-V4's in cpu_v4.py.

With nothing watching the attention, every main layer runs in one kernel call (`cpu_decode.layers`). Otherwise
block by block: the attention kernel; the observers (the offloading predictor gets the feed-forward's router input
and routing, computed once); the feed-forward kernel, or, where its experts are scheduled by the host (offloaded)
or the route was computed ahead, the eager feed-forward. A sub-step the kernels have no plan for (V3.2's indexed
attention, offloaded experts) runs eagerly, for that sub-step only; `cpu_decode.uncovered` says why, once.
`stats()` counts the forwards each way (Engine.stats()["cpu_step"]).
"""
from __future__ import annotations

import torch

from ..cache import ModelCache, Positions, as_model_cache
from ..kernels import cpu_decode
from .eager import Eager


class CpuStep(Eager):
    name = "cpu"
    kernels = cpu_decode          # the family's kernels module: knows, covers, uncovered, enabled, sub-steps

    def __init__(self, model, device: torch.device, log=None):
        super().__init__(model, device, log)
        dtype = model.embed.weight.dtype
        self.fp32 = dtype == torch.float32                  # the kernels' activations
        if not self.fp32:
            self.log(f"note: the compiled CPU decode step computes in float32; {str(dtype).replace('torch.', '')} "
                     f"decodes eagerly")
        for reason in self.kernels.uncovered(model) if self.fp32 else []:
            self.log(f"note: the compiled CPU decode step runs this eagerly: {reason}")
        self.covers = self.fp32 and self.kernels.covers(model)
        self.reset_stats()

    def on(self) -> bool:
        """Whether decode steps go to the kernels now (fp32, and not turned off by DSV3LITE_CPU_DECODE=eager)."""
        return self.fp32 and self.kernels.enabled()

    def runs_whole(self) -> bool:
        """Whether a decode step runs every block through the kernels (they cover the model and are on now)."""
        return self.covers and self.kernels.enabled()

    def stats(self) -> dict:
        """Forwards (main and MTP) since reset_stats: every main layer in one kernel call, block by block through
        the sub-step kernels (observers, or a sub-step left eager), or eagerly (prompts, the kernels off)."""
        return dict(self.forwards)

    def reset_stats(self) -> None:
        self.forwards = {"whole": 0, "by_block": 0, "eager": 0}

    def hidden(self, token_ids: list[int], start: int, cache: ModelCache, absorb: bool) -> torch.Tensor:
        model = self.model
        if not absorb or not self.on():
            self.forwards["eager"] += 1
            return model.hidden(self.tokens(token_ids), start, cache, absorb)
        cache = as_model_cache(cache, model.args.latent_dim)
        pos = Positions(start, len(token_ids))
        h, cos, sin = model.prologue(self.tokens(token_ids), pos)
        observers = model.observers
        if not observers.attention and not observers.layer:
            out = cpu_decode.layers(model, h, start, cos, sin, cache)
            if out is not None:
                self.forwards["whole"] += 1
                return model.norm(out)
        self.forwards["by_block"] += 1
        for i, block in enumerate(model.layers):
            h = self.block(block, h, pos, cos, sin, cache[i])
        return model.norm(h)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: list[int], start: int, cache, absorb: bool) -> torch.Tensor:
        model = self.model
        if not absorb or not self.on():
            self.forwards["eager"] += 1
            return model.mtp_hidden(hidden, self.tokens(next_ids), start, cache, absorb)
        self.forwards["by_block"] += 1
        pos = Positions(start, len(next_ids))
        h, cos, sin = model.mtp_prologue(hidden, self.tokens(next_ids), pos)
        return model.mtp.head_norm(self.block(model.mtp.block, h, pos, cos, sin, cache))

    def block(self, block, h: torch.Tensor, pos: Positions, cos, sin, cache) -> torch.Tensor:
        """Block.forward(h, pos, cos, sin, cache, absorb=True), each sub-step through its kernel where it has one."""
        a = cpu_decode.attention(block, h, pos.start, cos, sin, cache)
        if a is None:
            a = block.attention(h, pos, cos, sin, cache, absorb=True)
        observers = self.model.observers
        routed = block.routed_ahead(a) if observers.layer else None
        observers.after_attention(block, a, routed)
        if routed is None:
            out = cpu_decode.feed_forward(block, a)
            if out is not None:
                return out
        return block.feed_forward(a, routed)
