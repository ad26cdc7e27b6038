"""The `dsv3lite` command: chat, generate, serve, ui, info, plan, quantize, trace, convert-tokenizer, cache.

Bad input ends with one line on stderr and a non-zero exit; `--debug` shows the traceback.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

import click

from .console import console, dim, input_text, log, unknown_ids_note
from .errors import Terminated, UserError
from .offload.options import MISS_POLICIES, OffloadOptions
from .offload.policy import POLICIES
from .footprint import DENSE_DTYPES
from .quant.table import FORMATS, INT4_GROUP_SIZES as GROUP_SIZES
from .stats import summary
from .utils import format_bytes, format_count, parse_size, write_problem

OFFLOAD_DEFAULTS = OffloadOptions()

EXIT_USER = 2


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


THREADS_OPTION = click.option(
    "--threads", "-t", type=click.IntRange(min=1), default=None,
    help="Threads of every parallel region (torch, the CPU kernels, the offloading CPU worker).  [default: the "
         "physical cores; CPU decode steps then use fewer while other programs hold cores]")


def _set_threads(threads: int | None) -> None:
    """--threads N, or the physical cores, for every parallel region from here on."""
    from . import threads as thread_rules

    thread_rules.apply(thread_rules.resolve(threads))


CHAT_SAMPLING = {"temperature": 0.8, "top_p": 0.95}   # chat (terminal and web UI) samples; scripted runs are greedy


def engine_options(temp: float = 0.0, top_p: float = 1.0):
    """Flags shared by chat, generate, serve and trace; `temp` and `top_p` are the command's defaults."""
    opts = [
        click.option("--weights", "-w", type=click.Path(), default=None,
                     help="Checkpoint directory (HF safetensors or dsv3lite-quantized). Default: the bundled demo model."),
        click.option("--device", default="auto", show_default=True, help="auto | cuda | cpu"),
        click.option("--gpu-mem", type=SIZE, default=None,
                     help="Hard cap on GPU bytes (80G = 80 GiB, 80GB = 80e9, or auto). On CPU it turns on the "
                          "simulated device tier with this budget."),
        click.option("--cpu-mem", type=SIZE, default=None,
                     help="Cap on host memory for expert blobs. With a GPU: pin the most used experts up to it, "
                          "serve the rest from the mapped file. On CPU: bound the mapped experts' resident pages."),
        click.option("--ctx-size", "-c", type=click.IntRange(min=2), default=None,
                     help="Context length (tokens) of the latent cache.  [default: 4096, or the model's limit]"),
        click.option("--max-tokens", "-m", type=click.IntRange(min=1), default=256, show_default=True,
                     help="Most tokens to generate per reply."),
        click.option("--temp", type=click.FloatRange(min=0), default=temp, show_default=True,
                     help="Sampling temperature (0 = greedy)."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=top_p, show_default=True,
                     help="Nucleus sampling: draw from the smallest set of tokens whose probabilities sum to P "
                          "(1 = off)."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off."),
        click.option("--seed", type=int, default=None, help="Sampling seed (reproducible output)."),
        click.option("--system-prompt", default=None, help="System message for chat."),
        click.option("--mtp/--no-mtp", default=True, show_default=True,
                     help="Speculative decoding with the model's own MTP head."),
        click.option("--dtype", default=None, help="bfloat16 (CUDA default) | float32 (CPU default) | float16"),
        click.option("--experts", type=click.Choice(FORMATS), default=None,
                     help="Quantize an HF checkpoint's routed experts to this format at load."),
        click.option("--dense", type=click.Choice(DENSE_DTYPES), default=None,
                     help="Pack the non-expert weights (attention, dense MLPs, shared experts, lm_head) to this "
                          "dtype as they load: on CPU computed by the CPU kernels, on a GPU by the W8A16 / W4A16 "
                          "kernels (fp8 | int4 | bf16). A CUDA run of an FP8 checkpoint picks fp8 when its budget "
                          "needs it."),
        click.option("--num-draft-tokens", type=click.IntRange(1, 3), default=1, show_default=True,
                     help="MTP draft tokens per step."),
        click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                     help="On a GPU, replay decode steps from CUDA graphs (--no-cuda-graphs: launch them eagerly)."),
        click.option("--lookahead", type=click.IntRange(0, 8), default=OFFLOAD_DEFAULTS.lookahead, show_default=True,
                     help="Offloading: MoE layers ahead whose experts are predicted and prefetched."),
        click.option("--miss-policy", type=click.Choice(MISS_POLICIES), default=OFFLOAD_DEFAULTS.miss_policy,
                     show_default=True,
                     help="Offloading: a missed expert is fetched to the device or computed on the CPU "
                          "(auto: whichever the start-up cost model says is faster)."),
        click.option("--cache-policy", type=click.Choice(list(POLICIES)), default=OFFLOAD_DEFAULTS.cache_policy,
                     show_default=True, help="Offloading: expert-slot eviction policy."),
        click.option("--cpu-threads", type=click.IntRange(0, 4096), default=OFFLOAD_DEFAULTS.cpu_threads,
                     help="Offloading: threads computing misses on the CPU (default 0: --threads less one, the "
                          "main thread's)."),
        THREADS_OPTION,
    ]

    def decorate(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn
    return decorate


def _engine(o: dict):
    import dsv3lite

    _set_threads(o["threads"])
    return dsv3lite.load(weights=o["weights"], device=o["device"], gpu_mem=o["gpu_mem"], dtype=o["dtype"],
                         ctx_size=o["ctx_size"], mtp=o["mtp"], experts=o["experts"], cpu_mem=o["cpu_mem"],
                         dense=o["dense"], log=log, num_draft_tokens=o["num_draft_tokens"],
                         cuda_graphs=o["cuda_graphs"], lookahead=o["lookahead"],
                         miss_policy=o["miss_policy"], cache_policy=o["cache_policy"], cpu_threads=o["cpu_threads"],
                         threads=o["threads"])


def _sampling(o: dict) -> dict:
    return dict(max_tokens=o["max_tokens"], temperature=o["temp"], top_p=o["top_p"], top_k=o["top_k"],
                seed=o["seed"])


def _stdin_text(what: str) -> str:
    """All of stdin, or a UserError when there is none to read (closed, as with `<&-`)."""
    if sys.stdin is None or sys.stdin.closed:
        raise UserError(f"{what} reads stdin, but stdin is closed")
    try:
        text = sys.stdin.read()
    except (OSError, ValueError) as e:
        raise UserError(f"{what} cannot read stdin: {e}") from None
    return input_text(text, "stdin")


class _Group(click.Group):
    """The top-level command: with no arguments it prints its help and exits 0."""

    def parse_args(self, ctx, args):
        if not args:
            click.echo(ctx.get_help())
            ctx.exit(0)
        return super().parse_args(ctx, args)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.version_option(package_name="dsv3lite")
@click.pass_context
def cli(ctx, debug):
    """Run DeepSeek-V3-family MoE models on one machine whose GPU is too small for them."""
    ctx.ensure_object(dict)
    ctx.obj["debug"] = debug


@cli.command(short_help="Complete a prompt (streamed text, or --json).")
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, token_ids, stats) and nothing else.")
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt as a user message with the chat template.")
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@engine_options()
def generate(prompt, as_json, as_chat, stop, **o):
    """Complete a prompt and stream the text (or print JSON with --json)."""
    if prompt == "-":
        prompt = _stdin_text("--prompt -")
    llm = _engine(o)
    if as_chat:
        messages = ([{"role": "system", "content": o["system_prompt"]}] if o["system_prompt"] else [])
        stream = llm.chat(messages + [{"role": "user", "content": prompt}], stop=list(stop), **_sampling(o))
    else:
        stream = llm.generate(prompt, stop=list(stop), **_sampling(o))
    text, ids, finish = [], [], None
    with contextlib.ExitStack() as streaming:
        if not as_json:
            streaming.enter_context(console.stream())
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
    note = unknown_ids_note(ids, llm)
    if note:
        log(note)
    if as_json:
        click.echo(json.dumps({"text": "".join(text), "token_ids": ids, "prompt_tokens": stats["prompt_tokens"],
                               "finish_reason": finish or "length", "stats": stats}))
    else:
        log(dim(summary(stats, finish or "length")))


