"""What the device tier really holds, measured from the tensors themselves (not from the plan that sized it).

`held_bytes(engine)`: the model's weights and buffers on the device, the expert slot pool and the KV cache.
`PeakTracker`: the high-water mark of everything else a forward allocates (activations, logits, expanded K/V,
kernel workspaces), counted per storage from the outputs of every tensor operation while it is active. On CPU
the simulated device tier is checked this way against `--gpu-mem` (tests/test_budget.py); on CUDA the runtime
also compares `torch.cuda.max_memory_allocated` with the budget after the first prefill and decode step.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def held_bytes(engine) -> dict[str, int]:
    """{"weights", "slots", "kv_cache"}: bytes of distinct storages the device tier holds between forwards (the
    host tier's expert blobs are not in the model and are not counted)."""
    seen: set[int] = set()

    def total(tensors) -> int:
        n = 0
        for t in tensors:
            ptr, nbytes = _storage(t)
            if ptr and ptr not in seen:
                seen.add(ptr)
                n += nbytes
        return n

    model = engine.model
    out = {"weights": total(list(model.parameters()) + list(model.buffers()))}
    rt = engine.offload
    out["slots"] = total([rt.cache.pool]) if rt is not None else 0
    out["kv_cache"] = total(engine.cache.tensors()) if engine.cache is not None else 0
    return out


def held_pointers(engine) -> set[int]:
    """Storage addresses of what `held_bytes` counts and of the host tier (never workspace)."""
    tensors = list(engine.model.parameters()) + list(engine.model.buffers())
    if engine.cache is not None:
        tensors += engine.cache.tensors()
    if engine.offload is not None:
        tensors += [engine.offload.cache.pool, *engine.offload.host.layers.values(), *engine.offload.host.hot.values()]
    return {_storage(t)[0] for t in tensors}


class PeakTracker(TorchDispatchMode):
    """Live bytes of the storages that tensor operations create while active, and their peak. Storages in
    `exclude` (weights, caches) are not counted; a storage stays live while any tensor made here views it."""

    def __init__(self, exclude: set[int] = frozenset()):
        super().__init__()
        self.exclude = set(exclude)
        self.live = 0
        self.peak = 0
        self.refs: dict[int, list[int]] = {}      # storage address -> [tensors alive here, nbytes]

    def _release(self, ptr: int) -> None:
        entry = self.refs.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.refs[ptr]
            self.live -= entry[1]

    def _track(self, t: torch.Tensor) -> None:
        ptr, nbytes = _storage(t)
        if not ptr or ptr in self.exclude:
            return
        entry = self.refs.get(ptr)
        if entry is None:
            entry = self.refs[ptr] = [0, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._release, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out
