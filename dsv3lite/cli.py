"""The `dsv3lite` command: chat, generate, info (and quantize, serve, ui, plan, trace, bench).

Bad input ends with one line on stderr and a non-zero exit; `--debug` shows the traceback.
"""
from __future__ import annotations

import json
import os
import sys
import time

import click

from .errors import UserError
from .utils import format_bytes, format_count, parse_size

EXIT_USER = 2


def log(msg: str) -> None:
    click.echo(msg, err=True)


class SizeParam(click.ParamType):
    """A byte size ('80G' = 80 GiB, '80GB' = 80e9) or 'auto'."""
    name = "size"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int) or str(value).lower() == "auto":
            return value if not isinstance(value, str) else value.lower()
        try:
            n = parse_size(value)
        except UserError as e:
            self.fail(str(e), param, ctx)
        log(f"{param.opts[-1] if param else 'size'} {value} = {n:,} bytes ({format_bytes(n)})")
        return n


SIZE = SizeParam()


def engine_options(fn):
    """Flags shared by chat, generate and serve."""
    opts = [
        click.option("--weights", "-w", type=click.Path(), default=None,
                     help="Checkpoint directory (HF safetensors or dsv3lite-quantized). Default: the bundled demo model."),
        click.option("--device", default="auto", show_default=True, help="auto | cuda | cpu"),
        click.option("--gpu-mem", type=SIZE, default=None,
                     help="Hard cap on GPU bytes (80G = 80 GiB, 80GB = 80e9, or auto). On CPU it turns on the "
                          "simulated device tier with this budget."),
        click.option("--cpu-mem", type=SIZE, default=None, help="Cap on pinned host memory for expert blobs."),
        click.option("--ctx-size", "-c", type=click.IntRange(min=2), default=None,
                     help="Context length (tokens) of the latent cache.  [default: 4096, or the model's limit]"),
        click.option("--max-tokens", "-m", type=click.IntRange(min=1), default=256, show_default=True,
                     help="Most tokens to generate per reply."),
        click.option("--temp", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     help="Sampling temperature (0 = greedy)."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off."),
        click.option("--seed", type=int, default=None, help="Sampling seed (reproducible output)."),
        click.option("--system-prompt", default=None, help="System message for chat."),
        click.option("--mtp/--no-mtp", default=True, show_default=True,
                     help="Speculative decoding with the model's own MTP head."),
        click.option("--dtype", default=None, help="bfloat16 (CUDA default) | float32 (CPU default) | float16"),
        click.option("--experts", type=click.Choice(["int4", "fp8", "nf4", "bf16"]), default=None,
                     help="Quantize an HF checkpoint's routed experts to this format at load."),
        click.option("--num-draft-tokens", type=click.IntRange(1, 3), default=1, show_default=True,
                     help="MTP draft tokens per step."),
        click.option("--lookahead", type=click.IntRange(0, 8), default=2, show_default=True,
                     help="Offloading: MoE layers ahead whose experts are predicted and prefetched."),
        click.option("--miss-policy", type=click.Choice(["auto", "fetch", "cpu"]), default="auto", show_default=True,
                     help="Offloading: a missed expert is fetched to the device or computed on the CPU "
                          "(auto: whichever the start-up cost model says is faster)."),
        click.option("--cache-policy", type=click.Choice(["decayed-lfu", "lru", "lfu"]), default="decayed-lfu",
                     show_default=True, help="Offloading: expert-slot eviction policy."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def _engine(o: dict):
    import dsv3lite

    return dsv3lite.load(weights=o["weights"], device=o["device"], gpu_mem=o["gpu_mem"], dtype=o["dtype"],
                         ctx_size=o["ctx_size"], mtp=o["mtp"], experts=o["experts"], cpu_mem=o["cpu_mem"],
                         log=log, num_draft_tokens=o["num_draft_tokens"], lookahead=o["lookahead"],
                         miss_policy=o["miss_policy"], cache_policy=o["cache_policy"])


def _sampling(o: dict) -> dict:
    return dict(max_tokens=o["max_tokens"], temperature=o["temp"], top_p=o["top_p"], top_k=o["top_k"],
                seed=o["seed"])


def stats_line(s: dict) -> str:
    """One human line: prompt/prefill/decode/TTFT, MTP and expert-cache figures when they apply."""
    parts = [f"{s['prompt_tokens']} prompt tok" + (f" ({s['cached_prompt_tokens']} cached)" if s.get("cached_prompt_tokens") else ""),
             f"prefill {s['prefill_tok_s']:.1f} tok/s", f"decode {s['decode_tok_s']:.1f} tok/s",
             f"TTFT {s['ttft_s']:.2f}s"]
    mtp = s["mtp"]
    if mtp["enabled"]:
        parts.append(f"MTP accept {mtp['acceptance_rate']:.0%} ({mtp['tokens_per_forward']:.2f} tok/fwd)")
    ec = s["expert_cache"]
    if ec["hits"] or ec["demand_misses"] or ec["cpu_experts"]:
        parts.append(f"experts hit {ec['hit_rate']:.0%}, {ec['demand_misses']} misses, "
                     f"H2D {ec['h2d_gb_s']:.1f} GB/s, stall {ec['stall_ms']:.0f} ms")
    mem = s.get("memory", {})
    if "gpu_peak_bytes" in mem:
        parts.append(f"GPU peak {format_bytes(mem['gpu_peak_bytes'])}")
    return " | ".join(parts)


def _dim(text: str) -> str:
    return f"\033[2m{text}\033[0m" if sys.stderr.isatty() else text


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(package_name="dsv3lite")
@click.pass_context
def cli(ctx, debug):
    """Run DeepSeek-V3-family MoE models on one machine whose GPU is too small for them."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


@cli.command()
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token_ids, stats) and nothing else.")
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt as a user message with the chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@engine_options
def generate(prompt, as_json, as_chat, stop, **o):
    """Complete a prompt and stream the text (or print JSON with --json)."""
    if prompt == "-":
        prompt = sys.stdin.read()
    llm = _engine(o)
    if as_chat:
        messages = ([{"role": "system", "content": o["system_prompt"]}] if o["system_prompt"] else [])
        stream = llm.chat(messages + [{"role": "user", "content": prompt}], stop=list(stop), **_sampling(o))
    else:
        stream = llm.generate(prompt, stop=list(stop), **_sampling(o))
    text, ids, finish = [], [], None
    try:
        for chunk in stream:
            text.append(chunk.text)
            if chunk.token_id is not None and not (chunk.finish_reason == "stop" and chunk.token_id in llm.stop_ids):
                ids.append(chunk.token_id)
            finish = chunk.finish_reason
            if not as_json and chunk.text:
                click.echo(chunk.text, nl=False)
                sys.stdout.flush()
    finally:
        stream.close()
    stats = llm.stats()
    if as_json:
        click.echo(json.dumps({"text": "".join(text), "token_ids": ids, "prompt_tokens": stats["prompt_tokens"],
                               "finish_reason": finish or "length", "stats": stats}))
    else:
        click.echo()
        log(_dim(stats_line(stats)))


CHAT_HELP = """commands:
  /exit        leave (Ctrl-D works too)
  /clear       forget the conversation
  /help        this text
  \"\"\"          start or end a multi-line message
Ctrl-C stops the current reply."""


def _read_message() -> str | None:
    """One user message; None on EOF. Lines between two '\"\"\"' form one multi-line message."""
    line = input(">>> ")
    if not line.strip().startswith('"""'):
        return line
    first = line.strip()[3:]
    if first.endswith('"""'):
        return first[:-3]
    lines = [first] if first else []
    while True:
        more = input("... ")
        if more.rstrip().endswith('"""'):
            lines.append(more.rstrip()[:-3])
            return "\n".join(lines)
        lines.append(more)


@cli.command()
@engine_options
def chat(**o):
    """Interactive chat in the terminal (streaming; /help for commands)."""
    llm = _engine(o)
    base = [{"role": "system", "content": o["system_prompt"]}] if o["system_prompt"] else []
    history = list(base)
    log(_dim("type /help for commands, /exit to leave"))
    while True:
        try:
            msg = _read_message()
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo()
            log("(use /exit or Ctrl-D to leave)")
            continue
        cmd = msg.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit", "/bye"):
            return
        if cmd == "/help":
            click.echo(CHAT_HELP)
            continue
        if cmd == "/clear":
            history = list(base)
            llm.reset()
            log(_dim("conversation cleared"))
            continue
        if cmd.startswith("/"):
            log(f"unknown command {cmd.split()[0]} (/help lists them)")
            continue
        history.append({"role": "user", "content": msg})
        reply = []
        stream = llm.chat(history, **_sampling(o))
        try:
            for chunk in stream:
                reply.append(chunk.text)
                click.echo(chunk.text, nl=False)
                sys.stdout.flush()
        except KeyboardInterrupt:
            log(_dim("\n[stopped]"))
        finally:
            stream.close()
        click.echo()
        history.append({"role": "assistant", "content": "".join(reply)})
        log(_dim(stats_line(llm.stats())))


@cli.command()
@click.option("--weights", "-w", type=click.Path(), default=None, help="Checkpoint directory (default: demo model).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def info(weights, as_json):
    """Config summary, parameter counts (total / active), bytes per component, KV bytes per token."""
    from .config import ModelArgs
    from .footprint import footprint
    from .runtime import resolve_weights

    root = resolve_weights(weights)
    a = ModelArgs.from_dir(root)
    fp = footprint(a)
    bpp = 2  # bytes per parameter at bf16
    comps = {"embeddings": fp.embed, "lm_head": fp.head, "attention+norms": fp.attention, "dense MLPs": fp.dense_mlp,
             "routers": fp.routers, "shared experts": fp.shared_experts, "routed experts": fp.routed_experts,
             "MTP (non-expert)": fp.mtp_dense, "MTP routed experts": fp.mtp_routed_experts}
    if as_json:
        click.echo(json.dumps({"weights": str(root), "model_type": a.model_type, "total_params": fp.total,
                               "active_params": fp.active, "components": comps,
                               "kv_bytes_per_token": a.kv_bytes_per_token}))
        return
    moe = a.moe_layer_ids
    click.echo(f"{root}\n  model_type {a.model_type}: {a.num_hidden_layers} layers ({len(moe)} MoE), hidden {a.hidden_size}, "
               f"{a.num_attention_heads} heads, vocab {a.vocab_size}")
    click.echo(f"  MLA: q_lora_rank {a.q_lora_rank}, kv_lora_rank {a.kv_lora_rank}, rope {a.qk_rope_head_dim} "
               f"({a.rope_type}{f' x{a.rope_factor:g}' if a.rope_type == 'yarn' else ''}), softmax scale {a.softmax_scale:.6f}")
    click.echo(f"  MoE: {a.n_routed_experts} routed experts of {a.moe_intermediate_size} (top-{a.num_experts_per_tok}, "
               f"{a.scoring_func}/{a.topk_method}, groups {a.n_group}/{a.topk_group}), {a.n_shared_experts} shared")
    click.echo(f"  MTP layers: {a.num_nextn_predict_layers}; FP8 checkpoint: {'yes' if a.fp8_block_size else 'no'}")
    click.echo(f"  parameters: {format_count(fp.total)} total, {format_count(fp.active)} active per token"
               + (f" (+{format_count(fp.mtp_dense + fp.mtp_routed_experts)} MTP)" if fp.mtp_dense else ""))
    click.echo("  bytes per component at bf16:")
    for k, v in comps.items():
        if v:
            click.echo(f"    {k:<20} {format_count(v):>8} params  {format_bytes(v * bpp):>12}")
    click.echo(f"  latent KV cache: {a.latent_dim} values/token/layer = {format_bytes(a.kv_bytes_per_token)} per token "
               f"(bf16, {a.num_hidden_layers} layers)")


@cli.command()
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--experts", type=click.Choice(["int4", "fp8", "nf4", "bf16"]), required=True,
              help="Format of the routed experts.")
@click.option("--group-size", type=click.Choice(["32", "64", "128"]), default="128", show_default=True,
              help="int4 group size along the input dimension.")
@click.option("--dense", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
              help="Non-expert weights: bf16, or keep an FP8 source's FP8 tensors.")
@click.option("--force", is_flag=True, help="Replace an existing DST.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from DST.partial/.")
def quantize(src, dst, experts, group_size, dense, force, resume):
    """Write SRC (HF checkpoint) to DST with routed experts as one packed blob each (expert-major)."""
    from .quant.checkpoint import quantize_checkpoint

    quantize_checkpoint(src, dst, experts=experts, group_size=int(group_size), dense=dense, force=force,
                        resume=resume, progress=True, log=log)


@cli.command()
@click.option("--weights", "-w", type=click.Path(), default=None, help="Checkpoint directory (default: demo model).")
@click.option("--gpu-mem", type=SIZE, required=True, help="Device budget to plan for (80G = 80 GiB).")
@click.option("--ctx-size", "-c", type=click.IntRange(min=2), default=None,
              help="Context length (tokens).  [default: 4096, or the model's limit]")
@click.option("--experts", type=click.Choice(["int4", "fp8", "nf4", "bf16"]), default=None,
              help="Expert format (default: the checkpoint's own).")
@click.option("--dtype", default="bfloat16", show_default=True, help="Compute dtype of the resident weights.")
@click.option("--mtp/--no-mtp", default=True, show_default=True)
def plan(weights, gpu_mem, ctx_size, experts, dtype, mtp):
    """Print what --gpu-mem buys (resident components, expert slots) from shapes alone, reading no weights."""
    import torch

    from .config import ModelArgs
    from .offload.setup import plan_for
    from .runtime import DEFAULT_CTX_SIZE, resolve_weights
    from .utils import resolve_dtype

    root = resolve_weights(weights)
    args = ModelArgs.from_dir(root)
    if ctx_size is None:
        ctx_size = min(DEFAULT_CTX_SIZE, args.max_position_embeddings)
    if gpu_mem == "auto":
        raise UserError("plan needs an explicit --gpu-mem size")
    p, *_ = plan_for(root, args, gpu_mem, ctx_size, experts, mtp, resolve_dtype(dtype, torch.device("cuda")))
    click.echo(f"plan for {root} with --gpu-mem {format_bytes(gpu_mem)}, --ctx-size {ctx_size}:")
    click.echo(p.table())


@cli.command()
@click.option("--prompt", "-p", required=True, help="Prompt text.")
@click.option("--out", "-o", type=click.Path(), required=True, help="Trace file to write (JSON lines).")
@click.option("--trace-lookahead", type=click.IntRange(1, 8), default=3, show_default=True,
              help="Record predictions made this many layers ahead.")
@engine_options
def trace(prompt, out, trace_lookahead, **o):
    """Generate, recording per-token, per-layer expert ids and router predictions (for benchmarks/cache_sim.py)."""
    from .offload.trace import TraceRecorder

    llm = _engine(o)
    rec = TraceRecorder(llm.model, trace_lookahead)
    stream = llm.generate(prompt, **_sampling(o))
    text = []
    for i, chunk in enumerate(stream):
        if i == 0:
            rec.phase = "decode"                  # events after the first token belong to decode steps
        text.append(chunk.text)
    a = llm.args
    rec.write(out, {"weights": llm.weights, "n_experts": a.n_routed_experts, "top_k": a.num_experts_per_tok,
                    "moe_layers": [m.layer_id for m in llm.model.moe_modules()], "lookahead": trace_lookahead,
                    "prompt_tokens": llm.stats()["prompt_tokens"], "generated": llm.stats()["generated_tokens"]})
    log(f"wrote {len(rec.events)} routing events to {out}")



@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (anything but loopback is reachable from other machines).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1 (and KEY to open the UI).")
@click.option("--ui/--no-ui", "with_ui", default=True, show_default=True, help="Serve the web UI at / (needs gradio).")
@engine_options
def serve(host, port, api_key, with_ui, **o):
    """OpenAI-compatible API at /v1 and the web UI at /, over one engine."""
    from .app.server import serve as run_server

    run_server(lambda: _engine(o), host=host, port=port, api_key=api_key, ui=with_ui, sampling=_sampling(o),
               system_prompt=o["system_prompt"], log=log)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (anything but loopback is reachable from other machines).")
@click.option("--port", type=click.IntRange(0, 65535), default=7860, show_default=True)
@click.option("--api-key", default=None, help="Require KEY to open the UI and on /v1.")
@engine_options
def ui(host, port, api_key, **o):
    """The web UI in your browser (open the printed URL); the OpenAI API is served alongside at /v1."""
    from .app.server import serve as run_server

    run_server(lambda: _engine(o), host=host, port=port, api_key=api_key, ui=True, sampling=_sampling(o),
               system_prompt=o["system_prompt"], log=log)

def main(argv=None) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        cli.main(args=argv, prog_name="dsv3lite", standalone_mode=False)
        return 0
    except click.exceptions.Abort:
        log("aborted")
        return 130
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        log(f"error: {e.format_message()}")
        return EXIT_USER
    except UserError as e:
        if debug:
            raise
        log(f"error: {e}")
        return EXIT_USER
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as e:   # an unexpected failure still ends in one line unless --debug
        if debug:
            raise
        log(f"error: {type(e).__name__}: {e} (run with --debug for the traceback)")
        return 1


if __name__ == "__main__":
    sys.exit(main())
