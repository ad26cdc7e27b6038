"""FP8 block dequantization (checkpoint loading, quantize): the compiled CPU kernel gives the bits of its PyTorch
twin, bf16(fp32(q) * s), for every e4m3 code, edge blocks and NaN codes included."""
from __future__ import annotations


import pytest
import torch

from dsv3lite.kernels import cpu_build
from dsv3lite.quant.fp8 import expand_block_scales, fp8_block_dequant, fp8_block_dequant_ref

pytestmark = pytest.mark.cpu_kernels


@pytest.mark.parametrize("n,k", [(256, 256), (130, 300), (1, 129), (384, 7168)])
def test_kernel_matches_the_twin_bit_for_bit(n, k):
    g = torch.Generator().manual_seed(n * k)
    codes = torch.arange(256, dtype=torch.uint8).repeat(-(-n * k // 256))[:n * k]      # every code, NaNs too
    q = codes[torch.randperm(n * k, generator=g)].view(n, k).view(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 2.0 ** torch.randint(-12, 4, (1,), generator=g).item()
    got = fp8_block_dequant(q, s)
    assert torch.equal(got.view(torch.int16), fp8_block_dequant_ref(q, s).view(torch.int16))
    spelled = (q.float() * expand_block_scales(s, n, k)).to(torch.bfloat16)
    assert torch.equal(got.view(torch.int16), spelled.view(torch.int16))
    assert fp8_block_dequant(q, s, torch.float32).dtype == torch.float32


def test_kernel_runs_without_the_library(monkeypatch):
    q = torch.randn(200, 300).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3)
    fast = fp8_block_dequant(q, s)
    monkeypatch.setattr(cpu_build, "library", lambda: None)
    assert torch.equal(fp8_block_dequant(q, s), fast)
