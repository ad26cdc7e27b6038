"""The OpenAI-compatible server: a real uvicorn server on 127.0.0.1 over a tiny checkpoint, driven with the official
`openai` client and raw httpx. Oracle: Engine.chat / Engine.generate run directly on the same checkpoint (greedy)."""
from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

import dsv3lite
from dsv3lite.app.reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning
from dsv3lite.app.runner import EngineRunner
from dsv3lite.app.server import ServerThread, create_app, is_loopback
from dsv3lite.generate import Chunk

CTX = 128
QUIET = dict(device="cpu", ctx_size=CTX, progress=False, log=lambda m: None)


pytestmark = pytest.mark.usefixtures("one_thread")


def load(path):
    llm = dsv3lite.load(path, **QUIET)
    llm.stop_ids = set()             # no EOS: every reply runs to its max_tokens or stop string (deterministic)
    return llm


@pytest.fixture(scope="module")
def oracle(v3_dir):
    return load(v3_dir)


@pytest.fixture(scope="module")
def llm(v3_dir):
    return load(v3_dir)


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(create_app(llm, ui=False, sampling={"max_tokens": 8}, log=lambda m: None)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_text(engine, messages, **kw) -> str:
    return "".join(c.text for c in engine.chat(messages, temperature=0.0, **kw))


def complete_text(engine, prompt, **kw) -> str:
    return "".join(c.text for c in engine.generate(prompt, temperature=0.0, **kw))


def server_stats(server) -> dict:
    return httpx.get(server.url + "/v1/stats", timeout=10).json()


# --- the API against the engine -------------------------------------------------------------------------------------

def test_models_and_health(server, client, v3_dir):
    assert [m.id for m in client.models.list().data] == [v3_dir.name]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == v3_dir.name


def test_chat_greedy_equals_engine_chat(client, oracle, v3_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be, or not to be?"}]
    want = chat_text(oracle, messages, max_tokens=7)
    r = client.chat.completions.create(model=v3_dir.name, messages=messages, max_tokens=7, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length"
    prompt_len = len(oracle.tokenizer.encode_chat(messages))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (prompt_len, 7, prompt_len + 7)

    stream = client.chat.completions.create(model=v3_dir.name, messages=messages, max_completion_tokens=7,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    assert chunks[-1].usage.prompt_tokens == prompt_len
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(server, v3_dir):
    body = {"model": v3_dir.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line for line in r.text.split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all(json.loads(e[6:])["object"] == "chat.completion.chunk" for e in events[:-1])


def test_completions_equal_engine_generate(client, oracle, v3_dir):
    want = complete_text(oracle, "The quick brown fox", max_tokens=6)
    r = client.completions.create(model=v3_dir.name, prompt="The quick brown fox", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(oracle.tokenizer.encode("The quick brown fox", add_bos=True))
    chunks = list(client.completions.create(model=v3_dir.name, prompt="The quick brown fox", max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 6
    ids = oracle.tokenizer.encode("The quick brown fox", add_bos=True)      # a prompt of token ids works too
    assert client.completions.create(model=v3_dir.name, prompt=ids, max_tokens=6, temperature=0).choices[0].text == want


def test_stop_strings(client, oracle, v3_dir):
    messages = [{"role": "user", "content": "Numbers like 12345"}]
    full = chat_text(oracle, messages, max_tokens=12)
    stop = full[3:5]
    want = chat_text(oracle, messages, max_tokens=12, stop=[stop])
    assert want == full[:full.index(stop)]
    for form in (stop, [stop, "never-appears"]):
        r = client.chat.completions.create(model=v3_dir.name, messages=messages, max_tokens=12, temperature=0,
                                           stop=form)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=v3_dir.name, messages=messages, max_tokens=12,
                                                 temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client, v3_dir):
    kw = dict(model=v3_dir.name, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=1.5,
              top_p=0.95)
    a = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=7, **kw).choices[0].message.content
    assert a == b


def test_follow_up_reuses_the_conversation_cache(client, oracle, v3_dir):
    first = [{"role": "user", "content": "Hello there"}]
    r1 = client.chat.completions.create(model=v3_dir.name, messages=first, max_tokens=6, temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model=v3_dir.name, messages=second, max_tokens=6, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens     # the whole first prompt
    assert r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens
    assert r2.choices[0].message.content == chat_text(oracle, second, max_tokens=6)


def test_eight_concurrent_clients_get_their_own_answers(server, oracle, v3_dir):
    prompts = [f"client {i} asks: what is {i} + {i}?" for i in range(8)]
    want = [chat_text(oracle, [{"role": "user", "content": p}], max_tokens=5) for p in prompts]
    assert len(set(want)) > 1

    def ask(prompt):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=v3_dir.name, messages=[{"role": "user", "content": prompt}],
                                      max_tokens=5, temperature=0)
        return r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, prompts))
    assert got == want


def test_disconnect_mid_stream_cancels_the_generation(server, llm, oracle, v3_dir, monkeypatch):
    from dsv3lite.testing import paced

    # at most 50 tok/s, so the test does not depend on this machine's speed
    monkeypatch.setattr(llm, "generate", paced(llm.generate, 0.02))
    before = server_stats(server)["server"]
    max_tokens = CTX - 20
    body = {"model": v3_dir.name, "messages": [{"role": "user", "content": "go on"}], "max_tokens": max_tokens,
            "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]                      # a few events, then hang up
            assert any(line.startswith("data: ") for line in got)
            t0 = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200   # the loop is not blocked
    deadline = time.monotonic() + 20
    while (now := server_stats(server)["server"])["cancelled"] == before["cancelled"]:
        assert time.monotonic() < deadline, "the abandoned generation was not cancelled"
        time.sleep(0.05)
    assert now["completion_tokens"] - before["completion_tokens"] < max_tokens / 2   # it stopped early
    follow_up = [{"role": "user", "content": "next"}]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={"messages": follow_up, "max_tokens": 3})
    assert time.monotonic() - t0 < 20
    assert r.status_code == 200                            # and the engine's cache was left consistent:
    assert r.json()["choices"][0]["message"]["content"] == chat_text(oracle, follow_up, max_tokens=3)


def test_runner_serves_places_in_arrival_order():
    """A request that arrived first runs first, even when a later one was ready sooner."""
    class Fake:
        model = None

        def stats(self):
            return {}

    runner = EngineRunner(Fake())
    order = []

    def start(name):
        def run():
            order.append(name)
            yield Chunk(name, 0, "stop")
        return run

    async def main():
        places = [runner.reserve() for _ in range(4)]           # four requests arrive
        jobs = {"c": runner.submit(places[2], start("c")), "a": runner.submit(places[0], start("a"))}
        runner.drop(places[3])                                  # the fourth was rejected
        await asyncio.sleep(0.1)
        assert order == ["a"]                                   # "c" waits for the second arrival
        jobs["b"] = runner.submit(places[1], start("b"))
        for name, job in jobs.items():
            assert [c.text async for c in job.chunks()] == [name]

    asyncio.run(main())
    runner.close()
    assert order == ["a", "b", "c"]


# --- bad requests ---------------------------------------------------------------------------------------------------

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path,body,status,param,code", [
    ("/v1/chat/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/chat/completions", [1, 2], 400, None, "invalid_type"),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content", None),
    ("/v1/chat/completions", {**GOOD, "model": "gpt-4o"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**GOOD, "max_tokens": "ten"}, 400, "max_tokens", None),
    ("/v1/chat/completions", {**GOOD, "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ("/v1/chat/completions", {**GOOD, "temperature": 2.5}, 400, "temperature", None),
    ("/v1/chat/completions", {**GOOD, "temperature": "hot"}, 400, "temperature", None),
    ("/v1/chat/completions", {**GOOD, "top_p": 0}, 400, "top_p", None),
    ("/v1/chat/completions", {**GOOD, "seed": 1.5}, 400, "seed", None),
    ("/v1/chat/completions", {**GOOD, "stop": 5}, 400, "stop", None),
    ("/v1/chat/completions", {**GOOD, "n": 2}, 400, "n", None),
    ("/v1/chat/completions", {**GOOD, "stream": "yes"}, 400, "stream", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 300}]}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {**GOOD, "seed": 10**23}, 400, "seed", None),
    ("/v1/chat/completions", {**GOOD, "seed": -2**64}, 400, "seed", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages[0].content",
     "invalid_unicode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udcff"}]}]}, 400,
     "messages[0].content", "invalid_unicode"),
    ("/v1/chat/completions", {**GOOD, "stop": ["a", "\ud800"]}, 400, "stop", "invalid_unicode"),
    ("/v1/chat/completions", b"[" * 100_000, 400, None, "invalid_json"),
    ("/v1/chat/completions", b'{"messages": ' + b"[" * 100_000, 400, None, "invalid_json"),
    ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}, 400, "prompt", "invalid_unicode"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": [5, 10**9]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": list(range(5, 5 + CTX))}, 400, "prompt", "context_length_exceeded"),
    ("/v1/embeddings", {"input": "hi"}, 404, None, "not_found"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    if code is not None:
        assert err["code"] == code
    if code == "context_length_exceeded":
        assert f"context holds {CTX}" in err["message"]


def test_largest_seed_is_taken(client, v3_dir):
    for seed in (2**64 - 1, -2**63):
        r = client.chat.completions.create(model=v3_dir.name, messages=GOOD["messages"], max_tokens=2, seed=seed,
                                           temperature=1.0)
        assert r.usage.completion_tokens == 2


def test_oversized_body_is_413_and_server_lives_on(server):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
    r = httpx.post(server.url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.post(server.url + "/v1/chat/completions", json=GOOD, timeout=30).status_code == 200


def test_unexpected_engine_error_is_500_and_server_lives_on(server, llm, monkeypatch):
    def broken(ids, **kw):
        raise RuntimeError("simulated fault")

    monkeypatch.setattr(llm, "generate", broken)
    r = httpx.post(server.url + "/v1/chat/completions", json=GOOD, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "simulated fault" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", json={**GOOD, "stream": True}, timeout=30)
    assert r.status_code == 200 and "simulated fault" in r.text and "[DONE]" not in r.text   # reported in-band
    monkeypatch.undo()
    assert httpx.post(server.url + "/v1/chat/completions", json=GOOD, timeout=30).status_code == 200


def test_a_shutdown_ends_replies_in_flight_with_an_error_and_done(llm, v3_dir, monkeypatch):
    """SIGINT / SIGTERM (uvicorn's handle_exit, called as the signal handler would): a running stream, a queued
    stream and a queued whole reply each end at once, saying why; the streams with [DONE]; the log says "stopped"."""
    from dsv3lite.testing import paced

    monkeypatch.setattr(llm, "generate", paced(llm.generate, 0.02))
    lines: list[str] = []
    done: dict[str, object] = {}
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": CTX - 20}
    with ServerThread(create_app(llm, ui=False, log=lines.append)) as s:
        started = []

        def stream(name, path, body):
            with httpx.stream("POST", s.url + path, json={**body, "stream": True}, timeout=30) as r:
                events = []
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        started.append(name)
                done[name] = events

        def whole():
            done["whole"] = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)

        with ThreadPoolExecutor(3) as pool:
            pool.submit(stream, "chat", "/v1/chat/completions", body)
            deadline = time.monotonic() + 20
            while "chat" not in started:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            pool.submit(stream, "completion", "/v1/completions", {"prompt": "go", "max_tokens": CTX - 20})
            pool.submit(whole)
            time.sleep(0.3)                                   # both queued behind the first
            t0 = time.monotonic()
            s.server.handle_exit(signal.SIGTERM, None)
        assert time.monotonic() - t0 < 5
    for name in ("chat", "completion"):
        *_, error, last = done[name]
        assert last == "data: [DONE]", done[name][-3:]
        assert json.loads(error.removeprefix("data: "))["error"]["code"] == "server_shutdown"
    assert done["whole"].status_code == 503 and done["whole"].json()["error"]["code"] == "server_shutdown"
    stopped = [line for line in lines if "(stopped)" in line]
    assert len(stopped) == 3, lines
    assert not any("Traceback" in line or " 500 " in line for line in lines)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_stops_gracefully_on_a_signal(v3_dir, sig):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dsv3lite.cli", "serve", "--no-ui", "-w", str(v3_dir),
                             "--port", "0", "-c", str(CTX)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert "serving" in proc.stdout.readline()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert f"{sig.name}: stopping" in err and err.rstrip().endswith("server stopped") and "Traceback" not in err


def test_api_key(llm, v3_dir):
    app = create_app(llm, api_key="sekret", ui=False, log=lambda m: None)
    with ServerThread(app) as s:
        assert httpx.get(s.url + "/health").status_code == 200                       # health stays open
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = httpx.post(s.url + "/v1/chat/completions", json=GOOD, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(s.url + "/v1/models", headers=headers).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0, timeout=60)
        r = c.chat.completions.create(model=v3_dir.name, messages=GOOD["messages"], max_tokens=2)
        assert r.usage.completion_tokens == 2


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("::")


# --- reasoning (<think>) ----------------------------------------------------------------------------------------------

SPLITS = [
    ("<think>Let me see.</think>\n\nThe answer.", False, "Let me see.", "The answer."),
    ("  <think>a < b </thin k></think>c", False, "a < b </thin k>", "c"),
    ("Plain answer with <think> inside.", False, None, "Plain answer with <think> inside."),
    ("<this is not a tag>", False, None, "<this is not a tag>"),
    ("<think>never closed", False, "never closed", ""),
    ("opened by the prompt.</think>Done.", True, "opened by the prompt.", "Done."),
    ("<thi", False, None, "<thi"),
    ("", True, None, ""),
]


@pytest.mark.parametrize("text,opened,reasoning,content", SPLITS)
def test_reasoning_splitter_on_any_chunking(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)
    cuts = range(len(text) + 1)
    for i in cuts:                                 # every split into three chunks: tags cut anywhere
        for j in cuts[i:]:
            s = ReasoningSplitter(opened)
            parts = [s.feed(text[:i]), s.feed(text[i:j]), s.feed(text[j:]), s.flush()]
            assert "".join(p[0] for p in parts) == (reasoning or "")
            assert "".join(p[1] for p in parts) == content


def test_reasoning_splitter_streams_eagerly():
    s = ReasoningSplitter()
    assert s.feed("<think>abc</") == ("abc", "")          # "</" held back: it may be the closing tag
    assert s.feed("x") == ("</x", "")
    assert s.feed("</think>\n") == ("", "")
    assert s.feed("\nanswer") == ("", "answer")
    assert prompt_opens_reasoning("<｜Assistant｜><think>\n") and not prompt_opens_reasoning("<think>a</think>")


R1_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
               "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
               "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")


def test_reasoning_content_streamed_and_whole(v3_dir, tmp_path):
    """A template that opens <think> in the prompt; the engine's output is scripted, with tags cut across chunks."""
    r1_dir = tmp_path / "r1-style"
    shutil.copytree(v3_dir, r1_dir)
    config = json.loads((r1_dir / "tokenizer_config.json").read_text())
    (r1_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": R1_TEMPLATE}))
    engine = load(r1_dir)
    pieces = ["Two plus", " two is four", ".</th", "ink>", "\n\n", "It is ", "4."]
    engine.generate = lambda ids, **kw: iter([Chunk(p, 7) for p in pieces[:-1]] + [Chunk(pieces[-1], 7, "stop")])
    with ServerThread(create_app(engine, ui=False, log=lambda m: None)) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        messages = [{"role": "user", "content": "2+2?"}]
        r = c.chat.completions.create(model="r1-style", messages=messages)
        assert r.choices[0].message.content == "It is 4."
        assert r.choices[0].message.reasoning_content == "Two plus two is four."
        chunks = list(c.chat.completions.create(model="r1-style", messages=messages, stream=True))
        deltas = [c.choices[0].delta for c in chunks]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Two plus two is four."
        assert "".join(d.content or "" for d in deltas) == "It is 4."
        assert not any("think>" in (d.content or "") + (getattr(d, "reasoning_content", None) or "")
                       for d in deltas)


# --- the command line -------------------------------------------------------------------------------------------------

def test_serve_no_ui_command_never_imports_gradio(v3_dir, tmp_path):
    """`dsv3lite serve --no-ui` end to end, with an importable 'gradio' that records any attempt to load it."""
    fake = tmp_path / "poison"
    (fake / "gradio").mkdir(parents=True)
    marker = tmp_path / "gradio-was-imported"
    (fake / "gradio" / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nraise ImportError('gradio must not be imported with --no-ui')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "dsv3lite.cli", "serve", "--no-ui", "-w", str(v3_dir),
                             "--port", "0", "-c", str(CTX), "-m", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
        url = match.group(0)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3   # -m is the default
        assert httpx.get(url + "/").status_code == 404                                  # no UI mounted
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err
    assert not marker.exists()
    assert "Traceback" not in err


def test_serve_reports_a_taken_port_in_one_line(v3_dir):
    from dsv3lite.app.server import bind_socket
    from dsv3lite.cli import main

    sock = bind_socket("127.0.0.1", 0)
    sock.listen()
    try:
        port = sock.getsockname()[1]
        assert main(["serve", "--no-ui", "-w", str(v3_dir), "--port", str(port)]) != 0
    finally:
        sock.close()


def test_v4_checkpoint_is_served(v4_dir):
    """A released-layout DeepSeek-V4 checkpoint behind the API: chat and completions (streamed and whole) equal the
    engine's greedy replies, with its MTP block speculating; the stats endpoint reports the run."""
    oracle, llm = load(v4_dir), load(v4_dir)
    messages = [{"role": "user", "content": "To be, or not to be?"}]
    want = chat_text(oracle, messages, max_tokens=8)
    with ServerThread(create_app(llm, ui=False, sampling={"max_tokens": 8}, log=lambda m: None)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.chat.completions.create(model=v4_dir.name, messages=messages, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want and r.usage.completion_tokens == 8
        chunks = list(client.chat.completions.create(model=v4_dir.name, messages=messages, max_tokens=8,
                                                     temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        text = complete_text(oracle, "The quick brown fox", max_tokens=6)
        r = client.completions.create(model=v4_dir.name, prompt="The quick brown fox", max_tokens=6, temperature=0)
        assert r.choices[0].text == text
        assert server_stats(server)["mtp"]["enabled"] is True
