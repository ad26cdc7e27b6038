"""The eager executor: every forward pass as the model writes it (the twin of every other executor)."""
from __future__ import annotations

import torch

from ..cache import ModelCache


class Eager:
    """Every step as the model writes it."""
    name = "eager"

    def __init__(self, model, device: torch.device, log=None):
        self.model, self.device = model, device
        self.log = log or (lambda msg: None)

    def runs_whole(self) -> bool:
        """Whether a decode step runs every block through compiled kernels (CpuStep)."""
        return False

    def stats(self) -> dict | None:
        """The executor's counters since reset_stats (CpuStep's), or None."""
        return None

    def reset_stats(self) -> None:
        """Counters from zero (the Engine calls it as a generation starts)."""

    def tokens(self, token_ids: list[int]) -> torch.Tensor:
        return torch.tensor([token_ids], dtype=torch.long, device=self.device)

    def hidden(self, token_ids: list[int], start: int, cache: ModelCache, absorb: bool) -> torch.Tensor:
        """The main layers over token_ids at positions start.. -> the model's hidden state [1, S, ...]."""
        return self.model.hidden(self.tokens(token_ids), start, cache, absorb)

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: list[int], start: int, cache, absorb: bool) -> torch.Tensor:
        """The MTP block over pairs (hidden_i, next_ids[i]) at positions start.. -> its output [1, S, ...]."""
        return self.model.mtp_hidden(hidden, self.tokens(next_ids), start, cache, absorb)
