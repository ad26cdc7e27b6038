"""`dsv3lite serve`: one process, one Engine, an OpenAI-compatible API under /v1 and the Gradio UI at /.

    POST /v1/chat/completions   chat (streamed as SSE chat.completion.chunk objects, or whole); R1-style <think>
                                reasoning comes back as reasoning_content
    POST /v1/completions        plain text completion (streamed or whole)
    GET  /v1/models             the one model
    GET  /v1/stats              engine.stats() of the last generation plus server counters
    GET  /health                liveness (open even with --api-key)

Generations run one at a time, in arrival order, on the EngineRunner's worker thread (app/runner.py). Because the
engine keeps the latent cache of the last conversation, a request whose messages extend the previous ones prefills
only the new tokens; usage.prompt_tokens_details.cached_tokens says how many were reused.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import signal
import socket
import sys
import threading
import time
import traceback

from dsv3lite.errors import ModelFault, UserError
from dsv3lite.generate import SamplingParams

try:
    import uvicorn
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
except ImportError as e:       # the GPU benchmark image, for one, has neither
    raise UserError(f"the server needs fastapi and uvicorn ({e.name} is missing): "
                    f"pip install fastapi uvicorn, or pip install 'dsv3lite[ui]'") from None

from .protocol import (APIError, chat_chunk, chat_response, completion_response, new_id, now, parse_chat,
                       parse_completion, usage, usage_chunk)
from .reasoning import ReasoningSplitter, prompt_opens_reasoning, split_reasoning, uses_reasoning
from .runner import EngineRunner

MAX_BODY_BYTES = 1 << 20          # larger request bodies get 413 (serve --max-body)
DRAIN_LIMIT = 64 << 20            # an oversized body is read and discarded up to this, so the client sees the 413


SHUTDOWN = APIError(503, "the server is shutting down: this reply was cut short", code="server_shutdown")


def model_name(engine) -> str:
    """The id /v1/models reports: the checkpoint directory's name, or dsv3lite-demo for the bundled model."""
    from pathlib import Path

    from dsv3lite import DEMO_DIR

    if engine.weights is None:
        return "dsv3lite"
    path = Path(engine.weights)
    with contextlib.suppress(OSError):
        if path.resolve() == DEMO_DIR.resolve():
            return "dsv3lite-demo"
    return path.name or "dsv3lite"


async def read_json(request: Request, limit: int):
    declared = request.headers.get("content-length", "")
    size, body = 0, bytearray()
    async for piece in request.stream():
        size += len(piece)
        if size <= limit and not (declared.isdigit() and int(declared) > limit):
            body += piece
        elif size > DRAIN_LIMIT:
            break
    if size > limit or (declared.isdigit() and int(declared) > limit):
        raise APIError(413, f"the request body is larger than {limit} bytes (the server's --max-body)",
                       code="request_too_large")
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "the request body nests arrays or objects too deeply", code="invalid_json") from None


class _JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends (even before the stream started)."""

    def __init__(self, job, content, **kw):
        super().__init__(content, **kw)
        self.job = job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _cancel_on_disconnect(request: Request, job) -> None:
    """For whole (non-streamed) responses: a client that goes away cancels its generation."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            job.cancel()
            return


def _as_api_error(e: BaseException, log) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ModelFault):
        log(f"error: {e}")
        return APIError(500, str(e), code="model_fault")
    if isinstance(e, UserError):
        code = "context_length_exceeded" if "context" in str(e) else "invalid_value"
        return APIError(400, str(e), code=code)
    log(f"error: unexpected {type(e).__name__} while serving a request:\n{traceback.format_exc()}")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


