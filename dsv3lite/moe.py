"""The V3 family's feed-forward: the SwiGLU MLP (dense layers, shared experts), the router, the resident dense
routed experts and the MoE that composes them.

Routed experts sit behind one seam, `MoE.experts`: a module called as `experts(x [N, D], ids [N, K], weights [N, K])
-> [N, D]`, so the offloading runtime (and the packed providers of experts.py) swap in without touching the network.
Outputs are summed in ascending expert id, each weighted output rounded to x.dtype before it is added (as
transformers does), whatever computed it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelArgs
from .layers import Linear, Observers, as_dtype, inference_views

class MLP(nn.Module):
    """SwiGLU: down(silu(gate x) * up x). Dense layers and shared experts."""

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.w1 = Linear(dim, inter)   # gate_proj
        self.w3 = Linear(dim, inter)   # up_proj
        self.w2 = Linear(inter, dim)   # down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Gate(nn.Module):
    """Router in fp32: sigmoid + bias-corrected grouped top-k (noaux_tc) or softmax greedy / group-limited."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.hidden_size, dtype=torch.float32))
        if args.has_gate_bias:
            self.register_buffer("bias", torch.zeros(args.n_routed_experts, dtype=torch.float32))
        else:
            self.bias = None

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Unbiased routing scores [N, E] in fp32."""
        w = as_dtype(self.weight, torch.float32)
        logits = torch.mm(as_dtype(x, torch.float32), inference_views(self, (w,), w.t))     # F.linear's product
        return logits.sigmoid() if self.args.scoring_func == "sigmoid" else logits.softmax(dim=-1)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids [N, K] chosen from unbiased scores [N, E] (bias and group limit applied here)."""
        return self.pick(scores if self.bias is None else scores + self.bias)

    def pick(self, choice: torch.Tensor) -> torch.Tensor:
        """Expert ids [N, K] from bias-corrected scores [N, E]: the group limit, then the top k."""
        a = self.args
        if a.n_group > 1 and a.topk_method != "greedy":
            grouped = choice.view(-1, a.n_group, a.n_routed_experts // a.n_group)
            if a.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            keep = group_scores.topk(a.topk_group, dim=-1, sorted=False).indices
            dropped = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
            choice = grouped.masked_fill(dropped[..., None], float("-inf")).view_as(choice)
        return choice.topk(a.num_experts_per_tok, dim=-1, sorted=False).indices

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, K] fp32, ids [N, K], scores [N, E]); weights use the unbiased scores."""
        scores = self.scores(x)
        ids = self.select(scores)
        weights = scores.gather(1, ids)
        if self.args.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.args.routed_scaling_factor, ids, scores


FEW_TOKENS = 4      # up to this many tokens (MTP verification), RoutedExperts runs each token as a decode step


class RoutedExperts(nn.Module):
    """All routed experts of one layer, resident and dense: w1/w3 [E, I, D], w2 [E, D, I]."""

    def __init__(self, n_experts: int, dim: int, inter: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, inter, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, inter, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, inter))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w1, w3, w2 = self._transposed()
        return _swiglu(x, w1[e], w3[e], w2[e])

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_token(x, ids, weights)
        if x.shape[0] <= FEW_TOKENS:
            return self._few_tokens(x, ids, weights)
        return combine_experts(self.expert, x, ids, weights)

    def _few_tokens(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """A few tokens (MTP verification): each token as in `_one_token`, so a verified position gets the bits
        a plain decode step would give it."""
        return torch.cat([self._one_token(x[i:i + 1], ids[i:i + 1], weights[i:i + 1]) for i in range(x.shape[0])])

    def _one_token(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Decode of one token: the chosen experts in ascending id, each weighted output rounded to x.dtype and
        added, as combine_experts does (same operators per expert, so the same bits) without its grouping."""
        ids_sorted, order = ids[0].sort()
        w1, w3, w2 = self._transposed()
        out = None
        for e, w in zip(ids_sorted.tolist(), weights[0].index_select(0, order)[:, None].unbind(0)):
            t = as_dtype(_swiglu(x, w1[e], w3[e], w2[e]) * w, x.dtype)
            out = t if out is None else out + t
        return out

    def _transposed(self):
        """w1, w3, w2 transposed, the operands of x @ W^T: stacked [E, D, I], [E, D, I], [E, I, D], or in inference
        mode per-expert lists kept between decode steps."""
        def stacked():
            return tuple(w.transpose(1, 2) for w in (self.w1, self.w3, self.w2))
        if not torch.is_inference_mode_enabled():
            return stacked()
        return inference_views(self, (self.w1, self.w3, self.w2), lambda: tuple(t.unbind(0) for t in stacked()))


