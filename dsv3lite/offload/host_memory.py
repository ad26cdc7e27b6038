"""Page-locked host memory of exactly the size asked for.

`torch.empty(n, pin_memory=True)` goes through PyTorch's caching host allocator, which rounds every block up to
a power of two: a DeepSeek-V3 FP8 layer of expert blobs (10.5 GiB) would take 16 GiB, 944 GiB in all for
619 GiB of data. Instead the tier allocates ordinary memory of the exact size and registers it with the CUDA
driver (cudaHostRegister): the same DMA speed as pinned memory, nothing rounded, unregistered when freed.
"""
from __future__ import annotations

import weakref

import torch

from ..errors import UserError


def _cudart_register(ptr: int, nbytes: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))


def _cudart_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def pinned_empty(shape: tuple[int, ...], register=_cudart_register, unregister=_cudart_unregister) -> torch.Tensor:
    """uint8 tensor of `shape` in page-locked host memory, exactly its size (see the module docstring). The
    registration ends when the returned tensor is freed (views of it then read pageable memory). `register` / `unregister` are the driver calls
    (replaceable for tests); a failed registration is one clear error."""
    t = torch.empty(shape, dtype=torch.uint8)
    nbytes = t.numel()
    if nbytes == 0:
        return t
    ptr = t.data_ptr()
    err = register(ptr, nbytes)
    if err != 0:
        raise UserError(f"cannot pin {nbytes / 2**30:.2f} GiB of host memory (CUDA error {err}): lower --cpu-mem "
                        f"or free host RAM")
    weakref.finalize(t, unregister, ptr)
    return t


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
