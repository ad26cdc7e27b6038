"""DeepSeek-V4's compiled CPU decode step: a decode step or an MTP verification (batch 1, up to ABSORB_MAX_TOKENS
tokens, fp32) through the kernels of kernels/cpu_v4.py, one per sub-step of a V4 block, strung as CpuStep strings
the V3 family's (cpu.py).

With nothing watching, every main layer runs in one kernel call (`cpu_v4.layers`). Otherwise block by block: the
attention kernel; the observers (the offloading predictor gets the feed-forward's router input and routing); the
feed-forward kernel, or, where the host schedules the experts (offloaded, --cpu-mem) or the route is wanted ahead,
the feed-forward's mHC pre through its kernel and the MoE and mHC post eagerly. The MTP block runs its two
sub-steps through the kernels too. Prompts (more tokens a forward) take the kernels too when the dense weights are
packed (--dense: the kernels' packed row dots beat the batched operators' dequantizing ones); with fp32 dense
weights they run eagerly, the model's batched operators (the kernels' row dots read a weight once per few tokens:
on the real-width slice they prefill slower, benchmarks/RESULTS.md). Prompts longer than a chunk go layer-major
(prefill.py) either way.
"""
from __future__ import annotations

import functools

import torch

from ..cache import ModelCache
from ..dense import PackedLinear
from ..kernels import cpu_v4
from .cpu import CpuStep


class V4CpuStep(CpuStep):
    kernels = cpu_v4

    @functools.cached_property
    def packed(self) -> bool:
        """Whether --dense packed the blocks' dense weights (then prompts take the kernels too)."""
        return any(isinstance(m, PackedLinear) for m in self.model.layers[0].modules())

    def takes(self, absorb: bool) -> bool:
        """Whether a forward goes to the kernels: a decode step or verification, or a prompt over packed weights."""
        return self.on() and (absorb or self.packed)

    def hidden(self, token_ids: list[int], start: int, cache: ModelCache, absorb: bool) -> torch.Tensor:
        model = self.model
        tokens = self.tokens(token_ids)
        if not self.takes(absorb):
            self.forwards["eager"] += 1
            return model.hidden(tokens, start, cache)
        x = model.prologue(tokens)
        observers = model.observers
        if not observers.attention and not observers.layer:
            out = cpu_v4.layers(model, x, start, cache, tokens)
            if out is not None:
                self.forwards["whole"] += 1
                return out
        self.forwards["by_block"] += 1
        for i, block in enumerate(model.layers):
            x = self.block(block, x, start, cache[i], tokens)
        return x

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: list[int], start: int, cache, absorb: bool) -> torch.Tensor:
        model = self.model
        tokens = self.tokens(next_ids)
        if not self.takes(absorb):
            self.forwards["eager"] += 1
            return model.mtp_hidden(hidden, tokens, start, cache)
        self.forwards["by_block"] += 1
        return self.block(model.mtp.block, model.mtp_prologue(hidden, tokens), start, cache, tokens)

    def block(self, block, x: torch.Tensor, start: int, cache, tokens: torch.Tensor) -> torch.Tensor:
        """Block.forward(x, start, cache, tokens), each sub-step through its kernel where it has one."""
        a = cpu_v4.attention(block, x, start, cache)
        if a is None:
            a = block.attention(x, start, cache)
        observers = self.model.observers
        if not observers.layer:
            observers.after_attention(block, a, None)
            out = cpu_v4.feed_forward(block, a, tokens)
            if out is not None:
                return out
        # the host runs the MoE (experts it schedules, or a route wanted ahead): its two halves around it, the
        # first through the mHC kernel; the route computed once, for the layer observers and the MoE
        half = cpu_v4.ffn_input(block, a)
        u, mix = half if half is not None else block.ffn_input(a)
        route = None
        if observers.layer:
            route = block.ffn.route(u, tokens)
            observers.after_attention(block, a, (u, route))
        return block.ffn_output(a, block.ffn(u, tokens, route), mix)
