"""The DeepSeek-V4 network (docs/dsv4-math.md §2, §6): the residual is hc_mult streams [B, S, n, D], mixed by mHC
around each block's attention and MoE; hc_head collapses them before the final norm and head. The MTP block reads
the streams before hc_head.

Surface used by the engine, executors and offloading (the spine): `args`, `embed`, `layers`, `mtp`, `observers`,
`blocks()`, `moe_modules()`, `new_cache(capacity, dtype, device)`, `hidden(tokens, start, cache, absorb) -> streams`,
`logits(streams)`, `mtp_prologue(streams, next_tokens)`, `mtp_hidden(streams, next_tokens, start, cache,
absorb)`, `mtp_logits(mtp_streams)` (absorb is the executors' argument, with no meaning here),
`token_route_tables()`; each block's sub-steps

    attention(x, start, cache)          mHC_attn around the attention, the block's cache written
    router_input(x)                     what the router reads: the ffn mHC pre-collapse of x, then ffn_norm
    routed_ahead(x, tokens)             (router_input(x), the MoE's route of it)
    feed_forward(x, tokens, routed)     mHC_ffn around the MoE; routed: routed_ahead(x, tokens), if computed
    ffn_input(x) / ffn_output(x, out, mix)   its two halves around the MoE (the layer-major prefill's)

(the token ids reach the hash routers through them). A state may have any leading dims: [..., n, D].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import ModelCache
from ..model import Linear, ObserverHandle, Observers
from .attention import Attention, RMSNorm, Rotary, unweighted_rms
from .cache import SlidingCache, new_cache
from .config import V4Args
from .moe import MoE


class HyperConnection(nn.Module):
    """One mHC (hc_attn or hc_ffn of a block), in fp32 (§2.2, §2.4): from the streams X [B, S, n, D] it computes
    pre [n] (collapse weights), post [n] (how the sub-block's output enters each stream) and comb [n, n] (Sinkhorn:
    columns sum to ~1; output stream k reads column k)."""

    def __init__(self, args: V4Args):
        super().__init__()
        n = args.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * args.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """fn . unweighted_rmsnorm(X flattened) in fp32: [..., (2 + n) n]."""
        return F.linear(unweighted_rms(x.flatten(-2).float(), self.eps), self.fn.float())

    def pre(self, x: torch.Tensor, mix: torch.Tensor | None = None) -> torch.Tensor:
        """Collapse weights [B, S, n] (no Sinkhorn: all a router predictor needs; the same bits as weights()')."""
        mix = self.mix(x) if mix is None else mix
        return torch.sigmoid(mix[..., :self.n] * self.scale[0] + self.base[:self.n]) + self.hc_eps

    def weights(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre [B, S, n], post [B, S, n], comb [B, S, n, n]) in fp32."""
        n = self.n
        mix = self.mix(x)
        post = 2 * torch.sigmoid(mix[..., n:2 * n] * self.scale[1] + self.base[n:2 * n])
        comb = mix[..., 2 * n:].unflatten(-1, (n, n)) * self.scale[2] + self.base[2 * n:].view(n, n)
        comb = comb.softmax(dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)          # a column step first
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        return self.pre(x, mix), post, comb

    @staticmethod
    def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """sum_i pre_i X_i [..., D]: fp32 products and sum, one rounding to X's dtype."""
        return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)

    @staticmethod
    def expand(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X_new[k] = post_k F + sum_i comb[i, k] X_i, in fp32 with one rounding (comb applied transposed)."""
        mixed = torch.matmul(comb.transpose(-1, -2), x.float())
        return (post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(x.dtype)


class HyperHead(nn.Module):
    """The final collapse of the streams (hc_head, §2.6): sigmoid pre weights, no post, no Sinkhorn."""

    def __init__(self, args: V4Args):
        super().__init__()
        n = args.hc_mult
        self.hc_eps, self.eps = args.hc_eps, args.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n, n * args.hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mix = F.linear(unweighted_rms(x.flatten(-2).float(), self.eps), self.fn.float())
        pre = torch.sigmoid(mix * self.scale.float() + self.base.float()) + self.hc_eps
        return HyperConnection.collapse(x, pre)


class Block(nn.Module):
    """One V4 block: X <- mHC_attn(X) then X <- mHC_ffn(X) over the streams [B, S, n, D]."""

    def __init__(self, args: V4Args, layer_id: int, main_rotary: Rotary, compress_rotary: Rotary):
        super().__init__()
        self.layer_id = layer_id
        self.is_moe = True
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer_id, main_rotary, compress_rotary)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn = MoE(args, layer_id)
        self.hc_attn = HyperConnection(args)
        self.hc_ffn = HyperConnection(args)
        self.observers = Observers()          # the model's own (Transformer sets it)

    def attention(self, x: torch.Tensor, start, cache: SlidingCache | None = None) -> torch.Tensor:
        """start: the first position, an int or cache.Positions (device positions: a captured decode step)."""
        pre, post, comb = self.hc_attn.weights(x)
        f = self.attn(self.attn_norm(self.hc_attn.collapse(x, pre)), start, cache)
        return self.hc_attn.expand(x, f, post, comb)

    def router_input(self, x: torch.Tensor) -> torch.Tensor:
        """What this block's router reads, from streams x: its own ffn mHC pre-collapse, then ffn_norm (exact for
        the streams it is given; a prediction when they are an earlier layer's)."""
        return self.ffn_norm(self.hc_ffn.collapse(x, self.hc_ffn.pre(x)))

    def routed_ahead(self, x: torch.Tensor, tokens: torch.Tensor | None = None):
        """(router input, route) of the feed-forward on streams x, computed before it runs; tokens [B, S]."""
        u = self.router_input(x)
        return u, self.ffn.route(u, tokens)

    def ffn_input(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """The feed-forward's first half: (its input router_input(x) [..., D], the ffn mHC's (post, comb) that
        ffn_output mixes with)."""
        pre, post, comb = self.hc_ffn.weights(x)
        return self.ffn_norm(self.hc_ffn.collapse(x, pre)), (post, comb)

    def ffn_output(self, x: torch.Tensor, out: torch.Tensor, mix: tuple) -> torch.Tensor:
        """The feed-forward's second half: the MoE's output joins the streams x through the ffn mHC's mix."""
        return self.hc_ffn.expand(x, out, *mix)

    def feed_forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None, routed=None) -> torch.Tensor:
        """tokens [B, S]: the ids of these positions (hash-routed layers read them); routed: routed_ahead(x)."""
        u, mix = self.ffn_input(x)
        return self.ffn_output(x, self.ffn(u, tokens, None if routed is None else routed[1]), mix)

    def forward(self, x: torch.Tensor, start: int, cache: SlidingCache | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        x = self.attention(x, start, cache)
        routed = self.routed_ahead(x, tokens) if self.observers.layer else None
        self.observers.after_attention(self, x, routed)
        return self.feed_forward(x, tokens, routed)


class MTP(nn.Module):
    """The MTP block (§6): Y = e_proj(enorm(embed(t_next))) + h_proj(hnorm(X)) per stream, a full V4 block (its
    own mHC, sliding attention, non-hash MoE), and its own hc_head and norm before the shared head."""

    def __init__(self, args: V4Args, main_rotary: Rotary, compress_rotary: Rotary):
        super().__init__()
        d = args.hidden_size
        self.enorm, self.hnorm = RMSNorm(d, args.rms_norm_eps), RMSNorm(d, args.rms_norm_eps)
        self.e_proj, self.h_proj = Linear(d, d), Linear(d, d)
        self.block = Block(args, args.mtp_layer_id, main_rotary, compress_rotary)
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(d, args.rms_norm_eps)

    def prologue(self, emb: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """emb [B, S, D]: embeddings of the next tokens; x [B, S, n, D]: the main streams (or the previous draft's
        MTP streams) -> the block's input streams [B, S, n, D]."""
        return self.h_proj(self.hnorm(x)) + self.e_proj(self.enorm(emb)).unsqueeze(2)

    def forward(self, emb: torch.Tensor, x: torch.Tensor, start: int, cache=None, tokens=None) -> torch.Tensor:
        """prologue(emb, x) through the block -> the MTP block's streams [B, S, n, D]."""
        return self.block(self.prologue(emb, x), start, cache, tokens)


class Transformer(nn.Module):
    """DeepSeek-V4: embed -> n identical streams -> blocks -> hc_head -> norm -> head."""

    def __init__(self, args: V4Args, with_mtp: bool = False):
        super().__init__()
        self.args = args
        main, compress = Rotary(args, compress=False), Rotary(args, compress=True)
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i, main, compress) for i in range(args.num_hidden_layers))
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = Linear(args.hidden_size, args.vocab_size)
        self.mtp = MTP(args, main, compress) if with_mtp else None
        self.observers = Observers()
        for block in self.blocks():
            block.observers = block.ffn.observers = self.observers

    def add_observer(self, on_attention=None, on_routing=None, on_layer=None) -> ObserverHandle:
        """Watch forward passes (layers.Observers lists the events): on_attention(block, streams [B, S, n, D]) after
        each block's attention (the MTP block's included), on_layer(block, streams, routed) at the same moment with
        the feed-forward's router input and routing, on_routing(layer_id, ids [N, K], scores [N, E]) after each
        router."""
        return self.observers.add(on_attention, on_layer, on_routing)

    def blocks(self) -> list[Block]:
        """Every block, main layers then the MTP block (cache index = position in this list)."""
        return list(self.layers) + ([self.mtp.block] if self.mtp is not None else [])

    def moe_modules(self) -> list[MoE]:
        return [b.ffn for b in self.blocks()]

    def token_route_tables(self) -> dict[int, torch.Tensor]:
        """The layers whose experts follow from the token id alone (hash routing): layer id -> tid2eid [vocab, K]."""
        return {b.layer_id: b.ffn.gate.tid2eid for b in self.layers if b.ffn.gate.is_hash}

    def new_cache(self, capacity: int, dtype: torch.dtype, device: torch.device) -> ModelCache:
        """Every block's cache object (its attention kind's) for one sequence of up to `capacity` tokens."""
        return new_cache(self.args, capacity, self.mtp is not None, 1, device, dtype)

    def prologue(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] -> the first streams [B, S, n, D]: n copies of the embeddings."""
        return self.embed(tokens).unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()

    def hidden(self, tokens: torch.Tensor, start: int = 0, cache: ModelCache | None = None,
               absorb: bool = False) -> torch.Tensor:
        """tokens [B, S] at positions start.. -> the streams after the last main block [B, S, n, D] (what hc_head
        and the MTP block read). cache: a ModelCache (new_cache), written here; None: a whole sequence."""
        x = self.prologue(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, start, None if cache is None else cache[i], tokens)
        return x

    def logits(self, state: torch.Tensor) -> torch.Tensor:
        """Streams [..., n, D] -> logits [..., vocab] in the compute dtype."""
        return self.head(self.norm(self.hc_head(state)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(self.hidden(tokens))

    def mtp_prologue(self, state: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """The MTP block's input streams for pairs (streams_i, t_{i+1}) [B, S, n, D]."""
        return self.mtp.prologue(self.embed(next_tokens), state)

    def mtp_hidden(self, state: torch.Tensor, next_tokens: torch.Tensor, start: int = 0,
                   cache: SlidingCache | None = None, absorb: bool = False) -> torch.Tensor:
        """The MTP block over pairs (streams_i, t_{i+1}) at positions start..; cache: the MTP block's own cache
        object (the ModelCache's entry after the main blocks). The result is also what the next draft feeds back
        as `state`."""
        return self.mtp(self.embed(next_tokens), state, start, cache, next_tokens)

    def mtp_logits(self, mtp_state: torch.Tensor) -> torch.Tensor:
        return self.head(self.mtp.norm(self.mtp.hc_head(mtp_state)))
