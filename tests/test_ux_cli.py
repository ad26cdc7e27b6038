"""The command line as a new user meets it: help, one-line errors before any slow work, notes that keep off the
streamed text, the stats line, sampling defaults, `plan` agreeing with the run, `info` on a quantized directory,
`trace`'s summary, and the README's test command reporting what ran."""
from __future__ import annotations

import io
import json
import os
import re
import runpy
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dsv3lite.cli as cli_module
from dsv3lite.cli import main
from dsv3lite.generate import Chunk

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def run(capsys, *args):
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def one_line_error(rc, err, *needles):
    assert rc != 0
    lines = err.strip().splitlines()
    errors = [l for l in lines if l.startswith("error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err and "Error:" not in errors[0].removeprefix("error:"), err   # no exception names
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.fixture()
def no_load(monkeypatch):
    """Fails the test if a command gets as far as loading the model."""
    def refuse(o):
        raise AssertionError("the model was loaded before the bad input was reported")
    monkeypatch.setattr(cli_module, "_engine", refuse)


def test_no_arguments_prints_help_and_exits_0(capsys):
    rc, out, err = run(capsys)
    assert rc == 0 and err == ""
    assert out.startswith("Usage: dsv3lite") and "Commands:" in out


def test_command_list_and_flags_have_whole_help_texts(capsys):
    rc, out, _ = run(capsys, "--help")
    commands = out.split("Commands:")[1].strip().splitlines()
    names = {line.split()[0] for line in commands}
    assert names == {"cache", "chat", "convert-tokenizer", "generate", "info", "plan", "quantize", "serve", "trace", "ui"}
    assert not any(line.rstrip().endswith("...") for line in commands), out
    for command, flag in (("generate", "--top-p"), ("serve", "--port"), ("ui", "--port"), ("chat", "--top-p")):
        rc, out, _ = run(capsys, command, "--help")
        text = re.search(rf"^\s+{flag}\b(.*?)(?=^\s+-)", out, re.S | re.M).group(1)
        assert re.search(r"[a-z]{4,}", text.split("[default")[0]), f"{command} {flag} has no help: {text!r}"


@pytest.mark.parametrize("content", [b"\x89\xff\xfe binary \x00\x01", b'{"model_type": "deepseek_v3",'])
@pytest.mark.parametrize("command", ["generate", "quantize", "info", "plan"])
def test_a_config_json_that_is_not_json_is_named(capsys, tmp_path, content, command):
    bad = tmp_path / "ckpt"
    bad.mkdir()
    (bad / "config.json").write_bytes(content)
    argv = {"generate": ["generate", "-w", bad, "-p", "hi"], "quantize": ["quantize", bad, tmp_path / "out",
                                                                            "--experts", "int4"],
            "info": ["info", "-w", bad], "plan": ["plan", "-w", bad, "--gpu-mem", "1G"]}[command]
    rc, out, err = run(capsys, *argv)
    one_line_error(rc, err, str(bad / "config.json"), "JSON")


def test_closed_stdin_is_one_line_before_loading(capsys, monkeypatch, no_load, v3_dir):
    monkeypatch.setattr(sys, "stdin", None)                 # what Python makes of `<&-`
    rc, _, err = run(capsys, "generate", "-w", v3_dir, "-p", "-")
    one_line_error(rc, err, "stdin", "closed")
    rc, _, err = run(capsys, "chat", "-w", v3_dir)
    one_line_error(rc, err, "stdin", "closed")


@pytest.mark.parametrize("argv", [["chat"], ["generate", "-p", "-"]])
def test_closed_stdin_in_a_real_process(v3_dir, argv):
    exe = [sys.executable, "-m", "dsv3lite.cli"]
    r = subprocess.run(exe + argv + ["-w", str(v3_dir)], capture_output=False, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(0), timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "stdin is closed" in r.stderr, r.stderr


@pytest.mark.parametrize("out,needle", [("/nonexistent/dir/t.jsonl", "/nonexistent/dir does not exist"),
                                        (".", "is a directory")])
def test_trace_output_is_checked_before_loading(capsys, no_load, v3_dir, out, needle):
    rc, _, err = run(capsys, "trace", "-w", v3_dir, "-p", "hi", "-o", out)
    one_line_error(rc, err, needle)


def test_trace_names_a_read_only_file_system(capsys, no_load, v3_dir, tmp_path, monkeypatch):
    import errno
    import tempfile

    def read_only(*a, **kw):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    monkeypatch.setattr(tempfile, "TemporaryFile", read_only)
    rc, _, err = run(capsys, "trace", "-w", v3_dir, "-p", "hi", "-o", tmp_path / "t.jsonl")
    one_line_error(rc, err, "Read-only file system")
    assert "permission" not in err


def test_sigterm_is_one_line_and_exit_143(capsys, monkeypatch, v3_dir):
    import signal

    def terminated(o):
        os.kill(os.getpid(), signal.SIGTERM)       # as `kill` or `docker stop` would, while the model loads
        time.sleep(5)
        raise AssertionError("SIGTERM did not stop the command")
    monkeypatch.setattr(cli_module, "_engine", terminated)
    rc, _, err = run(capsys, "generate", "-w", v3_dir, "-p", "hi")
    assert rc == 143 and err.strip() == "terminated (SIGTERM)"


def test_huge_seed_is_one_line(capsys, v3_dir):
    rc, _, err = run(capsys, "generate", "-w", v3_dir, "-p", "hi", "--seed", "99999999999999999999999")
    one_line_error(rc, err, "seed must be an integer from")


def test_trace_writes_and_summarises(capsys, tmp_path, v3_dir):
    out_file = tmp_path / "t.jsonl"
    rc, out, err = run(capsys, "trace", "-w", v3_dir, "-p", "hello there", "-m", "6", "-o", out_file,
                       "--trace-lookahead", "2")
    assert rc == 0, err
    lines = out_file.read_text().splitlines()
    meta = json.loads(lines[0])["meta"]
    assert f"wrote {out_file}: {len(lines) - 1} routing events" in out
    assert f"{meta['generated']} generated tokens" in out
    rows = {l.split()[0]: l.split()[1:] for l in out.splitlines() if re.match(r"^\s+(\d+|MTP)\s+\d+\s", l)}
    assert set(rows) == {str(i) for i in meta["moe_layers"]}
    assert meta["token_layers"] == []            # no layer routed by the token id (DeepSeek-V4's hash layers)
    from dsv3lite.offload.trace import read_trace
    trace = read_trace(out_file)
    layer = meta["moe_layers"][-1]               # the last layer: predicted from 1 and 2 layers back
    steps = [(step, {e for _, e in keys}) for step, keys in trace.accesses if keys and keys[0][0] == layer]
    hits = sum(len(used & trace.predictions[(step, layer)][1]) for step, used in steps)
    assert rows[str(layer)][1] == f"{hits / sum(len(u) for _, u in steps):.0%}"   # the "1 ahead" column
    assert rows[str(layer)][0] == str(len(set().union(*(u for _, u in steps))))
    progress = [l for l in err.splitlines() if l.startswith("tracing: ")]
    assert progress and progress[-1] == "tracing: 6/6 tokens"                      # no terminal: a line a quarter
    hint = out.strip().splitlines()[-1]
    assert hint.startswith("replay it") and str(out_file) in hint
    sim = Path(hint.split("python ", 1)[1].split(" --trace")[0])
    assert sim.is_file() and sim.name == "cache_sim.py"                            # (a source checkout here)


def test_the_replay_hint_of_an_installed_package(tmp_path, monkeypatch):
    monkeypatch.setattr(cli_module, "__file__", str(tmp_path / "site-packages" / "dsv3lite" / "cli.py"))
    hint = cli_module._replay_hint(tmp_path / "t.jsonl")
    assert "source tree (not installed with the package)" in hint


def _with_mid_stream_note(monkeypatch):
    real = cli_module._engine

    def engine(o):
        llm = real(o)
        for name in ("generate", "chat"):
            inner = getattr(llm, name)

            def noisy(*a, _inner=inner, **kw):
                def gen():
                    for i, chunk in enumerate(_inner(*a, **kw)):
                        if i == 2:
                            llm.log("note: MTP speculation turned off: a test notice")
                        yield chunk
                return gen()
            setattr(llm, name, noisy)
        return llm
    monkeypatch.setattr(cli_module, "_engine", engine)


def test_notes_never_land_inside_the_streamed_text(monkeypatch, v3_dir):
    _with_mid_stream_note(monkeypatch)
    terminal = io.StringIO()                       # stdout and stderr on one terminal
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    rc = main(["generate", "-w", str(v3_dir), "-p", "hi", "-m", "8", "--temp", "0.9", "--seed", "1"])
    assert rc == 0
    lines = terminal.getvalue().splitlines()
    notes = [i for i, l in enumerate(lines) if "a test notice" in l]
    assert len(notes) == 1 and lines[notes[0]].startswith("note: MTP"), lines
    assert notes[0] >= 1 and "tok/s" in lines[notes[0] + 1]          # after the text, before the stats line


def test_stats_line_has_token_count_and_finish_reason(capsys, v3_dir):
    rc, out, err = run(capsys, "generate", "-w", v3_dir, "-p", "hi", "-m", "5")
    assert rc == 0
    from dsv3lite.stats import summary
    assert "| 5 tok (length) |" in err.strip().splitlines()[-1]
    assert summary({"prompt_tokens": 3, "generated_tokens": 4, "prefill_tok_s": 1.0, "decode_tok_s": 2.0,
                    "ttft_s": 0.5, "mtp": {"enabled": False}, "expert_cache": {}}, "stop").startswith(
        "3 prompt tok | 4 tok (stop) | prefill 1.0 tok/s | decode 2.0 tok/s | TTFT 0.50s")


def test_chat_samples_by_default_and_generate_is_greedy(capsys, monkeypatch, v3_dir):
    seen = {}
    real = cli_module._engine

    def engine(o):
        seen.update(o)
        llm = real(o)
        return llm
    monkeypatch.setattr(cli_module, "_engine", engine)
    monkeypatch.setattr(sys, "stdin", io.StringIO("/exit\n"))
    assert run(capsys, "chat", "-w", v3_dir)[0] == 0
    assert seen["temp"] == cli_module.CHAT_SAMPLING["temperature"] > 0 and seen["top_p"] < 1
    assert run(capsys, "generate", "-w", v3_dir, "-p", "hi", "-m", "1")[0] == 0
    assert seen["temp"] == 0 and seen["top_p"] == 1


def test_ids_past_the_tokenizer_are_reported(capsys, monkeypatch, v3_dir):
    real = cli_module._engine

    def engine(o):
        llm = real(o)
        vocab = llm.tokenizer.vocab_size
        llm.generate = lambda *a, **kw: (c for c in [Chunk("a", 5), Chunk("", vocab + 3), Chunk("", vocab + 4, "length")])
        return llm
    monkeypatch.setattr(cli_module, "_engine", engine)
    rc, out, err = run(capsys, "generate", "-w", v3_dir, "-p", "hi", "-m", "3")
    assert rc == 0
    note = [l for l in err.splitlines() if l.startswith("note:") and "tokenizer" in l]
    assert len(note) == 1 and "2 of the 3 generated tokens" in note[0] and "print as nothing" in note[0]


def _minimum(err: str) -> str:
    return re.search(r"minimum --gpu-mem is ([0-9.]+ \w+)", err).group(1)


def test_plan_uses_the_runs_dtype_and_rules(capsys, v3_dir):
    rc, out, err = run(capsys, "plan", "-w", v3_dir, "--gpu-mem", "1M", "-c", "64", "--device", "cpu")
    assert rc != 0
    minimum = _minimum(err)
    rc, out, err = run(capsys, "generate", "-w", v3_dir, "--gpu-mem", "1M", "-c", "64", "-p", "hi", "--device", "cpu")
    assert rc != 0 and _minimum(err) == minimum          # the same refusal, the same minimum
    from dsv3lite.utils import parse_size
    at_least = str(int(parse_size(minimum.replace(" ", "").replace("iB", "")) * 1.01))
    rc, out, _ = run(capsys, "plan", "-w", v3_dir, "--gpu-mem", at_least, "-c", "64", "--device", "cpu")
    assert rc == 0 and "on cpu (float32)" in out
    rc, _, err = run(capsys, "generate", "-w", v3_dir, "--gpu-mem", at_least, "-c", "64", "-p", "hi", "-m", "2",
                     "--device", "cpu")
    assert rc == 0, err
    rc, out, err = run(capsys, "plan", "-w", v3_dir, "--gpu-mem", at_least, "-c", "64", "--device", "cpu",
                       "--dtype", "bfloat16")
    assert rc == 0 and "on cpu (bfloat16)" in out         # --dtype still chooses


def test_info_shows_the_stored_expert_bytes(capsys, tmp_path, v3_dir):
    dst = tmp_path / "int4"
    assert main(["quantize", str(v3_dir), str(dst), "--experts", "int4", "--group-size", "32"]) == 0
    capsys.readouterr()
    hf = json.loads(run(capsys, "info", "-w", v3_dir, "--json")[1])
    q = json.loads(run(capsys, "info", "-w", dst, "--json")[1])
    manifest = json.loads((dst / "dsv3lite_manifest.json").read_text())
    n_main = len([l for l in manifest["moe_layers"] if l < json.loads((dst / "config.json").read_text())[
        "num_hidden_layers"]])
    blob = manifest["layout"]["blob_bytes"]
    assert q["component_bytes"]["routed experts"] == n_main * manifest["n_experts"] * blob
    assert q["component_bytes"]["routed experts"] < hf["component_bytes"]["routed experts"] / 2    # int4 vs bf16
    assert q["component_bytes"]["embeddings"] == 2 * q["components"]["embeddings"]         # bf16, as quantize writes
    assert hf["component_bytes"]["embeddings"] == 4 * hf["components"]["embeddings"]        # fp32, as this one is
    text = run(capsys, "info", "-w", dst)[1]
    assert "int4 (group 32) routed experts" in text


def test_readme_test_command_prints_what_ran(tmp_path):
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"^(python -m pytest[^\n]*)$", readme, re.M).group(1).split()
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    r = subprocess.run([sys.executable, *command[1:], "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
                        "-p", "no:cacheprovider", str(tmp_path / "test_one.py")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"\b1 passed\b", r.stdout), r.stdout


def _plan_host_tier(out: str) -> str:
    return re.search(r"host tier: ([0-9.]+ \w+)", out).group(1)


def test_info_and_plan_agree_on_the_experts_the_host_tier_and_mtp(capsys, tmp_path, v3_dir):
    """An FP8 checkpoint's config alone (DeepSeek-V3's), and a checkpoint that declares an MTP layer it lacks."""
    script = runpy.run_path(str(ROOT / "scripts" / "memory_table.py"))
    v3 = tmp_path / "v3"
    v3.mkdir()
    (v3 / "config.json").write_text(json.dumps(script["MODELS"]["DeepSeek-V3 / R1 (671B)"]))
    info = json.loads(run(capsys, "info", "-w", v3, "--json")[1])
    rc, out, _ = run(capsys, "plan", "-w", v3, "--gpu-mem", "80G", "--device", "cuda")
    assert rc == 0 and "on cuda (bfloat16)" in out and "expert slots (" in out and ", fp8)" in out
    from dsv3lite.utils import format_bytes
    assert info["expert_format"] == "fp8" and format_bytes(info["host_tier_bytes"]) == _plan_host_tier(out) \
        == "619.65 GiB"
    assert info["mtp_layer"] and "MTP routed experts" in info["components"]
    text = run(capsys, "info", "-w", v3)[1]
    assert "619.65 GiB of fp8 routed-expert blobs" in text

    info = json.loads(run(capsys, "info", "-w", v3_dir, "--json")[1])       # declares 1 MTP layer, has none
    rc, out, _ = run(capsys, "plan", "-w", v3_dir, "--gpu-mem", "1M", "--device", "cpu", "-c", "64")
    assert not info["mtp_layer"] and "MTP routed experts" not in info["components"]
    from dsv3lite.offload.setup import plan_for
    from dsv3lite.config import ModelArgs
    import torch
    plan, _, with_mtp = plan_for(v3_dir, ModelArgs.from_dir(v3_dir), 1 << 30, 64, None, True, torch.float32)
    assert not with_mtp and plan.host_bytes == info["host_tier_bytes"]
    assert "absent from the checkpoint (MTP off)" in run(capsys, "info", "-w", v3_dir)[1]


def test_info_counts_bytes_as_stored(capsys, fp8_dirs):
    src, fp8 = fp8_dirs
    bf16_info = json.loads(run(capsys, "info", "-w", src, "--json")[1])
    fp8_info = json.loads(run(capsys, "info", "-w", fp8, "--json")[1])
    assert fp8_info["expert_format"] == "fp8" and bf16_info["expert_format"] == "bf16"
    assert "f8_e4m3" in fp8_info["stored_as"]
    files = sum(f.stat().st_size for f in fp8.glob("*.safetensors"))
    assert sum(fp8_info["component_bytes"].values()) <= files                # what the files hold, headers aside
    assert fp8_info["component_bytes"]["routed experts"] < 0.6 * bf16_info["component_bytes"]["routed experts"]


def test_plan_for_cuda_works_on_any_machine(capsys, v3_dir):
    rc, out, err = run(capsys, "plan", "-w", v3_dir, "--gpu-mem", "4G", "--device", "cuda", "-c", "64")
    assert rc == 0 and "on cuda (bfloat16)" in out and "2.50 GiB" in out      # 4 GiB less the CUDA reserve
    rc, _, err = run(capsys, "plan", "-w", v3_dir, "--gpu-mem", "auto", "--device", "cuda")
    one_line_error(rc, err, "give a size")


def test_help_imports_no_torch():
    code = "import sys\nfrom dsv3lite.cli import main\nmain(['--help'])\nprint('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip().endswith("False") and "Commands:" in r.stdout


def test_the_program_ends_when_its_command_is_done(monkeypatch, capsys):
    """Run as the program (argv None), exit handlers run and output is flushed, then the process ends at once (the
    interpreter's teardown of torch kept a finished command alive 1-3 s)."""
    import atexit

    calls = []
    monkeypatch.setattr(atexit, "_run_exitfuncs", lambda: calls.append("exit handlers"))   # (not this process's)
    monkeypatch.setattr(sys, "argv", ["dsv3lite", "--version"])

    def exit_now(rc):
        calls.append(rc)
        raise SystemExit(rc)
    monkeypatch.setattr(os, "_exit", exit_now)
    with pytest.raises(SystemExit):
        main()
    assert calls == ["exit handlers", 0] and "version" in capsys.readouterr().out
    assert main(["--version"]) == 0 and calls == ["exit handlers", 0]   # called with argv (tests, scripts): returns