def create_app(engine, *, api_key: str | None = None, ui: bool = True, sampling: dict | None = None,
               system_prompt: str | None = None, reasoning: bool | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, log=None, ui_sampling: dict | None = None) -> FastAPI:
    """The FastAPI app serving `engine`. sampling: defaults for omitted request fields (max_tokens, temperature,
    top_p, top_k, seed; no max_tokens: a reply runs until it stops or fills the context); ui_sampling: what the
    web UI's settings start at instead (e.g. chat's temperature); reasoning: split <think> blocks (None: when the chat template uses them). `log` gets one line per request."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    defaults = dict(sampling or {})
    model_id = model_name(engine)
    with_reasoning = uses_reasoning(engine.tokenizer) if reasoning is None else bool(reasoning)
    runner = EngineRunner(engine, count_routing=ui and engine.offload is None)   # the UI's routing heat map
    started = time.time()
    counters = {"requests": 0, "errors_4xx": 0, "errors_5xx": 0}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        await asyncio.to_thread(runner.close)

    app = FastAPI(title="dsv3lite", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.runner, app.state.engine, app.state.model_id = runner, engine, model_id

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        counters["errors_5xx" if e.status >= 500 else "errors_4xx"] += 1
        request.state.error = e.message                       # for the access log
        headers = {**({"WWW-Authenticate": "Bearer"} if e.status == 401 else {}), **(e.headers or {})}
        return JSONResponse(e.body(), status_code=e.status, headers=headers or None)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):     # a bug answers 500 in OpenAI's shape; serving goes on
        return await api_error(request, _as_api_error(e, log))

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key (send the header 'Authorization: Bearer KEY')",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_id, "busy": runner.current is not None, "queued": runner.queued()}

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @v1.get("/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{model_id}'", "model",
                           "model_not_found")
        return _model_card()

    def _model_card() -> dict:
        return {"id": model_id, "object": "model", "created": int(started), "owned_by": "dsv3lite",
                "context_length": engine.ctx_size}

    @v1.get("/stats")
    async def stats():
        server = {"uptime_s": time.time() - started, "model": model_id, **counters, **runner.live()}
        return {**runner.last_stats, "server": server}

    async def admit(request: Request, parse, encode):
        """Take a place in line on arrival, then validate and tokenize (off the event loop) -> (place, req, ids, extra)."""
        counters["requests"] += 1
        place = runner.reserve()
        try:
            body = await read_json(request, max_body_bytes)
            req = parse(body)
            SamplingParams(**{**req.sampling, "max_tokens": req.sampling["max_tokens"] or 1})   # the engine's checks
            ids, extra = await asyncio.to_thread(encode, req)
            if not ids:
                raise APIError(400, "the prompt is empty", "prompt")
            if len(ids) >= engine.ctx_size:
                raise APIError(400, f"the prompt is {len(ids)} tokens but the context holds {engine.ctx_size} "
                               f"(shorten the prompt, or restart the server with a larger --ctx-size)",
                               "messages" if req.messages is not None else "prompt", "context_length_exceeded")
            if req.sampling["max_tokens"] is None:                # as llama-server and ollama: to the context
                req.sampling["max_tokens"] = engine.ctx_size - len(ids)
            return place, req, ids, extra
        except BaseException as e:
            runner.drop(place)
            if isinstance(e, Exception):
                raise _as_api_error(e, log) from None
            raise

    def encode_chat(req):
        text = engine.tokenizer.apply_chat_template(req.messages, add_generation_prompt=True)
        return engine.tokenizer.encode(text), with_reasoning and prompt_opens_reasoning(text)

    def encode_prompt(req):
        if isinstance(req.prompt, str):
            return engine.tokenizer.encode(req.prompt, add_bos=True), False
        return list(req.prompt), False

    def start(ids, req):
        return lambda: engine.generate(ids, **req.sampling)

    def usage_of(job, ids, n_tokens) -> dict:
        cached = (job.stats or {}).get("cached_prompt_tokens", 0)
        return usage(len(ids), n_tokens, cached)

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        place, req, ids, in_reasoning = await admit(
            request, lambda body: parse_chat(body, defaults, model_id), encode_chat)
        job = request.state.job = runner.submit(place, start(ids, req))
        rid, created = new_id("chatcmpl"), now()
        if req.stream:
            return _event_stream(job, _chat_events(job, req, ids, rid, created, in_reasoning))
        return await _whole(request, job, lambda text, finish, n: _chat_whole(job, ids, rid, created, in_reasoning,
                                                                            text, finish, n))

    def _chat_whole(job, ids, rid, created, in_reasoning, text, finish, n):
        reasoning, content = split_reasoning(text, in_reasoning) if with_reasoning else (None, text)
        return chat_response(rid, created, model_id, content, reasoning, finish, usage_of(job, ids, n), with_reasoning)

    async def _chat_events(job, req, ids, rid, created, in_reasoning):
        splitter = ReasoningSplitter(in_reasoning) if with_reasoning else None
        yield _sse(chat_chunk(rid, created, model_id, {"role": "assistant", "content": ""},
                              with_usage_field=req.include_usage))
        n, finish = 0, None
        async for chunk in job.chunks():
            n += 1
            finish = chunk.finish_reason
            parts = [splitter.feed(chunk.text)] if splitter else [("", chunk.text)]
            if splitter and finish:
                parts.append(splitter.flush())
            for reasoning, content in parts:
                delta = {k: v for k, v in (("reasoning_content", reasoning), ("content", content)) if v}
                if delta:
                    yield _sse(chat_chunk(rid, created, model_id, delta, with_usage_field=req.include_usage))
        if finish is None:                # cancelled: by the client (gone), or by a shutdown (told, then [DONE])
            for event in _stopped(job):
                yield event
            return
        yield _sse(chat_chunk(rid, created, model_id, {}, finish, with_usage_field=req.include_usage))
        if req.include_usage:
            yield _sse(usage_chunk(rid, created, model_id, "chat.completion.chunk", usage_of(job, ids, n)))
        yield "data: [DONE]\n\n"

    @v1.post("/completions")
    async def completions(request: Request):
        place, req, ids, _ = await admit(
            request, lambda body: parse_completion(body, defaults, model_id, engine.args.vocab_size), encode_prompt)
        job = request.state.job = runner.submit(place, start(ids, req))
        rid, created = new_id("cmpl"), now()
        if req.stream:
            return _event_stream(job, _completion_events(job, req, ids, rid, created))
        return await _whole(request, job, lambda text, finish, n: completion_response(
            rid, created, model_id, text, finish, usage_of(job, ids, n)))

    async def _completion_events(job, req, ids, rid, created):
        n, finish = 0, None
        async for chunk in job.chunks():
            n += 1
            finish = chunk.finish_reason
            if chunk.text or finish:
                yield _sse(completion_response(rid, created, model_id, chunk.text, finish, None,
                                               obj_usage=req.include_usage))
        if finish is None:
            for event in _stopped(job):
                yield event
            return
        if req.include_usage:
            yield _sse(usage_chunk(rid, created, model_id, "text_completion", usage_of(job, ids, n)))
        yield "data: [DONE]\n\n"

    def _stopped(job):
        """The end of a stream that a shutdown cut short: an error event, then [DONE]."""
        if job.stopped:
            yield _sse(SHUTDOWN.body())
            yield "data: [DONE]\n\n"

    def _event_stream(job, events):
        async def guarded():
            try:
                async for item in events:
                    yield item
            except Exception as e:                # after the 200 went out: report in-band, then end the stream
                err = _as_api_error(e, log)
                counters["errors_5xx" if err.status >= 500 else "errors_4xx"] += 1
                yield _sse(err.body())
            finally:                              # also on client disconnect: stop generating at once
                job.cancel()
                await events.aclose()
        return _JobStream(job, guarded(), media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _whole(request: Request, job, build):
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job))
        text, n, finish = [], 0, None
        try:
            async for chunk in job.chunks():
                text.append(chunk.text)
                n += 1
                finish = chunk.finish_reason or finish
        except Exception as e:
            raise _as_api_error(e, log) from None
        finally:
            watcher.cancel()
            job.cancel()
        if finish is None:
            raise SHUTDOWN if job.stopped else APIError(503, "the generation was cancelled", code="cancelled")
        return build("".join(text), finish, n)

    @v1.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(path: str, request: Request):
        allowed = "POST" if path in ("chat/completions", "completions") else \
            "GET" if path in ("models", "stats") or path.startswith("models/") else None
        if allowed is not None:
            raise APIError(405, f"{request.method} is not allowed on /v1/{path}: use {allowed}",
                           code="method_not_allowed", headers={"Allow": allowed})
        raise APIError(404, f"no such endpoint: /v1/{path}", code="not_found")

    app.include_router(v1)
    app.add_middleware(AccessLog, log=log)
    if ui:
        from .ui import mount_ui

        app = mount_ui(app, runner, model_id=model_id, sampling={**defaults, **(ui_sampling or {})},
                       system_prompt=system_prompt, reasoning=with_reasoning, api_key=api_key, log=log)
    return app


class AccessLog:
    """One line per API request, as uvicorn's access log writes them, plus the tokens generated and, for an error,
    its reason: `127.0.0.1:50312 "POST /v1/chat/completions" 200 12 tok 0.53s`. The web UI's own traffic (pages,
    assets, Gradio's queue) is logged only when it fails; its replies are logged by the UI."""

    def __init__(self, app, log):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [None]
        state = scope.setdefault("state", {})

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        except Exception as e:                 # answered by the app's 500 handler, outside this middleware
            status[0] = status[0] or 500
            state.setdefault("error", f"internal error: {type(e).__name__}: {e}")
            raise
        finally:
            path = scope.get("path", "")
            if path.startswith("/v1/") or path == "/health" or (status[0] or 500) >= 400:
                self.log(_access_line(scope, status[0], time.perf_counter() - t0, state))