@cli.command(short_help="Chat in the terminal (streaming, line editing).")
@engine_options(temp=CHAT_SAMPLING["temperature"], top_p=CHAT_SAMPLING["top_p"])
def chat(**o):
    """Interactive chat in the terminal: streaming replies, readline editing and history, /help for commands.
    Samples by default (--temp 0 for greedy replies)."""
    if sys.stdin is None or sys.stdin.closed:
        raise UserError("chat reads messages from stdin, but stdin is closed")
    from .chat_repl import chat_loop

    llm = _engine(o)
    chat_loop(llm, _sampling(o), [{"role": "system", "content": o["system_prompt"]}] if o["system_prompt"] else [])


@cli.command(short_help="Config, parameter counts, bytes per component.")
@click.option("--weights", "-w", type=click.Path(), default=None, help="Checkpoint directory (default: demo model).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--dense", type=click.Choice(DENSE_DTYPES), default=None,
              help="Count the non-expert weights as a run with --dense packs them.")
def info(weights, as_json, dense):
    """Config summary, parameter counts (total / active), bytes per component as stored, KV bytes per token, and
    the host tier of routed-expert blobs (the same code as `plan`)."""
    from .builder import resolve_weights
    from .family import family_of
    from .inventory import inventory

    root = resolve_weights(weights)
    inv = inventory(root, dense)
    a, fp, tier = inv.args, inv.footprint, inv.tier
    family = family_of(a)
    if as_json:
        click.echo(json.dumps({"weights": str(root), "model_type": a.model_type, "total_params": fp.total,
                               "active_params": fp.active, "components": inv.params, "component_bytes": inv.bytes,
                               "stored_as": inv.stored, "kv_bytes_per_token": a.kv_bytes_per_token,
                               "host_tier_bytes": inv.host_tier_bytes, "expert_format": tier.source.fmt.name,
                               "mtp_layer": tier.with_mtp, **family.info_json(a)}))
        return
    click.echo(str(root))
    for line in family.info_lines(a, tier.with_mtp):
        click.echo(line)
    click.echo(f"  parameters: {format_count(fp.total)} total, {format_count(fp.active)} active per token"
               + (f" (+{format_count(fp.mtp_dense + fp.mtp_routed_experts)} MTP)" if tier.with_mtp else ""))
    click.echo(f"  bytes per component ({inv.stored}):")
    for k, v in inv.params.items():
        if v:
            click.echo(f"    {k:<20} {format_count(v):>8} params  {format_bytes(inv.bytes[k]):>12}")
    click.echo(f"  host tier when offloaded: {format_bytes(inv.host_tier_bytes)} of {tier.source.fmt.label} "
               f"routed-expert blobs (as `plan` counts them)")
    for line in family.kv_lines(a):
        click.echo(line)


