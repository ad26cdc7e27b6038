"""DeepSeek-V4's MoE (docs/dsv4-math.md §2.5): every layer, sqrt-softplus scores in fp32, no groups; the first
num_hash_layers pick their experts by token id (tid2eid), the others by top-k of score + bias; the weights are the
chosen scores, normalised, times routed_scaling_factor. Routed and shared experts are SwiGLUs clamped at
swiglu_limit.

The routed experts sit behind the seam `experts(x [N, D], ids [N, K], weights [N, K]) -> [N, D]` (outputs summed
in ascending expert id, each weighted output rounded to x.dtype: model.combine_experts); offloading plugs in there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..model import Linear, Observers, RoutedExperts, combine_experts, inference_views
from ..quant.layout import swiglu_act
from .config import V4Args


class Gate(nn.Module):
    """The router, in fp32: scores s = sqrt(softplus(W x)); ids from tid2eid[token] (hash layers) or top-k of
    s + bias; weights s[ids] / sum * routed_scaling_factor."""

    def __init__(self, args: V4Args, layer_id: int):
        super().__init__()
        self.args, self.is_hash = args, args.is_hash_layer(layer_id)
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size, dtype=torch.float32))
        if self.is_hash:   # a trained token id -> expert ids table; a row may repeat an expert (then it counts twice)
            self.register_buffer("tid2eid", torch.zeros(args.vocab_size, args.num_experts_per_tok, dtype=torch.int32))
        else:
            self.register_buffer("bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Routing scores [N, E] in fp32 from x [N, D]."""
        w = self.weight.float()
        return F.softplus(torch.mm(x.float(), inference_views(self, (w,), w.t))).sqrt()

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids [N, K] of a learned router from its scores [N, E]: top-k of score + bias (no groups)."""
        return (scores + self.bias).topk(self.args.num_experts_per_tok, dim=-1, sorted=False).indices

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None):
        """x [N, D], tokens [N] (hash layers) -> (weights [N, K] fp32, ids [N, K], scores [N, E])."""
        scores = self.scores(x)
        if self.is_hash:
            if tokens is None:
                raise ValueError("a hash-routed layer needs the token ids")
            ids = self.tid2eid[tokens.reshape(-1)].long()
        else:
            ids = self.select(scores)
        weights = scores.gather(1, ids)
        if self.args.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.args.routed_scaling_factor, ids, scores


class Experts(RoutedExperts):
    """All routed experts of one layer, resident and dense (w1 / w3 [E, I, D], w2 [E, D, I]), clamped SwiGLU."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float):
        super().__init__(n_experts, dim, inter)
        self.limit = limit

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self._transposed()
        return torch.mm(swiglu_act(torch.mm(x, w1[e]), torch.mm(x, w3[e]), self.limit), w2[e])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return combine_experts(self.expert, x, ids, weights)

    def cpu_blobs(self):
        return None                  # the V3 CPU decode step has no clamp


class SharedExpert(nn.Module):
    """The shared expert: a SwiGLU clamped like the routed ones."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.w1, self.w3, self.w2 = Linear(dim, inter), Linear(dim, inter), Linear(inter, dim)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu_act(self.w1(x), self.w3(x), self.limit))


class MoE(nn.Module):
    def __init__(self, args: V4Args, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.gate = Gate(args, layer_id)
        self.experts = Experts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size,
                               args.swiglu_limit)
        self.shared_experts = SharedExpert(args.hidden_size, args.moe_intermediate_size, args.swiglu_limit)
        self.observers = Observers()          # the model's own, shared by all its layers (the model sets it)

    def route(self, x: torch.Tensor, tokens: torch.Tensor | None = None):
        """x [..., D], tokens [...] (hash layers) -> (weights [N, K] fp32, ids [N, K], scores [N, E]) over its
        N = x.numel() / D tokens."""
        return self.gate(x.reshape(-1, x.shape[-1]), tokens)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x)

    def routed(self, x: torch.Tensor, route) -> torch.Tensor:
        """The routed experts' weighted sum for x [..., D] under `route` (route's result), shaped as x."""
        weights, ids, _ = route
        return self.experts(x.reshape(-1, x.shape[-1]), ids, weights).view(x.shape)

    @staticmethod
    def combine(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return routed + shared

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None, route=None) -> torch.Tensor:
        """x [B, S, D], tokens [B, S] (read by hash layers) -> [B, S, D]; route: route(x, tokens), when computed
        ahead (the layer observer event)."""
        if route is None:
            route = self.route(x, tokens)
        self.observers.routed(self.layer_id, route[1], route[2])
        shared = self.shared(x)
        return self.combine(self.routed(x, route), shared)
