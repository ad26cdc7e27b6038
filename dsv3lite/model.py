"""The DeepSeek-V3-family network (V3/R1/V3.1, V3.2, Kimi-K2/K2.5, Moonlight, V2): the decoder block, the MTP
module and the Transformer that composes them. Its pieces live beside it: attention.py (RoPE, MLA, V3.2's
indexer), moe.py (router, experts, MoE), layers.py (Linear, RMSNorm, observers), cache.py (the latent cache).

This is the math and nothing else: executors (dsv3lite/executors/) run the same sub-steps in other orders or
through compiled kernels, never by copies of them. The sub-steps of a block:

    attention(h, pos, cos, sin, cache, absorb)   h + attention(attn_norm(h)), the layer's cache written
    router_input(h)                              what the router reads: ffn_norm(h)
    routed_ahead(h)                              (router_input(h), the MoE's route of it), or None (dense)
    feed_forward(h, routed=None)                 h + ffn(router_input(h)); routed: routed_ahead(h), if computed
    residual(h, out)                             h + out (how a sub-block's output joins the residual)

and of the MoE (moe.py): route(x), shared(x), routed(x, route), combine(routed, shared).

Numerics follow transformers' DeepseekV3/V2 (docs/dsv3-math.md, "Reference B").
"""
from __future__ import annotations

import torch
from torch import nn

