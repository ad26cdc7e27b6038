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
