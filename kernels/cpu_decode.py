"""The compiled CPU decode step's kernels, one per sub-step of a V3-family block, and the whole step strung in one
call: what dsv3lite/executors/cpu.py runs for a decode step, with the eager sub-steps (model.py) as their twin.

A decode step of DeepSeek-V3 is 61 layers of a few dozen small operators each; on the CPU, eager PyTorch spends
more time dispatching them than computing (about 0.8 ms per layer at V3's geometry and tiny widths, against
0.16 ms for a llama.cpp graph). For batch 1 and up to ABSORB_MAX_TOKENS tokens (kernels/csrc/cpu_kernels.cpp):

  attention     Block.attention: h + wo(absorbed attention over the layer's latent cache of [kv_norm(c) |
                rope(k_pe)]), the query through wq_a / q_norm / wq_b (or wq); the projections of all the call's tokens
                at once (the weights read once), their cache rows written, then each token over the rows up to its
                own (`dsv3_attention`)
  feed_forward  Block.feed_forward: h + dense MLP, or h + routed experts (router: sigmoid or softmax scores, bias,
                group limit, top-k, weights; the experts through dsv3_moe) + shared experts (`dsv3_ffn`)
  layers        both, for every main layer, in one call (`dsv3_layers`), the same kernels in the same order, so the
                same bits; the routing observers are called afterwards

Each returns None where it cannot run (the executor then runs that sub-step eagerly): the kernels absent or off
(DSV3LITE_CPU_DECODE=eager), activations not fp32 on the CPU in inference mode, or a block the kernel has no plan
for (`uncovered` says why: V3.2's indexed attention, experts the host schedules). tests/test_cpu_decode.py
compares them with the eager sub-steps. The linears go through dsv3_linear's row kernels (plain fp32 weights, or
--dense packed ones), so a token's result does not depend on how many tokens share the call: MTP verification gets
the bits of a plain decode step.
"""
from __future__ import annotations

import ctypes
import os
import weakref

import torch
from torch import nn

from . import cpu_build, cpu_experts
from .cpu_abi import F32, AttnDesc, FfnDesc, Lin
from .cpu_linear import GROUP
from ..cache import LatentCache
from ..moe import RoutedExperts
from ..quant.table import cpu_code
from ..limits import ABSORB_MAX_TOKENS

TOPK_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
MAX_ROPE = 256                            # the kernels' bounds (cpu_kernels.cpp): RoPE width, router groups
MAX_ROUTER_GROUPS = 1024
_ptr = ctypes.c_void_p


def enabled() -> bool:
    """False when DSV3LITE_CPU_DECODE=eager asks for the eager path (read at each call, so tests can switch it)."""
    return os.environ.get("DSV3LITE_CPU_DECODE", "").strip().lower() != "eager"


