"""The command line: JSON schema of `generate --json`, `info`, and one clear line for every bad input."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from dsv3lite.cli import main


def cli(capsys, *args):
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def assert_one_line_error(rc, err, *needles):
    lines = [l for l in err.strip().splitlines() if l.startswith("error:")]
    assert rc != 0
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def test_generate_json_schema(capsys, v3_dir):
    rc, out, err = cli(capsys, "generate", "-w", str(v3_dir), "-p", "hi", "-m", "5", "--json")
    assert rc == 0, err
    doc = json.loads(out)                                 # exactly one JSON object on stdout
    assert set(doc) >= {"text", "token_ids", "prompt_tokens", "finish_reason", "stats"}
    assert doc["finish_reason"] in ("stop", "length")
    assert isinstance(doc["token_ids"], list) and len(doc["token_ids"]) <= 5
    s = doc["stats"]
    assert {"prefill_tok_s", "decode_tok_s", "ttft_s", "mtp", "expert_cache"} <= set(s)
    assert s["mtp"]["enabled"] is False                    # the tiny checkpoint carries no MTP weights


def test_generate_streams_text(capsys, v3_dir):
    rc, out, err = cli(capsys, "generate", "-w", str(v3_dir), "-p", "hi", "-m", "5", "--seed", "3", "--temp", "0.7")
    assert rc == 0, err
    assert "decode" in err and "tok/s" in err             # the stats line


def test_info(capsys, v3_dir):
    rc, out, err = cli(capsys, "info", "-w", str(v3_dir))
    assert rc == 0
    assert "total" in out and "active" in out and "per token" in out
    rc, out, _ = cli(capsys, "info", "-w", str(v3_dir), "--json")
    doc = json.loads(out)
    assert doc["total_params"] > doc["active_params"] > 0


def test_size_is_echoed(capsys, v3_dir):
    rc, out, err = cli(capsys, "generate", "-w", str(v3_dir), "-p", "hi", "-m", "1", "--cpu-mem", "1GB", "--json")
    assert rc == 0, err
    assert "1,000,000,000 bytes" in err


def _damaged(tmp_path, src, how):
    dst = tmp_path / how
    shutil.copytree(src, dst)
    st = dst / "model.safetensors"
    if how == "truncated":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    elif how in ("missing", "shape"):
        from safetensors.torch import load_file, save_file
        tensors = load_file(st)
        if how == "missing":
            del tensors["model.layers.1.self_attn.kv_b_proj.weight"]
        else:
            tensors["model.layers.0.self_attn.o_proj.weight"] = tensors["model.layers.0.self_attn.o_proj.weight"][:, :10].contiguous()
        save_file(tensors, st)
    elif how == "model_type":
        cfg = json.loads((dst / "config.json").read_text())
        cfg["model_type"] = "llama"
        (dst / "config.json").write_text(json.dumps(cfg))
    elif how == "no_config":
        (dst / "config.json").unlink()
    return dst


@pytest.mark.parametrize("how,needles", [
    ("truncated", ["model.safetensors", "truncated"]),
    ("garbage", ["model.safetensors"]),
    ("missing", ["model.layers.1.self_attn.kv_b_proj.weight", "missing"]),
    ("shape", ["model.layers.0.self_attn.o_proj.weight", "(64, 10)", "(64, 64)"]),
    ("model_type", ["llama"]),
    ("no_config", ["config.json"]),
])
def test_damaged_checkpoints(capsys, tmp_path, v3_dir, how, needles):
    bad = _damaged(tmp_path, v3_dir, how)
    rc, out, err = cli(capsys, "generate", "-w", str(bad), "-p", "hi", "-m", "2")
    assert_one_line_error(rc, err, *needles)


@pytest.mark.parametrize("args,needle", [
    (["-w", "/nonexistent/dir"], "not found"),
    (["--temp", "-1"], "--temp"),
    (["--top-p", "0"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--gpu-mem", "12Q"], "cannot parse size"),
    (["-c", "1"], "--ctx-size"),
    (["--dtype", "int3"], "dtype"),
    (["--device", "tpu"], "device"),
])
def test_bad_flags(capsys, v3_dir, args, needle):
    argv = ["generate", "-p", "hi", "-m", "2"] + (args if args[0] == "-w" else ["-w", str(v3_dir)] + args)
    rc, out, err = cli(capsys, *argv)
    assert_one_line_error(rc, err, needle)


def test_prompt_over_context(capsys, v3_dir):
    rc, out, err = cli(capsys, "generate", "-w", str(v3_dir), "-c", "8", "-p", "word " * 50)
    assert_one_line_error(rc, err, "context")


def test_console_script_runs_and_fails_cleanly(v3_dir):
    from pathlib import Path

    exe = Path(sys.executable).parent / "dsv3lite"
    exe = str(exe) if exe.exists() else shutil.which("dsv3lite")
    r = subprocess.run([exe, "generate", "-w", "/no/such/dir", "-p", "x"], capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0 and r.stderr.startswith("error:")


def test_cuda_graphs_switch_reaches_the_engine(capsys, v3_dir, monkeypatch):
    """--no-cuda-graphs reaches Engine (on this CPU there are no graphs either way; `cuda_graphs` is what it gets)."""
    from dsv3lite import generate

    seen = []
    init = generate.Engine.__init__

    def spy(self, *a, **kw):
        seen.append(kw.get("cuda_graphs", True))
        init(self, *a, **kw)
    monkeypatch.setattr(generate.Engine, "__init__", spy)
    for flag, expected in (("--no-cuda-graphs", False), ("--cuda-graphs", True)):
        rc, out, err = cli(capsys, "generate", "-w", str(v3_dir), "-p", "hi", "-m", "2", flag)
        assert rc == 0, err
        assert seen.pop() is expected


def test_v4_generate_and_chat_with_its_template(capsys, monkeypatch, v4_dir):
    """A released-layout DeepSeek-V4 checkpoint through `generate --json` (its MTP block on) and `chat`, whose
    prompt is the checkpoint's chat template rendered (the engine's chat tokens)."""
    import io

    import dsv3lite
    from dsv3lite import cli as cli_module

    rc, out, err = cli(capsys, "generate", "-w", str(v4_dir), "-p", "hi", "-m", "6", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["prompt_tokens"] > 0 and len(doc["token_ids"]) <= 6 and doc["stats"]["mtp"]["enabled"] is True
    llm = dsv3lite.load(v4_dir, device="cpu", progress=False, log=lambda m: None)
    messages = [{"role": "user", "content": "hello there"}]
    ids = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
    assert llm.tokenizer.decode(ids).endswith("<｜Assistant｜>")      # the template's own markers
    want = [c.token_id for c in llm.generate(ids, max_tokens=5)]
    assert [c.token_id for c in llm.chat(messages, max_tokens=5)] == want
    seen = []
    real = cli_module._engine

    def engine(o):
        e = real(o)
        generate = e.generate
        e.generate = lambda prompt, **kw: (seen.append(list(prompt)), generate(prompt, **kw))[1]
        return e
    monkeypatch.setattr(cli_module, "_engine", engine)
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello there\n/exit\n"))
    rc, out, err = cli(capsys, "chat", "-w", str(v4_dir), "-m", "5", "--temp", "0")
    assert rc == 0, err
    assert seen and seen[0] == ids and "tok (length)" in err       # the template rendered, as the engine's chat
