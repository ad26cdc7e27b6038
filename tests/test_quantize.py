"""`dsv3lite quantize`: the output directory, quantized dir == quantize-at-load, FP8 passthrough, closeness to the
original model, interrupt + --resume, and one clear line for every bad input."""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dsv3lite
from dsv3lite.cli import main
from dsv3lite.config import ModelArgs
from dsv3lite.quant import get_format
from dsv3lite.quant.checkpoint import (EXPERTS_FILE, MANIFEST, PAUSE_ENV, PROGRESS, blob_name, open_layer_blobs,
                                       quantize_checkpoint, quantize_layer_from_hf, read_manifest)
from dsv3lite.quant.fp8 import fp8_block_dequant
from dsv3lite.quant.tensorfile import DATA_ALIGN, tensor_spans

FORMATS = ["bf16", "fp8", "int4", "nf4"]
QUIET = dict(progress=False, log=lambda msg: None)


def _fmt_params():
    nf4 = pytest.mark.skipif(not _has_bnb(), reason="nf4 needs bitsandbytes")
    return [pytest.param(f, marks=nf4 if f == "nf4" else ()) for f in FORMATS]


def _has_bnb() -> bool:
    try:
        import bitsandbytes  # noqa: F401
        return True
    except ImportError:
        return False


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("quantize")


@pytest.fixture(scope="module")
def bf16_src(work):
    """Tiny DeepSeek-V3 checkpoint stored in bf16 (so the dense weights of DST equal the source's bit for bit)."""
    from dsv3lite.testing import write_checkpoint

    return write_checkpoint(work / "src-bf16", "v3", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_src(work):
    """Tiny FP8 checkpoint laid out like DeepSeek's release: FP8 projections + scale_inv, everything else bf16."""
    from dsv3lite.testing import write_checkpoint, write_fp8_copy

    bf16 = write_checkpoint(work / "src-v3fp8-bf16", "v3fp8", dtype=torch.bfloat16)
    return write_fp8_copy(bf16, work / "src-fp8")


@pytest.fixture(scope="module")
def quantized(work, bf16_src):
    """quantized(fmt) -> DST directory of bf16_src with `fmt` experts (made once per format)."""
    made = {}

    def make(fmt: str) -> Path:
        if fmt not in made:
            made[fmt] = quantize_checkpoint(bf16_src, work / f"q-{fmt}" / "dst", experts=fmt, **QUIET)
        return made[fmt]

    return make


def _load(path, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=64, progress=False, log=lambda msg: None, **kw)
    llm.stop_ids = set()                          # always generate max_tokens
    return llm


def _greedy(llm, n=8):
    prompt = llm.tokenizer.encode("To be, or not", add_bos=True)
    return [c.token_id for c in llm.generate(prompt, max_tokens=n)]


def _tokens(seed=0, length=16):
    return torch.randint(0, 400, (1, length), generator=torch.Generator().manual_seed(seed))


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


# ---- the output directory --------------------------------------------------------------------------------------

def test_output_directory_format(work, bf16_src, quantized):
    from safetensors import safe_open

    src_files = _files(bf16_src)
    dst = quantized("int4")
    assert [p.name for p in dst.parent.iterdir()] == [dst.name]        # nothing written beside DST
    assert _files(bf16_src) == src_files                              # the source is untouched
    assert not (dst / PROGRESS).exists()
    names = {p.name for p in dst.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors", EXPERTS_FILE,
            MANIFEST} <= names
    assert (dst / "config.json").read_bytes() == (bf16_src / "config.json").read_bytes()

    args = ModelArgs.from_dir(bf16_src)
    m = read_manifest(dst)
    layout = get_format("int4", 128).layout(args.moe_intermediate_size, args.hidden_size)
    assert (m.format, m.group_size, m.layout, m.dense_dtype) == ("int4", 128, layout, "bf16")
    assert m.moe_layers == args.moe_layer_ids == [1, 2] and m.n_experts == args.n_routed_experts
    assert m.source_hash.startswith("sha256:") and m.manifest_version == 1

    with safe_open(str(dst / EXPERTS_FILE), "pt") as f:              # an ordinary safetensors file
        assert set(f.keys()) == {blob_name(i) for i in m.moe_layers}
        for i in m.moe_layers:
            t = f.get_tensor(blob_name(i))
            assert t.dtype == torch.uint8 and tuple(t.shape) == (args.n_routed_experts, layout.blob_bytes)
            assert torch.equal(t, open_layer_blobs(dst, m, i))       # the mmap sees the same bytes
    assert all(s.start % DATA_ALIGN == 0 for s in tensor_spans(dst / EXPERTS_FILE).values())

    with safe_open(str(bf16_src / "model.safetensors"), "pt") as f:
        src = {n: f.get_tensor(n) for n in f.keys()}
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        out = {n: f.get_tensor(n) for n in f.keys()}
    assert set(out) == {n for n in src if ".mlp.experts." not in n}
    for name, t in out.items():
        router = name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
        assert t.dtype == (torch.float32 if router else torch.bfloat16), name
        assert torch.equal(t, src[name].to(t.dtype)), name


@pytest.mark.parametrize("fmt", _fmt_params())
@torch.no_grad()
def test_quantized_dir_equals_quantize_at_load(bf16_src, quantized, fmt):
    dst = quantized(fmt)
    m = read_manifest(dst)
    args = ModelArgs.from_dir(bf16_src)
    fmt_obj = get_format(fmt)
    for layer in m.moe_layers:
        at_load = quantize_layer_from_hf(bf16_src, args, layer, fmt_obj, m.layout)
        assert torch.equal(open_layer_blobs(dst, m, layer), at_load)
    q, hf = _load(dst), _load(bf16_src, experts=fmt)
    x = _tokens()
    assert torch.equal(q.forward(x), hf.forward(x))
    assert _greedy(q) == _greedy(hf)


@pytest.mark.parametrize("fmt,bound", [("bf16", 0.02), ("fp8", 0.08), ("int4", 0.25), ("nf4", 0.25)])
@torch.no_grad()
def test_logits_close_to_the_original_model(bf16_src, quantized, fmt, bound):
    if fmt == "nf4" and not _has_bnb():
        pytest.skip("nf4 needs bitsandbytes")
    x = _tokens(seed=1, length=24)
    ref = _load(bf16_src).forward(x)                                    # dense experts, straight from SRC
    got = _load(quantized(fmt)).forward(x)
    rel = float((got - ref).norm() / ref.norm())
    assert rel < bound, f"{fmt}: relative logit error {rel:.4f}"
    if fmt == "bf16":
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)          # same weights, another code path


