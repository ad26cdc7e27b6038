"""CUDA graphs of the decode step: the resident work of every layer replayed, not launched op by op.

A DeepSeek-V3 decode step is 61 layers of a few dozen small kernels each; at batch 1 the GPU finishes each kernel
sooner than Python launches the next, so the host sets the speed. `DecodeGraphs` runs a step of 1..ABSORB_MAX_TOKENS
tokens as a short list of *segments*: the longest runs of work that read nothing back to the host, each captured
once into a CUDA graph and replayed, with the rest between them run as usual:

  captured   the blocks' own sub-steps (model.py) that read nothing back: the embedding and RoPE rows, each layer's
             norms, attention (the Triton decode kernel over the whole latent cache, the positions and length on
             the device: cache.Positions.on_device; DeepSeek-V4's with its window ring, compressors and indexer
             written and read at the device positions, v4/attention.py), V4's mHC mixes, dense MLP, router and
             shared experts, the routed experts where their provider reads nothing back (resident blobs: the
             fused MoE kernel; `graph_safe`), the residual sums and the final norm
  run as is  routed experts that the host schedules (offloading: the runtime reads the routing and moves
             experts), attention that picks its path on the host (V3.2's sparse attention; DeepSeek-V4's where
             the Triton kernels do not run), the cache objects' lengths (V4: begin_write), and the observers
             (offloading's predictor after attention, routing watchers), called after the segment that computed
             their inputs, in layer order, with what eager decode hands them (the layer event's router input and
             routing)

A fully resident model with blob experts is one graph per step, a V4 too (off the kernels its attention runs
between segments: one per block plus one); an offloaded V3 is 59 (one per MoE layer, plus one). The eager path is
the twin: a segment's first run is eager (which also warms up kernels), then it is captured and replayed, and on
its next step (a new position) it runs both ways once more; any difference turns graphs off for the engine with
one line (DSV3LITE_GRAPHS=0 turns them off from the start). Graphs of one step size share one memory pool. Off
CUDA the same segments run with a stand-in capture (tests: `capture=`).
"""
from __future__ import annotations

import os

import torch

from ..cache import ModelCache, Positions
from ..layers import OBSERVER_EVENTS
from ..limits import ABSORB_MAX_TOKENS

ENV = "DSV3LITE_GRAPHS"


def enabled() -> bool:
    """False when DSV3LITE_GRAPHS=0 (or off / eager) asks for the eager decode step."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "off", "eager", "false", "no")


def supported(model) -> bool:
    """Every model of the V3 family and DeepSeek-V4: their sub-steps either capture, or run between the captured
    segments."""
    return _family(model) is not None


class _Op:
    """One piece of a step: fn(env) updates the step's named tensors in place. capturable: reads nothing back to
    the host; hook: an observer call, run after the segment that computed its inputs (never captured)."""
    __slots__ = ("name", "fn", "capturable", "hook")

    def __init__(self, name: str, fn, capturable: bool = True, hook: bool = False):
        self.name, self.fn, self.capturable, self.hook = name, fn, capturable, hook


class _Family:
    """What the graphs need of a model family. Each family gives cache_setting(cache) -> (device, key), or None
    when no graphs serve that cache, and ops(model, observers, device, cache) -> its step's ops; these defaults
    cover the rest: what to make before any capture, and what its plans hold alive."""

    @staticmethod
    def prepare(model, cache: ModelCache, device: torch.device) -> None:
        """Nothing, unless the family has tables every position needs (made before any capture)."""

    @staticmethod
    def held(model) -> tuple:
        return ()


class _V3Family(_Family):
    """The V3 family: the one latent tensor (batch 1), every position's RoPE rows made before any capture."""

    @staticmethod
    def cache_setting(cache: ModelCache):
        tensor = cache.tensor
        if tensor is None or tensor.shape[1] != 1:
            return None
        return tensor.device, (tensor.data_ptr(), tuple(tensor.shape))

    @staticmethod
    def prepare(model, cache: ModelCache, device: torch.device) -> None:
        model.rotary.tables(cache.capacity, device)

    @staticmethod
    def held(model) -> tuple:
        return model.rotary.cos, model.rotary.sin

    @staticmethod
    def ops(model, observers, device: torch.device, cache: ModelCache) -> list[_Op]:
        return _ops(model, observers, device)