def _access_line(scope, status, seconds: float, state: dict) -> str:
    client = scope.get("client")
    who = f"{client[0]}:{client[1]} " if client else ""
    line = f'{who}"{scope.get("method", "?")} {scope.get("path", "")}" {status or "-"}'
    job = state.get("job")
    if job is not None:
        line += f" {job.tokens} tok"
        outcome = job.outcome()
        if outcome != "done":
            line += f" ({outcome})"
        if job.unknown_tokens:
            line += f" ({job.unknown_tokens} ids past the tokenizer's vocabulary)"
    line += f" {seconds:.2f}s"
    if state.get("error"):
        line += f": {state['error']}"
    return line


# --- running it ----------------------------------------------------------------------------------------------------

def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now (before loading weights) so a taken port fails at once, with one clear line."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"cannot resolve --host {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}"
                        + (" (another server is using this port; pick another with --port)"
                           if e.errno in (48, 98) else "")) from None
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app, on_started=None, on_signal=None):
    """uvicorn's server. On SIGINT or SIGTERM it stops gracefully: `on_signal(name)`, the runner cuts its replies
    short (streams end with an error event and [DONE]), and the process then exits normally instead of re-raising
    the signal."""
    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if self.started and on_started is not None:
                on_started()

        def handle_exit(self, sig, frame):
            if not self.should_exit:
                if on_signal is not None:
                    on_signal(signal.Signals(sig).name)
                app.state.runner.stop()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    return Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=3,
                                 lifespan="on"))


