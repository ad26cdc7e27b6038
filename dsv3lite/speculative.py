"""Speculative decoding with the model's own MTP head: verification by rejection sampling.

Drafts d_1..d_k come from the MTP head with probabilities q_j; the main model scores them in one forward,
giving p_j. Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); the first rejected position
samples from norm(max(0, p_j - q_j)); if every draft is accepted, a bonus token is sampled from p_{k+1}.
This keeps the target distribution exactly; with temperature 0 (one-hot p and q) it reduces to "accept
while the main model's argmax equals the draft".
"""
from __future__ import annotations

import torch

from .generate import sample


def accept_drafts(target: list[torch.Tensor], drafts: list[int], draft_probs: list[torch.Tensor],
                  generator: torch.Generator | None) -> tuple[int, int]:
    """target: k+1 probability vectors from the main model; drafts: k tokens; draft_probs: their k q vectors.
    -> (number of drafts accepted, the next token: the correction at the first rejection or the bonus)."""
    for j, (d, q) in enumerate(zip(drafts, draft_probs)):
        p = target[j]
        pd, qd = float(p[d]), float(q[d])
        if qd > 0 and pd >= qd:
            continue                                          # min(1, p/q) = 1: always accepted
        u = float(torch.rand((), generator=generator))
        if qd > 0 and u < pd / qd:
            continue
        residual = (p - q).clamp_(min=0)
        if float(residual.sum()) <= 0:
            residual = p.clone()
        return j, sample(residual / residual.sum(), generator)
    return len(drafts), sample(target[len(drafts)], generator)