@cli.command(short_help="Write an HF checkpoint with int4/fp8/nf4/bf16 experts.")
@click.argument("src", type=click.Path())
@click.argument("dst", type=click.Path())
@click.option("--experts", type=click.Choice(FORMATS), required=True,
              help="Format of the routed experts.")
@click.option("--group-size", type=click.Choice([str(g) for g in GROUP_SIZES]), default="128", show_default=True,
              help="int4 group size along the input dimension.")
@click.option("--dense", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
              help="Non-expert weights: bf16, or keep an FP8 source's FP8 tensors.")
@click.option("--fast/--no-fast", default=False, show_default=True,
              help="int4: skip the clipping search (plain min/max range per group; quicker, a little less exact).")
@click.option("--device", default="auto", show_default=True,
              help="Where the quantization arithmetic runs: auto (CUDA when available), cpu, cuda or cuda:N. "
                   "The blobs are the CPU's, up to rare ties between equally good int4 ranges.")
@click.option("--force", is_flag=True, help="Replace an existing DST.")
@click.option("--resume", is_flag=True, help="Continue an interrupted run from DST.partial/.")
@THREADS_OPTION
def quantize(src, dst, experts, group_size, dense, fast, device, force, resume, threads):
    """Write SRC (HF checkpoint) to DST with routed experts as one packed blob each (expert-major), experts
    quantized in parallel on --threads CPU threads (or on the GPU), with an ETA."""
    from .quant.checkpoint import quantize_checkpoint

    _set_threads(threads)
    quantize_checkpoint(src, dst, experts=experts, group_size=int(group_size), dense=dense, force=force,
                        resume=resume, progress=True, log=log, fast=fast, device=device)


