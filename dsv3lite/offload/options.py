"""The user's offloading choices, with their defaults, in one dataclass passed through constructors
(the CLI, `dsv3lite.load(**options)`, the setup and the runtime all read it; none repeats a default)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..errors import UserError

MISS_POLICIES = ("auto", "fetch", "cpu")     # where a demand miss is served: cost model, H2D copy, CPU compute


@dataclass(frozen=True)
class OffloadOptions:
    lookahead: int = 2                  # MoE layers ahead whose experts the router predictor prefetches
    miss_policy: str = "auto"           # one of MISS_POLICIES
    cache_policy: str = "decayed-lfu"   # a name in offload.policy.POLICIES
    cpu_mem: int | str | None = None    # cap on host memory for expert blobs ("64G", bytes); None: what RAM allows
    cpu_threads: int = 0                # threads computing CPU-assigned misses; 0: --threads less one (threads.py)

    def __post_init__(self):
        from ..utils import parse_size
        from .policy import POLICIES

        if not isinstance(self.lookahead, int) or isinstance(self.lookahead, bool) or self.lookahead < 0:
            raise UserError(f"--lookahead must be an integer >= 0, got {self.lookahead!r}")
        if self.miss_policy not in MISS_POLICIES:
            raise UserError(f"unknown --miss-policy {self.miss_policy!r}: use {', '.join(MISS_POLICIES)}")
        if self.cache_policy not in POLICIES:
            raise UserError(f"unknown cache policy {self.cache_policy!r}: use {', '.join(POLICIES)}")
        if self.cpu_mem is not None:
            parse_size(self.cpu_mem)
        if not isinstance(self.cpu_threads, int) or isinstance(self.cpu_threads, bool) or self.cpu_threads < 0:
            raise UserError(f"--cpu-threads must be an integer >= 0, got {self.cpu_threads!r}")

    @property
    def cpu_mem_bytes(self) -> int | None:
        from ..utils import parse_size

        return None if self.cpu_mem is None else parse_size(self.cpu_mem)

    @classmethod
    def take(cls, options: dict) -> "OffloadOptions":
        """Pop this dataclass's fields out of a keyword dict (the rest stays for the engine)."""
        return cls(**{f.name: options.pop(f.name) for f in fields(cls) if f.name in options})
