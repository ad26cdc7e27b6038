"""Router-driven expert prediction: after layer l's attention, apply the routers of the next MoE layers
(each with its own ffn norm, bias and group limit) to the current hidden state. DeepSeek-V4's residual is
streams: a later block's router then reads its own `router_input` of the current streams (its ffn mHC
pre-collapse, then ffn_norm) and its gate picks from its own scores. Layers whose experts follow from the token
id alone (V4's hash layers: model.token_route_tables) are not predicted here: the runtime knows them exactly as
soon as the tokens are sampled.

The current layer's own router on its own input is exact, so `predict` also returns the experts layer l
is about to use; the runtime reads everything to the host in one transfer per layer. That norm and routing
come with the observer call (the model's layer event: computed once, for the layer's feed-forward and for this).

One decode step runs the main layers and then, while MTP drafts, the MTP layer: the MTP layer follows the last
main layer in the chain of "layers ahead" (predicted only while MTP ran in the previous step). Beyond the end of
a step, the next token's first MoE layers are predicted before that token exists, from two sources, each with
its own label in place of a distance: the last main layer's hidden state (`NEXT_FROM_LAST`) and the MTP layer's
(`NEXT_FROM_MTP`).
"""
from __future__ import annotations

import torch

from ..model import Block, Transformer   # the V3 family's, whose routers one batched product predicts

NEXT_FROM_LAST = "next/last"       # the next token's first MoE layers, from the last main layer's hidden state
NEXT_FROM_MTP = "next/mtp"         # the same, from the MTP layer's hidden state
NEXT_TOKEN_SOURCES = (NEXT_FROM_LAST, NEXT_FROM_MTP)


def distance_order(distance: int | str) -> tuple:
    """Sort key of prediction distances: layers ahead in this step by distance, then the next token's sources."""
    return (0, distance, "") if isinstance(distance, int) else (1, 0, distance)


