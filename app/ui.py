"""The web UI (Gradio Blocks), mounted at / by the server: streaming chat with Stop, sampling settings, live stats
and a chart of expert use. It shares the server's EngineRunner, so UI replies and API requests wait in one line.

Gradio is imported here only: `dsv3lite serve --no-ui` runs without it.
"""
from __future__ import annotations

import asyncio
import hmac
import html
import os
import time
from dataclasses import dataclass

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
import gradio as gr  # noqa: E402  (this module is imported only when the UI is served)

from dsv3lite.stats import offload_active, summary
from dsv3lite.utils import format_bytes

from .charts import bar_chart_svg, heatmap_svg
from .reasoning import ReasoningSplitter, prompt_opens_reasoning

STREAM_EVERY_S = 0.05          # the chat redraws at most this often while a reply streams
REFRESH_EVERY_S = 2.0          # the stats panel polls the server this often


def format_stats(s: dict | None, live: dict | None = None, finish: str | None = None) -> str:
    """Markdown for the stats panel: this page's last reply (engine.stats() after it, and why it ended), plus what
    the server is doing now (runner.live()) while something runs."""
    lines = []
    if live and live.get("busy"):
        rate = f" at {live['decode_tok_s']:.1f} tok/s" if live.get("decode_tok_s") else ""
        lines.append(f"**generating**: {live.get('tokens', 0)} tokens{rate}"
                     + (f", {live['queued']} waiting" if live.get("queued") else ""))
    if not s or not s.get("prompt_tokens"):
        return "\n\n".join(lines + ["*No reply yet: the stats of each reply appear here.*"])
    rows = [("prefill", f"{s['prefill_tok_s']:.1f} tok/s"),
            ("decode", f"{s['decode_tok_s']:.1f} tok/s"),
            ("TTFT", f"{s['ttft_s'] * 1e3:.0f} ms"),
            ("prompt", f"{s['prompt_tokens']} tok ({s.get('cached_prompt_tokens', 0)} cached)"),
            ("reply", f"{s['generated_tokens']} tok" + (f" ({finish})" if finish else ""))]
    mtp = s["mtp"]
    rows.append(("MTP", f"{mtp['acceptance_rate']:.0%} accepted, {mtp['tokens_per_forward']:.2f} tok/forward"
                 if mtp["enabled"] else f"off ({mtp.get('reason') or 'disabled'})"))
    ec = s["expert_cache"]
    if offload_active(s):
        rows.append(("expert cache", f"{ec['hit_rate']:.0%} hit, {ec['demand_misses']} misses, "
                                     f"{ec['cpu_experts']} on CPU, stall {ec['stall_ms']:.0f} ms"))
        rows.append(("H2D", f"{ec['h2d_gb_s']:.1f} GB/s ({format_bytes(ec['h2d_bytes'])})"))
    else:
        rows.append(("expert cache", "all experts resident"))
    mem = s.get("memory", {})
    if "gpu_peak_bytes" in mem:
        rows.append(("GPU peak", format_bytes(mem["gpu_peak_bytes"])))
    if "host_rss_bytes" in mem:
        rows.append(("host RSS", format_bytes(mem["host_rss_bytes"])))
    table = "| last reply | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
    return "\n\n".join(lines + [table, f"<small><code>{html.escape(summary(s, finish))}</code></small>"])


def render_chart(runner, job=None) -> str:
    """Per-layer expert-cache hit rate when experts are offloaded; otherwise the routing heat map of `job` (a
    finished runner Job; None: nothing to show yet)."""
    stats = job.stats if job is not None else None
    per_layer = ((stats or {}).get("expert_cache") or {}).get("per_layer")
    if runner.engine.offload is not None:
        if not per_layer:
            return ""
        layers = sorted(per_layer, key=int)
        return bar_chart_svg([str(l) for l in layers], [per_layer[l]["hit_rate"] for l in layers],
                             "expert-cache hit rate per layer (last reply)")
    rec = runner.routing
    if rec is None or job is None:
        return ""
    mtp_layer = runner.engine.args.num_hidden_layers
    labels = ["MTP" if l == mtp_layer else str(l) for l in rec.layer_ids]
    counts = job.routing if job.routing is not None else []
    return heatmap_svg(counts, labels, "tokens per expert (layer x expert), last reply")


@dataclass
class _Session:
    """One open page: its running job (for Stop), its last finished one (for the stats panel and chart) and an
    epoch that Clear bumps, so a reply still streaming into a cleared chat stops drawing there."""
    job: object = None
    last: object = None
    stop_requested: bool = False
    epoch: int = 0


def _stop_button(running: bool):
    return gr.Button(interactive=running, variant="stop" if running else "secondary")


