"""The expert cache on disk: an HF checkpoint's experts packed once (by quantize's code) and mapped by later
launches, token-identical to quantizing at load; reused, listed and cleared; an interrupted write is resumed."""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import dsv3lite
from dsv3lite import expert_cache_dir
from dsv3lite.cli import main
from dsv3lite.errors import UserError
from dsv3lite.quant.checkpoint import EXPERTS_FILE, PAUSE_ENV, PROGRESS, quantize_checkpoint
from dsv3lite.testing import offload_budget, write_checkpoint


@pytest.fixture
def cache(tmp_path, monkeypatch):
    location = tmp_path / "expert-cache"
    monkeypatch.setenv(expert_cache_dir.ENV, str(location))
    return location


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    from dsv3lite.testing import add_mtp_weights

    return add_mtp_weights(write_checkpoint(tmp_path_factory.mktemp("cache-src") / "m", "v3"))


def load(path, lines, **kw):
    llm = dsv3lite.load(path, device="cpu", ctx_size=128, progress=False, log=lines.append, **kw)
    llm.stop_ids = set()
    return llm


def greedy(llm):
    return [c.token_id for c in llm.generate("the cache", max_tokens=10)]


def test_written_once_then_mapped_and_identical_to_quantizing_at_load(src, cache, monkeypatch, tmp_path):
    first, second = [], []
    tokens = greedy(load(src, first, experts="int4"))
    assert any(l.startswith("expert cache: writing int4") for l in first)
    (entry,) = expert_cache_dir.entries(cache)
    assert entry.format == "int4" and (entry.path / EXPERTS_FILE).is_file()
    assert not (entry.path / "model.safetensors").exists()                 # experts only: dense stays in SRC
    assert greedy(load(src, second, experts="int4")) == tokens
    assert any(l.startswith("expert cache: mapping int4") for l in second)
    assert not any("writing" in l or "quantizing" in l for l in second)
    monkeypatch.setenv(expert_cache_dir.ENV, "off")
    off = []
    assert greedy(load(src, off, experts="int4")) == tokens
    assert any("quantizing routed experts to int4 at load" in l for l in off)
    # the same bytes as `quantize` writes
    q = quantize_checkpoint(src, tmp_path / "q", experts="int4", progress=False, log=lambda m: None)
    assert (q / EXPERTS_FILE).read_bytes() == (entry.path / EXPERTS_FILE).read_bytes()


def test_offloading_an_hf_checkpoint_maps_its_cache(src, cache):
    lines = []
    llm = load(src, lines, experts="int4", gpu_mem=offload_budget(src, 8, "int4", ctx=128))
    assert llm.offload.host.mode == "mmap" and llm.stats()["expert_cache"]["host_tier"] == "mmap"
    assert len(expert_cache_dir.entries(cache)) == 1
    with pytest.raises(UserError, match="expert cache"):
        load(expert_cache_dir.entries(cache)[0].path, [])                # the cache is not a model


def test_cache_command_lists_and_clears(src, cache, capsys):
    load(src, [], experts="int4")
    load(src, [], experts="fp8")
    assert main(["cache"]) == 0
    err = capsys.readouterr().err
    assert "expert caches in" in err and ": 2," in err and "int4" in err and "fp8" in err
    assert main(["cache", "--clear"]) == 0
    assert "removed 2 expert caches" in capsys.readouterr().err
    assert expert_cache_dir.entries(cache) == [] and not any(cache.iterdir())


def test_no_room_on_disk_falls_back_to_quantizing_at_load(src, cache, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10, 10, 0))
    lines = []
    load(src, lines, experts="int4")
    assert any("do not fit" in l and "quantizing at load instead" in l for l in lines)
    assert expert_cache_dir.entries(cache) == []


def test_a_read_only_cache_serves_what_it_holds_and_else_falls_back(src, cache, monkeypatch):
    tokens = greedy(load(src, [], experts="int4"))                          # writes the int4 entry
    monkeypatch.setattr(expert_cache_dir, "write_problem", lambda d: "Read-only file system")
    lines = []
    assert greedy(load(src, lines, experts="int4")) == tokens               # mapped, as before
    assert any(l.startswith("expert cache: mapping int4") for l in lines)
    lines = []
    assert greedy(load(src, lines, experts="int8"))                         # nothing cached: quantized at load
    assert any("cannot write under" in l and "Read-only file system" in l for l in lines)
    assert any("quantizing routed experts to int8 at load" in l for l in lines)


def test_a_disk_that_fills_while_writing_falls_back(src, cache, monkeypatch):
    from dsv3lite.quant import tensorfile

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(tensorfile, "_pwrite_all", full)
    lines = []
    tokens = greedy(load(src, lines, experts="int4"))
    assert any("No space left on device" in l and "quantizing at load instead" in l for l in lines), lines
    monkeypatch.setenv(expert_cache_dir.ENV, "off")
    assert greedy(load(src, [], experts="int4")) == tokens


def test_interrupted_write_is_resumed_by_the_next_launch(src, cache, tmp_path):
    env = dict(os.environ, **{PAUSE_ENV: "1", "OMP_NUM_THREADS": "1", expert_cache_dir.ENV: str(cache)})
    cmd = [sys.executable, "-m", "dsv3lite.cli", "generate", "-w", str(src), "--experts", "int4", "-p", "hi",
           "-m", "2", "--device", "cpu"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        partials = list(cache.glob("*.partial")) if cache.is_dir() else []
        with contextlib.suppress(OSError, ValueError, KeyError):      # progress.json may be mid-write
            if partials and json.loads((partials[0] / PROGRESS).read_text())["layers_done"]:
                break
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    errors = [l for l in err.splitlines() if l.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "next launch resumes it" in errors[0], err
    assert expert_cache_dir.entries(cache) == [] and partials[0].is_dir()
    lines = []
    load(src, lines, experts="int4")
    (entry,) = expert_cache_dir.entries(cache)
    q = quantize_checkpoint(src, tmp_path / "q", experts="int4", progress=False, log=lambda m: None)
    assert (q / EXPERTS_FILE).read_bytes() == (entry.path / EXPERTS_FILE).read_bytes()