class _V4Family(_Family):
    """DeepSeek-V4: a cache object per block (batch 1); the step's ops are _v4_ops."""

    @staticmethod
    def cache_setting(cache: ModelCache):
        ring = cache[0].window.kv
        if ring.shape[0] != 1:
            return None
        return ring.device, tuple(map(id, cache.layers))

    @staticmethod
    def ops(model, observers, device: torch.device, cache: ModelCache) -> list[_Op]:
        return _v4_ops(model, observers, device, cache)


def _family(model):
    from ..model import Transformer
    from ..v4.model import Transformer as V4Transformer

    if isinstance(model, Transformer):
        return _V3Family
    if isinstance(model, V4Transformer):
        return _V4Family
    return None


def _ops(model, observers, device: torch.device) -> list[_Op]:
    """The step as the blocks' own sub-steps, in eager decode's order (hooks where eager calls the observers, the
    routed experts where it runs them). Captured ops see the positions on the device only; an op that needs them
    on the host (V3.2's sparse attention, which picks its path by the context length) runs between segments."""

    def embed(env):
        env["seqlens"] = env["seqlen64"].to(torch.int32)
        env["h"], env["cos"], env["sin"] = model.prologue(env["tokens"], _device_positions(env))

    ops = [_Op("embed", embed)]
    for i, block in enumerate(model.layers):
        host_attention = block.attn.indexer is not None
        ops.append(_Op(f"layer {i} attention", _attention(block, i, host_attention), capturable=not host_attention))
        if block.is_moe:
            ops += _moe_ops(block, i, observers, device, _moe_pre(block, i), _residual(block, i))
            continue
        if observers.attention or observers.layer:
            ops.append(_watch_op(block, i, observers))
        ops.append(_Op(f"layer {i} MLP", _mlp(block)))

    def final(env):
        env["out"] = model.norm(env["h"])
    ops.append(_Op("final norm", final))
    return ops


def _v4_ops(model, observers, device: torch.device, cache: ModelCache) -> list[_Op]:
    """A DeepSeek-V4 step as its blocks' sub-steps, in eager decode's order (v4/model.py Block.forward). First, on
    the host, every block's cache object takes the step's length (begin_write: a rollback, the capacity check).
    Attention captures where the Triton kernels run (Attention.captures): the ring, the compressors' state and
    entries written at the device positions, the kernels reading them there; elsewhere it runs between the
    segments at the host's position. Each block's feed-forward captures: the mHC pre and ffn_norm, the router
    (hash layers read the static tokens), the shared expert, the routed experts where their provider reads
    nothing back, the mHC post; the observers run after the segment, as for the V3 family."""
    n_main, dtype = len(model.layers), model.embed.weight.dtype

    def lengths(env):
        for layer_cache in env["cache"].layers[:n_main]:
            layer_cache.begin_write(env["start"], env["tokens"].shape[1])

    def embed(env):
        env["seqlens"] = env["seqlen64"].to(torch.int32)
        env["h"] = model.prologue(env["tokens"])

    ops = [_Op("cache lengths", lengths, capturable=False), _Op("embed", embed)]
    for i, block in enumerate(model.layers):
        on_device = block.attn.captures(cache[i], dtype)
        ops.append(_Op(f"layer {i} attention", _v4_attention(block, i, on_device), capturable=on_device))
        ops += _moe_ops(block, i, observers, device, _v4_moe_pre(block, i), _v4_residual(block, i))

    def final(env):
        env["out"] = env["h"]                  # the streams (the engine's logits apply hc_head, the norm, the head)
    ops.append(_Op("streams", final))
    return ops


def _v4_attention(block, i, on_device: bool):
    def fn(env):
        pos = _device_positions(env) if on_device else env["start"]
        env["h"] = env[("h", i)] = block.attention(env["h"], pos, env["cache"][i])
    return fn


