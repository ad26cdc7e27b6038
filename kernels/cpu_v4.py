"""DeepSeek-V4's compiled CPU step: its kernels, one per sub-step of a V4 block, and the whole step strung in one call
(kernels/csrc/cpu_v4.cpp), with the eager sub-steps of dsv3lite/v4 as their twin (executors/cpu_v4.py strings them).

  attention     Block.attention: mHC pre (the [(2 + n) n, n D] mix, sigmoid and Sinkhorn, the collapse), attn_norm,
                q / kv projections, per-head norm and RoPE, the window ring, the compressor's state and the entries
                it completes, the indexer's scores and top-k (CSA), attention over the window and the visible or
                selected entries with the sink, the inverse RoPE, the grouped wo_a and wo_b, mHC post (`dsv4_attention`)
  feed_forward  Block.feed_forward: mHC pre, ffn_norm, the sqrt-softplus router (hash table or top-k of score +
                bias), the routed experts (dsv3_moe: resident blobs of any format, or the dense fp32 ones, with the
                SwiGLU clamp), the shared expert, mHC post (`dsv4_ffn`)
  layers        both, for every main layer, in one call (`dsv4_layers`); the routing observers are called afterwards
  ffn_input     Block.ffn_input: the feed-forward's mHC pre and ffn_norm, for a MoE the host runs (`dsv4_hc_pre`)

Any number of tokens a call (decode, MTP verification, prefill chunks), batch 1, fp32 activations on the CPU in
inference mode; the dense weights plain fp32 or packed (dense.PackedLinear: the fp8 / bf16 / int8 / int4 row
kernels of dsv3_linear). Each returns None where it cannot run (the caller runs the eager sub-step): the kernels
absent or off (DSV3LITE_CPU_DECODE=eager), or a block the kernel has no plan for (`uncovered` says why: experts the
host schedules). A token's result does not depend on how many tokens share the call (cpu_v4.cpp), so MTP
verification gets a plain step's bits. tests/test_cpu_v4.py compares every kernel with its twin.
"""
from __future__ import annotations

import ctypes
import math
import weakref

import torch

from . import cpu_build, cpu_experts
from .cpu_abi import F32, HcDesc, Lin, V4AttnDesc, V4CacheDesc, V4FfnDesc
from .cpu_decode import (MAX_ROPE, StepPlans, _address, _lin, _norm, _plain, _plan, _Plan, _resident_blobs,
                         _Watched, all_planned, enabled, plan_reasons)

_ptr = ctypes.c_void_p
MAX_HC = 16                                   # streams the kernels hold (cpu_v4.cpp)


def knows(model) -> bool:
    """Whether `model` is a DeepSeek-V4 network (the family these kernels are written for)."""
    from ..v4.model import Transformer

    return isinstance(model, Transformer)


def _hc(hc, keep: list[torch.Tensor]) -> HcDesc | None:
    parts = (hc.fn, hc.base, hc.scale)
    if not all(_plain(t) for t in parts) or not 1 <= hc.n <= MAX_HC:
        return None
    keep += parts
    return HcDesc(hc.fn.data_ptr(), hc.base.data_ptr(), hc.scale.data_ptr(), hc.n, hc.iters, hc.eps, hc.hc_eps)