from .attention import MLA, Indexer, Rotary, apply_rope, causal_mask, rope_inv_freq  # noqa: F401  (re-exported)
from .cache import ModelCache, Positions, as_model_cache, latent_caches, LatentCache
from .config import ModelArgs
from .layers import Linear, ObserverHandle, Observers, RMSNorm, as_dtype, inference_views  # noqa: F401
from .moe import FEW_TOKENS, MLP, Gate, MoE, RoutedExperts, combine_experts  # noqa: F401


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = MLA(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.is_moe = args.is_moe_layer(layer_id)
        self.ffn = MoE(args, layer_id) if self.is_moe else MLP(args.hidden_size, args.intermediate_size)
        self.observers = Observers()          # the model's own (Transformer sets it)

    def attention(self, h: torch.Tensor, pos: Positions, cos: torch.Tensor, sin: torch.Tensor,
                  cache: LatentCache | None = None, absorb: bool = False) -> torch.Tensor:
        return self.residual(h, self.attn(self.attn_norm(h), pos, cos, sin, cache, absorb))

    @staticmethod
    def residual(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """A sub-block's output added to the residual stream."""
        return h + out

    def router_input(self, h: torch.Tensor) -> torch.Tensor:
        """The feed-forward's input, which its router reads (also, from an earlier layer's h, a prediction)."""
        return self.ffn_norm(h)

    def routed_ahead(self, h: torch.Tensor):
        """(x, route) of a MoE block's feed-forward on h, computed before it runs (None for a dense block)."""
        if not self.is_moe:
            return None
        x = self.router_input(h)
        return x, self.ffn.route(x)

    def feed_forward(self, h: torch.Tensor, routed=None) -> torch.Tensor:
        if routed is not None:
            x, route = routed
            return self.residual(h, self.ffn(x, route))
        return self.residual(h, self.ffn(self.router_input(h)))

    def forward(self, h: torch.Tensor, pos: Positions, cos: torch.Tensor, sin: torch.Tensor,
                cache: LatentCache | None = None, absorb: bool = False) -> torch.Tensor:
        h = self.attention(h, pos, cos, sin, cache, absorb)
        routed = self.routed_ahead(h) if self.observers.layer else None
        self.observers.after_attention(self, h, routed)
        return self.feed_forward(h, routed)


class MTPLayer(nn.Module):
    """Multi-token prediction module: [enorm(emb(t_{i+1})) | hnorm(h_i)] -> eh_proj -> block -> head_norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d = args.hidden_size
        self.enorm = RMSNorm(d, args.rms_norm_eps)
        self.hnorm = RMSNorm(d, args.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d)
        self.block = Block(args, args.mtp_layer_id)
        self.head_norm = RMSNorm(d, args.rms_norm_eps)

    def prologue(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """emb: embeddings of the next tokens [B, S, D]; hidden: the main model's final-normed hidden [B, S, D]."""
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, pos: Positions, cos, sin, cache=None,
                absorb=False) -> torch.Tensor:
        return self.head_norm(self.block(self.prologue(emb, hidden), pos, cos, sin, cache, absorb))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, with_mtp: bool = False):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = Linear(args.hidden_size, args.vocab_size)
        self.mtp = MTPLayer(args) if with_mtp else None
        self.rotary = Rotary(args)
        self.observers = Observers()
        for block in self.blocks():
            block.observers = self.observers
            if block.is_moe:
                block.ffn.observers = self.observers

    def add_observer(self, on_attention=None, on_routing=None, on_layer=None) -> ObserverHandle:
        """Watch forward passes (layers.Observers lists the events): on_attention(block, h [B, S, D]) after each
        layer's attention (the MTP block included, after the main layers), on_layer(block, h, routed) at the same
        moment with the feed-forward's router input and routing, on_routing(layer_id, ids [N, K], scores [N, E])
        after each MoE router, MTP layer included. Observers run in the order they were added;
        `handle.remove()` detaches them."""
        return self.observers.add(on_attention, on_layer, on_routing)

    def blocks(self) -> list[Block]:
        """Every decoder block, main layers then the MTP block (cache index = position in this list)."""
        return list(self.layers) + ([self.mtp.block] if self.mtp is not None else [])

    def moe_modules(self) -> list[MoE]:
        return [b.ffn for b in self.blocks() if b.is_moe]

    def token_route_tables(self) -> dict[int, torch.Tensor]:
        """The layers whose experts follow from the token id alone, with their tables: none in this family."""
        return {}

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device) -> ModelCache:
        """Every block's latent cache for one sequence of up to `capacity` tokens (V3.2: with its index keys)."""
        tensor = torch.zeros(len(self.blocks()), 1, capacity, self.args.cache_dim, dtype=dtype, device=device)
        return latent_caches(tensor, self.args.latent_dim, self.args.num_hidden_layers)

    # --- a forward pass, as its pieces and whole ---------------------------------------------------------------
    def prologue(self, tokens: torch.Tensor, pos: Positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [B, S] -> (embeddings [B, S, D], the RoPE rows cos / sin [S, 1, dr] every layer uses)."""
        h = self.embed(tokens)
        cos, sin = pos.rope(self.rotary, h.dtype, h.device)
        return h, cos, sin

    def hidden(self, tokens: torch.Tensor, start: int = 0, cache=None, absorb: bool = False) -> torch.Tensor:
        """tokens [B, S] at positions start.. -> final-normed hidden [B, S, D] (what the MTP module reads). cache:
        a ModelCache (or a latent tensor [n_blocks, B, Tmax, cache_dim]) or None."""
        pos = Positions(start, tokens.shape[1])
        cache = as_model_cache(cache, self.args.latent_dim)
        h, cos, sin = self.prologue(tokens, pos)
        for i, layer in enumerate(self.layers):
            h = layer(h, pos, cos, sin, None if cache is None else cache[i], absorb)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def forward(self, tokens: torch.Tensor, start: int = 0, cache=None, absorb: bool = False) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab] in the compute dtype."""
        return self.logits(self.hidden(tokens, start, cache, absorb))

    def mtp_prologue(self, hidden: torch.Tensor, next_tokens: torch.Tensor, pos: Positions):
        """The MTP block's input for pairs (hidden_i, t_{i+1}), and the RoPE rows -> (h, cos, sin)."""
        cos, sin = pos.rope(self.rotary, hidden.dtype, hidden.device)
        return self.mtp.prologue(self.embed(next_tokens), hidden), cos, sin

    def mtp_hidden(self, hidden: torch.Tensor, next_tokens: torch.Tensor, start: int = 0, cache=None,
                   absorb: bool = False) -> torch.Tensor:
        """MTP pass over pairs (hidden_i, t_{i+1}) at positions start.. -> its normed output [B, S, D] (the next
        draft's `hidden`); cache: the MTP layer's own LatentCache (or its tensor [B, Tmax, cache_dim])."""
        pos = Positions(start, next_tokens.shape[1])
        if isinstance(cache, torch.Tensor):
            cache = LatentCache(cache, self.args.latent_dim)
        h, cos, sin = self.mtp_prologue(hidden, next_tokens, pos)
        return self.mtp.head_norm(self.mtp.block(h, pos, cos, sin, cache, absorb))

    def mtp_logits(self, mtp_hidden: torch.Tensor) -> torch.Tensor:
        return self.head(mtp_hidden)


def init_weights(model: Transformer, std: float = 0.02) -> Transformer:
    """Random init for training from scratch: normal(0, std) matrices, unit norms, zero router bias."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("norm.bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)
        for mod in model.modules():
            if isinstance(mod, Gate) and mod.bias is not None:
                mod.bias.zero_()
    return model