def _v4_moe_pre(block, i):
    """The feed-forward up to the routed experts: its input and mHC mix (ffn_input), the route (the token ids for a
    hash layer), the shared expert."""
    def fn(env):
        x, (env[("post", i)], env[("comb", i)]) = block.ffn_input(env[("h", i)])
        env[("x", i)] = x
        env[("weights", i)], env[("ids", i)], env[("scores", i)] = block.ffn.route(x, env["tokens"])
        env[("shared", i)] = block.ffn.shared(x)
    return fn


def _v4_residual(block, i):
    def fn(env):
        out = block.ffn.combine(env[("routed", i)], env[("shared", i)])
        env["h"] = block.ffn_output(env[("h", i)], out, (env[("post", i)], env[("comb", i)]))
    return fn


def _watch_op(block, i, observers) -> _Op:
    return _Op(f"layer {i} attention observers", _watch(block, i, observers), capturable=False, hook=True)


def _moe_ops(block, i, observers, device: torch.device, pre, residual) -> list[_Op]:
    """A MoE block's feed-forward after its attention, as eager decode runs it: `pre` (router input, route and
    shared experts: the family's), the observers (called after the segment that computed their inputs), the routed
    experts (captured where their provider reads nothing back), then `residual` (the family's)."""
    ops = [_Op(f"layer {i} router and shared experts", pre)]
    if observers.attention or observers.layer:
        ops.append(_watch_op(block, i, observers))
    if observers.routing:
        ops.append(_Op(f"layer {i} routing observers", _route_watch(block, i, observers), capturable=False, hook=True))
    safe = getattr(block.ffn.experts, "graph_safe", None)
    ops.append(_Op(f"layer {i} routed experts", _routed(block, i), capturable=bool(safe and safe(device))))
    ops.append(_Op(f"layer {i} residual", residual))
    return ops


def _device_positions(env) -> Positions:
    return Positions.on_device(env["positions"], env["seqlens"])


def _attention(block, i, host: bool):
    def fn(env):
        pos = Positions(env["start"], env["positions"].shape[0]) if host else _device_positions(env)
        env["h"] = env[("h", i)] = block.attention(env["h"], pos, env["cos"], env["sin"], env["cache"][i],
                                                   absorb=True)
    return fn


def _moe_pre(block, i):
    """The feed-forward up to the routed experts: the router's input and route, the shared experts (queued first,
    as MoE.forward does)."""
    def fn(env):
        x = env[("x", i)] = block.router_input(env["h"])
        env[("weights", i)], env[("ids", i)], env[("scores", i)] = block.ffn.route(x)
        env[("shared", i)] = block.ffn.shared(x)
    return fn


def _route(env, i):
    return env[("weights", i)], env[("ids", i)], env[("scores", i)]


def _routed(block, i):
    def fn(env):
        env[("routed", i)] = block.ffn.routed(env[("x", i)], _route(env, i))
    return fn


def _residual(block, i):
    def fn(env):
        env["h"] = block.residual(env[("h", i)], block.ffn.combine(env[("routed", i)], env[("shared", i)]))
    return fn


def _mlp(block):
    def fn(env):
        env["h"] = block.feed_forward(env["h"])
    return fn


def _watch(block, i, observers):
    """The attention observers with the layer's output, and the layer observers with the feed-forward's router input
    and routing, as eager decode calls them (the offloading predictor reuses them instead of computing them again)."""
    def fn(env):
        routed = (env[("x", i)], _route(env, i)) if block.is_moe and observers.layer else None
        observers.after_attention(block, env[("h", i)], routed)
    return fn


def _route_watch(block, i, observers):
    def fn(env):
        ids, scores = env[("ids", i)].clone(), env[("scores", i)].clone()   # the graph rewrites its own next step
        observers.routed(block.layer_id, ids, scores)
    return fn


class _Reads(dict):
    """A step's env that records the keys read before being written: the inputs a segment's graph takes."""

    def __init__(self, env: dict):
        super().__init__(env)
        self.read: list = []
        self._written: set = set()

    def __getitem__(self, key):
        if key not in self._written and key not in self.read:
            self.read.append(key)
        return super().__getitem__(key)

    def __setitem__(self, key, value):
        self._written.add(key)
        super().__setitem__(key, value)


