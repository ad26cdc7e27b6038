"""Routing traces and the cache simulator that replays them.

`TraceRecorder` (used by `dsv3lite trace`) writes, for every forward step and MoE layer, the experts each
token used and the predictions made 1..d layers earlier (JSON lines). `simulate` replays the decode
accesses of a trace against a slot pool of a given size under LRU / LFU / decayed-LFU (the runtime's own
policy classes) or Belady's MIN (the offline optimum), optionally with router-predicted prefetch, and
counts every load: demand misses plus prefetches, wasted ones included.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .policy import Key, make_policy
from .predictor import RoutePredictor


class TraceRecorder:
    """Records routing (distance 0) and predictions (distance >= 1) from a model's layer hook."""

    def __init__(self, model, lookahead: int = 3):
        self.predictor = RoutePredictor(model, lookahead)
        self.first_layer = model.layers[0]
        self.events: list[dict] = []
        self.step = -1
        self.phase = "prefill"
        previous = model.layer_hook

        def hook(layer, h):
            if previous is not None:
                previous(layer, h)
            self.record(layer, h)

        model.layer_hook = hook

    def record(self, layer, h) -> None:
        if layer is self.first_layer:
            self.step += 1
        tokens = h.shape[0] * h.shape[1]
        for target, (distance, rows) in self.predictor.predict(layer, h).items():
            self.events.append({"step": self.step, "phase": self.phase, "tokens": tokens, "layer": target,
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
    predictions: dict[tuple[int, int], dict[int, set[int]]]   # (step, layer) -> {distance: predicted ids}


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
    uses: int
    demand_loads: int
    prefetch_loads: int
    wasted_prefetches: int

    @property
    def loads(self) -> int:
        return self.demand_loads + self.prefetch_loads

    @property
    def hit_rate(self) -> float:
        return 1 - self.demand_loads / self.uses if self.uses else 0.0


def simulate(trace: Trace, slots: int, policy: str, prefetch_distance: int = 0) -> SimResult:
    """Replay decode accesses. policy: lru | lfu | decayed-lfu | belady. prefetch_distance d > 0 loads the
    experts predicted d layers ahead (as the runtime does) before they are needed."""
    if policy == "belady":
        return _belady(trace, slots)
    pol = make_policy(policy)
    resident: dict[Key, bool] = {}          # key -> still unused since a prefetch loaded it
    res = SimResult(policy if not prefetch_distance else f"{policy}+prefetch@{prefetch_distance}", slots,
                    0, 0, 0, 0)

    def load(key, now, pinned, prefetched) -> bool:
        if len(resident) >= slots:
            candidates = [k for k in resident if k not in pinned]
            if not candidates:
                return False
            victim = pol.victim(candidates, now)
            if resident.pop(victim):
                res.wasted_prefetches += 1
            pol.forget(victim)
        resident[key] = prefetched
        pol.admit(key, now)
        return True

    for step, keys in trace.accesses:
        layer = keys[0][0] if keys else None
        pinned = set(keys)
        for key in keys:
            res.uses += 1
            pol.touch(key, step)
            if key in resident:
                resident[key] = False
            else:
                res.demand_loads += 1
                load(key, step, pinned, False)
        if prefetch_distance and layer is not None:
            # what the runtime prefetches after this layer's attention: predictions for layer + d
            for d in range(1, prefetch_distance + 1):
                target = layer + d
                predicted = trace.predictions.get((step, target), {}).get(d)
                if not predicted:
                    continue
                want = {(target, e) for e in predicted}
                for key in sorted(want - set(resident)):
                    if load(key, step, pinned | want, True):
                        res.prefetch_loads += 1
    return res


def _belady(trace: Trace, slots: int) -> SimResult:
    """Belady's MIN: on a miss evict the resident key whose next use is farthest away (never one of the
    keys of the current access). Optimal in loads for demand paging."""
    seq: list[tuple[int, Key]] = [(i, k) for i, (_, keys) in enumerate(trace.accesses) for k in keys]
    next_use: dict[int, int] = {}
    last: dict[Key, int] = {}
    for pos in range(len(seq) - 1, -1, -1):
        _, k = seq[pos]
        next_use[pos] = last.get(k, 1 << 60)
        last[k] = pos
    resident: dict[Key, int] = {}           # key -> position of its next use
    res = SimResult("belady", slots, 0, 0, 0, 0)
    pos = 0
    for i, (_, keys) in enumerate(trace.accesses):
        pinned = set(keys)
        for k in keys:
            res.uses += 1
            if k not in resident:
                res.demand_loads += 1
                if len(resident) >= slots:
                    victim = max((c for c in resident if c not in pinned), key=lambda c: (resident[c], c))
                    del resident[victim]
            resident[k] = next_use[pos]
            pos += 1
    return res
