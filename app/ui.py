"""The web UI (Gradio Blocks), mounted at / by the server: streaming chat with Stop, sampling settings, live stats
and a chart of expert use. It shares the server's EngineRunner, so UI replies and API requests wait in one line.

Gradio is imported here only: `dsv3lite serve --no-ui` runs without it.
"""
from __future__ import annotations

import asyncio
import hmac
import os
import time

from dsv3lite.utils import format_bytes

from .charts import bar_chart_svg, heatmap_svg
from .reasoning import ReasoningSplitter, prompt_opens_reasoning

STREAM_EVERY_S = 0.05          # the chat redraws at most this often while a reply streams
REFRESH_EVERY_S = 2.0          # the stats panel polls the server this often


def format_stats(s: dict, live: dict | None = None) -> str:
    """Markdown for the stats panel, from engine.stats() (and runner.live() while something runs)."""
    lines = []
    if live and live.get("busy"):
        rate = f" at {live['decode_tok_s']:.1f} tok/s" if live.get("decode_tok_s") else ""
        lines.append(f"**generating**: {live.get('tokens', 0)} tokens{rate}"
                     + (f", {live['queued']} waiting" if live.get("queued") else ""))
    if not s or not s.get("generated_tokens"):
        return "\n\n".join(lines + ["*No reply yet: the stats of each reply appear here.*"])
    rows = [("prefill", f"{s['prefill_tok_s']:.1f} tok/s"),
            ("decode", f"{s['decode_tok_s']:.1f} tok/s"),
            ("TTFT", f"{s['ttft_s'] * 1e3:.0f} ms"),
            ("prompt", f"{s['prompt_tokens']} tok ({s.get('cached_prompt_tokens', 0)} cached)"),
            ("reply", f"{s['generated_tokens']} tok")]
    mtp = s["mtp"]
    rows.append(("MTP", f"{mtp['acceptance_rate']:.0%} accepted, {mtp['tokens_per_forward']:.2f} tok/forward"
                 if mtp["enabled"] else f"off ({mtp.get('reason') or 'disabled'})"))
    ec = s["expert_cache"]
    if ec["hits"] or ec["prefetch_hits"] or ec["demand_misses"] or ec["cpu_experts"]:
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
    return "\n\n".join(lines + [table])


def render_chart(runner) -> str:
    """Per-layer expert-cache hit rate when experts are offloaded; otherwise the last request's routing heat map."""
    per_layer = (runner.last_stats.get("expert_cache") or {}).get("per_layer")
    if runner.engine.offload is not None and per_layer:
        layers = sorted(per_layer, key=int)
        return bar_chart_svg([str(l) for l in layers], [per_layer[l]["hit_rate"] for l in layers],
                             "expert-cache hit rate per layer (last request)")
    rec = runner.routing
    if rec is None:
        return ""
    mtp_layer = runner.engine.args.num_hidden_layers
    labels = ["MTP" if l == mtp_layer else str(l) for l in rec.layer_ids]
    if rec.last is None:
        return heatmap_svg([], labels, "tokens per expert (layer x expert), last request")
    return heatmap_svg(rec.last, labels, "tokens per expert (layer x expert), last request")


def set_mtp(engine, on: bool) -> None:
    """Turn MTP speculation on or off between generations (called on the engine's worker thread)."""
    if engine.model.mtp is None or on == engine.mtp_enabled:
        return
    if on:
        engine.mtp_valid = 0           # the MTP cache was not kept up to date while off: rebuild it
        engine.mtp_off_reason = None
    else:
        engine.mtp_off_reason = "turned off in the web UI"
    engine.mtp_enabled = on