@cli.command("convert-tokenizer", short_help="tokenizer.json from tiktoken.model (Kimi).")
@click.argument("weights", type=click.Path())
@click.option("--force", is_flag=True, help="Replace an existing tokenizer.json.")
def convert_tokenizer(weights, force):
    """Build WEIGHTS/tokenizer.json from its tiktoken.model and tokenizer_config.json (Kimi-K2, Moonlight). Loading
    such a checkpoint does the same on its own, into a cache; this writes it next to the model."""
    from .tiktoken_convert import TIKTOKEN_FILE, build_tokenizer_json, write_atomic
    from .tokenizer import read_json
    from .utils import checkpoint_dir

    root = checkpoint_dir(weights, "weights directory")
    if not (root / TIKTOKEN_FILE).is_file():
        raise UserError(f"no {TIKTOKEN_FILE} in {root}: nothing to convert")
    out = root / "tokenizer.json"
    if out.exists() and not force:
        raise UserError(f"{out} exists: add --force to replace it")
    write_atomic(out, build_tokenizer_json(root / TIKTOKEN_FILE, read_json(root / "tokenizer_config.json")))
    log(f"wrote {out}")


@cli.command("cache", short_help="List or clear the expert caches of HF checkpoints.")
@click.option("--clear", is_flag=True, help="Remove every expert cache (the next launch writes its own again).")
def cache_cmd(clear):
    """The expert caches: an HF checkpoint's routed experts packed once to disk in the format a launch asked for
    (--experts, or offloading), mapped by later launches. Location: $DSV3LITE_EXPERT_CACHE (off: none)."""
    from . import expert_cache_dir

    location = expert_cache_dir.cache_location()
    if location is None:
        log(f"expert caches are off ({expert_cache_dir.ENV}={os.environ.get(expert_cache_dir.ENV)})")
        return
    if clear:
        n, freed = expert_cache_dir.clear(location)
        log(f"removed {n} expert cache{'' if n == 1 else 's'} from {location} ({format_bytes(freed)} freed)")
        return
    found = expert_cache_dir.entries(location)
    log(f"expert caches in {location}: {len(found)}, {format_bytes(sum(e.bytes for e in found))}")
    for e in found:
        log(f"  {e.path.name}  {e.format}  {format_bytes(e.bytes)}  source {e.source_hash[:19]}")


@cli.command(short_help="What a --gpu-mem budget buys, reading no weights.")
@click.option("--weights", "-w", type=click.Path(), default=None, help="Checkpoint directory (default: demo model).")
@click.option("--gpu-mem", type=SIZE, required=True,
              help="Device budget to plan for (80G = 80 GiB; auto on CUDA: free memory minus a reserve).")
