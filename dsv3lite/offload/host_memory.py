"""Page-locked host memory of exactly the size asked for.

`torch.empty(n, pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every block up to
a power of two: a DeepSeek-V3 FP8 layer of expert blobs (10.5 GiB) would take 16 GiB, 944 GiB in all for
619 GiB of data. Instead the tier maps memory of the exact size and registers it with the CUDA driver
(cudaHostRegister): the same DMA speed as pinned memory, nothing rounded, unregistered when freed. How much host
RAM the tier may take (`host_ram_budget`) follows the machine and this process's cgroup.

Also here: the background pinners of a mapped tier (whole layers, `BackgroundPinner`, when all of it fits; the
most used experts up to --cpu-mem, `HotExperts`, when it does not) and `ResidentCap`, --cpu-mem on the CPU.
"""
from __future__ import annotations

import mmap
import weakref

import torch

from ..errors import UserError


CUDA_HOST_REGISTER_PORTABLE = 1        # pinned for every CUDA context, not only the current one
HOST_RESERVE_MIN = 2 * 2**30            # host RAM the host tier leaves to the OS and the rest of the process ...
HOST_RESERVE_SHARE = 16                 # ... or 1/16 of the RAM within reach, whichever is more


def _cudart_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, CUDA_HOST_REGISTER_PORTABLE))


def _cudart_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def pinned_empty(shape: tuple[int, ...], register=_cudart_register, unregister=_cudart_unregister) -> torch.Tensor:
    """uint8 tensor of `shape` in page-locked host memory, exactly its size (see the module docstring).

    The memory is an anonymous mapping of its own (whole pages: two allocations never share a page, so a
    registration never meets a page registered already), registered portable (every CUDA context may copy from it).
    The tensor's storage owns the mapping: the registration lasts while any tensor or view of that storage lives
    and ends before the mapping is unmapped. `register` / `unregister` are the driver calls (replaceable for
    tests); a failed registration is one clear error."""
    import ctypes

    nbytes = 1
    for d in shape:
        nbytes *= d
    if nbytes == 0:
        return torch.empty(shape, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = (ctypes.c_uint8 * nbytes).from_buffer(mapping)      # keeps the mapping; the storage will keep it
    ptr = ctypes.addressof(buffer)
    err = register(ptr, nbytes)
    if err != 0:
        del buffer
        mapping.close()
        raise UserError(f"cannot pin {nbytes / 2**30:.2f} GiB of host memory (CUDA error {err}): lower --cpu-mem "
                        f"or free host RAM")
    weakref.finalize(buffer, unregister, ptr)     # runs when the last storage using it goes, before the unmap
    return torch.frombuffer(buffer, dtype=torch.uint8).view(shape)


def host_reserve(reachable: int) -> int:
    """Host RAM kept out of the host tier when `reachable` bytes are within the process's reach."""
    return max(HOST_RESERVE_MIN, reachable // HOST_RESERVE_SHARE)


def host_ram_budget(cgroup=None) -> int:
    """Bytes of host RAM the host tier may take now: what the machine has available, or what this process's cgroup
    still allows when that is less (`cgroup`: (limit, usage) or None; default: read by `cgroup_memory`), less
    `host_reserve` of the RAM within reach."""
    import psutil

    vm = psutil.virtual_memory()
    available, reachable = vm.available, vm.total
    found = cgroup_memory() if cgroup is None else cgroup
    if found is not None:
        limit, usage = found
        available, reachable = min(available, limit - usage), min(reachable, limit)
    return available - host_reserve(reachable)


def cgroup_memory(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, int] | None:
    """(limit, usage) in bytes of the tightest memory limit on this process's cgroup and its ancestors (cgroup v2
    memory.max / memory.current, or v1 memory.limit_in_bytes / memory.usage_in_bytes); None without a limit."""
    from pathlib import Path

    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    tightest = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":                                      # v2: one unified hierarchy
            base, files = Path(root), ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):                   # v1: the memory controller's hierarchy
            base, files = Path(root) / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        here = base / rel.lstrip("/")
        for d in [here, *here.parents]:
            try:
                limit, usage = ((d / f).read_text().strip() for f in files)
            except OSError:
                if d == base:
                    break
                continue
            if limit.isdigit() and int(limit) < 2**60 and (
                    tightest is None or int(limit) - int(usage) < tightest[0] - tightest[1]):
                tightest = (int(limit), int(usage))
            if d == base:
                break
    return tightest


class BackgroundPinner:
    """Pins a mapped host tier layer by layer in a background thread while the runtime serves from the mapping:
    each layer is copied into exactly-sized pinned memory (`pin`, default pinned_empty) and swapped in
    (HostStore.swap); `on_swap(layer)` then runs (the CPU worker refreshes its blob addresses). Stops at the first
    failure (what is pinned stays pinned) with one line; `join()` waits for it."""

    def __init__(self, host, layers, pin=None, on_swap=None, log=None):
        import threading

        self.host, self.layers = host, list(layers)
        self.pin = pin or (lambda shape: pinned_empty(shape))
        self.on_swap = on_swap or (lambda layer: None)
        self.log = log or (lambda msg: None)
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="dsv3lite-pin", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for layer in self.layers:
            src = self.host.layers[layer]
            try:
                pinned = self.pin(tuple(src.shape))
                pinned.copy_(src)
            except Exception as e:                       # noqa: BLE001 (any failure ends pinning, not serving)
                self.error = str(e)
                n = len(self.host.pinned_layers)
                self.log(f"note: background pinning stopped after {n} layer{'' if n == 1 else 's'}: {e}")
                return
            self.host.swap(layer, pinned)
            self.on_swap(layer)

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)


