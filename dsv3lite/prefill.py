"""Layer-major prefill: a long prompt goes through layer l, every PREFILL_CHUNK-token chunk of it, before layer l+1.

Attention still runs chunk by chunk over the latent cache (chunk c of layer l attends to the cache positions that
chunks 0..c of layer l wrote, as the chunk-major order does), dense MLPs and shared experts chunk by chunk, but each
MoE layer's routed experts are called once for all of up to LAYER_MAJOR_TOKENS tokens: an offloaded layer's experts
cross to the device once per group of chunks instead of once per chunk (a 4K-token prompt: once, not 8 times), and
resident experts see larger token groups. The engine uses it for prompts longer than one chunk.

    hidden = prefill_hidden(model, tokens [1, N], start, cache)    # final-normed [1, N, D], like model.hidden
"""
from __future__ import annotations

import torch

from .limits import PREFILL_CHUNK
from .model import Block, Transformer, as_dtype


def prefill_hidden(model: Transformer, tokens: torch.Tensor, start: int, cache: torch.Tensor,
                   chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """tokens [1, N] at positions start.. -> final-normed hidden [1, N, D]; cache: the main layers' latent cache."""
    bounds = [(s, min(s + chunk, tokens.shape[1])) for s in range(0, tokens.shape[1], chunk)]
    hs = [model.embed(tokens[:, a:b]) for a, b in bounds]
    rope = [tuple(as_dtype(t, hs[0].dtype)[:, None] for t in model.rotary(start + a, b - a, hs[0].device))
            for a, b in bounds]
    watchers = model.observers.attention
    for i, layer in enumerate(model.layers):
        hs = [layer.attention(h, start + a, *rope[c], cache[i], False) for c, (h, (a, _)) in enumerate(zip(hs, bounds))]
        if watchers:
            whole = torch.cat(hs, dim=1)              # observers see the layer's whole prompt, as one forward
            for fn in watchers:
                fn(layer, whole)
        hs = _moe_chunks(layer, hs) if layer.is_moe else [layer.feed_forward(h) for h in hs]
    return torch.cat([model.norm(h) for h in hs], dim=1)


def _moe_chunks(layer: Block, hs: list[torch.Tensor]) -> list[torch.Tensor]:
    """h + moe(ffn_norm(h)) for every chunk, with the routed experts called once for all chunks' tokens (the same
    sum as MoE.forward: routed + shared, added to the residual)."""
    moe = layer.ffn
    normed = [layer.ffn_norm(h) for h in hs]
    flats = [n.reshape(-1, n.shape[-1]) for n in normed]
    routes = [moe.gate(f) for f in flats]                 # (weights, ids, scores) per chunk
    for fn in moe.observers.routing:
        for weights, ids, scores in routes:
            fn(moe.layer_id, ids, scores)
    shared = [moe.shared_experts(n) for n in normed]
    routed = moe.experts(torch.cat(flats), torch.cat([r[1] for r in routes]), torch.cat([r[0] for r in routes]))
    out, row = [], 0
    for h, s, f in zip(hs, shared, flats):
        n = f.shape[0]
        out.append(h + (routed[row:row + n].view(h.shape) + s))
        row += n
    return out