@click.option("--ctx-size", "-c", type=click.IntRange(min=2), default=None,
              help="Context length (tokens).  [default: 4096, or the model's limit]")
@click.option("--experts", type=click.Choice(FORMATS), default=None,
              help="Expert format (default: the checkpoint's own).")
@click.option("--device", default="auto", show_default=True, help="The device of the run planned for: auto | cuda | cpu")
@click.option("--dtype", default=None,
              help="Compute dtype of the resident weights.  [default: bfloat16 on CUDA, float32 on CPU, as a run]")
@click.option("--mtp/--no-mtp", default=True, show_default=True)
@click.option("--dense", type=click.Choice(DENSE_DTYPES), default=None,
              help="Non-expert weights packed to this dtype, as a run with --dense.")
def plan(weights, gpu_mem, ctx_size, experts, device, dtype, mtp, dense):
    """Print what --gpu-mem buys (resident components, expert slots) from shapes alone, reading no weights: the
    plan `chat`/`generate`/`serve` make with the same flags."""
    from .builder import DEFAULT_CTX_SIZE, choose_dense, resolve_weights
    from .config import ModelArgs
    from .dense import check_dense
    from .offload.setup import plan_for, resolve_budget
    from .utils import resolve_device, resolve_dtype

    root = resolve_weights(weights)
    dev = resolve_device(device, present=False)          # a plan reads no weights: any machine can plan for CUDA
    dt = resolve_dtype(dtype, dev)
    args = ModelArgs.from_dir(root)
    ctx_size = min(ctx_size or DEFAULT_CTX_SIZE, args.max_position_embeddings)
    budget = resolve_budget(gpu_mem, dev)
    check_dense(dense, dev)
    dense = choose_dense(root, args, dense, dev, budget, ctx_size, experts, mtp, dt, click.echo)   # as a run would
    p, *_ = plan_for(root, args, budget, ctx_size, experts, mtp, dt, dense)
    click.echo(f"plan for {root} on {dev.type} ({str(dt).replace('torch.', '')}"
               f"{f', --dense {dense}' if dense else ''}) with --gpu-mem "
               f"{format_bytes(budget)}, --ctx-size {ctx_size}:")
    click.echo(p.table())


def _writable_file(path: str, what: str) -> Path:
    """`path` as a file that can be created or replaced, checked before any slow work."""
    out = Path(path).expanduser()
    parent = out.parent if str(out.parent) else Path(".")
    if out.is_dir():
        raise UserError(f"{what} {out} is a directory: give a file name")
    if not parent.is_dir():
        raise UserError(f"cannot write {what} {out}: the directory {parent} does not exist")
    problem = write_problem(parent) or (None if not out.exists() or os.access(out, os.W_OK) else "permission denied")
    if problem:
        raise UserError(f"cannot write {what} {out}: {problem}")
    return out


def _trace_summary(events: list[dict], layers: list[int], lookahead: int, mtp_layer: int) -> list[str]:
    """Per MoE layer, over the decode steps: experts used, and the share of them the routers predicted
    1..lookahead layers ahead (what prefetching can hide)."""
    used: dict[tuple[int, int], set[int]] = {}
    predicted: dict[tuple[int, int, int], set[int]] = {}
    for ev in events:
        if ev["phase"] != "decode":
            continue
        ids = {e for row in ev["ids"] for e in row}
        if ev["distance"] == 0:
            used[(ev["step"], ev["layer"])] = ids
        else:
            predicted[(ev["step"], ev["layer"], ev["distance"])] = ids
    distances = range(1, lookahead + 1)
    lines = [f"  {'layer':>5}  {'experts used':>12}  " + "  ".join(f"{f'{d} ahead':>8}" for d in distances)]
    for layer in layers:
        steps = [(step, ids) for (step, l), ids in used.items() if l == layer]
        if not steps:
            continue
        distinct = set().union(*(ids for _, ids in steps))
        cells = []
        for d in distances:
            hits = total = 0
            for step, ids in steps:
                if (step, layer, d) in predicted:
                    hits += len(ids & predicted[(step, layer, d)])
                    total += len(ids)
            cells.append(f"{hits / total:>8.0%}" if total else f"{'-':>8}")
        name = "MTP" if layer == mtp_layer else str(layer)
        lines.append(f"  {name:>5}  {len(distinct):>12}  " + "  ".join(cells))
    return lines