class GraphMismatch(Exception):
    """A replayed segment's outputs differ from its eager ops' (the graphs turn off)."""


class _Segment:
    """A run of capturable ops and the hooks that follow them: eager on its first run, then captured, replayed,
    and checked against the eager ops once more on the next run (a new position: nothing of the first step may
    be baked into the graph)."""

    def __init__(self, ops: list[_Op], hooks: list[_Op]):
        self.ops, self.hooks = ops, hooks
        self.replay = None
        self.inputs: dict = {}          # key -> the static tensor the graph reads (only the keys its ops read)
        self.copied: list = []          # keys whose value is copied into the static tensor before each replay
        self.outputs: dict = {}         # key -> the static tensor the graph writes
        self.checks_left = 1            # eager-vs-replay comparisons still to run, at positions after the capture's
        self.captured_at = -1           # the first position of the step it was captured in

    @property
    def name(self) -> str:
        return self.ops[0].name if len(self.ops) == 1 else f"{self.ops[0].name} .. {self.ops[-1].name}"

    def eager(self, env: dict) -> dict:
        """The ops run as they are, over env in place (graphs off, or a replay refused)."""
        for op in self.ops:
            op.fn(env)
        return env

    def _written(self, env: dict, reads: list | None = None) -> dict:
        """The ops over env -> only the entries they wrote (new keys, or new tensors under old keys); `reads` gets
        the keys they read before writing them."""
        out = dict(env) if reads is None else _Reads(env)
        for op in self.ops:
            op.fn(out)
        if reads is not None:
            reads.extend(out.read)
        return {k: v for k, v in out.items() if k not in env or v is not env[k]}

    def run(self, env: dict, runner: "DecodeGraphs", start: int) -> dict:
        if self.replay is None:
            reads: list = []
            reference = runner.warm(lambda e: self._written(e, reads), env)
            self._capture({k: env[k] for k in reads}, runner)
            self.captured_at = start
        else:
            for key in self.copied:
                self.inputs[key].copy_(env[key])
            reference = None
            if self.checks_left and start != self.captured_at:
                self.checks_left -= 1
                reference = self._written(env)
        self.replay()
        if reference is not None:
            self._compare(reference, runner)
        env.update(self.outputs)            # the step's own dict: no copy of its growing per-layer entries
        return env

    def _capture(self, reads: dict, runner: "DecodeGraphs") -> None:
        """Static inputs (what the ops read): the tensors earlier graphs write, and the cache, read in place;
        copies of the others (the eager ops' outputs between segments), refreshed before each replay."""
        self.inputs, self.copied = {}, []
        for key, value in reads.items():
            if isinstance(value, torch.Tensor) and not runner.is_static(value):
                value = value.clone()
                self.copied.append(key)
            self.inputs[key] = value
        self.outputs, self.replay = runner.capture(lambda: self._written(self.inputs))
        runner.mark_static(self.outputs.values())

    def _compare(self, reference: dict, runner: "DecodeGraphs") -> None:
        """Replayed outputs against the eager ones: integers equal, floats equal within a couple of roundings of
        their dtype element by element (the same kernels give the same bits; a library may pick another
        algorithm inside a capture)."""
        for key, static in self.outputs.items():
            ref = reference[key]
            if torch.equal(static, ref):
                continue
            bad = not static.is_floating_point()
            if not bad:
                a, b = static.float(), ref.float()
                rtol = runner.tolerance(static.dtype)
                atol = rtol * 1e-2 * float(b.abs().max())
                bad = bool(((a - b).abs() > rtol * b.abs() + atol).any())
            if bad:
                raise GraphMismatch(f"{self.name}: the replayed {key} differs from the eager one")


