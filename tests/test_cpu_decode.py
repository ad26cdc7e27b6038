"""The CPU decode step (executors/cpu.py over kernels/cpu_decode.py: a block's attention and its feed-forward, one
kernel call each)
against its twin, the eager path, and against transformers; a call of several tokens against single steps; the
cases it leaves to the eager path; DeepSeek-V3's routing geometry and its real widths."""
from __future__ import annotations

import contextlib

import pytest
import torch

import dsv3lite
from dsv3lite.cache import LatentCache, Positions
from dsv3lite.executors.cpu import CpuStep
from dsv3lite.kernels import cpu_decode
from dsv3lite.loader import load_model
from dsv3lite.model import Rotary, as_dtype
from dsv3lite.testing import KernelSpy

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.cpu_kernels]
CPU = torch.device("cpu")
PREFILL, STEPS = 8, 6


@contextlib.contextmanager
def watched(model):
    """An attention observer on `model` (as the offloading runtime adds): the layers then run one by one."""
    seen = []
    handle = model.add_observer(on_attention=lambda block, h: seen.append(block.layer_id))
    try:
        yield seen
    finally:
        handle.remove()


def eager(monkeypatch, on: bool = True):
    monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager" if on else "")


def decode_logits(model, tokens: torch.Tensor, ctx: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill tokens[:, :PREFILL] (eager: more than ABSORB_MAX_TOKENS), then one decode step per further token.
    -> (logits of the decode steps [steps, V], the cache)."""
    args = model.args
    cache = torch.zeros(len(model.blocks()), 1, ctx, args.cache_dim)
    step = CpuStep(model, CPU)
    out = []
    with torch.inference_mode():
        model.hidden(tokens[:, :PREFILL], 0, cache[:args.num_hidden_layers])
        for i in range(PREFILL, tokens.shape[1]):
            h = step.hidden(tokens[0, i:i + 1].tolist(), i, cache[:args.num_hidden_layers], absorb=True)
            out.append(model.logits(h)[0, -1])
    return torch.stack(out), cache


def prompt(n=PREFILL + STEPS, vocab=400, seed=0):
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", ["v3", "v2lite", "v2", "moonlight"])
def test_decode_steps_match_transformers(ckpt_factory, monkeypatch, variant):
    from transformers import AutoModelForCausalLM

    path = ckpt_factory(variant)
    x = prompt()
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
        expected = hf(x).logits[0, PREFILL:]
    spy = KernelSpy(monkeypatch, cpu_decode)
    model = load_model(path, CPU, torch.float32, progress=False, log=lambda m: None)
    got, _ = decode_logits(model, x)
    assert spy.ran == {"layers": STEPS, "attention": 0, "feed_forward": 0}, spy.ran
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with watched(model):                                      # an attention observer: block by block
        per_block, _ = decode_logits(model, x)
    n_layers = model.args.num_hidden_layers
    assert spy.ran == {"layers": STEPS, "attention": STEPS * n_layers, "feed_forward": STEPS * n_layers}, spy.ran
    assert torch.equal(per_block, got)                        # the same kernels in the same order: the same bits


ENGINES = {                                     # dsv3lite.load options: expert formats x packed dense formats
    "fp32": {},
    "bf16 experts": dict(experts="bf16"),
    "int4 experts, int4 dense": dict(experts="int4", dense="int4"),
    "int8 experts, int8 dense": dict(experts="int8", dense="int8"),
    "fp8 experts, fp8 dense": dict(experts="fp8", dense="fp8"),
    "bf16 dense": dict(dense="bf16"),
    "int4g32 experts": dict(experts="int4g32"),
}


@pytest.fixture(scope="module")
def engines(v3_dir):
    made = {}

    def get(label):
        if label not in made:
            made[label] = dsv3lite.load(str(v3_dir), device="cpu", ctx_size=64, mtp=False, progress=False,
                                        log=lambda m: None, **ENGINES[label])
            made[label].stop_ids = set()
        return made[label]
    return get


def greedy(llm, n=12):
    llm.reset()
    return [c.token_id for c in llm.generate(prompt(6)[0].tolist(), max_tokens=n)]


@pytest.mark.parametrize("label", list(ENGINES))
def test_the_kernel_step_matches_the_eager_step(engines, monkeypatch, label):
    llm = engines(label)
    spy = KernelSpy(monkeypatch, cpu_decode)
    x = prompt()
    eager(monkeypatch)
    want, want_cache = decode_logits(llm.model, x)
    want_tokens = greedy(llm)
    assert spy.ran == {"layers": 0, "attention": 0, "feed_forward": 0}
    eager(monkeypatch, False)
    got, got_cache = decode_logits(llm.model, x)
    assert spy.ran["layers"] == STEPS
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got_cache, want_cache, atol=1e-5, rtol=1e-5)      # the rows the steps wrote
    assert greedy(llm) == want_tokens


@pytest.mark.parametrize("label", ["fp32", "bf16 experts", "int4 experts, int4 dense"])
def test_a_call_of_several_tokens_gives_each_token_its_own_steps_bits(engines, label):
    """MTP verification runs 2..4 tokens in one forward: each gets exactly the bits a plain decode step gives it
    (one-token row dots run four rows at a time for fp32 and bf16 weights, the same operations per row)."""
    model = engines(label).model
    args = model.args
    x = prompt(PREFILL + 3)
    caches, hidden = [], []
    for split in ([3], [1, 1, 1]):
        cache = torch.zeros(args.num_hidden_layers, 1, 64, args.cache_dim)
        step = CpuStep(model, CPU)
        with torch.inference_mode():
            model.hidden(x[:, :PREFILL], 0, cache)
            pos, out = PREFILL, []
            for n in split:
                out.append(step.hidden(x[0, pos:pos + n].tolist(), pos, cache, absorb=True)[0])
                pos += n
        caches.append(cache)
        hidden.append(torch.cat(out))
    assert torch.equal(hidden[0], hidden[1]) and torch.equal(caches[0], caches[1])


def test_routing_observers_see_the_kernels_routing(engines, monkeypatch):
    model = engines("bf16 experts").model
    seen = {}
    handle = model.add_observer(on_routing=lambda layer, ids, scores: seen.setdefault(mode, []).append(
        (layer, sorted(ids[0].tolist()), scores.clone())))
    try:
        for mode in ("eager", "kernel"):
            eager(monkeypatch, mode == "eager")
            decode_logits(model, prompt())
    finally:
        handle.remove()
    assert len(seen["kernel"]) == len(seen["eager"]) > 0
    step = [r for r in seen["eager"] if r[2].shape[0] == 1]           # the decode steps (the prefill is eager)
    kernel_steps = [r for r in seen["kernel"] if r[2].shape[0] == 1]
    assert [(layer, ids) for layer, ids, _ in kernel_steps] == [(layer, ids) for layer, ids, _ in step]
    for (_, _, a), (_, _, b) in zip(kernel_steps, step):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_cases_the_kernels_leave_to_the_eager_path(ckpt_factory, engines, monkeypatch):
    llm = engines("fp32")
    block = llm.model.layers[1]
    cos, sin = (as_dtype(t, torch.float32)[:, None] for t in llm.model.rotary(5, 1, CPU))
    h = torch.randn(1, 1, llm.args.hidden_size)
    cache = torch.zeros(1, 64, llm.args.cache_dim)
    with torch.inference_mode():
        assert cpu_decode.attention(block, h, 5, cos, sin, cache) is not None
        assert cpu_decode.feed_forward(block, h) is not None
        assert cpu_decode.attention(block, h, 64, cos, sin, cache) is None          # past the cache: eager raises
        assert cpu_decode.attention(block, h.to(torch.bfloat16), 5, cos, sin, cache) is None
        assert cpu_decode.feed_forward(block, torch.randn(1, 5, llm.args.hidden_size)) is None   # a prefill chunk
        layers_cache = torch.zeros(llm.args.num_hidden_layers, 1, 64, llm.args.cache_dim)
        assert cpu_decode.layers(llm.model, h, 5, cos, sin, layers_cache) is not None
        assert cpu_decode.layers(llm.model, h, 64, cos, sin, layers_cache) is None
        assert cpu_decode.layers(llm.model, h, 5, cos, sin, layers_cache[:1]) is None          # a cache too small
        eager(monkeypatch)
        assert cpu_decode.feed_forward(block, h) is None
    eager(monkeypatch, False)
    assert cpu_decode.feed_forward(block, h) is None                  # autograd sees the eager operators
    monkeypatch.setenv("DSV3LITE_CPU_KERNELS", "ref")
    with torch.inference_mode():
        assert cpu_decode.feed_forward(block, h) is None              # the PyTorch twins, everywhere
    monkeypatch.delenv("DSV3LITE_CPU_KERNELS")
    # V3.2's indexer keeps its attention eager; its feed-forward still takes the kernel
    v32 = load_model(ckpt_factory("v32"), CPU, torch.float32, progress=False, log=lambda m: None)
    cache = torch.zeros(1, 64, v32.args.cache_dim)
    with torch.inference_mode():
        assert cpu_decode.attention(v32.layers[1], h, 5, cos, sin, cache) is None
        assert cpu_decode.feed_forward(v32.layers[1], h) is not None


def test_v3_geometry_decode_equals_the_eager_path(tmp_path, monkeypatch):
    """61 layers, 256 experts, top-8 within 4 of 8 groups: tokens and logits against the eager path."""
    from dsv3lite.testing import write_geometry_checkpoint

    path = write_geometry_checkpoint(tmp_path / "g", hidden_size=32, moe_intermediate_size=16, intermediate_size=64,
                                     q_lora_rank=16, kv_lora_rank=16)
    model = load_model(path, CPU, torch.float32, progress=False, log=lambda m: None)
    x = prompt()
    eager(monkeypatch)
    want, _ = decode_logits(model, x)
    eager(monkeypatch, False)
    spy = KernelSpy(monkeypatch, cpu_decode)
    got, _ = decode_logits(model, x)
    assert spy.ran["layers"] == STEPS
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_block_at_deepseek_v3_widths(monkeypatch):
    """One MoE block at V3's widths (hidden 7168, 128 heads, q/kv lora 1536/512, experts 2048 wide; 4 routed
    experts so it fits a test) with 2 threads, over 100 positions of context: the kernel against the eager path."""
    from dsv3lite.testing_realwidth import realwidth_moe_block

    block, args = realwidth_moe_block()
    rotary = Rotary(args)
    cache = torch.randn(1, 128, args.cache_dim) * 0.5
    h = torch.randn(1, 1, args.hidden_size)
    outs = {}
    torch.set_num_threads(2)
    try:
        for mode in ("eager", "kernel"):
            eager(monkeypatch, mode == "eager")
            c = cache.clone()
            with torch.inference_mode():
                cos, sin = (t[:, None] for t in rotary(100, 1, CPU))
                if mode == "kernel":
                    a = cpu_decode.attention(block, h, 100, cos, sin, c)
                    f = cpu_decode.feed_forward(block, a)
                else:
                    a = block.attention(h, Positions(100, 1), cos, sin, LatentCache(c, args.latent_dim), absorb=True)
                    f = block.feed_forward(a)
                outs[mode] = (a, f, c[:, :101])
    finally:
        torch.set_num_threads(1)
    for got, want in zip(outs["kernel"], outs["eager"]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_tiny_model_the_step_runs_whole_decodes_with_every_thread(engines, ckpt_factory, monkeypatch):
    """The one-thread rule for tiny models holds for the eager path only (generate.decode_threads)."""
    llm = engines("fp32")
    assert cpu_decode.covers(llm.model) and llm.decode_threads is None
    eager(monkeypatch)
    assert not cpu_decode.covers(llm.model) and llm.decode_threads == 1
    eager(monkeypatch, False)
    v32 = load_model(ckpt_factory("v32"), CPU, torch.float32, progress=False, log=lambda m: None)
    assert not cpu_decode.covers(v32)                 # its attention stays eager


def test_a_weight_replaced_after_a_step_is_the_one_the_next_step_reads(v3_dir, monkeypatch):
    """The kernels' descriptors hold the weights weakly: a module swapped (or a weight moved) between steps
    rebuilds them, so the next step computes with the new weights, as the eager path does."""
    from dsv3lite.dense import pack_dense

    model = load_model(v3_dir, CPU, torch.float32, progress=False, log=lambda m: None)
    x = prompt()
    decode_logits(model, x)                                   # descriptors built for the fp32 linears
    pack_dense(model, "int8")
    got, _ = decode_logits(model, x)
    eager(monkeypatch)
    want, _ = decode_logits(model, x)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