@cli.command(short_help="Record per-token expert routing to a file.")
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads stdin).")
@click.option("--out", "-o", type=click.Path(), required=True, help="Trace file to write (JSON lines).")
@click.option("--trace-lookahead", type=click.IntRange(1, 8), default=3, show_default=True,
              help="Record predictions made this many layers ahead.")
@engine_options()
def trace(prompt, out, trace_lookahead, **o):
    """Generate, recording per-token, per-layer expert ids and router predictions (for benchmarks/cache_sim.py),
    then print a per-layer summary."""
    from .offload.trace import TraceRecorder

    out_path = _writable_file(out, "trace file")
    if prompt == "-":
        prompt = _stdin_text("--prompt -")
    llm = _engine(o)
    rec = TraceRecorder(llm.model, trace_lookahead)
    stream = llm.generate(prompt, **_sampling(o))
    finish = None
    with _token_progress(o["max_tokens"], "tracing") as advance:
        try:
            for i, chunk in enumerate(stream):
                if i == 0:
                    rec.phase = "decode"          # events after the first token belong to decode steps
                finish = chunk.finish_reason
                advance()
        finally:
            stream.close()
    a, stats = llm.args, llm.stats()
    layers = [m.layer_id for m in llm.model.moe_modules()]
    try:
        rec.write(out_path, {"weights": llm.weights, "n_experts": a.n_routed_experts, "top_k": a.num_experts_per_tok,
                             "moe_layers": layers, "lookahead": trace_lookahead,
                             "token_layers": sorted(llm.model.token_route_tables()),
                             "prompt_tokens": stats["prompt_tokens"], "generated": stats["generated_tokens"]})
    except OSError as e:
        raise UserError(f"cannot write trace file {out_path}: {e.strerror or e}") from None
    click.echo(f"wrote {out_path}: {len(rec.events)} routing events, {stats['prompt_tokens']} prompt + "
               f"{stats['generated_tokens']} generated tokens ({finish or 'length'}), {len(layers)} MoE layers x "
               f"{a.n_routed_experts} experts (top-{a.num_experts_per_tok})")
    click.echo("decode steps, per MoE layer: distinct experts used, and the share of each step's experts that the "
               "routers predicted d layers ahead:")
    for line in _trace_summary(rec.events, layers, trace_lookahead, a.mtp_layer_id):
        click.echo(line)
    click.echo(_replay_hint(out_path))


def _replay_hint(trace_file: Path) -> str:
    """Where the trace replayer is: benchmarks/cache_sim.py of the source tree, which an installed package lacks."""
    sim = Path(__file__).resolve().parents[1] / "benchmarks" / "cache_sim.py"
    if sim.is_file():
        return f"replay it against cache policies and sizes: python {sim} --trace {trace_file}"
    return (f"replay it against cache policies and sizes with benchmarks/cache_sim.py of the dsv3lite source tree "
            f"(not installed with the package): python benchmarks/cache_sim.py --trace {trace_file}")


@contextlib.contextmanager
def _token_progress(total: int, what: str):
    """Progress of a generation on stderr: a bar on a terminal, else a line at each quarter. Yields advance()."""
    from tqdm import tqdm

    from .utils import terminal_bar_fits

    if terminal_bar_fits():
        with tqdm(total=total, desc=what, unit="tok", file=sys.stderr, leave=False) as bar:
            yield bar.update
        return
    count = [0]

    def advance():
        count[0] += 1
        if count[0] * 4 // total > (count[0] - 1) * 4 // total:
            log(f"{what}: {count[0]}/{total} tokens")
    yield advance


