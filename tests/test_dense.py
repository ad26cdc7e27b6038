"""Packed non-expert weights on the CPU (`--dense`, dsv3lite/dense.py and kernels/cpu_linear.py): the linear kernel
against its twin per dtype, the packing's reconstruction error, the demo with packed dense weights, the checks on
the option, and the planner's byte counts. The GPU path and packing while loading: tests/test_dense_cuda.py."""
from __future__ import annotations

import json

import pytest
import torch

import dsv3lite
from dsv3lite.dense import DENSE_DTYPES, KEEP, PackedLinear, check_dense, pack_weight
from dsv3lite.errors import UserError
from dsv3lite.kernels import cpu_build
from dsv3lite.kernels.cpu_experts import matrix_weights_ref
from dsv3lite.kernels.cpu_linear import GROUP, linear_forward, linear_ref

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = dict(progress=False, log=lambda m: None)


def gen(seed: int = 2) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("n,k", [(64, 256), (100, 200), (40, 384)])
def test_linear_kernel_matches_twin(dtype, n, k):
    if cpu_build.library() is None:
        pytest.skip(cpu_build.status())
    gen = torch.Generator().manual_seed(0)
    packed = pack_weight(torch.randn(n, k, generator=gen) * 0.05, dtype)
    for t in (1, 3, 9, 70):                    # 70: bf16 takes the widened matmul (BF16_MATMUL_ROWS)
        x = torch.randn(t, k, generator=gen)
        got, want = linear_forward(x, dtype, n, *packed), linear_ref(x, dtype, n, *packed)
        err = (got - want).abs().max().item()
        assert err <= 2e-5 * want.abs().max().item(), f"{dtype} T={t}: max |kernel - twin| {err:.3e}"


def test_a_bf16_weight_widened_in_blocks_of_rows_gives_the_twins_product(monkeypatch):
    from dsv3lite.kernels import cpu_linear

    monkeypatch.setattr(cpu_linear, "WIDEN_ELEMENTS", 7 * 200)            # 7 rows a block: 100 rows in 15 blocks
    packed = pack_weight(torch.randn(100, 200, generator=gen()) * 0.05, "bf16")
    x = torch.randn(cpu_linear.BF16_MATMUL_ROWS, 200, generator=gen())
    torch.testing.assert_close(linear_forward(x, "bf16", 100, *packed), linear_ref(x, "bf16", 100, *packed),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [("bf16", 4e-3), ("fp8", 4e-2), ("int8", 1e-2), ("int4", 0.12)])
def test_packing_reconstructs_the_weight(dtype, tol):
    w = torch.randn(96, 300, generator=torch.Generator().manual_seed(1))
    back = matrix_weights_ref(dtype, *pack_weight(w, dtype), 96, 300, GROUP)
    assert ((back - w).norm() / w.norm()).item() < tol


def test_forced_off_runs_the_twin(monkeypatch):
    packed = pack_weight(torch.randn(32, 256, generator=gen()), "int8")
    x = torch.randn(2, 256, generator=gen())
    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")
    assert torch.equal(linear_forward(x, "int8", 32, *packed), linear_ref(x, "int8", 32, *packed))


def test_packed_linear_keeps_leading_dims():
    lin = torch.nn.Linear(256, 48, bias=False)
    p = PackedLinear.from_linear(lin, "bf16")
    x = torch.randn(2, 3, 256, generator=gen())
    assert p(x).shape == (2, 3, 48) and p.nbytes == 48 * 256 * 2
    torch.testing.assert_close(p(x), lin(x), atol=1e-2, rtol=1e-2)


def test_check_dense():
    check_dense(None, torch.device("cuda"))
    check_dense("int4", torch.device("cpu"))
    check_dense("fp8", torch.device("cuda"))          # the GPU path: tests/test_dense_cuda.py
    with pytest.raises(UserError, match="unknown dense dtype"):
        check_dense("int3", torch.device("cpu"))
    with pytest.raises(UserError, match="--device cpu"):
        check_dense("int8", torch.device("cuda"))


def greedy(llm, n=24):
    llm.stop_ids = set()
    return [c.token_id for c in llm.generate("ROMEO:\n", max_tokens=n)]


def test_demo_with_packed_dense_weights():
    """bf16 holds the demo's (bf16) weights exactly: the greedy tokens stay; 8- and 4-bit packings keep the
    reference slice's perplexity within a few percent."""
    from dsv3lite import DEMO_DIR

    plain = dsv3lite.load(device="cpu", mtp=False, **QUIET)
    card = (DEMO_DIR / "README.md").read_text(encoding="utf-8").split("<!-- reference-slice -->", 1)[1]
    ids = torch.tensor([plain.tokenizer.encode(card.split("```text\n", 1)[1], add_bos=True)[:256]])

    def ppl(logits):
        return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).exp().item()

    want, tokens = ppl(plain.forward(ids)), greedy(plain)
    for dtype, rel in (("bf16", 1e-4), ("int8", 0.02), ("fp8", 0.03), ("int4", 0.08)):
        llm = dsv3lite.load(device="cpu", mtp=False, dense=dtype, **QUIET)
        linears = [m for m in llm.model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(name in KEEP for mod in llm.model.modules() for name, m in mod.named_children()
                                if isinstance(m, torch.nn.Linear))
        assert isinstance(llm.model.head, PackedLinear) and isinstance(llm.model.layers[0].ffn.w1, PackedLinear)
        assert ppl(llm.forward(ids)) == pytest.approx(want, rel=rel), dtype
        if dtype == "bf16":
            assert greedy(llm) == tokens


def test_plan_counts_the_dense_dtype():
    from dsv3lite import DEMO_DIR
    from dsv3lite.config import ModelArgs
    from dsv3lite.footprint import DENSE_WEIGHT_BYTES, footprint
    from dsv3lite.offload.setup import plan_for

    args = ModelArgs.from_dir(DEMO_DIR)
    fp = footprint(args)
    plans = {d: plan_for(DEMO_DIR, args, 1 << 30, 256, "bf16", True, torch.float32, d)[0] for d in (None, "int4")}
    full, packed = plans[None].components, plans["int4"].components
    assert full["lm_head"] == fp.head * 4 and packed["lm_head"] == round(fp.head * DENSE_WEIGHT_BYTES["int4"])
    assert packed["embeddings"] == full["embeddings"] and packed["routers (fp32)"] == full["routers (fp32)"]
    assert full["attention + norms"] / 8 < packed["attention + norms"] < full["attention + norms"] / 2
    assert plans["int4"].resident < plans[None].resident


def test_cli_info_and_plan_count_the_dense_dtype():
    from click.testing import CliRunner

    from dsv3lite.cli import cli

    runner = CliRunner()
    full = json.loads(runner.invoke(cli, ["info", "--json"]).output)["component_bytes"]
    packed = json.loads(runner.invoke(cli, ["info", "--json", "--dense", "int8"]).output)["component_bytes"]
    assert packed["lm_head"] < full["lm_head"] / 1.9 and packed["embeddings"] == full["embeddings"]
    assert packed["routed experts"] == full["routed experts"]
    out = runner.invoke(cli, ["plan", "--device", "cpu", "--gpu-mem", "1G", "--dense", "int4"])
    assert out.exit_code == 0 and "--dense int4" in out.output
    bad = runner.invoke(cli, ["info", "--dense", "int3"])
    assert bad.exit_code != 0 and "int3" in bad.output