class _StepPlan:
    """The segments (and the eager ops between them) of one step size over one cache, and its static inputs:
    one int64 buffer of tokens | positions | length, written by one copy per step."""

    def __init__(self, model, runner: "DecodeGraphs", seqlen: int, cache: ModelCache, device: torch.device):
        self.seqlen, self.cache = seqlen, cache
        observers = model.observers
        family = _family(model)
        # what the plan's key names by id, held alive
        self.held = (list(observers.attention), list(observers.layer), list(observers.routing),
                     [b.ffn.experts for b in model.layers if b.is_moe], family.held(model))
        self.packed = torch.zeros(2 * seqlen + 1, dtype=torch.int64, device=device)
        self.static = {"tokens": self.packed[:seqlen].view(1, seqlen), "positions": self.packed[seqlen:2 * seqlen],
                       "seqlen64": self.packed[2 * seqlen:], "cache": cache}
        runner.mark_static(self.static.values())
        self.items: list = []                       # _Segment, or an eager _Op between segments
        current: list[_Op] = []
        hooks: list[_Op] = []
        for op in family.ops(model, observers, device, cache):
            if op.capturable:
                current.append(op)
            elif op.hook and current:
                hooks.append(op)                    # reads what the segment wrote under per-layer keys
            else:
                self._close(current, hooks)
                current, hooks = [], []
                self.items.append(op)
        self._close(current, hooks)

    def _close(self, ops: list[_Op], hooks: list[_Op]) -> None:
        if ops:
            self.items.append(_Segment(ops, hooks))

    @property
    def n_graphs(self) -> int:
        return sum(isinstance(item, _Segment) for item in self.items)