def test_mtp_layer_is_quantized_and_its_shared_copies_dropped(work):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from dsv3lite.testing import add_mtp_weights, write_checkpoint

    src = write_checkpoint(work / "src-mtp", "v3", dtype=torch.bfloat16)
    add_mtp_weights(src)
    tensors = load_file(src / "model.safetensors")
    n = ModelArgs.from_dir(src).num_hidden_layers                      # the MTP layer id
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, src / "model.safetensors",
              metadata={"format": "pt"})
    dst = quantize_checkpoint(src, work / "q-mtp", experts="fp8", **QUIET)
    assert read_manifest(dst).moe_layers == [1, 2, n]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert f"model.layers.{n}.eh_proj.weight" in keys and f"model.layers.{n}.self_attn.o_proj.weight" in keys
    assert f"model.layers.{n}.embed_tokens.weight" not in keys and f"model.layers.{n}.shared_head.head.weight" not in keys
    q, hf = _load(dst), _load(src, experts="fp8")
    assert q.model.mtp is not None
    assert _greedy(q) == _greedy(hf)


# ---- FP8 sources ------------------------------------------------------------------------------------------------

def test_fp8_source_passes_through_bit_exact(work, fp8_src):
    from safetensors import safe_open

    dst = quantize_checkpoint(fp8_src, work / "q-fp8-fp8", experts="fp8", dense="fp8", **QUIET)
    m = read_manifest(dst)
    with safe_open(str(fp8_src / "model.safetensors"), "pt") as f:
        src = {n: f.get_tensor(n) for n in f.keys()}
    for layer in m.moe_layers:
        blobs = open_layer_blobs(dst, m, layer)
        for e in range(m.n_experts):
            for proj, matrix in zip(("gate_proj", "up_proj", "down_proj"), ("gate", "up", "down")):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                w = m.layout.view(blobs[e], f"{matrix}.weight")
                s = m.layout.view(blobs[e], f"{matrix}.scale")
                assert torch.equal(w.view(torch.uint8), src[name].view(torch.uint8))
                assert torch.equal(s, src[name + "_scale_inv"])
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.dtype == torch.float8_e4m3fn or name.endswith("_scale_inv"):
                assert torch.equal(t.view(torch.uint8), src[name].view(torch.uint8)), name
    # FP8 in, FP8 out: the same model as the source, to the bit
    x = _tokens(length=12)
    assert torch.equal(_load(dst).forward(x), _load(fp8_src, experts="fp8").forward(x))


