"""The spine: the model is the math (no executor imports, no fields written from outside it while it runs), the
executors take the sub-steps they can run and leave the rest eager with one line (V3.2 through the compiled CPU
step and the decode graphs; offloaded CPU decode with compiled attention), the cache objects' contract, and the
compiled library checked against the Python side when it loads."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import dsv3lite
from dsv3lite.kernels import cpu_decode
from dsv3lite.testing import KernelSpy, offload_budget

from test_architecture import import_graph

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
MODEL_MODULES = ("dsv3lite.model", "dsv3lite.attention", "dsv3lite.moe", "dsv3lite.layers", "dsv3lite.cache",
                 "dsv3lite.config")
MODEL_FILES = {str(ROOT / "dsv3lite" / f"{m.split('.')[-1]}.py") for m in MODEL_MODULES}


def load(path=None, **kw):
    llm = dsv3lite.load(None if path is None else str(path), device="cpu", progress=False, log=kw.pop("log", None)
                        or (lambda m: None), **kw)
    llm.stop_ids = set()
    return llm


def greedy(llm, n=8, prompt="The capital of France is"):
    llm.reset()
    return [c.token_id for c in llm.generate(prompt, max_tokens=n)]


# --- the model is the math --------------------------------------------------------------------------------------

def test_no_model_module_reaches_an_executor_or_the_cpu_kernels():
    graph = import_graph()
    assert set(MODEL_MODULES) <= set(graph)
    for start in MODEL_MODULES:                        # what each model module imports, directly or not
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        bad = sorted(d for d in seen if d.startswith("dsv3lite.executors") or d.startswith("dsv3lite.kernels.cpu_")
                     or d in ("dsv3lite.generate", "dsv3lite.offload", "dsv3lite.experts")
                     or d.startswith("dsv3lite.offload."))
        assert bad == [], f"{start} reaches {bad}"


class FieldWrites:
    """Records assignments to attributes of a model's modules made from outside the model's files (setattr), and
    compares each module's own state (attributes, submodules, parameters, buffers) before and after."""

    # what the model's own code keeps between calls: views of its weights (layers.inference_views), RoPE tables
    OWN_CACHES = {"_inference_views", "cos", "sin"}

    def __init__(self, *models):
        self.modules = [m for model in models for m in model.modules()]
        self.ids = {id(m) for m in self.modules}
        self.writes: list[str] = []
        self.before = [self._state(m) for m in self.modules]

    @staticmethod
    def _state(m) -> dict:
        out = {k: id(v) for k, v in m.__dict__.items() if not k.startswith("_") or k == "_inference_views"}
        for table in ("_modules", "_parameters", "_buffers"):
            out.update({f"{table}.{k}": id(v) for k, v in m.__dict__[table].items()})
        return out

    @contextlib.contextmanager
    def watching(self):
        real = torch.nn.Module.__setattr__
        ids, writes = self.ids, self.writes

        def spy(module, name, value):
            if id(module) in ids:
                caller = sys._getframe(1).f_code.co_filename
                if caller not in MODEL_FILES:
                    writes.append(f"{type(module).__name__}.{name} from {caller}")
            real(module, name, value)
        torch.nn.Module.__setattr__ = spy
        try:
            yield
        finally:
            torch.nn.Module.__setattr__ = real

    def changed(self) -> list[str]:
        out = []
        for m, before in zip(self.modules, self.before):
            after = self._state(m)
            for key in set(before) | set(after):
                if before.get(key) != after.get(key) and key not in self.OWN_CACHES:
                    out.append(f"{type(m).__name__}.{key}")
        return sorted(set(out))