def build_ui(runner, *, model_id: str, sampling: dict | None = None, system_prompt: str | None = None,
             reasoning: bool = False):
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    engine = runner.engine
    sampling = sampling or {}
    has_mtp = engine.model.mtp is not None
    ctx = engine.ctx_size

    async def respond(message, history, chat, system, temperature, top_p, max_tokens, mtp_on):
        message = (message or "").strip()
        if not message:
            yield gr.skip(), history, chat, gr.skip(), gr.skip()
            return
        history = history + [{"role": "user", "content": message}]
        chat = chat + [{"role": "user", "content": message}]
        yield "", history, chat, gr.skip(), gr.skip()
        messages = ([{"role": "system", "content": system}] if system and system.strip() else []) + history
        place = runner.reserve()
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
            yield gr.skip(), history[:-1], chat, gr.skip(), gr.skip()
            return
        params = dict(max_tokens=int(max_tokens), temperature=float(temperature), top_p=float(top_p),
                      top_k=sampling.get("top_k", 0), seed=sampling.get("seed"))

        def start():
            set_mtp(engine, bool(mtp_on))
            return engine.generate(ids, **params)

        job = runner.submit(place, start)
        splitter = ReasoningSplitter(prompt_opens_reasoning(text)) if reasoning else None
        thought, answer = "", ""
        base = list(chat)
        last_yield = 0.0

        def view():
            shown = list(base)
            if thought:
                shown.append({"role": "assistant", "content": thought,
                              "metadata": {"title": "Reasoning", "status": "pending" if not answer else "done"}})
            shown.append({"role": "assistant", "content": answer})
            return shown, history + [{"role": "assistant", "content": answer}]

        try:
            async for chunk in job.chunks():
                parts = [splitter.feed(chunk.text)] if splitter else [("", chunk.text)]
                if splitter and chunk.finish_reason:
                    parts.append(splitter.flush())
                for r, c in parts:
                    thought, answer = thought + r, answer + c
                if time.monotonic() - last_yield >= STREAM_EVERY_S:
                    last_yield = time.monotonic()
                    shown, hist = view()
                    yield gr.skip(), hist, shown, format_stats(runner.last_stats, runner.live()), gr.skip()
        except Exception as e:
            shown, hist = view()
            yield gr.skip(), hist, shown + [{"role": "assistant", "content": f"⚠️ {e}"}], gr.skip(), gr.skip()
            return
        finally:
            job.cancel()               # Stop pressed or page closed: the engine stops at the next token
        shown, hist = view()
        yield gr.skip(), hist, shown, format_stats(job.stats or runner.last_stats), render_chart(runner)

    def refresh(seen):
        c = runner.counters
        finished = c["completed"] + c["cancelled"] + c["failed"]     # the chart changes when a job ends
        chart = render_chart(runner) if finished != seen else gr.skip()
        return format_stats(runner.last_stats, runner.live()), chart, finished

    with gr.Blocks(title=f"dsv3lite · {model_id}") as demo:
        history = gr.State([])        # the conversation as the model sees it (no reasoning, no error notes)
        seen_finished = gr.State(-1)
        gr.Markdown(f"### dsv3lite · {model_id}\n{engine.device} · {str(engine.dtype).replace('torch.', '')} · "
                    f"context {ctx} tokens")
        with gr.Row():
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="chat", height=460, elem_id="dsv3lite-chat")
                with gr.Row():
                    box = gr.Textbox(placeholder="Message (Enter sends)", show_label=False, scale=6,
                                     elem_id="dsv3lite-input", autofocus=True)
                    send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id="dsv3lite-send")
                    stop = gr.Button("Stop", variant="stop", scale=1, min_width=80, elem_id="dsv3lite-stop")
                    clear = gr.Button("Clear", scale=1, min_width=80, elem_id="dsv3lite-clear")
                with gr.Accordion("Settings", open=False, elem_id="dsv3lite-settings"):
                    system = gr.Textbox(label="System prompt", value=system_prompt or "", lines=2)
                    temperature = gr.Slider(0.0, 2.0, value=float(sampling.get("temperature", 0.0)), step=0.05,
                                            label="Temperature (0 = greedy)")
                    top_p = gr.Slider(0.01, 1.0, value=float(sampling.get("top_p", 1.0)), step=0.01, label="Top-p")
                    max_tokens = gr.Slider(1, max(ctx - 1, 1), value=min(int(sampling.get("max_tokens", 256)), ctx - 1),
                                           step=1, label="Max tokens")
                    mtp = gr.Checkbox(value=engine.mtp_enabled, interactive=has_mtp,
                                      label="MTP speculative decoding" + ("" if has_mtp else
                                                                         " (this checkpoint has no MTP head)"))
            with gr.Column(scale=2):
                stats = gr.Markdown(format_stats(runner.last_stats), elem_id="dsv3lite-stats")
                chart = gr.HTML(render_chart(runner), elem_id="dsv3lite-chart")
        inputs = [box, history, chatbot, system, temperature, top_p, max_tokens, mtp]
        outputs = [box, history, chatbot, stats, chart]
        on_send = send.click(respond, inputs, outputs, concurrency_limit=None, show_progress="hidden")
        on_enter = box.submit(respond, inputs, outputs, concurrency_limit=None, show_progress="hidden")
        stop.click(None, cancels=[on_send, on_enter])
        clear.click(lambda: ([], []), None, [history, chatbot], cancels=[on_send, on_enter])
        chatbot.clear(lambda: [], None, [history], cancels=[on_send, on_enter])
        gr.Timer(REFRESH_EVERY_S).tick(refresh, [seen_finished], [stats, chart, seen_finished], show_progress="hidden",
                                       concurrency_limit=None)
    return demo


def mount_ui(app, runner, *, model_id: str, sampling: dict | None = None, system_prompt: str | None = None,
             reasoning: bool = False, api_key: str | None = None):
    """Mount the UI at / of `app`. With an API key, the browser asks for it (any user name, the key as password)."""
    demo = build_ui(runner, model_id=model_id, sampling=sampling, system_prompt=system_prompt, reasoning=reasoning)
    import gradio as gr

    auth = None
    if api_key is not None:
        def auth(user: str, password: str) -> bool:
            return hmac.compare_digest(password.encode(), api_key.encode())
    return gr.mount_gradio_app(app, demo, path="/", auth=auth, ssr_mode=False,
                               auth_message="Enter the server's API key as the password (any user name)."
                               if api_key else None)
