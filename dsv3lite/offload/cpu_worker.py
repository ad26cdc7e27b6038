"""Demand misses computed on the CPU by a worker thread while the device computes the rest of the layer.

Per MoE layer the runtime hands the worker the experts it assigned to the CPU (`submit`); the worker brings the
layer's input to the host (a non-blocking copy into pinned memory that only the worker waits for), runs the
compiled kernel once for all of those experts (kernels/cpu_experts.py, per-pair outputs) and returns
[T, K, D] fp32 in pinned memory, zeros at the pairs it did not compute. Meanwhile the caller's thread goes on
queueing the device's work (the shared expert, copies, resident experts); the CPU outputs then enter the same
ascending-id sum as the device's (the fused kernel's external outputs, or `combine_experts`). One job runs at a
time; buffers are reused (nothing is allocated per layer in steady state once each token count has been seen).
"""
from __future__ import annotations

import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..kernels import cpu_experts
from ..quant.layout import BlobLayout
from ..threads import worker_threads
from .cache import HostStore


class CpuJob:
    """One layer's CPU-assigned experts in flight on the worker."""

    def __init__(self, future: Future, rows: list[list[int]], experts: set[int], device: torch.device,
                 worker: "CpuWorker"):
        self.future, self.rows, self.experts, self.device = future, rows, experts, device
        self.worker = worker
        self._pairs: torch.Tensor | None = None     # [T, K, D] on the caller's device, once fetched

    def pairs(self) -> torch.Tensor:
        """[T, K, D] fp32 per-pair outputs on the caller's device (blocks until the worker is done)."""
        if self._pairs is None:
            t0 = time.perf_counter()
            host = self.future.result()
            self.worker.wait_s += time.perf_counter() - t0
            if self.device.type == "cuda":
                self._pairs = host.to(self.device, non_blocking=True)
                self.worker.mark_consumed(self.device)     # the pinned buffer is reused once this copy is done
            else:
                self._pairs = host
        return self._pairs

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert e's outputs for its tokens in the order `model.combine_experts` gathers them (ascending t*K+k)."""
        k = len(self.rows[0])
        flat = [i for i in range(len(self.rows) * k) if self.rows[i // k][i % k] == e]
        t = torch.tensor([i // k for i in flat])
        j = torch.tensor([i % k for i in flat])
        return self.pairs()[t.to(self.device), j.to(self.device)].to(dtype)


class CpuWorker:
    """The worker thread, the blob addresses of every host layer and the reused staging buffers."""

    def __init__(self, host: HostStore, layout: BlobLayout, threads: int = 0, limit: float | None = None):
        """limit: the experts' SwiGLU clamp (DeepSeek-V4)."""
        self.host, self.layout, self.limit = host, layout, limit
        self.threads = threads or worker_threads(torch.get_num_threads())
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="dsv3lite-cpu-experts")
        weakref.finalize(self, self.executor.shutdown, False)     # the thread ends with its runtime
        n_experts = max(blobs.shape[0] for blobs in host.layers.values())
        self.masked = torch.zeros(n_experts, dtype=torch.int64)     # this job's experts' addresses, 0 elsewhere
        self.buffers: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.consumed: torch.cuda.Event | None = None   # the device copy of the last job's outputs
        self.busy = threading.Lock()
        self.jobs = 0
        self.compute_s = 0.0      # worker time in the kernel
        self.wait_s = 0.0         # caller time blocked on the worker

    def reset_counts(self) -> None:
        self.jobs, self.compute_s, self.wait_s = 0, 0.0, 0.0

    @staticmethod
    def usable(layout: BlobLayout, limit: float | None = None) -> bool:
        """Whether misses of this layout (and clamp) can go to the worker (the compiled kernel exists for it here)."""
        return cpu_experts.available(layout, limit)

    def _buffers(self, t: int, k: int, pinned: bool):
        bufs = self.buffers.get((t, k))
        if bufs is None:
            d = self.layout.hidden
            bufs = (torch.empty(t, d, pin_memory=pinned), torch.empty(t, k, d, pin_memory=pinned),
                    torch.ones(t, k))
            self.buffers[(t, k)] = bufs
        return bufs

    def submit(self, layer_id: int, x: torch.Tensor, rows: list[list[int]], experts: set[int]) -> CpuJob:
        """Start computing `experts` (each (t, k) pair of `rows` whose expert is in it) of layer_id on x [T, D]."""
        assert experts and not self.busy.locked(), "one CPU job at a time"
        t, k = len(rows), len(rows[0])
        cuda = x.is_cuda
        xh, out, ones = self._buffers(t, k, cuda)
        ready = None
        if cuda:
            xh.copy_(x, non_blocking=True)              # x is the device's; the worker waits for this copy
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(x.device))
        else:
            xh = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
        blobs = self.host.layers[layer_id]              # held by the job: a swap cannot free what it reads
        idx = torch.tensor(sorted(experts))
        self.masked.zero_()
        self.masked[idx] = self.host.addresses(layer_id)[idx]
        ids = torch.tensor(rows, dtype=torch.int64)
        consumed, self.consumed = self.consumed, None
        self.busy.acquire()
        self.jobs += 1

        def run() -> torch.Tensor:
            try:
                if consumed is not None:
                    consumed.synchronize()              # the previous outputs have left this buffer
                if ready is not None:
                    ready.synchronize()
                t0 = time.perf_counter()
                with torch.inference_mode():                # thread-local: the caller's buffers may be inference tensors
                    out.zero_()
                    cpu_experts.cpu_experts_forward(xh, ids, ones, blobs, self.layout, ptrs=self.masked,
                                                    per_pair=True, out=out, threads=self.threads, limit=self.limit)
                self.compute_s += time.perf_counter() - t0
                return out
            finally:
                self.busy.release()

        return CpuJob(self.executor.submit(run), rows, experts, x.device, self)

    def mark_consumed(self, device: torch.device) -> None:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        self.consumed = ev

    def time_experts(self, layer_id: int, experts: list[int], n_tokens: int) -> float:
        """Best seconds of the kernel on `n_tokens` tokens routed to one expert, each timing on another expert
        of `experts` (so its weights come from memory, not a cache), with the worker's thread count."""
        d = self.layout.hidden
        x = torch.randn(n_tokens, d) * 0.1
        ids = torch.zeros(n_tokens, 1, dtype=torch.int64)
        ones = torch.ones(n_tokens, 1)
        out = torch.empty(n_tokens, 1, d)
        blobs = self.host.layers[layer_id]
        best = float("inf")
        for e in experts:
            blob = blobs[e:e + 1]
            int(blob[0, ::4096].sum())                  # pages in (an mmap'd tier), without filling the caches
            ptrs = self.host.addresses(layer_id)[e:e + 1]
            t0 = time.perf_counter()
            cpu_experts.cpu_experts_forward(x, ids, ones, blob, self.layout, ptrs=ptrs, per_pair=True, out=out,
                                            threads=self.threads, limit=self.limit)
            best = min(best, time.perf_counter() - t0)
        return best

    def close(self) -> None:
        self.executor.shutdown(wait=True)
