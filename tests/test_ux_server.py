"""The server as its operator sees it: one log line per request (method, path, status, tokens, time, and the reason
of an error), 405 for a known endpoint asked with the wrong method, and an idle `serve` (web UI included) that
leaves the CPU alone."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import psutil
import pytest

import dsv3lite
from dsv3lite.app.server import ServerThread, create_app
from dsv3lite.generate import Chunk

pytestmark = pytest.mark.usefixtures("one_thread")
GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def logged(v3_dir):
    llm = dsv3lite.load(v3_dir, device="cpu", ctx_size=64, progress=False, log=lambda m: None)
    llm.stop_ids = set()                       # every reply runs to max_tokens
    lines: list[str] = []
    with ServerThread(create_app(llm, ui=False, log=lines.append)) as server:
        yield server, lines, llm


def line_for(lines: list[str], needle: str, timeout: float = 10, after: int = 0) -> str:
    """The log line holding `needle` among lines[after:] (it is written as the response ends, so it may trail the
    client a little)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [l for l in lines[after:] if needle in l]
        if found:
            return found[-1]
        time.sleep(0.02)
    raise AssertionError(f"no log line with {needle!r} in {lines}")


def test_one_log_line_per_request(logged):
    server, lines, _ = logged
    r = httpx.post(server.url + "/v1/chat/completions", json=GOOD, timeout=30)
    assert r.status_code == 200
    line = line_for(lines, '"POST /v1/chat/completions" 200')
    assert " 3 tok " in line and line.endswith("s") and line.startswith("127.0.0.1:")

    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stream": True}, timeout=30)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert " 2 tok " in line_for(lines, '"POST /v1/completions" 200')     # logged when the stream has ended

    r = httpx.post(server.url + "/v1/chat/completions", json={**GOOD, "temperature": 9}, timeout=30)
    assert r.status_code == 400
    line = line_for(lines, '"POST /v1/chat/completions" 400')
    assert line.endswith(r.json()["error"]["message"]) and "'temperature'" in line     # the reason

    before = len(lines)
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    assert '"GET /health" 200' in line_for(lines, "/health")
    time.sleep(0.2)
    assert len(lines) == before + 1                                    # one line per request


def test_ids_past_the_tokenizer_are_logged(logged, monkeypatch):
    server, lines, llm = logged
    vocab = llm.tokenizer.vocab_size

    def past_vocab(ids, **kw):
        yield Chunk("a", 5)
        yield Chunk("", vocab + 1, "length")
    monkeypatch.setattr(llm, "generate", past_vocab)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200
    line = line_for(lines, "past the tokenizer")
    assert '"POST /v1/completions" 200 2 tok (1 ids past the tokenizer\'s vocabulary)' in line


def test_a_stream_its_client_left_is_logged_as_cancelled(logged, monkeypatch):
    from dsv3lite.testing import paced

    server, lines, llm = logged
    monkeypatch.setattr(llm, "generate", paced(llm.generate, 0.02))
    before = len(lines)
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 40, "stream": True},
                      timeout=30) as r:
        events = r.iter_lines()
        assert next(events).startswith("data: ")             # one token, then hang up
    line = line_for(lines, '"POST /v1/completions" 200 ', after=before)
    assert "(cancelled)" in line and " 40 tok" not in line


@pytest.mark.parametrize("method,path,allow", [("GET", "/v1/chat/completions", "POST"),
                                               ("GET", "/v1/completions", "POST"),
                                               ("POST", "/v1/models", "GET"),
                                               ("DELETE", "/v1/stats", "GET")])
def test_wrong_method_is_405_with_allow(logged, method, path, allow):
    server, lines, _ = logged
    r = httpx.request(method, server.url + path, timeout=30)
    assert r.status_code == 405 and r.headers["allow"] == allow
    err = r.json()["error"]
    assert err["code"] == "method_not_allowed" and allow in err["message"]
    assert f'"{method} {path}" 405' in line_for(lines, f'"{method} {path}"')
    assert httpx.get(server.url + "/v1/embeddings", timeout=30).status_code == 404   # unknown stays 404


def test_idle_serve_with_the_ui_uses_no_cpu(v3_dir, tmp_path):
    pytest.importorskip("gradio")
    env = dict(os.environ, HOME=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "dsv3lite.cli", "serve", "-w", str(v3_dir), "--device", "cpu",
                             "-c", "64", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=env, start_new_session=True)
    try:
        line = proc.stdout.readline()                   # "serving ... at http://..." once it accepts connections
        assert line.startswith("serving "), line
        time.sleep(1.0)                                 # start-up work (threads, imports) settles
        p = psutil.Process(proc.pid)
        window = 3.0

        def cpu_in_window() -> float:
            before = sum(p.cpu_times()[:2])
            time.sleep(window)
            return sum(p.cpu_times()[:2]) - before
        # the quieter of two windows: start-up work that runs late on a loaded machine lands in the first only,
        # a serve that polls or spins shows in both
        used = min(cpu_in_window(), cpu_in_window())
        assert used < 0.02 * window, f"an idle serve used {used / window:.1%} of a core"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_request_without_max_tokens_runs_to_the_context():
    """As llama-server's and ollama's: a request without max_tokens stops at a stop token or a full context (it
    stopped at an undocumented 256)."""
    llm = dsv3lite.load(device="cpu", ctx_size=400, mtp=False, progress=False, log=lambda m: None)   # the demo
    llm.stop_ids = set()
    with ServerThread(create_app(llm, ui=False, log=lambda m: None)) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab"}, timeout=120)
        assert r.status_code == 200, r.text
        use, choice = r.json()["usage"], r.json()["choices"][0]
        assert choice["finish_reason"] == "length" and use["total_tokens"] >= llm.ctx_size - 1
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 3}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 3


def test_serve_flags_reach_the_server(monkeypatch, v3_dir):
    from dsv3lite.app import server as server_module
    from dsv3lite.cli import main

    seen = {}
    monkeypatch.setattr(server_module, "serve", lambda load, **kw: seen.update(kw))
    assert main(["serve", "--no-ui", "-w", str(v3_dir), "--max-body", "2K"]) == 0
    assert seen["max_body_bytes"] == 2048 and seen["sampling"]["max_tokens"] is None     # no -m: to the context
    assert main(["ui", "-w", str(v3_dir), "-m", "5"]) == 0
    assert seen["max_body_bytes"] is None and seen["sampling"]["max_tokens"] == 5


def test_a_body_past_the_cap_names_the_flag(v3_dir):
    llm = dsv3lite.load(v3_dir, device="cpu", ctx_size=64, progress=False, log=lambda m: None)
    with ServerThread(create_app(llm, ui=False, max_body_bytes=2048, log=lambda m: None)) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x" * 3000, "max_tokens": 1}, timeout=30)
    assert r.status_code == 413 and "--max-body" in r.json()["error"]["message"]
