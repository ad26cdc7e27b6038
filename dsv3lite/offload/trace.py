"""Routing traces and the cache simulator that replays them.

`TraceRecorder` (used by `dsv3lite trace`) writes, for every forward step and MoE layer, the experts each
token used and the predictions made 1..d layers earlier (JSON lines). `simulate` replays the decode
accesses of a trace against a slot pool of a given size under LRU / LFU / decayed-LFU (the runtime's own
policy classes and its own slot table, offload/slots.py) or Belady's MIN (the offline optimum), optionally
with router-predicted prefetch, and counts every load: demand misses plus prefetches, wasted ones included.
"""
from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
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
        self.observer = model.add_observer(on_attention=self.record)

    def detach(self) -> None:
        self.observer.remove()

    def record(self, layer, h) -> None:
        if layer is self.first_layer:
            self.step += 1
        tokens = h.shape[0] * h.shape[1]
        for target, (distance, rows) in self.predictor.predict(layer, h).items():
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

    @property
    def loads(self) -> int:
        return self.demand_loads + self.prefetch_loads

    @property
    def hit_rate(self) -> float:
        return 1 - self.demand_loads / self.uses if self.uses else 0.0


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


def simulate(trace: Trace, slots: int, policy: str, prefetch_distance: int = 0,
             next_token: str | None = None) -> SimResult:
    """Replay decode accesses through the runtime's slot table. policy: lru | lfu | decayed-lfu | belady.
    prefetch_distance d > 0 loads the experts predicted d layers ahead (as the runtime does) before they are
    needed (not with belady, which is the bound for demand paging); next_token (a predictor.NEXT_TOKEN_SOURCES
    label) also loads, at the end of each step, what that source predicted for the next step's layers."""
    if policy == "belady":
        table = SlotTable(slots, Belady([k for _, keys in trace.accesses for k in keys]))
        prefetch_distance, next_token = 0, None
    else:
        table = SlotTable(slots, make_policy(policy))
    name = policy + (f"+prefetch@{prefetch_distance}" if prefetch_distance else "") + \
        (f"+{next_token}" if next_token else "")
    res = SimResult(name, slots)
    next_layers = sorted({layer for (_, layer), by in trace.predictions.items() if next_token in by})

    def prefetch(want: set, keep: set) -> None:
        table.set_pins(keep | want)
        for key in sorted(k for k in want if k not in table):
            if table.allocate(key, "prefetch") is not None:
                res.prefetch_loads += 1

    for i, (step, keys) in enumerate(trace.accesses):
        table.advance(step)
        table.set_pins(keys)                  # the keys of the current access are never evicted
        for key in keys:
            res.uses += 1
            if table.use(key) is None:
                res.demand_loads += 1
                table.allocate(key, "demand")
        if prefetch_distance and keys:
            # what the runtime prefetches after this layer's attention: predictions for layer + d
            layer = keys[0][0]
            for d in range(1, prefetch_distance + 1):
                target = layer + d
                predicted = trace.predictions.get((step, target), {}).get(d)
                if not predicted:
                    continue
                prefetch({(target, e) for e in predicted}, set(keys))
        if next_token and (i + 1 == len(trace.accesses) or trace.accesses[i + 1][0] != step):
            by_layer = [(l, trace.predictions.get((step + 1, l), {}).get(next_token)) for l in next_layers]
            prefetch({(l, e) for l, ids in by_layer if ids for e in ids}, set())
    res.wasted_prefetches, res.evictions = table.wasted_prefetches, table.evictions
    res.resident = tuple(sorted(table.resident_keys()))
    return res