class RoutePredictor:
    """next_token: the next-token sources to predict from, or "auto" (what the runtime uses): the MTP layer's
    while MTP runs, else the last main layer's (on the demo's traces their recall is 42% and 28%, against 53% for
    two layers ahead within a step: benchmarks/cache_sim.py --mtp)."""

    def __init__(self, model: Transformer, lookahead: int = 2, next_token: tuple[str, ...] | str = "auto"):
        self.lookahead = max(int(lookahead), 0)
        self.auto = next_token == "auto"
        next_token = NEXT_TOKEN_SOURCES if self.auto else next_token
        self.layers = list(model.layers)
        self.mtp = model.mtp.block if model.mtp is not None else None
        self.batched = isinstance(model, Transformer)       # else each target's own router_input and gate
        self.token_layers = set(model.token_route_tables())
        self.position = {id(b): i for i, b in enumerate(self.layers)}
        if self.mtp is not None:
            self.position[id(self.mtp)] = len(self.layers)
        assert set(next_token) <= set(NEXT_TOKEN_SOURCES), next_token
        self.next_sources = {id(self.layers[-1]): NEXT_FROM_LAST} if NEXT_FROM_LAST in next_token else {}
        if self.mtp is not None and NEXT_FROM_MTP in next_token:
            self.next_sources[id(self.mtp)] = NEXT_FROM_MTP
        self.first_moe = [b for b in self.layers if b.is_moe and b.layer_id not in self.token_layers][:self.lookahead]
        self.mtp_ran = False              # whether the MTP layer ran in the step before this one
        self._stacks: dict = {}           # blocks predicted together -> their norm weights, gate weights, biases
        self._mtp_this_step = False

    def targets(self, layer: Block) -> list[tuple[int | str, Block]]:
        """(distance, block) for the current layer (distance 0), the MoE layers up to `lookahead` ahead (the MTP
        layer after the last main layer, while MTP runs), and the next token's first MoE layers (labelled by
        source) when `layer` is the last main layer or the MTP layer."""
        i = self.position.get(id(layer))
        if i is None:
            return [(0, layer)] if layer.is_moe else []
        if i == 0:
            self.mtp_ran, self._mtp_this_step = self._mtp_this_step, False
        if layer is self.mtp:
            self._mtp_this_step = True
        chain = self.layers + ([self.mtp] if self.mtp is not None and (self.mtp_ran or layer is self.mtp) else [])
        out: list[tuple[int | str, Block]] = []
        for d in range(0, self.lookahead + 1):
            j = i + d
            if j < len(chain) and chain[j].is_moe and (d == 0 or chain[j].layer_id not in self.token_layers):
                out.append((d, chain[j]))
        source = self.next_sources.get(id(layer))
        if source == NEXT_FROM_LAST and self.auto and self.mtp_ran:
            source = None                                # the MTP layer, about to run, predicts better
        if source is not None:
            ahead = {id(b) for _, b in out}
            out += [(source, b) for b in self.first_moe if id(b) not in ahead]
        return out

    def lookahead_ids(self, blocks: list[Block], flat: torch.Tensor) -> torch.Tensor:
        """Predicted expert ids [len(blocks), N, K] of MoE `blocks` from one hidden state flat [N, D], batched:
        the RMS statistics once (each block's ffn norm differs only by its weight), one product per block, and
        one bias-corrected, group-limited top-k over all of them. A prediction, not the routing: the normalised
        value is not rounded to the hidden dtype as the layer's own norm rounds it."""
        gate = blocks[0].ffn.gate
        key = tuple(id(b) for b in blocks)
        parts = self._stacks.get(key)
        if parts is None:
            eps = blocks[0].ffn_norm.eps
            wts = [(b.ffn_norm.weight.float(), b.ffn.gate.weight.float().t()) for b in blocks]
            bias = None if gate.bias is None else torch.stack([b.ffn.gate.bias for b in blocks])[:, None, :]
            parts = self._stacks[key] = (eps, wts, bias)
        eps, wts, bias = parts
        x = flat.float()
        r = x * x.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        logits = torch.stack([torch.mm(r * w, gt) for w, gt in wts])            # [B, N, E]
        scores = logits.sigmoid() if gate.args.scoring_func == "sigmoid" else logits.softmax(dim=-1)
        choice = scores if bias is None else scores + bias
        n_experts = choice.shape[-1]
        return gate.pick(choice.view(-1, n_experts)).view(len(blocks), flat.shape[0], -1)

    @staticmethod
    def own_router_ids(block, h: torch.Tensor) -> torch.Tensor:
        """Predicted expert ids [N, K] of a (learned-routing) block from a state h of an earlier point: its own
        router input of h, its gate's scores and choice."""
        x = block.router_input(h)
        gate = block.ffn.gate
        return gate.select(gate.scores(x.reshape(-1, x.shape[-1])))

    @torch.no_grad()
    def predict(self, layer: Block, h: torch.Tensor, routed=None) -> dict[int, tuple[int | str, list[list[int]]]]:
        """h [B, S, D] (V4: streams [B, S, n, D]) after `layer`'s attention -> {moe layer id: (distance or next-token
        source, per-token expert ids)}. routed: the layer's (router input, routing) when already computed (the
        model's layer event).

        Distance 0 is the exact routing of `layer` itself (its ffn input is router_input(h))."""
        targets = self.targets(layer)
        if not targets:
            return {}
        ids = []
        ahead = targets
        if targets[0][0] == 0 and targets[0][1] is layer:    # exact: the layer's own router on its own input
            if routed is None:
                routed = layer.routed_ahead(h)
            ids.append(routed[1][1])
            ahead = targets[1:]
        if ahead and self.batched:
            ids.extend(self.lookahead_ids([b for _, b in ahead], h.reshape(-1, h.shape[-1])))
        elif ahead:
            ids.extend(self.own_router_ids(b, h) for _, b in ahead)
        host = torch.stack(ids).tolist()                 # the one device->host read of this layer
        return {b.layer_id: (d, rows) for (d, b), rows in zip(targets, host)}