def _swiglu(x: torch.Tensor, w1t: torch.Tensor, w3t: torch.Tensor, w2t: torch.Tensor) -> torch.Tensor:
    """One expert on x [N, D] from transposed weights: the products F.linear would run (mm on W^T), same bits."""
    return torch.mm(F.silu(torch.mm(x, w1t)) * torch.mm(x, w3t), w2t)


def combine_experts(expert_fn, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    host_ids: list[list[int]] | None = None) -> torch.Tensor:
    """sum_k weights[n, k] * expert_{ids[n, k]}(x[n]), accumulated in ascending expert id.

    Each expert's weighted output is rounded to x.dtype before it is added (as transformers does), so every
    provider that goes through here gives the same bits for the same expert outputs. `host_ids` (the same ids
    already on the host) saves the device->host read of the routing.
    """
    out = torch.zeros_like(x)
    k = ids.shape[1]
    if host_ids is None:
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)              # (token, slot) pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=1).tolist()
    else:
        pairs = sorted(range(len(host_ids) * k), key=lambda i: (host_ids[i // k][i % k], i))
        order = torch.tensor(pairs, dtype=torch.long).to(x.device, non_blocking=True)
        counts = [0] * (max(e for row in host_ids for e in row) + 1)
        for row in host_ids:
            for e in row:
                counts[e] += 1
    token = order // k
    w = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token[start:start + n]
        y = expert_fn(e, x.index_select(0, tok))              # index_select: its backward is a fast index_add
        out.index_add_(0, tok, (y * w[start:start + n, None]).to(x.dtype))
        start += n
    return out


class MoE(nn.Module):
    """A MoE feed-forward: the router, the routed experts behind the `experts` seam, the shared experts. Its
    sub-steps are what executors call; forward is their composition."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.gate = Gate(args)
        self.experts = RoutedExperts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size)
        self.shared_experts = MLP(args.hidden_size, args.n_shared_experts * args.moe_intermediate_size)
        self.observers = Observers()          # the model's own, shared by all its layers (Transformer sets it)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [..., D] -> (weights [N, K] fp32, ids [N, K], scores [N, E]) over its N = x.numel() / D tokens."""
        return self.gate(x.reshape(-1, x.shape[-1]))

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared_experts(x)

    def routed(self, x: torch.Tensor, route) -> torch.Tensor:
        """The routed experts' weighted sum for x [..., D] under `route` (route's result), shaped as x."""
        weights, ids, _ = route
        return self.experts(x.reshape(-1, x.shape[-1]), ids, weights).view(x.shape)

    def forward(self, x: torch.Tensor, route=None) -> torch.Tensor:
        """x [..., D] -> routed + shared; route: route(x), when computed ahead (Observers' layer event)."""
        if route is None:
            route = self.route(x)
        self.observers.routed(self.layer_id, route[1], route[2])
        # the shared expert first: on a GPU it is queued before the routed experts wait for copies or CPU results
        # (and on an offloaded layer it runs while they do); addition commutes exactly, so the bits do not change
        shared = self.shared(x)
        return self.combine(self.routed(x, route), shared)

    @staticmethod
    def combine(routed: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return routed + shared