def check_packed_fits(cap: int | None, total: int, fmt_name: str) -> None:
    """--cpu-mem against expert blobs packed in memory at load (they cannot be dropped): a one-line error when
    they exceed it."""
    if cap is not None and total > cap:
        from ..expert_cache_dir import ENV
        from ..utils import format_bytes

        raise UserError(f"--cpu-mem {format_bytes(cap)} is below the {format_bytes(total)} of {fmt_name} expert "
                        f"blobs this run packs in memory: let the expert cache serve them from disk (drop "
                        f"{ENV}=off, or free disk room for it) or raise --cpu-mem")


class HotExperts:
    """--cpu-mem below a mapped tier's size: the most used experts pinned, up to `capacity` of them, the rest served
    from the map. After each prompt (`update`, called where nothing reads the host tier: no copy being issued, no
    CPU job running) the routing counts, decayed by `decay` per prompt, rank the experts: those that left the top
    `capacity` go back to the map at once; a background thread waits until every copy issued from their rows has
    finished (`fence`), then copies the newcomers into free rows and publishes each (HostStore.pin_expert). Rows are
    allocated `chunk_rows` at a time with `pin` (exact size, pinned_empty) and never beyond `capacity`."""

    def __init__(self, host, capacity: int, fence=None, pin=None, log=None, chunk_rows: int = 16,
                 decay: float = 0.5):
        import queue
        import threading

        self.host, self.capacity, self.chunk_rows, self.decay = host, capacity, chunk_rows, decay
        self.fence = fence or (lambda: (lambda: None))
        self.pin = pin or (lambda shape: pinned_empty(shape))
        self.log = log or (lambda msg: None)
        self.score: dict = {}
        self.free: list[torch.Tensor] = []          # pinned rows holding no published expert
        self.allocated = 0                          # rows allocated so far (<= capacity)
        self.pending: set = set()                   # keys queued to be pinned
        self.error: str | None = None
        self.queue: "queue.Queue" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="dsv3lite-pin-hot", daemon=True)
        self.thread.start()

    def ranked(self) -> list:
        """The keys to keep pinned: the `capacity` highest scores (a pinned key first among equals, then by key)."""
        hot = self.host.hot
        return sorted(self.score, key=lambda k: (-self.score[k], k not in hot, k))[:self.capacity]

    def update(self, counts: dict) -> None:
        if self.error is not None:
            return
        for k in self.score:
            self.score[k] *= self.decay
        for k, c in counts.items():
            self.score[k] = self.score.get(k, 0.0) + c
        wanted = self.ranked()
        keep = set(wanted)
        freed = [self.host.unpin_expert(k) for k in list(self.host.hot) if k not in keep]
        newcomers = [k for k in wanted if k not in self.host.hot and k not in self.pending]
        if not freed and not newcomers:
            return
        self.pending.update(newcomers)
        self.queue.put((self.fence() if freed else None, freed, newcomers))

    def _row(self) -> torch.Tensor | None:
        if not self.free:
            n = min(self.chunk_rows, self.capacity - self.allocated)
            if n <= 0:
                return None
            chunk = self.pin((n, self.host.blob_bytes))
            self.allocated += n
            self.free.extend(chunk[i] for i in range(n))     # each row keeps its chunk alive
        return self.free.pop()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            fence, freed, newcomers = item
            try:
                if fence is not None:
                    fence()                                  # nothing still reads the freed rows
                self.free.extend(freed)
                for key in newcomers:
                    row = self._row()
                    if row is None:
                        break
                    layer, e = key
                    row.copy_(self.host.layers[layer][e])
                    self.host.pin_expert(key, row)
            except Exception as e:                           # noqa: BLE001 (pinning stops, serving goes on)
                self.error = str(e)
                self.log(f"note: pinning the most used experts stopped at {len(self.host.hot)}: {e}")
                return
            finally:
                self.pending.difference_update(newcomers)
                self.queue.task_done()

    def join(self) -> None:
        """Wait until every queued update is pinned."""
        self.queue.join()

    def close(self) -> None:
        self.queue.put(None)


def _madvise_dontneed():
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    dontneed = 4                                             # MADV_DONTNEED on Linux

    def drop(ptr: int, nbytes: int) -> None:
        page = mmap.PAGESIZE
        start = -(-ptr // page) * page                       # whole pages inside the blob only
        end = (ptr + nbytes) // page * page
        if end > start:
            libc.madvise(start, end - start, dontneed)
    return drop


class ResidentCap:
    """--cpu-mem on the CPU: the mapped expert blobs this process has touched stay within `cap` bytes of its
    resident memory. Each use (`touch`, blob addresses) moves the blob to the recent end; past the cap the least
    recently used blobs' pages are dropped from the process (madvise DONTNEED on a read-only private mapping: the
    next use reads them again from the page cache or the disk). The blobs of the current call are never dropped."""

    def __init__(self, cap: int, blob_bytes: int, drop=None):
        from collections import OrderedDict

        self.cap, self.blob_bytes = cap, blob_bytes
        self.drop = drop or _madvise_dontneed()
        self.recent: "OrderedDict[int, None]" = OrderedDict()
        self.resident = 0                                    # bytes of the blobs touched and not dropped
        self.dropped = 0                                     # blobs dropped so far

    def touch(self, addresses) -> None:
        recent = self.recent
        n = 0
        for a in addresses:
            n += 1
            if a in recent:
                recent.move_to_end(a)
            else:
                recent[a] = None
                self.resident += self.blob_bytes
        while self.resident > self.cap and len(recent) > n:
            a, _ = recent.popitem(last=False)
            self.drop(a, self.blob_bytes)
            self.resident -= self.blob_bytes
            self.dropped += 1
