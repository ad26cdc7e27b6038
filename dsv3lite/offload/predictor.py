"""Router-driven expert prediction: after layer l's attention, apply the routers of the next MoE layers
(each with its own ffn norm, bias and group limit) to the current hidden state.

The current layer's own router on its own input is exact, so `predict` also returns the experts layer l
is about to use; the runtime reads everything to the host in one transfer per layer.
"""
from __future__ import annotations

import torch

from ..model import Block, Transformer


class RoutePredictor:
    def __init__(self, model: Transformer, lookahead: int = 2):
        self.lookahead = max(int(lookahead), 0)
        self.layers = list(model.layers)
        self.position = {id(b): i for i, b in enumerate(self.layers)}

    def targets(self, layer: Block) -> list[tuple[int, Block]]:
        """(distance, block) for the current layer (distance 0) and the MoE layers up to `lookahead` ahead."""
        i = self.position.get(id(layer))
        if i is None:
            return [(0, layer)] if layer.is_moe else []
        out = []
        for d in range(0, self.lookahead + 1):
            j = i + d
            if j < len(self.layers) and self.layers[j].is_moe:
                out.append((d, self.layers[j]))
        return out

    @torch.no_grad()
    def predict(self, layer: Block, h: torch.Tensor) -> dict[int, tuple[int, list[list[int]]]]:
        """h [B, S, D] after `layer`'s attention -> {moe layer id: (distance, per-token expert ids)}.

        Distance 0 is the exact routing of `layer` itself (its ffn input is ffn_norm(h))."""
        targets = self.targets(layer)
        if not targets:
            return {}
        flat = h.reshape(-1, h.shape[-1])
        ids = [b.ffn.gate.select(b.ffn.gate.scores(b.ffn_norm(flat))) for _, b in targets]
        host = torch.stack(ids).tolist()                 # the one device->host read of this layer
        return {b.layer_id: (d, rows) for (d, b), rows in zip(targets, host)}
