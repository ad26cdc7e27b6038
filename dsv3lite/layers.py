"""Building blocks every model family shares: dtype helpers, the bias-free Linear, RMSNorm, and the observers that
watch a model's forward passes."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, skipping the no-op (but dispatched) conversion when it already is."""
    return x if x.dtype == dtype else x.to(dtype)


def inference_views(owner: nn.Module, tensors: tuple[torch.Tensor, ...], build):
    """build() -> views of `tensors` (transposes, per-expert slices), kept on `owner` between inference-mode calls
    so a decode step does not re-derive them (one set of views per owner); rebuilt when a tensor changes storage
    (a load, .to()), never kept (nor built from a cache) outside inference mode, where autograd must see the
    parameters themselves."""
    if not torch.is_inference_mode_enabled():
        return build()
    key = [t.data_ptr() for t in tensors]
    cached = owner.__dict__.get("_inference_views")
    if cached is None or cached[0] != key:
        cached = owner.__dict__["_inference_views"] = (key, build())
    return cached[1]


def swiglu_act(g: torch.Tensor, u: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(g) * u; with `limit` (DeepSeek-V4's swiglu_limit) silu(min(g, limit)) * clamp(u, -limit, limit). The
    SwiGLU every expert path computes (the kernels' twins and quant.layout's reference included)."""
    if limit is None:
        return F.silu(g) * u
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


class Linear(nn.Linear):
    """A bias-free nn.Linear whose inference forward is the product linear() reduces to, x @ W^T (matmul, or mm for
    2-D x: the same kernel on the same operands, so the same bits), with W^T kept between calls: a decode step is
    hundreds of tiny products, and linear's dispatch layers cost more than the product itself."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not torch.is_inference_mode_enabled():
            return F.linear(x, w)
        wt = inference_views(self, (w,), w.t)
        return torch.mm(x, wt) if x.dim() == 2 else torch.matmul(x, wt)     # matmul folds the rows into one mm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, normalised value rounded to the input dtype, then the weight multiply. Spelled out: the
        # bits of F.rms_norm (checked in test_model_parity) in a third of its operators (on CPU it is a composite that
        # also converts eps to a tensor and back)
        h = as_dtype(x, torch.float32)
        return self.weight * as_dtype(h * h.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_(), x.dtype)


# --- observers ---------------------------------------------------------------------------------------

OBSERVER_EVENTS = ("attention", "layer", "routing")


class Observers:
    """The callbacks watching one model's forward passes, per event; lists stay empty (and cost one loop over nothing)
    when nobody watches. Events, in the order a block calls them:

      attention  fn(block, h): after the block's attention, before its feed-forward
      layer      fn(block, h, routed): the same moment, with what the block's feed-forward is about to use, computed
                 once for both: routed = (x, (weights, ids, scores)) for a MoE block (its router's input and routing),
                 None for a dense one (the offloading runtime predicts and prefetches here)
      routing    fn(layer_id, ids [N, K], scores [N, E]): after each MoE router
    """

    def __init__(self):
        self.attention: list = []
        self.layer: list = []
        self.routing: list = []

    def add(self, on_attention=None, on_layer=None, on_routing=None) -> "ObserverHandle":
        fns = dict(zip(OBSERVER_EVENTS, (on_attention, on_layer, on_routing)))
        assert any(fn is not None for fn in fns.values()), "an observer needs at least one callback"
        for event, fn in fns.items():
            if fn is not None:
                getattr(self, event).append(fn)
        return ObserverHandle(self, fns)

    def after_attention(self, block, h, routed) -> None:
        for fn in self.attention:
            fn(block, h)
        for fn in self.layer:
            fn(block, h, routed)

    def routed(self, layer_id: int, ids, scores) -> None:
        for fn in self.routing:
            fn(layer_id, ids, scores)


class ObserverHandle:
    def __init__(self, observers: Observers, fns: dict):
        self._observers, self._fns = observers, fns

    def remove(self) -> None:
        """Detach the callbacks (idempotent)."""
        for event, fn in self._fns.items():
            fns = getattr(self._observers, event)
            if fn is not None and fn in fns:
                fns.remove(fn)
        self._fns = {}