def build_ui(runner, *, model_id: str, sampling: dict | None = None, system_prompt: str | None = None,
             reasoning: bool = False, log=None):
    engine = runner.engine
    sampling = sampling or {}
    has_mtp = engine.model.mtp is not None
    ctx = engine.ctx_size
    sessions: dict[str, _Session] = {}           # session hash (one per page load) -> its state
    mtp_choice = [engine.mtp_enabled]            # the MTP box's last value: only a change reconfigures the engine

    def session(request: gr.Request) -> _Session:
        return sessions.setdefault(request.session_hash or "", _Session())

    async def respond(message, history, chat, system, temperature, top_p, max_tokens, mtp_on, request: gr.Request):
        message = (message or "").strip()
        if not message:
            yield gr.skip(), history, chat, gr.skip(), gr.skip(), gr.skip()
            return
        me = session(request)
        me.stop_requested, epoch = False, me.epoch
        history = history + [{"role": "user", "content": message}]
        chat = chat + [{"role": "user", "content": message}]
        yield "", history, chat, gr.skip(), gr.skip(), _stop_button(True)
        messages = ([{"role": "system", "content": system}] if system and system.strip() else []) + history
        place, t0 = runner.reserve(), time.perf_counter()
        try:
            text = await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages)
            ids = await asyncio.to_thread(engine.tokenizer.encode, text)
            if len(ids) >= ctx:
                raise ValueError(f"the conversation is {len(ids)} tokens but the context holds {ctx}: press Clear")
        except BaseException as e:    # a cancelled handler must give its place up too, or the line stalls
            runner.drop(place)
            if not isinstance(e, Exception):
                raise
            chat = chat + [{"role": "assistant", "content": f"⚠️ {e}"}]
            yield gr.skip(), history[:-1], chat, gr.skip(), gr.skip(), _stop_button(False)
            return
        params = dict(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                      top_k=sampling.get("top_k", 0), seed=sampling.get("seed"))

        def start():
            if has_mtp and bool(mtp_on) != mtp_choice[0]:   # an unchanged box leaves MTP as its timer left it
                mtp_choice[0] = bool(mtp_on)
                engine.configure_mtp(enabled=bool(mtp_on), reason="turned off in the web UI")
            return engine.generate(ids, **params)

        job = me.job = runner.submit(place, start)
        if me.stop_requested or me.epoch != epoch:    # Stop or Clear came while the prompt was being prepared
            job.cancel()
        splitter = ReasoningSplitter(prompt_opens_reasoning(text)) if reasoning else None
        thought, answer = "", ""
        base = list(chat)
        last_yield = 0.0

        def view(note: str = ""):
            shown = list(base)
            if thought:
                shown.append({"role": "assistant", "content": thought,
                              "metadata": {"title": "Reasoning", "status": "pending" if not answer else "done"}})
            shown.append({"role": "assistant", "content": answer + note})
            return shown, history + [{"role": "assistant", "content": answer}]

        def current():                            # (history, chat) to show, or skips once Clear emptied them
            return view() if me.epoch == epoch else (gr.skip(), gr.skip())

        error = None
        try:
            async for chunk in job.chunks():
                parts = [splitter.feed(chunk.text)] if splitter else [("", chunk.text)]
                if splitter and chunk.finish_reason:
                    parts.append(splitter.flush())
                for r, c in parts:
                    thought, answer = thought + r, answer + c
                if time.monotonic() - last_yield >= STREAM_EVERY_S and not job.cancelled.is_set():
                    last_yield = time.monotonic()
                    shown, hist = current()
                    yield gr.skip(), hist, shown, format_stats(_last_stats(me), runner.live()), gr.skip(), gr.skip()
        except Exception as e:
            error = e
        finally:
            job.cancel()               # page closed (the handler is cancelled): the engine stops at the next token
            if me.job is job:
                me.job = None
        me.last = job
        if log is not None:
            ended = "stopped" if job.status == "cancelled" else job.finish_reason or job.status
            log(f"web UI reply: {job.tokens} tok ({ended}) in {time.perf_counter() - t0:.2f}s"
                + (f": {error}" if error is not None else ""))
        if me.epoch != epoch:          # cleared meanwhile: the chat stays empty
            yield gr.skip(), gr.skip(), gr.skip(), _panel(me), gr.skip(), _stop_button(False)
            return
        if error is not None:
            shown, hist = view()
            shown = shown + [{"role": "assistant", "content": f"⚠️ {error}"}]
        else:
            note = " *[stopped]*" if job.status == "cancelled" else ""
            if job.unknown_tokens:
                note += f" *[{job.unknown_tokens} token ids past the tokenizer's vocabulary: shown as nothing]*"
            shown, hist = view(note)
        yield gr.skip(), hist, shown, _panel(me), render_chart(runner, job), _stop_button(False)

    def _last_stats(me: _Session) -> dict | None:
        return me.last.stats if me.last is not None else None

    def _panel(me: _Session, live: dict | None = None) -> str:
        job = me.last
        if job is None:
            return format_stats(None, live)
        finish = "stopped" if job.status == "cancelled" else job.finish_reason
        return format_stats(job.stats, live, finish)

    def stop_reply(request: gr.Request):
        me = session(request)
        me.stop_requested = True
        if me.job is not None:
            me.job.cancel()            # the reply ends at the next token and is marked [stopped]
        return gr.Button(interactive=False)

    def clear_chat(request: gr.Request):
        me = session(request)
        me.epoch += 1
        if me.job is not None:
            me.job.cancel()
        return [], [], _stop_button(False)

    def refresh(request: gr.Request):
        return _panel(session(request), runner.live())

    def forget(request: gr.Request):   # the page was closed or reloaded
        me = sessions.pop(request.session_hash or "", None)
        if me is not None and me.job is not None:
            me.job.cancel()

    with gr.Blocks(title=f"dsv3lite · {model_id}") as demo:
        history = gr.State([])        # the conversation as the model sees it (no reasoning, no error notes)
        gr.Markdown(f"### dsv3lite · {model_id}\n{engine.device} · {str(engine.dtype).replace('torch.', '')} · "
                    f"context {ctx} tokens")
        with gr.Row(equal_height=False):
            with gr.Column(scale=3, min_width=300):
                chatbot = gr.Chatbot(label="chat", height=460, elem_id="dsv3lite-chat")
                box = gr.Textbox(placeholder="Message (Enter sends)", show_label=False, elem_id="dsv3lite-input",
                                 autofocus=True)
                with gr.Row(elem_id="dsv3lite-buttons"):
                    send = gr.Button("Send", variant="primary", min_width=70, elem_id="dsv3lite-send")
                    stop = gr.Button("Stop", variant="secondary", interactive=False, min_width=70,
                                     elem_id="dsv3lite-stop")
                    clear = gr.Button("Clear", min_width=70, elem_id="dsv3lite-clear")
                with gr.Accordion("Settings", open=False, elem_id="dsv3lite-settings"):
                    system = gr.Textbox(label="System prompt", value=system_prompt or "", lines=2)
                    temperature = gr.Slider(0.0, 2.0, value=float(sampling.get("temperature", 0.0)), step=0.05,
                                            label="Temperature (0 = greedy)")
                    top_p = gr.Slider(0.01, 1.0, value=float(sampling.get("top_p", 1.0)), step=0.01, label="Top-p")
                    max_tokens = gr.Slider(1, max(ctx - 1, 1),
                                           value=min(int(sampling.get("max_tokens") or ctx - 1), ctx - 1),
                                           step=1, label="Max tokens")
                    mtp = gr.Checkbox(value=engine.mtp_enabled, interactive=has_mtp,
                                      label="MTP speculative decoding" + ("" if has_mtp else
                                                                         " (this checkpoint has no MTP head)"))
            with gr.Column(scale=2, min_width=300):
                stats = gr.Markdown(format_stats(None), elem_id="dsv3lite-stats")
                chart = gr.HTML(render_chart(runner), elem_id="dsv3lite-chart")
        inputs = [box, history, chatbot, system, temperature, top_p, max_tokens, mtp]
        outputs = [box, history, chatbot, stats, chart, stop]
        gr.on([send.click, box.submit], respond, inputs, outputs, concurrency_limit=None, show_progress="hidden")
        # Stop and Clear act on the page's own job directly (not Gradio's `cancels`, which can leave the chat
        # showing an error badge when it lands early in a reply)
        stop.click(stop_reply, None, [stop], queue=False, show_progress="hidden")
        clear.click(clear_chat, None, [history, chatbot, stop], queue=False, show_progress="hidden")
        chatbot.clear(clear_chat, None, [history, chatbot, stop], queue=False, show_progress="hidden")
        gr.Timer(REFRESH_EVERY_S).tick(refresh, None, [stats], show_progress="hidden", concurrency_limit=None)
        demo.unload(forget)
    return demo