def test_nothing_outside_the_model_writes_its_modules_while_it_runs(v3_dir, monkeypatch, tmp_path):
    """Every executor and observer that runs a model (the compiled CPU step, eager steps, layer-major prefill, MTP
    speculation, the offloading runtime and its predictor, decode graphs, a trace recorder) leaves the model's
    modules as it found them."""
    from dsv3lite import generate
    from dsv3lite.executors.graphs import DecodeGraphs, eager_capture
    from dsv3lite.offload.trace import TraceRecorder

    resident = load(v3_dir, mtp=True, mtp_adaptive=False, ctx_size=256)
    offloaded = load(v3_dir, mtp=True, mtp_adaptive=False, ctx_size=256, experts="bf16", miss_policy="fetch",
                     gpu_mem=offload_budget(v3_dir, 8, "bf16", ctx=256))
    watch = FieldWrites(resident.model, offloaded.model)
    monkeypatch.setattr(generate, "PREFILL_CHUNK", 8)            # prompts past 8 tokens go layer-major
    with watch.watching():
        for llm in (resident, offloaded):
            greedy(llm, 6)                                       # the compiled step (offloaded: per block)
            greedy(llm, 4, prompt="a longer prompt that is prefilled layer by layer, for a change")
            monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager")
            greedy(llm, 4)                                       # eager steps
            monkeypatch.delenv("DSV3LITE_CPU_DECODE")
            llm.graphs = DecodeGraphs(llm.model, capture=eager_capture)
            greedy(llm, 4)                                       # decode graphs (a stand-in capture)
            llm.graphs = None
            recorder = TraceRecorder(llm.model)
            greedy(llm, 3)
            recorder.detach()
    assert watch.writes == [] and watch.changed() == []


def test_the_field_watch_sees_a_write_from_outside(v3_dir):
    llm = load(v3_dir, mtp=False)
    watch = FieldWrites(llm.model)
    with watch.watching():
        llm.model.layers[0].attn.marker = 1
        llm.model.layers[1].__dict__["hidden_state"] = 2
    assert len(watch.writes) == 1 and "MLA.marker" in watch.writes[0]
    assert watch.changed() == ["Block.hidden_state", "MLA.marker"]


# --- executors: a sub-step they cannot run stays eager, the rest does not --------------------------------------

@pytest.mark.cpu_kernels
def test_v32_decodes_through_the_compiled_step_but_its_sparse_attention(ckpt_factory, monkeypatch):
    logs = []
    llm = load(ckpt_factory("v32"), mtp=False, log=logs.append)
    notes = [m for m in logs if "compiled CPU decode step" in m]
    assert len(notes) == 1 and "V3.2's sparse (indexed) attention" in notes[0]
    monkeypatch.setenv("DSV3LITE_CPU_DECODE", "eager")
    want = greedy(llm, 10)
    monkeypatch.delenv("DSV3LITE_CPU_DECODE")
    ran = KernelSpy(monkeypatch, cpu_decode)
    assert greedy(llm, 10) == want
    n_layers, steps = llm.args.num_hidden_layers, 9
    assert ran.ran["attention"] == 0 and ran.declined["attention"] == steps * n_layers
    assert ran.ran["feed_forward"] == steps * n_layers                    # every layer's feed-forward compiled


def test_v32_decodes_through_the_decode_graphs(ckpt_factory):
    """Its sparse attention picks its path on the host: it runs between the captured segments, the rest is
    captured; the tokens are the eager step's."""
    from dsv3lite.executors.graphs import DecodeGraphs, eager_capture

    llm = load(ckpt_factory("v32"), mtp=False, experts="int4")
    want = greedy(llm, 8)
    logs = []
    llm.graphs = DecodeGraphs(llm.model, log=logs.append, capture=eager_capture)
    assert greedy(llm, 8) == want and not logs
    stats = llm.graphs.stats()
    n_layers = llm.args.num_hidden_layers
    assert stats["off"] is None and stats["graphs_per_step"] == {1: n_layers + 1}     # between the attentions


