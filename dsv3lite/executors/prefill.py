"""Layer-major prefill: a long prompt goes through layer l, every PREFILL_CHUNK-token chunk of it, before layer l+1.

Attention still runs chunk by chunk over the cache (chunk c of layer l attends to the cache positions that chunks
0..c of layer l wrote, as the chunk-major order does), dense MLPs and shared experts chunk by chunk, but each MoE
layer's routed experts are called once for all of up to LAYER_MAJOR_TOKENS tokens: an offloaded layer's experts
cross to the device once per group of chunks instead of once per chunk (a 4K-token prompt: once, not 8 times), and
resident experts see larger token groups. The engine uses it for prompts longer than one chunk. Every piece is one of
the block's own sub-steps (model.py), called in this order.

    hidden = prefill_hidden(model, tokens [1, N], start, cache)    # as model.hidden: final-normed [1, N, D]
                                                                    #   (DeepSeek-V4: its streams [1, N, n, D])
"""
from __future__ import annotations

import torch

from ..cache import ModelCache, Positions, as_model_cache
from ..limits import PREFILL_CHUNK
from ..model import Transformer      # the V3 family's network (DeepSeek-V4's runs its own order below)


def prefill_hidden(model, tokens: torch.Tensor, start: int, cache: ModelCache,
                   chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """tokens [1, N] at positions start.. -> the state model.hidden gives (final-normed hidden [1, N, D]; DeepSeek-V4:
    the streams [1, N, n, D]); cache: the model's caches."""
    if not isinstance(model, Transformer):
        return _streams_prefill(model, tokens, start, cache, chunk)
    cache = as_model_cache(cache, model.args.latent_dim)
    positions = [Positions(start + s, min(chunk, tokens.shape[1] - s)) for s in range(0, tokens.shape[1], chunk)]
    pieces = [model.prologue(tokens[:, p.start - start:p.end - start], p) for p in positions]
    hs = [h for h, _, _ in pieces]
    observers = model.observers
    for i, layer in enumerate(model.layers):
        hs = [layer.attention(h, p, cos, sin, cache[i]) for h, p, (_, cos, sin) in zip(hs, positions, pieces)]
        if layer.is_moe:
            inputs = [(layer.router_input(h), None) for h in hs]
            routes = [layer.ffn.route(x) for x, _ in inputs]
            hs = _moe_chunks(layer, hs, observers, inputs, routes, lambda h, out, _: layer.residual(h, out))
        else:
            if observers.attention or observers.layer:
                observers.after_attention(layer, torch.cat(hs, dim=1), None)
            hs = [layer.feed_forward(h) for h in hs]
    return torch.cat([model.norm(h) for h in hs], dim=1)


def _streams_prefill(model, tokens: torch.Tensor, start: int, cache: ModelCache, chunk: int) -> torch.Tensor:
    """DeepSeek-V4's order: the residual is streams, each feed-forward sits between its mHC's two halves (the
    block's ffn_input and ffn_output), and the chunk's token ids reach the hash routers."""
    spans = [(s, min(s + chunk, tokens.shape[1])) for s in range(0, tokens.shape[1], chunk)]
    toks = [tokens[:, a:b] for a, b in spans]
    xs = [model.prologue(t) for t in toks]
    for i, layer in enumerate(model.layers):
        xs = [layer.attention(x, start + a, cache[i]) for x, (a, _) in zip(xs, spans)]
        inputs = [layer.ffn_input(x) for x in xs]
        routes = [layer.ffn.route(u, t) for (u, _), t in zip(inputs, toks)]
        xs = _moe_chunks(layer, xs, model.observers, inputs, routes, layer.ffn_output)
    return torch.cat(xs, dim=1)


def _moe_chunks(layer, hs: list[torch.Tensor], observers, inputs, routes, join) -> list[torch.Tensor]:
    """Every chunk through the MoE block's feed-forward (MoE.forward's sub-steps: route, shared, routed, combine,
    then join(h, out, extra) to the residual), with the routed experts called once for all chunks' tokens. inputs:
    per chunk (the router's input x, what join needs besides); routes: per chunk (weights, ids, scores). Observers
    see the layer's whole prompt, as one forward."""
    moe = layer.ffn
    xs = [x for x, _ in inputs]
    whole = tuple(torch.cat(parts) for parts in zip(*routes))
    if observers.attention or observers.layer:
        routed = (torch.cat(xs, dim=1), whole) if observers.layer else None
        observers.after_attention(layer, torch.cat(hs, dim=1), routed)
    for weights, ids, scores in routes:
        observers.routed(moe.layer_id, ids, scores)
    shared = [moe.shared(x) for x in xs]
    flats = [x.reshape(-1, x.shape[-1]) for x in xs]
    routed = moe.routed(torch.cat(flats), whole)
    out, row = [], 0
    for h, (x, extra), s, f in zip(hs, inputs, shared, flats):
        n = f.shape[0]
        out.append(join(h, moe.combine(routed[row:row + n].view(x.shape), s), extra))
        row += n
    return out