class DecodeGraphs:
    """The decode steps of one model, replayed from CUDA graphs (see the module docstring). `hidden` is
    Transformer.hidden for a decode step of batch 1, or None where graphs do not apply (the caller runs the
    eager step). capture(fn) -> (outputs, replay): the capture to use (default: CUDA graphs on the cache's device);
    log: where the one line goes when graphs turn themselves off."""

    def __init__(self, model, log=None, capture=None):
        self.model = model
        self.log = log or (lambda msg: None)
        self._capture = capture
        self.plans: dict = {}
        self.off_reason: str | None = None
        self._static: set[int] = set()              # ids of the tensors graphs write or read in place
        self._keep: list = []                       # ... kept alive while their ids are in use
        self._pools: dict = {}                       # step size -> the memory pool its graphs share
        self._pool_key = 1
        self._stream = None
        self._device = None                         # the CUDA device of the cache the graphs serve

    # --- the step ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def hidden(self, tokens: list[int], start: int, cache: ModelCache) -> torch.Tensor | None:
        """The main layers over `tokens` at positions start.. -> what the model's hidden gives (V3 family: the
        final-normed hidden [1, S, D]; V4: the streams [1, S, n, D]) as a new tensor, or None (graphs are off, or do
        not apply to this step). cache: the model's caches (batch 1)."""
        seqlen = len(tokens)
        model = self.model
        family = _family(model)
        found = family.cache_setting(cache) if family is not None else None
        if self.off_reason is not None or not 1 <= seqlen <= ABSORB_MAX_TOKENS or found is None \
                or start + seqlen > cache.capacity:
            return None
        device, cache_key = found
        observers = model.observers
        setting = (id(cache), cache_key,
                   *(tuple(map(id, getattr(observers, event))) for event in OBSERVER_EVENTS),
                   tuple(id(b.ffn.experts) for b in model.layers if b.is_moe))
        plan = self.plans.get((seqlen, setting))
        if plan is None:
            if any(k[1] != setting for k in self.plans):
                self._reset()                  # a new cache, observers or experts: the old graphs serve no step
            self._device = device
            family.prepare(model, cache, device)           # what every position needs, made before any capture
            plan = self.plans[seqlen, setting] = _StepPlan(model, self, seqlen, cache, device)
        plan.packed.copy_(torch.tensor(tokens + list(range(start, start + seqlen)) + [start + seqlen]))
        env = dict(plan.static)
        env["start"] = start                   # read only by the ops that run between segments
        self._pool_key = seqlen
        for item in plan.items:
            if not isinstance(item, _Segment):
                item.fn(env)
                continue
            if self.off_reason is not None:
                env = item.eager(env)
            else:
                try:
                    env = item.run(env, self, start)
                except GraphMismatch as e:
                    self._turn_off(str(e))
                    env = item.eager(env)
                except Exception as e:                  # a capture the driver or a library refused
                    first = (str(e).strip().splitlines() or ["no message"])[0]
                    self._turn_off(f"capture failed in {item.name}: {first}")
                    env = item.eager(env)
            for hook in item.hooks:
                hook.fn(env)
        return env["out"].clone()

    def _reset(self) -> None:
        if self._stream is not None:
            torch.cuda.synchronize(self._stream.device)  # nothing replayed may still run when its graph goes
        self.plans.clear()
        self._static.clear()
        self._keep.clear()
        self._pools.clear()

    def _turn_off(self, why: str) -> None:
        self.off_reason = why
        self._reset()
        self.log(f"CUDA graphs off for this engine ({why}); decoding eagerly")

    # --- what segments ask for ---------------------------------------------------------------------------
    def is_static(self, t: torch.Tensor) -> bool:
        return id(t) in self._static

    def mark_static(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._static.add(id(t))
                self._keep.append(t)

    @staticmethod
    def tolerance(dtype: torch.dtype) -> float:
        """Relative difference allowed between a replayed and an eager float: about two roundings of `dtype`."""
        return 2 * torch.finfo(dtype).eps

    def warm(self, fn, env: dict) -> dict:
        """fn(env) eagerly; on CUDA on a side stream (the warm-up a capture wants: libraries set up their
        handles and workspaces outside it)."""
        device = self._device
        if device.type != "cuda":
            return fn(env)
        stream, main = self._side_stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(main)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")        # a host sync in these ops raises here, before any capture
        try:
            with torch.cuda.stream(stream):
                return fn(env)
        finally:
            torch.cuda.set_sync_debug_mode(mode)
            main.wait_stream(stream)

    def capture(self, fn):
        """fn() captured -> (its outputs, the replay); the segments of a step size share a memory pool."""
        if self._capture is not None:
            return self._capture(fn)
        device = self._device
        pool = self._pools.get(self._pool_key)
        if pool is None:
            pool = self._pools[self._pool_key] = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream, main = self._side_stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(main)
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # the pinner may allocate meanwhile
                try:
                    out = fn()
                except BaseException as error:
                    try:
                        graph.capture_end()             # the stream leaves capture mode; the first error is raised
                    except Exception as end_error:
                        error.add_note(f"ending the capture failed too: {end_error}")
                    raise
                graph.capture_end()
        finally:
            main.wait_stream(stream)
        self._keep.append(graph)
        return out, graph.replay

    def _side_stream(self, device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def stats(self) -> dict:
        """{"graphs_per_step": {step size: graphs replayed per step}, "off": why graphs turned off, or None}."""
        sizes = {plan.seqlen: plan.n_graphs for plan in self.plans.values()}
        return {"graphs_per_step": sizes, "off": self.off_reason}


def eager_capture(fn):
    """A stand-in for a CUDA graph off the GPU (tests): fn's outputs in static tensors that each replay rewrites
    from the static inputs fn reads, as a graph's are. (What a real capture adds, that nothing may read back to the
    host or depend on a Python value of the step, is what the second-step check compares on a GPU.)"""
    static = {k: v.clone() for k, v in fn().items()}

    def replay():
        for k, v in fn().items():
            static[k].copy_(v)
    return static, replay


class GraphStep:
    """The executor of a GPU Engine: decode steps (1..ABSORB_MAX_TOKENS tokens) replayed from `graphs`, everything
    else (prefill chunks, MTP steps, steps the graphs decline) through `fallback`."""
    name = "cuda-graphs"

    def __init__(self, fallback, graphs: DecodeGraphs | None = None):
        self.fallback = fallback
        self.model, self.device, self.log = fallback.model, fallback.device, fallback.log
        self.graphs = graphs if graphs is not None else DecodeGraphs(self.model, log=self.log)

    def hidden(self, token_ids: list[int], start: int, cache, absorb: bool) -> torch.Tensor:
        if absorb:
            h = self.graphs.hidden(token_ids, start, cache)
            if h is not None:
                return h
        return self.fallback.hidden(token_ids, start, cache, absorb)

    def mtp_hidden(self, hidden, next_ids: list[int], start: int, cache, absorb: bool) -> torch.Tensor:
        return self.fallback.mtp_hidden(hidden, next_ids, start, cache, absorb)