class _Watched:
    """Tensors a descriptor points into, held weakly: valid while each is alive and keeps its storage (a module
    swapped or a weight replaced after a step drops or moves one, and the descriptor is rebuilt)."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.refs = [weakref.ref(t) for t in tensors]
        self.key = [t.data_ptr() for t in tensors]

    def valid(self) -> bool:
        return [None if (t := r()) is None else t.data_ptr() for r in self.refs] == self.key


class _Plan(_Watched):
    """One block's descriptor (a ctypes struct, or None when the kernel cannot run it: `why` says what it lacks),
    the tensors it points into, and `extra`: the arrays it owns (expert addresses and descriptor)."""

    def __init__(self, desc, tensors: list[torch.Tensor], extra=None, why: str | None = None):
        super().__init__(tensors)
        self.desc, self.extra, self.why = desc, extra, why
        self.addr = ctypes.addressof(desc) if desc is not None else None


def _plain(t: torch.Tensor | None) -> bool:
    return t is not None and t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def _lin(mod: nn.Module, keep: list[torch.Tensor]) -> Lin | None:
    """The kernel's view of one bias-free linear: a plain fp32 nn.Linear, or a module that describes its packed
    weight (dense.PackedLinear.cpu_matrix, --dense)."""
    describe = getattr(mod, "cpu_matrix", None)
    if describe is not None:
        found = describe()
        if found is None:
            return None
        fmt, n, k, tensors = found
        keep += [t for t in tensors if t is not None]
        return Lin(cpu_code(fmt), n, k, GROUP, *(None if t is None else t.data_ptr() for t in tensors))
    if isinstance(mod, nn.Linear) and mod.bias is None and _plain(mod.weight):
        keep.append(mod.weight)
        return Lin(F32, mod.weight.shape[0], mod.weight.shape[1], 0, mod.weight.data_ptr(), None, None)
    return None


def _address(t: torch.Tensor | None, keep: list[torch.Tensor]) -> int | None:
    """The address of a plain fp32 tensor the kernel reads (kept in `keep`), or None."""
    if not _plain(t):
        return None
    keep.append(t)
    return t.data_ptr()


def _norm(mod, keep: list[torch.Tensor]) -> int | None:
    return _address(getattr(mod, "weight", None), keep)


def _attention_plan(block) -> _Plan:
    attn, keep = block.attn, []
    a = attn.args
    if attn.indexer is not None:
        return _Plan(None, [], why="V3.2's sparse (indexed) attention has no compiled kernel")
    if a.qk_rope_head_dim > MAX_ROPE or a.qk_rope_head_dim % 2:
        return _Plan(None, [], why=f"a RoPE width of {a.qk_rope_head_dim} is past the kernel's bounds")
    if a.q_lora_rank:
        wq_a, wq_b, q_norm = _lin(attn.wq_a, keep), _lin(attn.wq_b, keep), _norm(attn.q_norm, keep)
        ok = wq_a is not None and q_norm is not None and attn.q_norm.eps == attn.kv_norm.eps
    else:
        wq_a, wq_b, q_norm, ok = Lin(), _lin(attn.wq, keep), None, True
    wkv_a, wo = _lin(attn.wkv_a, keep), _lin(attn.wo, keep)
    attn_norm, kv_norm = _norm(block.attn_norm, keep), _norm(attn.kv_norm, keep)
    wkv_b = attn.wkv_b.weight if isinstance(attn.wkv_b, nn.Linear) else None
    if not ok or None in (wq_b, wkv_a, wo, attn_norm, kv_norm) or not _plain(wkv_b):
        return _Plan(None, keep, why="attention weights in a format the kernel does not read")
    keep.append(wkv_b)
    desc = AttnDesc(wq_a, wq_b, wkv_a, wo, attn_norm, q_norm, kv_norm, wkv_b.data_ptr(), a.hidden_size,
                    attn.n_heads, a.q_lora_rank or 0, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim,
                    a.kv_lora_rank, a.cache_dim, int(a.rope_interleave), block.attn_norm.eps, attn.kv_norm.eps,
                    a.softmax_scale, 0.0)
    return _Plan(desc, keep)


def _mlp(mod) -> bool:
    return all(isinstance(getattr(mod, w, None), nn.Module) for w in ("w1", "w3", "w2"))


def _ffn_plan(block) -> _Plan:
    ffn, keep = block.ffn, []
    norm = _norm(block.ffn_norm, keep)
    mlp = ffn.shared_experts if block.is_moe else ffn
    if norm is None or not _mlp(mlp):
        return _Plan(None, keep, why="a feed-forward the kernel does not know")
    lins = [_lin(m, keep) for m in (mlp.w1, mlp.w3, mlp.w2)]
    if None in lins:
        return _Plan(None, keep, why="feed-forward weights in a format the kernel does not read")
    dim = block.ffn_norm.weight.numel()
    if not block.is_moe:
        dense = FfnDesc(*lins, norm, None, None, None, None, dim, 0, 0, 1, 1, 0, 0, 0, block.ffn_norm.eps, 1.0)
        return _Plan(dense, keep)
    gate, a = ffn.gate, ffn.gate.args
    experts = _resident_blobs(ffn.experts)
    bias = gate.bias
    if experts is None:
        return _Plan(None, keep)       # experts the host schedules (offloaded, --cpu-mem): eager by design
    if getattr(ffn.experts, "limit", None) is not None:
        return _Plan(None, keep, why="a SwiGLU clamp (the V3 family's descriptor has none)")
    if not _plain(gate.weight) or (bias is not None and not _plain(bias)) \
            or a.n_group > MAX_ROUTER_GROUPS or a.num_experts_per_tok > a.n_routed_experts:
        return _Plan(None, keep, why="a router past the kernel's bounds")
    ptrs, desc, tensors = experts
    keep += [gate.weight, *tensors] + ([bias] if bias is not None else [])
    d = FfnDesc(*lins, norm, gate.weight.data_ptr(), None if bias is None else bias.data_ptr(), ptrs.data_ptr(),
                desc.data_ptr(), dim, a.n_routed_experts, a.num_experts_per_tok, a.n_group, a.topk_group,
                int(a.scoring_func == "softmax"), TOPK_METHODS[a.topk_method], int(a.norm_topk_prob),
                block.ffn_norm.eps, a.routed_scaling_factor)
    return _Plan(d, keep, extra=(ptrs, desc))


def _resident_blobs(experts):
    """(expert addresses [E], descriptor, tensors read) of a resident provider the expert kernel reads: the model's
    dense fp32 experts (each expert's three matrices read as one blob), or a packed provider that describes its
    blobs (experts.BlobExperts.cpu_blobs); else None."""
    if isinstance(experts, RoutedExperts):
        found = cpu_experts.dense_experts(experts.w1, experts.w3, experts.w2)
        return None if found is None else (*found, [experts.w1, experts.w3, experts.w2])
    describe = getattr(experts, "cpu_blobs", None)
    return describe() if describe is not None else None


# plans kept per block, outside it (modules are never written by the executors): weak keys, so a block dropped
# drops its plans; a plan whose tensors moved is rebuilt (the V4 family's blocks keep theirs here too)
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _plan(block, slot: int, build) -> _Plan:
    plans = _PLANS.setdefault(block, [None, None])
    plan = plans[slot]
    if plan is None or not plan.valid():
        plan = plans[slot] = build(block)
    return plan


def _block_plans(block) -> tuple[_Plan, _Plan]:
    """(attention plan, feed-forward plan) of one block."""
    return _plan(block, 0, _attention_plan), _plan(block, 1, _ffn_plan)


def plan_reasons(blocks, plans_of) -> list[str]:
    """Why sub-steps of `blocks` run eagerly, one line per distinct reason (nothing when the kernels are absent or
    off: then everything runs eagerly, and cpu_build already said why). plans_of(block) -> (attention plan,
    feed-forward plan): a family's."""
    if not enabled() or cpu_build.library() is None:
        return []
    reasons = []
    for block in blocks:
        for what, plan in zip(("attention", "feed-forward"), plans_of(block)):
            line = f"{what}: {plan.why}"
            if plan.desc is None and plan.why and line not in reasons:
                reasons.append(line)
    return reasons


def all_planned(blocks, plans_of) -> bool:
    """Whether the kernels are there, on, and have a plan for every sub-step of `blocks` (plans_of as above)."""
    if not enabled() or cpu_build.library() is None:
        return False
    return all(a.desc is not None and f.desc is not None for a, f in map(plans_of, blocks))


def uncovered(model) -> list[str]:
    """Why sub-steps of `model`'s blocks run eagerly, one line per distinct reason."""
    return plan_reasons(model.blocks(), _block_plans)


def _fits(cache: torch.Tensor, start: int, seqlen: int, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernels can write the tokens' rows of cache [..., 1, Tmax, cache_dim] (fp32, contiguous, room
    for them; else the eager path runs, or raises its own error) and read the RoPE rows cos / sin."""
    return cache.dtype == torch.float32 and cache.shape[-3] == 1 and cache.is_contiguous() \
        and start + seqlen <= cache.shape[-2] and cos.dtype == torch.float32 and cos.is_contiguous() \
        and sin.is_contiguous()


class StepPlans(_Watched):
    """Every main layer's plans for one model (kept alive here) as the arrays a whole-step kernel reads (`attn`,
    `ffn`: descriptor addresses per layer); valid while every plan's tensors are. plans_of: the family's."""

    def __init__(self, model, plans_of):
        blocks = list(model.layers)
        self.plans = plans = [plans_of(b) for b in blocks]
        super().__init__([r() for a, f in plans for r in a.refs + f.refs])
        self.ok = all(a.desc is not None and f.desc is not None for a, f in plans)
        if not self.ok:
            return
        n = len(blocks)
        self.blocks = blocks
        self.attn = (_ptr * n)(*(a.addr for a, _ in plans))
        self.ffn = (_ptr * n)(*(f.addr for _, f in plans))
        self.k, self.e = model.args.num_experts_per_tok, model.args.n_routed_experts


class _Layers(StepPlans):
    """StepPlans of a V3-family model, with routing buffers for its MoE layers (dsv3_layers)."""

    def __init__(self, model):
        super().__init__(model, _block_plans)
        if not self.ok:
            return
        blocks, n, k, e = self.blocks, len(self.blocks), self.k, self.e
        self.ids = torch.zeros(n, ABSORB_MAX_TOKENS * k, dtype=torch.int64)
        self.scores = torch.zeros(n, ABSORB_MAX_TOKENS * e)
        self.ids_ptrs = (_ptr * n)(*(self.ids[i].data_ptr() if b.is_moe else None for i, b in enumerate(blocks)))
        self.score_ptrs = (_ptr * n)(*(self.scores[i].data_ptr() if b.is_moe else None for i, b in enumerate(blocks)))


_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layers(model, h: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
           cache: torch.Tensor) -> torch.Tensor | None:
    """Every main layer of `model` over h [1, S, D] (the embeddings) in one kernel call -> the last layer's output,
    or None (the layers run one by one). cache: the model's ModelCache (or its tensor [n_blocks, 1, Tmax,
    cache_dim]). The routing observers are called afterwards, layer by layer, with each MoE layer's ids and
    scores."""
    lib = _usable(h)
    if lib is None:
        return None
    seqlen = h.shape[1]
    cache = _tensor(cache)
    if cache is None or cache.dim() != 4 or cache.shape[0] < len(model.layers) \
            or not _fits(cache, start, seqlen, cos, sin):
        return None
    plan = _LAYERS.get(model)
    if plan is None or not plan.valid():
        plan = _LAYERS[model] = _Layers(model)
    if not plan.ok:
        return None
    h = h.contiguous()
    tmp, out = torch.empty_like(h), torch.empty_like(h)
    rc = lib.dsv3_layers(len(plan.blocks), plan.attn, plan.ffn, h.data_ptr(), tmp.data_ptr(), out.data_ptr(), seqlen,
                         start, cache.data_ptr(), cache.stride(0), cos.data_ptr(), sin.data_ptr(), plan.ids_ptrs,
                         plan.score_ptrs, 0)
    if rc != 0:
        raise ValueError(f"CPU decode kernel: error {rc}")
    if model.observers.routing:
        for i, b in enumerate(plan.blocks):
            if b.is_moe:
                ids = plan.ids[i, :seqlen * plan.k].view(seqlen, plan.k).clone()
                scores = plan.scores[i, :seqlen * plan.e].view(seqlen, plan.e).clone()
                model.observers.routed(b.layer_id, ids, scores)
    return out


def _tensor(cache) -> torch.Tensor | None:
    """The tensor behind a cache object (a layer's LatentCache, a model's ModelCache), or the tensor given."""
    if cache is None or isinstance(cache, torch.Tensor):
        return cache
    return cache.data if isinstance(cache, LatentCache) else cache.tensor


def knows(model) -> bool:
    """Whether the kernels here are written for `model`'s family (the V3 family's blocks)."""
    from ..model import Transformer

    return isinstance(model, Transformer)


def covers(model) -> bool:
    """Whether the decode step runs every block of `model` (the kernels are there, on, and can read each block)."""
    return knows(model) and all_planned(model.blocks(), _block_plans)


def _usable(h: torch.Tensor):
    """The library, when the step may run for hidden states h [1, S, D]; else None."""
    if h.device.type != "cpu" or h.dtype != torch.float32 or h.dim() != 3 or h.shape[0] != 1 \
            or h.shape[1] > ABSORB_MAX_TOKENS or not torch.is_inference_mode_enabled() or not enabled():
        return None
    return cpu_build.library()


def attention(block, h: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor,
              cache) -> torch.Tensor | None:
    """Block.attention(h, Positions(start, S), cos, sin, cache, absorb=True) in one kernel call, or None (the eager
    sub-step runs). h [1, S, D]; cache: this layer's LatentCache (or its tensor [1, Tmax, cache_dim]), which gets the
    S tokens' rows; cos / sin [S, 1, dr]."""
    lib = _usable(h)
    cache = _tensor(cache)
    if lib is None or cache is None:
        return None
    seqlen = h.shape[1]
    if cache.dim() != 3 or not _fits(cache, start, seqlen, cos, sin):
        return None
    plan = _plan(block, 0, _attention_plan)
    if plan.desc is None:
        return None
    h = h.contiguous()
    out = torch.empty_like(h)
    rc = lib.dsv3_attention(plan.addr, h.data_ptr(), out.data_ptr(), seqlen, start, cache.data_ptr(), cos.data_ptr(),
                            sin.data_ptr(), 0)
    if rc != 0:
        raise ValueError(f"CPU attention kernel: error {rc}")
    return out


def feed_forward(block, h: torch.Tensor) -> torch.Tensor | None:
    """Block.feed_forward(h) in one kernel call, or None (the eager path runs). MoE layers' routing observers are
    called with the kernel's ids and scores, as MoE.forward calls them."""
    lib = _usable(h)
    if lib is None:
        return None
    plan = _plan(block, 1, _ffn_plan)
    if plan.desc is None:
        return None
    seqlen = h.shape[1]
    h = h.contiguous()
    out = torch.empty_like(h)
    moe = block.ffn if block.is_moe else None
    ids = scores = None
    if moe is not None:
        ids = torch.empty(seqlen, plan.desc.topk, dtype=torch.int64)
        scores = torch.empty(seqlen, plan.desc.n_experts)
    rc = lib.dsv3_ffn(plan.addr, h.data_ptr(), out.data_ptr(), seqlen, None if ids is None else ids.data_ptr(),
                      None if scores is None else scores.data_ptr(), 0)
    if rc != 0:
        raise ValueError(f"CPU feed-forward kernel: error {rc}")
    if moe is not None:
        moe.observers.routed(moe.layer_id, ids, scores)
    return out