def test_fp8_source_to_int4_dequantizes_the_reference_way(work, fp8_src):
    from safetensors import safe_open

    dst = quantize_checkpoint(fp8_src, work / "q-fp8-int4", experts="int4", group_size=64, **QUIET)
    m = read_manifest(dst)
    layer, e = m.moe_layers[0], m.n_experts - 1
    with safe_open(str(fp8_src / "model.safetensors"), "pt") as f:
        dense = [fp8_block_dequant(f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight"),
                                   f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{p}.weight_scale_inv"))
                 for p in ("gate_proj", "up_proj", "down_proj")]
    assert torch.equal(open_layer_blobs(dst, m, layer)[e], get_format("int4", 64).pack(*dense))


# ---- interrupt and --resume ---------------------------------------------------------------------------------------

def _start_paused(src: Path, dst: Path, *extra) -> subprocess.Popen:
    env = dict(os.environ, **{PAUSE_ENV: "1", "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "dsv3lite.cli", "quantize", str(src), str(dst), "--experts", "int4", *extra]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_first_layer(proc: subprocess.Popen, partial: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if json.loads((partial / PROGRESS).read_text())["layers_done"]:
                return
        except (OSError, ValueError, KeyError):
            pass                                # not written yet, or caught mid-write: look again
        if proc.poll() is not None:
            raise AssertionError(f"quantize exited early: {proc.communicate()[1]}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("quantize did not finish its first layer in time")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM], ids=["SIGKILL", "SIGINT", "SIGTERM"])
def test_interrupted_quantize_leaves_only_partial_and_resume_finishes_it(work, bf16_src, quantized, capsys, sig):
    dst = work / f"q-interrupted-{sig.name}"
    partial = work / (dst.name + ".partial")
    proc = _start_paused(bf16_src, dst)
    _wait_for_first_layer(proc, partial)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    if sig != signal.SIGKILL:                       # Ctrl-C, kill: one line that says how to continue
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and "--resume" in lines[0] and "Traceback" not in err, err
    assert not dst.exists() and partial.is_dir()
    assert json.loads((partial / PROGRESS).read_text())["layers_done"] == [1]

    rc = main(["quantize", str(bf16_src), str(dst), "--experts", "int4", "--resume"])
    assert rc == 0, capsys.readouterr().err
    assert not partial.exists()
    assert _files(dst) == _files(quantized("int4"))                 # identical to an uninterrupted run


def test_a_disk_that_fills_part_way_is_one_line_and_resume_finishes(work, bf16_src, quantized, capsys, monkeypatch):
    from dsv3lite.quant import tensorfile

    dst = work / "q-disk-full"
    real, calls = tensorfile._pwrite_all, []

    def fills_up(fd, data, offset):
        calls.append(offset)
        if len(calls) > 40:                         # the dense file and some experts land, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)
    monkeypatch.setattr(tensorfile, "_pwrite_all", fills_up)
    rc = main(["quantize", str(bf16_src), str(dst), "--experts", "int4"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert "No space left on device" in lines[0] and "--resume" in lines[0]
    monkeypatch.setattr(tensorfile, "_pwrite_all", real)
    assert main(["quantize", str(bf16_src), str(dst), "--experts", "int4", "--resume"]) == 0
    assert _files(dst) == _files(quantized("int4"))


def test_a_read_only_destination_is_named(work, bf16_src, capsys, monkeypatch):
    import tempfile

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    _one_line_error(capsys, ["quantize", bf16_src, work / "ro" / "dst", "--experts", "int4"], "Read-only file system")
    assert not (work / "ro" / "dst.partial").exists()


# ---- one clear line for every bad input --------------------------------------------------------------------------

def _one_line_error(capsys, argv, *needles):
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.startswith("error:")]
    assert rc != 0, err
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_bad_quantize_inputs(work, bf16_src, quantized, capsys):
    q = ["quantize"]
    _one_line_error(capsys, q + [work / "nope", work / "out", "--experts", "int4"], "not found")
    empty = work / "empty-src"
    empty.mkdir(exist_ok=True)
    _one_line_error(capsys, q + [empty, work / "out", "--experts", "int4"], "config.json")
    no_weights = work / "config-only"
    no_weights.mkdir(exist_ok=True)
    shutil.copy(bf16_src / "config.json", no_weights / "config.json")
    _one_line_error(capsys, q + [no_weights, work / "out", "--experts", "int4"], "safetensors")
    _one_line_error(capsys, q + [bf16_src, work / "out", "--experts", "int3"], "int3")
    _one_line_error(capsys, q + [bf16_src, work / "out", "--experts", "int4", "--dense", "fp8"], "FP8")
    _one_line_error(capsys, q + [bf16_src, work / "out", "--experts", "int4", "--resume"], "nothing to resume")
    _one_line_error(capsys, q + [bf16_src, bf16_src / "sub", "--experts", "int4"], "inside")
    _one_line_error(capsys, q + [bf16_src, bf16_src, "--experts", "int4"], "DST")
    _one_line_error(capsys, q + [quantized("fp8"), work / "out", "--experts", "int4"], "already")
    existing = quantized("bf16")
    _one_line_error(capsys, q + [bf16_src, existing, "--experts", "int4"], "--force")
    foreign = work / "foreign"
    foreign.mkdir(exist_ok=True)
    (foreign / "notes.txt").write_text("mine")
    _one_line_error(capsys, q + [bf16_src, foreign, "--experts", "int4", "--force"], "not replacing")
    assert (foreign / "notes.txt").read_text() == "mine"
    assert not (work / "out").exists() and not (work / "out.partial").exists()


def test_force_replaces_and_resume_checks_options(work, bf16_src, capsys):
    dst = work / "q-force"
    assert main(["quantize", str(bf16_src), str(dst), "--experts", "bf16"]) == 0
    assert main(["quantize", str(bf16_src), str(dst), "--experts", "fp8", "--force"]) == 0
    assert read_manifest(dst).format == "fp8"
    partial = work / "q-force.partial"
    proc = _start_paused(bf16_src, work / "q-force")                   # DST exists: refused before any work
    assert proc.wait(timeout=60) != 0 and not partial.exists()
    proc = _start_paused(bf16_src, dst, "--force")
    _wait_for_first_layer(proc, partial)
    proc.kill()
    proc.wait()
    assert read_manifest(dst).format == "fp8"                          # the old DST stays until the new is done
    _one_line_error(capsys, ["quantize", bf16_src, dst, "--experts", "fp8", "--force", "--resume"], "int4")
    _one_line_error(capsys, ["quantize", bf16_src, dst, "--experts", "int4"], "--force")
    capsys.readouterr()
    assert main(["quantize", str(bf16_src), str(dst), "--experts", "int4", "--force", "--resume"]) == 0
    assert read_manifest(dst).format == "int4" and not partial.exists()


def test_bad_quantized_dirs_when_loading(work, quantized, capsys):
    good = quantized("int4")
    gen = ["generate", "-p", "hi", "-m", "1", "--device", "cpu", "-w"]

    def broken(name, edit):
        d = work / f"broken-{name}"
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(good, d)
        edit(d)
        return d

    missing = broken("missing", lambda d: (d / MANIFEST).unlink())
    _one_line_error(capsys, gen + [missing], MANIFEST)
    corrupt = broken("corrupt", lambda d: (d / MANIFEST).write_text("{not json"))
    _one_line_error(capsys, gen + [corrupt], "corrupt")

    def bump(d):
        doc = json.loads((d / MANIFEST).read_text())
        doc["manifest_version"] = 99
        (d / MANIFEST).write_text(json.dumps(doc))

    _one_line_error(capsys, gen + [broken("version", bump)], "version 99")
    _one_line_error(capsys, gen + [broken("no-blobs", lambda d: (d / EXPERTS_FILE).unlink())], EXPERTS_FILE)
    _one_line_error(capsys, gen + [good, "--experts", "fp8"], "int4")
    assert main(gen + [str(good), "--experts", "int4"]) == 0             # the format it holds is fine


@pytest.mark.parametrize("columns,shows", [(100, "B/s"), (0, "layer 1 done")], ids=["terminal", "zero-width"])
def test_quantize_progress_on_a_terminal(work, columns, shows):
    """A terminal gets the bar with a rate in binary units (never "0.00 GB/s"); a zero-width terminal, where a bar
    draws nothing, gets a line per layer; both count the layers as `info` does (the demo has an MTP layer)."""
    from test_ux_chat_terminal import Terminal

    args = ModelArgs.from_dir(dsv3lite.DEMO_DIR)
    dst = work / f"progress-{columns}"
    term = Terminal([sys.executable, "-m", "dsv3lite.cli", "quantize", str(dsv3lite.DEMO_DIR), str(dst), "--experts",
                     "bf16"], dict(os.environ, COLUMNS=str(columns or "")), columns=columns)
    term.expect(f"wrote {dst}")
    assert term.close() == 0
    assert shows in term.seen and "0.00 GB/s" not in term.seen
    assert f"{len(args.moe_layer_ids)} MoE layers + the MTP layer x {args.n_routed_experts} experts" in term.seen


def test_the_first_eta_leaves_out_the_start_up():
    """The first experts carry one-off costs (cold reads, start-up): 10 s, then 0.5 s per expert. The ETA stated up
    front is the steady rate's, not the start-up's (which made it 4-15x too long)."""
    from dsv3lite.quant.checkpoint import Eta

    now = [0.0]
    eta = Eta(total=1000, warm=2, clock=lambda: now[0])
    stated = None
    for done in range(1, 1001):
        now[0] += 10.0 if done <= 2 else 0.5
        left = eta.update(done)
        if eta.first(done):
            stated, at = left, done
    assert at == 4 and stated == pytest.approx((1000 - 4) * 0.5) and eta.per_item == pytest.approx(0.5)
    one = Eta(total=1, warm=2, clock=lambda: now[0])
    assert one.first(1) and one.update(1) == 0
