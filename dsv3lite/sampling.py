"""Sampling: the parameters of one generation and the distribution a token is drawn from.

`sampling_probs` turns logits into the probabilities sampling uses (temperature, top-k, top-p); `sample` draws
from them with the CPU generator, so a seed gives the same text on any device. Plain decoding and MTP
speculation (speculative.py) both sample through these two functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import ModelFault, UserError

SEED_RANGE = (-(1 << 63), (1 << 64) - 1)         # what torch.Generator.manual_seed takes


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        checks = [
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_finite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature!r}"),
            (_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}"),
            (self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
             f"seed must be an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]}, got {self.seed!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def sampling_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: logits [V] (any dtype) -> fp32 probabilities [V] after
    temperature, top-k and top-p. Temperature 0 is a one-hot on the argmax. Non-finite logits (NaN or inf: damaged
    weights, or a dtype that overflows) are a ModelFault: greedy decoding would otherwise pick a NaN's index."""
    logits = logits.float()
    if not bool(torch.isfinite(logits).all()):
        raise ModelFault("the model's logits are not finite (NaN or inf): the checkpoint's weights are damaged, or "
                         "the compute dtype overflows (try --dtype float32)")
    if p.temperature == 0:
        return torch.zeros_like(logits).scatter_(0, logits.argmax().view(1), 1.0)
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs          # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from `probs` (any device); draws use the CPU generator so a seed gives the same text anywhere."""
    probs = probs.float().cpu()
    if probs.max() == 1.0:
        return int(probs.argmax())
    return int(torch.multinomial(probs, 1, generator=generator))