def _serve(host, port, api_key, with_ui, max_body, o) -> None:
    from .app.server import serve as run_server

    given = click.get_current_context().get_parameter_source
    default = click.core.ParameterSource.DEFAULT
    ui_sampling = {k: v for k, v in CHAT_SAMPLING.items()                 # the web UI is a chat: it samples
                   if given({"temperature": "temp", "top_p": "top_p"}[k]) == default}
    sampling = _sampling(o)
    if given("max_tokens") == default:          # requests without max_tokens run to the context (llama-server's way)
        sampling["max_tokens"] = None
    run_server(lambda: _engine(o), host=host, port=port, api_key=api_key, ui=with_ui, sampling=sampling,
               ui_sampling=ui_sampling, system_prompt=o["system_prompt"], log=log, max_body_bytes=max_body)


def server_options(port: int, key_help: str):
    """--host, --port, --api-key and --max-body of serve and ui."""
    opts = [
        click.option("--host", default="127.0.0.1", show_default=True,
                     help="Address to listen on (anything but loopback is reachable from other machines)."),
        click.option("--port", type=click.IntRange(0, 65535), default=port, show_default=True,
                     help="TCP port to listen on (0: any free port)."),
        click.option("--api-key", default=None, help=key_help),
        click.option("--max-body", type=SIZE, default=None,
                     help="Largest request body (413 past it); a long prompt sent as token ids needs more.  "
                          "[default: 1M, app/server.py's MAX_BODY_BYTES]"),
    ]

    def decorate(fn):
        for opt in reversed(opts):
            fn = opt(fn)
        return fn
    return decorate


@cli.command(short_help="OpenAI-compatible API at /v1 and the web UI at /.")
@server_options(8000, "Require 'Authorization: Bearer KEY' on /v1 (and KEY to open the UI).")
@click.option("--ui/--no-ui", "with_ui", default=True, show_default=True, help="Serve the web UI at / (needs gradio).")
@engine_options()
def serve(host, port, api_key, max_body, with_ui, **o):
    """OpenAI-compatible API at /v1 and the web UI at /, over one engine. --temp, --top-p and -m are the defaults of
    API requests that leave them out (greedy unless given; without -m a reply runs until it stops or fills the
    context, as llama-server's and ollama's do); the web UI's settings start at chat's sampling."""
    _serve(host, port, api_key, with_ui, max_body, o)


@cli.command(short_help="The web UI (port 7860), with the API alongside.")
@server_options(7860, "Require KEY to open the UI and on /v1.")
@engine_options()
def ui(host, port, api_key, max_body, **o):
    """The web UI in your browser (open the printed URL); the OpenAI API is served alongside at /v1."""
    _serve(host, port, api_key, True, max_body, o)


@contextlib.contextmanager
def _sigterm_stops():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(sig, frame):
        raise Terminated()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    """The command line: argv (default sys.argv[1:]) -> exit status. Run as the `dsv3lite` program (argv None) it
    ends the process itself once the command is done (_exit_now)."""
    rc = _main(argv)
    if argv is None:
        _exit_now(rc)
    return rc


def _exit_now(rc: int) -> None:
    """Exit handlers run and output is flushed, then the process ends without the interpreter's teardown of torch
    and its kin, which kept a finished `generate` alive 1-3 s after its last line."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)


def _main(argv) -> int:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        with _sigterm_stops():
            cli.main(args=argv, prog_name="dsv3lite", standalone_mode=False)
        return 0
    except click.exceptions.Abort as e:          # click's form of KeyboardInterrupt (Ctrl-C, or SIGTERM above)
        if isinstance(e.__cause__, Terminated):
            log("terminated (SIGTERM)")
            return 128 + signal.SIGTERM
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