def serve(load_engine, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, ui: bool = True,
          sampling: dict | None = None, system_prompt: str | None = None, log=None,
          ui_sampling: dict | None = None, max_body_bytes: int | None = None) -> None:
    """Bind, load the engine (load_engine()), print where to go, serve until Ctrl-C (one log line per request)."""
    import click

    log = log or (lambda msg: print(msg, file=sys.stderr))
    if ui:
        try:
            import gradio  # noqa: F401  (checked before the weights load; the UI imports it for real)
        except ImportError:
            raise UserError("the web UI needs gradio (pip install 'dsv3lite[ui]'); or serve the API alone "
                            "with --no-ui") from None
    sock = bind_socket(host, port)
    port = sock.getsockname()[1]
    engine = load_engine()
    app = create_app(engine, api_key=api_key, ui=ui, sampling=sampling, system_prompt=system_prompt, log=log,
                     ui_sampling=ui_sampling, max_body_bytes=max_body_bytes or MAX_BODY_BYTES)
    if not is_loopback(host):
        log(f"warning: listening on {host}, reachable from other machines"
            + ("" if api_key else "; anyone who can reach it can use the model (consider --api-key)"))
    shown = host if is_loopback(host) or host not in ("0.0.0.0", "::", "[::]") else "127.0.0.1"
    shown = f"[{shown}]" if ":" in shown and not shown.startswith("[") else shown
    url = f"http://{shown}:{port}"

    def announce():                       # once the server accepts connections
        click.echo(f"serving {app.state.model_id} at {url}  (OpenAI API: {url}/v1"
                   + (f", web UI: {url}/" if ui else "") + ")  Ctrl-C stops")
        sys.stdout.flush()

    def on_signal(name):
        log(f"{name}: stopping (replies in flight end with an error event)")

    _uvicorn_server(app, announce, on_signal).run(sockets=[sock])
    log("server stopped")


class ServerThread:
    """The server on a background thread (tests, notebooks): `with ServerThread(app) as s: s.url ...`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.sock = bind_socket(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = _uvicorn_server(app)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True,
                                       name="dsv3lite-server")

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