def _attention_plan(block) -> _Plan:
    attn, keep = block.attn, []
    a = attn.args
    hc = _hc(block.hc_attn, keep)
    lins = [_lin(getattr(attn, n), keep) for n in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")]
    norms = [_norm(m, keep) for m in (block.attn_norm, attn.q_norm, attn.kv_norm)]
    ptrs = [_address(attn.attn_sink, keep), _address(attn.rotary.inv_freq, keep)]
    eps = {m.eps for m in (block.attn_norm, attn.q_norm, attn.kv_norm)} | {a.rms_norm_eps}
    comp, idx = attn.compressor, attn.indexer
    c_lins, i_lins, c_ptrs, i_ptrs = [Lin(), Lin()], [Lin()] * 4, [None, None], [None, None]
    if comp is not None:
        c_lins = [_lin(comp.wkv, keep), _lin(comp.wgate, keep)]
        c_ptrs = [_address(comp.ape, keep), _norm(comp.norm, keep)]
        eps.add(comp.norm.eps)
        ptrs += c_ptrs
    if idx is not None:
        ic = idx.compressor
        i_lins = [_lin(m, keep) for m in (idx.wq_b, idx.weights_proj, ic.wkv, ic.wgate)]
        i_ptrs = [_address(ic.ape, keep), _norm(ic.norm, keep)]
        eps.add(ic.norm.eps)
        ptrs += i_ptrs
    if hc is None or None in lins + norms + c_lins + i_lins + ptrs:
        return _Plan(None, keep, why="attention weights in a format the kernel does not read")
    if len(eps) != 1 or a.qk_rope_head_dim > MAX_ROPE or a.qk_rope_head_dim % 2:
        return _Plan(None, keep, why="an attention past the kernel's bounds (norm epsilons, RoPE width)")
    ratio = attn.ratio if comp is not None else 0
    desc = V4AttnDesc(hc, *lins, *c_lins, *i_lins, *norms, ptrs[0], *c_ptrs, *i_ptrs, ptrs[1], a.hidden_size,
                      attn.n_heads, attn.head_dim, a.qk_rope_head_dim, a.q_lora_rank, a.o_groups, attn.window, ratio,
                      int(comp is not None and comp.overlap), a.index_n_heads if idx else 0,
                      a.index_head_dim if idx else 0, idx.topk if idx else 0, a.rms_norm_eps, 0.0)
    return _Plan(desc, keep)


def _ffn_plan(block) -> _Plan:
    ffn, keep = block.ffn, []
    gate, a = ffn.gate, ffn.gate.args
    hc = _hc(block.hc_ffn, keep)
    norm = _norm(block.ffn_norm, keep)
    shared = [_lin(getattr(ffn.shared_experts, w), keep) for w in ("w1", "w3", "w2")]
    router = _address(gate.weight, keep)
    table = bias = None
    if gate.is_hash:
        if gate.tid2eid.dtype in (torch.int32, torch.int64) and gate.tid2eid.is_contiguous() \
                and gate.tid2eid.device.type == "cpu":
            table = gate.tid2eid
            keep.append(table)
    else:
        bias = _address(gate.bias, keep)
    if hc is None or norm is None or None in shared or router is None or (table is None and bias is None):
        return _Plan(None, keep, why="feed-forward weights in a format the kernel does not read")
    experts = _resident_blobs(ffn.experts)
    if experts is None:
        return _Plan(None, keep)       # experts the host schedules (offloaded, --cpu-mem): eager by design
    expert_ptrs, expert_desc, tensors = experts
    keep += tensors
    e, k = a.n_routed_experts, a.num_experts_per_tok
    d = V4FfnDesc(hc, *shared, Lin(F32, e, a.hidden_size, 0, router, None, None), norm, bias,
                  None if table is None else table.data_ptr(), expert_ptrs.data_ptr(), expert_desc.data_ptr(),
                  a.hidden_size, e, k, a.vocab_size, 0 if table is None else table.element_size(),
                  int(a.norm_topk_prob), cpu_experts._MXFP4_ACTS[cpu_experts.MXFP4_ACT], block.ffn_norm.eps,
                  a.routed_scaling_factor,
                  math.inf if a.swiglu_limit is None else a.swiglu_limit, 0.0)
    return _Plan(d, keep, extra=(expert_ptrs, expert_desc))


def block_plans(block) -> tuple[_Plan, _Plan]:
    """(attention plan, feed-forward plan) of one V4 block (kept with the V3 family's: cpu_decode._plan)."""
    return _plan(block, 0, _attention_plan), _plan(block, 1, _ffn_plan)


def uncovered(model) -> list[str]:
    """Why sub-steps of `model`'s blocks run eagerly, one line per distinct reason (nothing when the kernels are
    absent or off)."""
    return plan_reasons(model.blocks(), block_plans)


def covers(model) -> bool:
    """Whether the compiled step runs every block of `model` (the kernels are there, on, and can read each)."""
    return knows(model) and all_planned(model.blocks(), block_plans)


# --- cache objects ---------------------------------------------------------------------------------------------

class _CachePlan(_Watched):
    """The V4CacheDesc of one block's cache object (its tensors held weakly: rebuilt if one is replaced)."""

    def __init__(self, cache):
        tensors = [cache.window.kv]
        states = [cache.compressors.get(n) for n in ("compressor", "indexer")]
        for s in states:
            if s is not None:
                tensors += [s.cv.kv, s.g.kv, s.entries]
        super().__init__(tensors)
        self.ok = all(_plain(t) and t.shape[0] == 1 for t in tensors)
        if not self.ok:
            return
        main, index = states
        ptrs = []
        for s in (main, index):
            ptrs += [None] * 3 if s is None else [s.cv.kv.data_ptr(), s.g.kv.data_ptr(), s.entries.data_ptr()]
        self.desc = V4CacheDesc(cache.window.kv.data_ptr(), *ptrs, cache.window.slots,
                                0 if main is None else main.cv.slots, 0 if index is None else index.cv.slots,
                                0 if main is None else main.entries.shape[1])
        self.addr = ctypes.addressof(self.desc)


_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cache_plan(cache) -> _CachePlan:
    plan = _CACHES.get(cache)
    if plan is None or not plan.valid():
        plan = _CACHES[cache] = _CachePlan(cache)
    return plan


# --- calls -----------------------------------------------------------------------------------------------------

def _usable(x: torch.Tensor):
    """The library, when the step may run for streams x [1, S, n, D]; else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 4 or x.shape[0] != 1 \
            or not torch.is_inference_mode_enabled() or not enabled():
        return None
    return cpu_build.library()


def _check(rc: int, what: str) -> None:
    if rc != 0:
        reasons = {-1: "an expert id out of range", -4: "a token id outside the hash table",
                   -5: "no room for a compressed entry"}
        raise ValueError(f"CPU {what} kernel: {reasons.get(rc, f'error {rc}')}")


def attention(block, x: torch.Tensor, start: int, cache) -> torch.Tensor | None:
    """Block.attention(x, start, cache) in one kernel call, or None (the eager sub-step runs). x [1, S, n, D]; cache:
    this block's cache object, which gets the S tokens."""
    lib = _usable(x)
    if lib is None or cache is None:
        return None
    plan = _plan(block, 0, _attention_plan)
    cplan = _cache_plan(cache)
    if plan.desc is None or not cplan.ok:
        return None
    x = x.contiguous()
    cache.begin_write(start, x.shape[1])
    out = torch.empty_like(x)
    _check(lib.dsv4_attention(plan.addr, cplan.addr, x.data_ptr(), out.data_ptr(), x.shape[1], start, 0), "attention")
    return out


def feed_forward(block, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
    """Block.feed_forward(x, tokens) in one kernel call, or None (the eager sub-step runs); the routing observers
    are called with the kernel's ids and scores, as MoE.forward calls them. tokens [1, S]."""
    lib = _usable(x)
    if lib is None:
        return None
    plan = _plan(block, 1, _ffn_plan)
    if plan.desc is None:
        return None
    seqlen = x.shape[1]
    x, tokens = x.contiguous(), tokens.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty_like(x)
    ids = torch.empty(seqlen, plan.desc.topk, dtype=torch.int64)
    scores = torch.empty(seqlen, plan.desc.n_experts)
    _check(lib.dsv4_ffn(plan.addr, x.data_ptr(), out.data_ptr(), seqlen, tokens.data_ptr(), ids.data_ptr(),
                        scores.data_ptr(), 0), "feed-forward")
    block.ffn.observers.routed(block.ffn.layer_id, ids, scores)
    return out


def ffn_input(block, x: torch.Tensor):
    """Block.ffn_input(x) with its mHC pre (the mix, Sinkhorn, the collapse) through the kernel, for a feed-forward
    the host runs (experts it schedules) -> (ffn_norm of the collapse [1, S, D], (post [1, S, n], comb [1, S, n,
    n])), or None (the eager half runs)."""
    if _usable(x) is None:
        return None
    found = hc_pre(block.hc_ffn, x[0])
    if found is None:
        return None
    _, post, comb, u = found
    return block.ffn_norm(u[None]), (post[None], comb[None])


class _Layers(StepPlans):
    """StepPlans of a V4 model (dsv4_layers), with routing buffers grown to the longest call."""

    def __init__(self, model):
        super().__init__(model, block_plans)
        self.rows = 0
        self.ids = self.scores = None

    def routing(self, seqlen: int):
        """(ids pointers, scores pointers) of routing buffers for `seqlen` tokens (grown as needed)."""
        if seqlen > self.rows:
            n = len(self.blocks)
            self.rows = seqlen
            self.ids = torch.zeros(n, seqlen * self.k, dtype=torch.int64)
            self.scores = torch.zeros(n, seqlen * self.e)
            self.ids_ptrs = (_ptr * n)(*(t.data_ptr() for t in self.ids))
            self.score_ptrs = (_ptr * n)(*(t.data_ptr() for t in self.scores))
        return self.ids_ptrs, self.score_ptrs


_LAYERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def layers(model, x: torch.Tensor, start: int, cache, tokens: torch.Tensor) -> torch.Tensor | None:
    """Every main layer of `model` over the embedded streams x [1, S, n, D] in one kernel call -> the streams after
    the last layer, or None (the layers run one by one). cache: the model's ModelCache; tokens [1, S]. The routing
    observers are called afterwards, layer by layer."""
    lib = _usable(x)
    if lib is None or cache is None:
        return None
    plan = _LAYERS.get(model)
    if plan is None or not plan.valid():
        plan = _LAYERS[model] = _Layers(model)
    if not plan.ok:
        return None
    n = len(plan.blocks)
    cplans = [_cache_plan(cache[i]) for i in range(n)]
    if not all(c.ok for c in cplans):
        return None
    seqlen = x.shape[1]
    for i in range(n):
        cache[i].begin_write(start, seqlen)
    caches = (_ptr * n)(*(c.addr for c in cplans))
    x, tokens = x.contiguous(), tokens.reshape(-1).to(torch.int64).contiguous()
    tmp, out = torch.empty_like(x), torch.empty_like(x)
    ids, scores = plan.routing(seqlen)
    _check(lib.dsv4_layers(n, plan.attn, plan.ffn, caches, x.data_ptr(), tmp.data_ptr(), out.data_ptr(), seqlen,
                           start, tokens.data_ptr(), ids, scores, 0), "step")
    if model.observers.routing:
        for i, b in enumerate(plan.blocks):
            model.observers.routed(b.layer_id, plan.ids[i, :seqlen * plan.k].view(seqlen, plan.k).clone(),
                                   plan.scores[i, :seqlen * plan.e].view(seqlen, plan.e).clone())
    return out


def hc_pre(hc, x: torch.Tensor):
    """The mHC pre of streams x [T, n, D] through the kernel -> (pre [T, n], post [T, n], comb [T, n, n], collapse
    [T, D]), or None (no library, or an mHC it cannot read): HyperConnection.weights and collapse's twin."""
    lib = cpu_build.library()
    keep: list[torch.Tensor] = []
    desc = _hc(hc, keep)
    if lib is None or desc is None:
        return None
    x = x.float().contiguous()
    t, n, d = x.shape
    pre, post, comb, u = torch.empty(t, n), torch.empty(t, n), torch.empty(t, n, n), torch.empty(t, d)
    _check(lib.dsv4_hc_pre(ctypes.addressof(desc), d, x.data_ptr(), t, pre.data_ptr(), post.data_ptr(),
                           comb.data_ptr(), u.data_ptr(), 0), "mHC")
    return pre, post, comb, u