QUEUE_POLL_S = 0.05            # Gradio's queue looks for new events this often (its own value on Windows)
PROGRESS_POLL_S = 0.1          # and for progress updates this often (likewise)


def quiet_queue(demo) -> None:
    """Gradio's queue polls for work every 1 ms (and for progress every 10 ms) even with no page open: ~1,100
    event-loop wake-ups a second, 6-8% of a core for an idle server. Poll at Gradio's Windows intervals instead:
    a new event waits at most 50 ms to start (the chat redraws every STREAM_EVERY_S anyway)."""
    queue = getattr(demo, "_queue", None)
    if queue is not None and hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_POLL_S)
    if queue is not None and hasattr(queue, "progress_update_sleep_when_free"):
        queue.progress_update_sleep_when_free = max(queue.progress_update_sleep_when_free, PROGRESS_POLL_S)


def mount_ui(app, runner, *, model_id: str, sampling: dict | None = None, system_prompt: str | None = None,
             reasoning: bool = False, api_key: str | None = None, log=None):
    """Mount the UI at / of `app`. With an API key, the browser asks for it (any user name, the key as password)."""
    demo = build_ui(runner, model_id=model_id, sampling=sampling, system_prompt=system_prompt, reasoning=reasoning,
                    log=log)
    quiet_queue(demo)

    auth = None
    if api_key is not None:
        def auth(user: str, password: str) -> bool:
            return hmac.compare_digest(password.encode(), api_key.encode())
    return gr.mount_gradio_app(app, demo, path="/", auth=auth, ssr_mode=False,
                               auth_message="Enter the server's API key as the password (any user name)."
                               if api_key else None)
