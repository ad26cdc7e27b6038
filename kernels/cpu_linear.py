"""Dense linear layers on the CPU from packed weights (int8, int4, fp8, bf16): the compiled kernel and its twin.

    y = x @ W^T,  W [N, K] packed as one of:
      bf16  weight bfloat16 [N, K]
      fp8   weight float8_e4m3fn [N, K], scale float32 [ceil(N/128), ceil(K/128)] (quant.fp8's block format)
      int4  qweight uint8 [N, Kp/2], scales / zeros float16 [N, Kp/g] (quant.int4's group format, g = 128)
      int8  weight int8 [N, Kp], scale float32 [N, Kp/128] (symmetric per group of 128 along K)
The kernel (kernels/csrc/cpu_kernels.cpp, `dsv3_linear`) shares its row dots with the expert kernel, so the
numerics are cpu_experts'': fp8 block scales applied to each block's partial dot, and int4 / int8 weights against
activations quantized to int8 per group of 128 (`quantize_activation`). Without the library the twin runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_build
from ..quant.table import cpu_code
from .cpu_experts import matrix_weights_ref, quantize_activation

GROUP = 128                               # int4 / int8 group along K
# From this many rows of x, a bf16 weight is widened to fp32 a block of rows at a time for torch's matmul: the row
# kernel's fp32 multiply-adds are compute-bound past a few tokens (V3's wo, 2 threads: 262 against 205 ms at 64
# rows, 1055 against 381 at 256; 26 against 142 at 8). The values are the same (bf16 -> fp32 is exact).
BF16_MATMUL_ROWS = 64
WIDEN_ELEMENTS = 1 << 24                  # weights widened at once (64 MiB of fp32)


def linear_forward(x: torch.Tensor, fmt: str, n: int, weight: torch.Tensor, scale: torch.Tensor | None = None,
                   zero: torch.Tensor | None = None, out: torch.Tensor | None = None, threads: int = 0) -> torch.Tensor:
    """x [T, K] (CPU) -> [T, N] in x.dtype (fp32 into `out` when given)."""
    if fmt == "bf16" and x.shape[0] >= BF16_MATMUL_ROWS:
        y = _widened_matmul(x, weight)
        return y if out is None else out.copy_(y)
    lib = cpu_build.library()
    if lib is None or -(-x.shape[1] // GROUP) > 1024:
        y = linear_ref(x, fmt, n, weight, scale, zero)
        return y if out is None else out.copy_(y)
    xf = x if x.dtype == torch.float32 and x.is_contiguous() else x.float().contiguous()
    given = out is not None
    if out is None:
        out = torch.empty(x.shape[0], n)
    assert out.shape == (x.shape[0], n) and out.dtype == torch.float32 and out.is_contiguous()
    rc = lib.dsv3_linear(xf.data_ptr(), x.shape[0], x.shape[1], cpu_code(fmt), GROUP, n, weight.data_ptr(),
                         None if scale is None else scale.data_ptr(), None if zero is None else zero.data_ptr(),
                         out.data_ptr(), int(threads))
    if rc != 0:
        raise ValueError(f"CPU linear kernel: error {rc}")
    return out if given or x.dtype == torch.float32 else out.to(x.dtype)


def _widened_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ W^T for a bf16 weight [N, K], a block of its rows widened to fp32 at a time -> [T, N] in x.dtype."""
    n, k = weight.shape
    xf = x if x.dtype == torch.float32 else x.float()
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    rows = max(1, WIDEN_ELEMENTS // k)
    for r0 in range(0, n, rows):
        torch.mm(xf, weight[r0:r0 + rows].float().T, out=y[:, r0:r0 + rows])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def linear_ref(x: torch.Tensor, fmt: str, n: int, weight: torch.Tensor, scale: torch.Tensor | None = None,
               zero: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of linear_forward: the weights as the kernel applies them, int4 / int8 against int8 activations."""
    k = x.shape[1]
    w = matrix_weights_ref(fmt, weight, scale, zero, n, k, GROUP)
    xf = quantize_activation(x.float(), GROUP) if fmt in ("int4", "int8") else x.float()
    return F.linear(xf, w).to(x.dtype)
