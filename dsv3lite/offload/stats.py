"""Expert-cache telemetry: the counters the runtime and the cache keep, and the `expert_cache` entry of
`llm.stats()` / `generate --json` built from them (the DESIGN.md keys first, then the extra ones)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .predictor import distance_order


@dataclass
class UseCounts:
    """How the uses of experts were served (the runtime keeps one in total and one per layer)."""
    hits: int = 0                 # served from a slot that was ready before it was needed
    prefetch_hits: int = 0        # first use of a slot a prefetch filled (ready or still in flight)
    demand_misses: int = 0        # needed and not resident: fetched on demand or computed on the CPU
    cpu_experts: int = 0          # demand misses computed on the CPU

    @property
    def uses(self) -> int:
        return self.hits + self.prefetch_hits + self.demand_misses

    @property
    def hit_rate(self) -> float:
        return (self.hits + self.prefetch_hits) / self.uses if self.uses else 0.0


@dataclass
class CopyCounts:
    """What crossed to the device tier (the cache keeps it)."""
    h2d_bytes: int = 0
    h2d_copies: int = 0
    prefetches: int = 0
    stall_s: float = 0.0          # time compute waited for copies
    copy_s: float = 0.0           # time the copy engine spent (CPU: the memcpy itself)


@dataclass
class ExpertCacheStats:
    hits: int = 0
    prefetch_hits: int = 0
    demand_misses: int = 0
    hit_rate: float = 0.0
    h2d_bytes: int = 0
    h2d_gb_s: float = 0.0
    stall_ms: float = 0.0
    cpu_experts: int = 0
    predictor_precision: float = 0.0
    predictor_recall: float = 0.0
    # beyond the documented keys
    predictor_by_distance: dict = field(default_factory=dict)   # distance or next-token source -> {"precision", "recall"}
    predictor_by_layer_kind: dict = field(default_factory=dict)  # "hash" (known from token ids) | "learned" -> same
    prefetches: int = 0
    prefetches_wasted: int = 0    # prefetched, evicted before any use
    evictions: int = 0
    slots: int = 0
    resident_experts: int = 0
    host_tier: str = ""           # "pinned" | "memory" | "mmap" | "mmap, N of M layers pinned"
    host_pinned_bytes: int = 0    # expert blobs in pinned host memory
    miss_policy: str = ""
    cpu_jobs: int = 0             # layers whose CPU-assigned misses ran on the worker thread
    cpu_ms: float = 0.0           # worker time in the CPU kernel
    cpu_wait_ms: float = 0.0      # time the layer waited for the worker (the rest overlapped the device's work)
    per_layer: dict = field(default_factory=dict)               # layer -> {"hits", ..., "hit_rate"}

    @classmethod
    def collect(cls, uses: UseCounts, per_layer: dict[int, UseCounts], copies: CopyCounts,
                predictor: dict[int, list[int]], by_kind: dict[str, list[int]] | None = None,
                **pool) -> "ExpertCacheStats":
        """predictor: distance -> [true positives, predicted, actual]; by_kind: the same per layer kind; pool:
        evictions, slots, ... as fields."""
        tp, pred, act = (sum(r[i] for r in predictor.values()) for i in range(3))
        return cls(
            hits=uses.hits, prefetch_hits=uses.prefetch_hits, demand_misses=uses.demand_misses,
            hit_rate=uses.hit_rate, h2d_bytes=copies.h2d_bytes,
            h2d_gb_s=copies.h2d_bytes / copies.copy_s / 1e9 if copies.copy_s > 0 else 0.0,
            stall_ms=copies.stall_s * 1e3, cpu_experts=uses.cpu_experts,
            predictor_precision=tp / pred if pred else 0.0, predictor_recall=tp / act if act else 0.0,
            predictor_by_distance={d: _rates(r) for d, r in sorted(predictor.items(),
                                                                    key=lambda kv: distance_order(kv[0]))},
            predictor_by_layer_kind={k: _rates(r) for k, r in sorted((by_kind or {}).items())},
            prefetches=copies.prefetches,
            per_layer={l: {"hits": c.hits, "prefetch_hits": c.prefetch_hits, "demand_misses": c.demand_misses,
                           "hit_rate": c.hit_rate} for l, c in sorted(per_layer.items())},
            **pool)

    def as_dict(self) -> dict:
        return asdict(self)


def _rates(counts: list[int]) -> dict:
    """[true positives, predicted, actual] -> {"precision", "recall"}."""
    tp, pred, act = counts
    return {"precision": tp / pred if pred else 0.0, "recall": tp / act if act else 0.0}


def empty_expert_cache_stats() -> dict:
    """The `expert_cache` stats of a model whose experts are all resident: every key, all zero."""
    return ExpertCacheStats().as_dict()
