"""Routing traces and the cache simulator that replays them.

`TraceRecorder` (used by `dsv3lite trace`) writes, for every forward step and MoE layer, the experts each
token used and the predictions made 1..d layers earlier (JSON lines). `simulate` replays the decode
accesses of a trace against a slot pool of a given size under LRU / LFU / decayed-LFU (the runtime's own
policy classes and its own slot table, offload/slots.py) or Belady's MIN (the offline optimum), optionally
with router-predicted prefetch and with the exact prefetch of layers routed by the token id (DeepSeek-V4's hash
layers, the trace's `token_layers`), and counts every load: demand misses plus prefetches, wasted ones included,
in all and per layer.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from .policy import Key, Policy, make_policy
from .predictor import NEXT_TOKEN_SOURCES, RoutePredictor
from .slots import SlotTable


class TraceRecorder:
    """Records routing (distance 0) and predictions (distance >= 1) after each of a model's attention layers
    (a model observer; detach() removes it)."""

    def __init__(self, model, lookahead: int = 3):
        self.predictor = RoutePredictor(model, lookahead, next_token=NEXT_TOKEN_SOURCES)   # every source, measured
        self.first_layer = model.layers[0]
        self.events: list[dict] = []
        self.step = -1
        self.phase = "prefill"
        self.observer = model.add_observer(on_layer=self.record)

    def detach(self) -> None:
        self.observer.remove()

    def record(self, layer, h, routed=None) -> None:
        if layer is self.first_layer:
            self.step += 1
        tokens = h.shape[0] * h.shape[1]
        for target, (distance, rows) in self.predictor.predict(layer, h, routed).items():
            step = self.step + (not isinstance(distance, int))     # a next-token source predicts the next step
            self.events.append({"step": step, "phase": self.phase, "tokens": tokens, "layer": target,
                                "distance": distance, "ids": rows})

    def write(self, path: str | Path, meta: dict) -> None:
        with open(path, "w") as f:
            f.write(json.dumps({"meta": meta}) + "\n")
            for ev in self.events:
                f.write(json.dumps(ev) + "\n")


@dataclass
class Trace:
    meta: dict
    accesses: list[tuple[int, list[Key]]]                     # (step, keys of one layer), decode order
    predictions: dict[tuple[int, int], dict[int | str, set[int]]]   # (step, layer) -> {distance or source: ids}


def read_trace(path: str | Path, phase: str = "decode") -> Trace:
    from ..errors import UserError

    try:
        lines = Path(path).read_text().splitlines()
        meta = json.loads(lines[0])["meta"]
        events = [json.loads(l) for l in lines[1:] if l.strip()]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise UserError(f"cannot read trace {path}: {e}") from None
    accesses, preds = [], {}
    for ev in events:
        if ev["phase"] != phase:
            continue
        used = sorted({e for row in ev["ids"] for e in row})
        if ev["distance"] == 0:
            accesses.append((ev["step"], [(ev["layer"], e) for e in used]))
        else:
            preds.setdefault((ev["step"], ev["layer"]), {})[ev["distance"]] = set(used)
    return Trace(meta, accesses, preds)


@dataclass
class SimResult:
    policy: str
    slots: int
    uses: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0
    wasted_prefetches: int = 0
    evictions: int = 0
    resident: tuple[Key, ...] = ()          # the pool at the end, sorted
    stall_s: float = 0.0                    # time layers waited for copies (with a CopyTiming)
    by_layer: dict[int, list[int]] = field(default_factory=dict)   # layer -> [uses, demand loads, prefetch loads]

    @property
    def loads(self) -> int:
        return self.demand_loads + self.prefetch_loads

    @property
    def hit_rate(self) -> float:
        return 1 - self.demand_loads / self.uses if self.uses else 0.0

    def count(self, layer: int, column: int) -> None:
        """One more use (column 0), demand load (1) or prefetch load (2) in `layer`."""
        row = self.by_layer.get(layer)
        if row is None:
            row = self.by_layer[layer] = [0, 0, 0]
        row[column] += 1

    def layers_sum(self, layers) -> tuple[int, int, int]:
        """(uses, demand loads, prefetch loads) summed over `layers`."""
        rows = [self.by_layer.get(l, (0, 0, 0)) for l in layers]
        return tuple(sum(r[i] for r in rows) for i in range(3))


class Belady(Policy):
    """Belady's MIN as an order: the resident key whose next use is farthest away goes first. Built from the
    whole access sequence; each touch moves a key to its next use."""
    name = "belady"

    def __init__(self, sequence: list[Key]):
        self.future: dict[Key, deque[int]] = {}
        for pos, key in enumerate(sequence):
            self.future.setdefault(key, deque()).append(pos)

    def touch(self, key, now):
        self.future[key].popleft()

    def order(self, key):
        uses = self.future.get(key)
        return -uses[0] if uses else -(1 << 60)


@dataclass(frozen=True)
class CopyTiming:
    """Time model of one copy engine: copies run one at a time in issue order (queued DMA is not reordered by
    stream priority), each `copy_s`; a layer computes for `layer_s` once its experts are in. batch None: a layer's
    prefetches are queued all at once, ahead of its demand copies (the order the runtime used to issue them);
    batch B: behind its demand copies, at most B prefetches on the engine at a time (the runtime's
    PREFETCH_BATCH), the rest issued as earlier ones finish (checked when a layer starts and ends)."""
    layer_s: float
    copy_s: float
    batch: int | None = None


def simulate(trace: Trace, slots: int, policy: str | Policy, prefetch_distance: int = 0,
             next_token: str | None = None, timing: CopyTiming | None = None, token_layers=(),
             prior: dict[Key, float] | None = None) -> SimResult:
    """Replay decode accesses through the runtime's slot table. policy: lru | lfu | decayed-lfu | belady, or a
    Policy object. prefetch_distance d > 0 loads the experts predicted 1..d layers ahead (as the runtime does)
    before they are needed (not with belady, which is the bound for demand paging); next_token (a
    predictor.NEXT_TOKEN_SOURCES label) also loads, at the end of each step, what that source predicted for the
    next step's layers. Predicted keys are pinned with the current ones. token_layers: layers whose experts follow
    from the token id (DeepSeek-V4's hash layers; the trace's meta "token_layers"): at the start of each step their
    experts for it are pinned and prefetched ahead of everything else, nearest layer first, as the runtime does once
    a token is sampled (not with belady). prior: expected uses per step of some keys, added to the policy's counts
    at the start of every step (policy.seed). timing: also count the time layers wait for copies (stall_s)."""
    if policy == "belady":
        table = SlotTable(slots, Belady([k for _, keys in trace.accesses for k in keys]))
        prefetch_distance, next_token, token_layers, prior = 0, None, (), None
    else:
        table = SlotTable(slots, make_policy(policy) if isinstance(policy, str) else policy)
    token_layers = set(token_layers)
    name = (policy if isinstance(policy, str) else policy.name) + \
        (f"+prefetch@{prefetch_distance}" if prefetch_distance else "") + \
        (f"+{next_token}" if next_token else "") + ("+token" if token_layers else "") + ("+prior" if prior else "")
    res = SimResult(name, slots)
    by_step: dict[int, list[Key]] = {}         # step -> the keys of its token-routed layers, in layer order
    for step, keys in trace.accesses:
        if keys and keys[0][0] in token_layers:
            by_step.setdefault(step, []).extend(keys)
    token_pins: set[Key] = set()               # announced keys whose layer has not run yet
    next_layers = sorted({layer for (_, layer), by in trace.predictions.items() if next_token in by})
    now = engine = 0.0                 # the clock and when the copy engine is next free
    ready: dict[Key, float] = {}       # when each key's copy ends
    prefetch_ends: deque[float] = deque()
    queue: list[Key] = []              # predicted keys not yet issued, nearest first

    def copy(key: Key, kind: str) -> bool:
        nonlocal engine
        if table.allocate(key, kind) is None:
            return False
        if timing is not None:
            engine = max(engine, now) + timing.copy_s
            ready[key] = engine
            if kind == "prefetch":
                prefetch_ends.append(engine)
        return True

    def issue() -> None:
        while queue:
            if timing is not None and timing.batch is not None:
                while prefetch_ends and prefetch_ends[0] <= now:
                    prefetch_ends.popleft()
                if len(prefetch_ends) >= timing.batch:
                    return
            key = queue.pop(0)
            if key in table:
                continue
            if not copy(key, "prefetch"):
                queue.clear()                # every slot is pinned
                return
            res.prefetch_loads += 1
            res.count(key[0], 2)

    def predicted(i: int, step: int, layer: int) -> list[Key]:
        want: list[Key] = []
        for d in range(1, prefetch_distance + 1):
            want += [(layer + d, e) for e in sorted(trace.predictions.get((step, layer + d), {}).get(d, ()))]
        if next_token and (i + 1 == len(trace.accesses) or trace.accesses[i + 1][0] != step):
            for l in next_layers:
                want += [(l, e) for e in sorted(trace.predictions.get((step + 1, l), {}).get(next_token, ()))]
        return list(dict.fromkeys(want))

    early = timing is not None and timing.batch is None
    last_step = None
    for i, (step, keys) in enumerate(trace.accesses):
        table.advance(step)
        if step != last_step and (token_layers or prior):   # a token was sampled: its token-routed experts are known
            last_step = step
            if prior:
                table.seed(prior)
            announced = by_step.get(step, [])
            token_pins = set(announced)
            queue[:] = announced + [k for k in queue if k not in token_pins]
            table.set_pins(table.pins | token_pins)
            issue()
        if keys and keys[0][0] in token_layers:
            token_pins -= set(keys)
        want = predicted(i, step, keys[0][0]) if keys else []
        # the current keys, the predicted ones and the announced ones are not evicted
        table.set_pins(set(keys) | set(want) | token_pins)
        queue[:] = [k for k in queue if k in token_pins] + [k for k in want if k not in token_pins]
        if early:
            issue()
        for key in keys:
            res.uses += 1
            res.count(key[0], 0)
            if table.use(key) is None:
                res.demand_loads += 1
                res.count(key[0], 1)
                if not copy(key, "demand"):
                    table.set_pins(keys)              # demand outranks predictions (the runtime's keep_pins)
                    copy(key, "demand")
        if timing is not None:
            done = max((ready.get(k, 0.0) for k in keys), default=now)
            res.stall_s += max(0.0, done - now)
            now = max(now, done)
        if not early:
            issue()
        if timing is not None:
            now += timing.layer_s
            issue()
    res.wasted_prefetches, res.evictions = table.wasted_prefetches, table.evictions
    res.resident = tuple(sorted(table.resident_keys()))
    return res