@pytest.mark.cpu_kernels
def test_offloaded_cpu_decode_runs_compiled_attention_between_the_host_scheduled_experts(v3_dir, monkeypatch):
    kw = dict(mtp=False, ctx_size=160, experts="bf16")
    resident = load(v3_dir, **kw)
    offloaded = load(v3_dir, gpu_mem=offload_budget(v3_dir, 8, "bf16", ctx=160, mtp=False), miss_policy="fetch", **kw)
    want = greedy(resident, 8)
    ran = KernelSpy(monkeypatch, cpu_decode)
    assert greedy(offloaded, 8) == want
    args, steps = offloaded.args, 7
    n_moe = len(args.moe_layer_ids)
    assert ran.ran["attention"] == steps * args.num_hidden_layers                   # every layer's attention
    assert ran.ran["feed_forward"] == steps * (args.num_hidden_layers - n_moe)      # the dense layers' MLP
    assert offloaded.stats()["expert_cache"]["demand_misses"] > 0


# --- cache objects --------------------------------------------------------------------------------------------

def test_a_latent_cache_written_at_device_positions_holds_what_host_positions_write():
    from dsv3lite.cache import LatentCache, Positions, latent_caches

    rows = torch.randn(1, 3, 10)
    host, dev = (LatentCache(torch.zeros(1, 8, 12), 10) for _ in range(2))
    host.write(Positions(4, 3), rows)
    dev.write(Positions.on_device(torch.arange(4, 7), torch.tensor([7], dtype=torch.int32)), rows)
    assert torch.equal(host.data, dev.data) and torch.equal(host.data[0, 4:7, :10], rows[0])
    assert host.latents(Positions(4, 3)).shape == (1, 7, 12)
    assert dev.latents(Positions.on_device(torch.arange(4, 7), torch.tensor([7]))).shape == (1, 8, 12)
    caches = latent_caches(torch.zeros(3, 1, 8, 12), 10, n_main=2)
    assert len(caches) == 3 and caches.capacity == 8 and caches.keepable(5) == 5
    assert caches[2].data.data_ptr() == caches.tensor[2].data_ptr()         # views of one tensor


# --- the compiled library and the Python side agree, or the library is not used ---------------------------------

@pytest.mark.cpu_kernels
def test_the_library_is_checked_against_the_python_side(monkeypatch):
    import ctypes

    from dsv3lite.kernels import cpu_abi, cpu_build

    lib = cpu_build.library()
    assert cpu_abi.mismatch(lib) is None

    class Longer(ctypes.Structure):                     # a field the C++ side does not have
        _fields_ = cpu_abi.Lin._fields_ + [("extra", ctypes.c_int64)]
    Longer.__name__ = "Lin"
    structs = cpu_abi.STRUCTS
    monkeypatch.setattr(cpu_abi, "STRUCTS", {"dsv3_struct_layout": (Longer,)})
    assert "struct Lin" in cpu_abi.mismatch(lib)
    monkeypatch.setattr(cpu_abi, "STRUCTS", {"dsv4_struct_layout": (cpu_abi.V4FfnDesc, Longer)})
    assert "struct Lin is laid out as None" in cpu_abi.mismatch(lib)     # V4's reporter knows no Lin
    monkeypatch.setattr(cpu_abi, "STRUCTS", structs)
    monkeypatch.setattr(cpu_abi, "cpu_codes", lambda: {"int4": 7})
    assert "format 'int4' has code 2 in the library, 7" in cpu_abi.mismatch(lib)


def test_a_load_resolves_where_the_experts_come_from_once(v3_dir, monkeypatch):
    from dsv3lite import experts
    from dsv3lite.offload import setup

    calls = []
    real = experts.expert_source

    def counted(*a, **kw):
        calls.append(a[2] if len(a) > 2 else kw.get("experts"))
        return real(*a, **kw)
    monkeypatch.setattr(experts, "expert_source", counted)
    monkeypatch.setattr(setup, "expert_source", counted)
    for kw in (dict(experts="int4", gpu_mem=offload_budget(v3_dir, 8, "int4", ctx=128)), dict(experts="int4"), {}):
        calls.clear()
        load(v3_dir, ctx_size=128, **kw)
        assert len(calls) == 1, kw
