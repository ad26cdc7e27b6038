"""Expert offloading on one GPU, with synthetic DeepSeek-V3-shaped layers built in memory.

Hidden 7168, MLA with 128 heads (q_lora 1536, kv_lora 512, rope 64), 256 routed experts of 2048 per
MoE layer in int4 (random packed blobs: timing does not depend on the values), a router with a mild
popularity skew. Measured side by side in one process:

  copy   pinned host->device copy peak (one expert, and 1 GiB)
  decode tok/s: all experts resident | offloaded with prefetch | offloaded on demand (no prefetch),
         at several --gpu-mem budgets; hit rate, achieved H2D GB/s while copying, stall, peak GPU memory
         against the budget
  accel  HF accelerate device_map offload of the same shapes in bf16 (one MoE layer: host RAM), time per
         MoE layer against ours
  mtp    cost of a 2-token verify vs a 1-token step at two budgets (random weights cannot measure
         acceptance; the speedup at acceptance a is (1 + a) * t_step / t_verify_step)

    python benchmarks/gpu_offload.py RESULTS_DIR [--layers 4] [--quick]
    python benchmarks/gpu_offload.py RESULTS_DIR --device cpu --tiny     # logic check without a GPU
    python benchmarks/gpu_offload.py RESULTS_DIR --dry-run               # arguments and imports only
Each stage writes its table to RESULTS_DIR/offload_<stage>.md as soon as it is measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

V3_SHAPES = dict(model_type="deepseek_v3", vocab_size=8192, hidden_size=7168, intermediate_size=18432,
                 moe_intermediate_size=2048, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                 qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
                 n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                 first_k_dense_replace=0, max_position_embeddings=4096, num_nextn_predict_layers=0,
                 rms_norm_eps=1e-6)
TINY_SHAPES = dict(V3_SHAPES, vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                   num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=32, n_group=4, topk_group=2,
                   num_experts_per_tok=4)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Results:
    def __init__(self, out: Path):
        self.out = out
        out.mkdir(parents=True, exist_ok=True)

    def table(self, stage: str, title: str, header: list[str], rows: list[list], notes: list[str] = ()):
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        lines += [""] + [f"- {n}" for n in notes]
        text = "\n".join(lines) + "\n"
        (self.out / f"offload_{stage}.md").write_text(text)
        print(text, flush=True)


def model_args(shapes: dict, layers: int):
    from dsv3lite.config import ModelArgs

    return ModelArgs.from_dict(dict(shapes, num_hidden_layers=layers))


def build_dense(args, device, dtype, seed=0):
    """Transformer with random dense weights on `device`; routed experts left to a provider (installed later)."""
    from dsv3lite.model import Transformer, init_weights

    with torch.device("meta"):
        model = Transformer(args)
    for moe in model.moe_modules():
        moe.experts = torch.nn.Identity()          # placeholder without parameters
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    init_weights(model, std=0.02)
    model = model.to(dtype)
    for moe in model.moe_modules():                 # routers stay fp32, with a mild popularity skew
        g = moe.gate
        g.weight.data = g.weight.data.float()
        rank = torch.randperm(args.n_routed_experts, generator=torch.Generator().manual_seed(moe.layer_id))
        g.bias = (-0.03 * torch.log1p(rank.float())).to(device)
    return model.eval()


def random_blobs(args, layout, device, pin: bool) -> dict[int, torch.Tensor]:
    """Per MoE layer [E, blob_bytes] uint8 of random int4 codes with sane fp16 scales/zeros."""
    from dsv3lite.quant.layout import BlobLayout  # noqa: F401

    out = {}
    gen_dev = device if device.type == "cuda" else torch.device("cpu")
    for layer in args.moe_layer_ids:
        blobs = torch.randint(0, 256, (args.n_routed_experts, layout.blob_bytes), dtype=torch.uint8, device=gen_dev)
        for name, comp in layout.components.items():
            if name.endswith(("scales", "zeros")):
                view = blobs[:, comp.offset:comp.offset + comp.nbytes].view(torch.float16)
                view.fill_(0.01 if name.endswith("scales") else 8.0)
        if pin:
            host = torch.empty(blobs.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(blobs)
            blobs = host
        else:
            blobs = blobs.cpu()
        out[layer] = blobs
    return out


def engine_for(model, args, device, dtype, ctx):
    from dsv3lite.generate import Engine

    eng = Engine(model, None, device, dtype, ctx_size=ctx, mtp=False)
    eng.stop_ids = set()
    return eng


def decode_rate(eng, prompt_len: int, tokens: int, seed: int = 0) -> float:
    prompt = torch.randint(10, eng.args.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    eng.reset()
    list(eng.generate(prompt.tolist(), max_tokens=tokens))
    return eng.stats()["decode_tok_s"]


def stage_copy(res: Results, layout, device):
    if device.type != "cuda":
        return None
    blob = torch.empty(layout.blob_bytes, dtype=torch.uint8, pin_memory=True)
    big = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    dst_small = torch.empty_like(blob, device=device)
    dst_big = torch.empty_like(big, device=device)
    rows = []
    for name, src, dst, reps in (("one expert (int4)", blob, dst_small, 50), ("1 GiB", big, dst_big, 5)):
        dst.copy_(src, non_blocking=True)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        sync(device)
        gbs = src.numel() * reps / (time.perf_counter() - t0) / 1e9
        rows.append([name, f"{src.numel() / 2**20:.1f} MiB", f"{gbs:.1f}"])
    pageable = torch.empty(layout.blob_bytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    for _ in range(20):
        dst_small.copy_(pageable)
    sync(device)
    rows.append(["one expert, pageable", f"{layout.blob_bytes / 2**20:.1f} MiB",
                 f"{layout.blob_bytes * 20 / (time.perf_counter() - t0) / 1e9:.1f}"])
    res.table("copy", "Host-to-device copy peak", ["copy", "size", "GB/s"], rows)
    peak = max(float(r[2]) for r in rows[:2])
    del big, dst_big
    return peak


def stage_decode(res, args, device, dtype, layout, fmt, blobs, fractions, prompt_len, tokens, copy_peak, ctx):
    from dsv3lite.experts import BlobExperts
    from dsv3lite.offload.cache import HostStore
    from dsv3lite.offload.options import OffloadOptions
    from dsv3lite.offload.planner import make_plan
    from dsv3lite.offload.runtime import OffloadRuntime

    rows = []
    model = build_dense(args, device, dtype)
    total = len(args.moe_layer_ids) * args.n_routed_experts
    # all resident: the blobs on the device
    for moe in model.moe_modules():
        moe.experts = BlobExperts(blobs[moe.layer_id].to(device), fmt, layout)
    eng = engine_for(model, args, device, dtype, ctx)
    decode_rate(eng, prompt_len, 4)
    resident = decode_rate(eng, prompt_len, tokens)
    rows.append(["all resident", "-", f"{total}/{total}", f"{resident:.2f}", "1.00", "-", "-", "-", "-", "-"])
    for moe in model.moe_modules():
        moe.experts = torch.nn.Identity()
    del eng
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None
    for frac in fractions:
        n_slots = max(int(total * frac), 2 * args.num_experts_per_tok)
        probe = make_plan(args, 1 << 50, ctx, layout.blob_bytes, "int4", mtp=False)
        budget = probe.resident + n_slots * layout.blob_bytes
        for label, lookahead in (("offloaded + prefetch", 2), ("offloaded, on demand", 0)):
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            rt = OffloadRuntime(HostStore(blobs, layout.blob_bytes, "pinned" if device.type == "cuda" else "memory"),
                                fmt, layout, n_slots, device, dtype,
                                OffloadOptions(lookahead=lookahead, miss_policy="fetch"))
            for moe in model.moe_modules():
                moe.experts = rt.provider(moe.layer_id)
            rt.attach(model)
            eng = engine_for(model, args, device, dtype, ctx)
            eng.offload = rt
            decode_rate(eng, prompt_len, 4)
            rate = decode_rate(eng, prompt_len, tokens, seed=1)
            s = eng.stats()["expert_cache"]
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
            h2d = s["h2d_gb_s"]
            rows.append([label, f"{budget / 2**30:.1f} GiB", f"{n_slots}/{total}", f"{rate:.2f}",
                         f"{rate / resident:.2f}", f"{s['hit_rate']:.1%}",
                         f"{h2d:.1f}" + (f" ({h2d / copy_peak:.0%})" if copy_peak else ""),
                         f"{s['stall_ms']:.0f}", f"{s['predictor_recall']:.1%}",
                         f"{peak / 2**30:.1f} GiB" + (" OK" if peak <= budget else " OVER")])
            rt.detach()
            del eng, rt
            gc.collect()
    res.table("decode", f"Decode, synthetic V3 layers ({len(args.moe_layer_ids)} MoE layers, int4 experts)",
              ["mode", "--gpu-mem", "slots", "decode tok/s", "vs resident", "hit rate", "H2D GB/s (of peak)",
               "stall ms", "predictor recall", "peak GPU mem"], rows,
              [f"prompt {prompt_len} random tokens, {tokens} decoded greedily; random weights with a skewed router",
               "peak GPU memory counts model, KV cache, slots and activations (torch.cuda.max_memory_allocated)"])
    return model, resident, rows


def stage_accelerate(res, device, layers_ours_rows, ours_layers, tokens=3):
    """HF accelerate device_map offload: one V3-shaped MoE layer with bf16 experts on the CPU."""
    if device.type != "cuda":
        return
    try:
        import accelerate
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    except ImportError as e:
        res.table("accelerate", "HF accelerate offload", ["status"], [[f"skipped: {e}"]])
        return
    cfg = {k: v for k, v in V3_SHAPES.items() if k != "model_type"}
    cfg.update(num_hidden_layers=1, num_key_value_heads=128, first_k_dense_replace=0)
    config = DeepseekV3Config(**cfg)
    with torch.device("meta"):
        hf = DeepseekV3ForCausalLM(config)
    hf = hf.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name:
                p.zero_()
            else:
                p.normal_(0, 0.02)
    device_map = {"model.embed_tokens": 0, "model.norm": 0, "lm_head": 0, "model.rotary_emb": 0,
                  "model.layers.0.self_attn": 0, "model.layers.0.input_layernorm": 0,
                  "model.layers.0.post_attention_layernorm": 0, "model.layers.0.mlp.gate": 0,
                  "model.layers.0.mlp.shared_experts": 0, "model.layers.0.mlp.experts": "cpu"}
    hf = accelerate.dispatch_model(hf, device_map=device_map, main_device="cuda:0")
    ids = torch.randint(10, 8000, (1, 16), device="cuda")
    with torch.no_grad():
        hf(ids)
        times = []
        past = None
        out = hf(ids, use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(tokens):
            sync(device)
            t0 = time.perf_counter()
            out = hf(nxt, past_key_values=past, use_cache=True)
            sync(device)
            times.append(time.perf_counter() - t0)
            past = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
    acc_layer = statistics.median(times)
    rows = [["accelerate device_map (bf16 experts on CPU)", "1", f"{acc_layer * 1e3:.0f}", "1.0x"]]
    for r in layers_ours_rows:
        if r[0].startswith("offloaded"):
            per_layer = 1.0 / float(r[3]) / ours_layers
            rows.append([f"dsv3lite {r[0]} ({r[2]} slots, int4)", str(ours_layers), f"{per_layer * 1e3:.2f}",
                         f"{acc_layer / per_layer:.0f}x"])
    res.table("accelerate", "Time per MoE layer per decoded token vs HF accelerate offload",
              ["engine", "MoE layers", "ms per MoE layer", "speedup"], rows,
              ["accelerate moves the whole experts module to the GPU at every forward (22.5 GiB in bf16 per layer)",
               "dsv3lite time per layer = 1 / decode tok/s / MoE layers (includes attention, as accelerate's does)"])
    del hf
    gc.collect()
    torch.cuda.empty_cache()


def stage_mtp_cost(res, model, args, device, dtype, layout, fmt, blobs, fractions, ctx):
    """Time of a 1-token step vs a 2-token verify forward on the offloaded model (union of experts)."""
    from dsv3lite.offload.cache import HostStore
    from dsv3lite.offload.options import OffloadOptions
    from dsv3lite.offload.runtime import OffloadRuntime

    rows = []
    total = len(args.moe_layer_ids) * args.n_routed_experts
    for frac in fractions:
        n_slots = max(int(total * frac), 2 * args.num_experts_per_tok)
        rt = OffloadRuntime(HostStore(blobs, layout.blob_bytes, "pinned" if device.type == "cuda" else "memory"),
                            fmt, layout, n_slots, device, dtype, OffloadOptions(miss_policy="fetch"))
        for moe in model.moe_modules():
            moe.experts = rt.provider(moe.layer_id)
        rt.attach(model)
        eng = engine_for(model, args, device, dtype, ctx)
        eng.offload = rt
        prompt = torch.randint(10, args.vocab_size, (64,)).tolist()
        list(eng.generate(prompt, max_tokens=2))
        times = {1: [], 2: []}
        with torch.inference_mode():
            for i in range(12):
                for s in (1, 2):
                    toks = torch.randint(10, args.vocab_size, (s,)).tolist()
                    sync(device)
                    t0 = time.perf_counter()
                    eng._forward(toks, len(eng.cached_tokens), all_logits=True)
                    sync(device)
                    if i >= 2:
                        times[s].append(time.perf_counter() - t0)
        t1, t2 = statistics.median(times[1]), statistics.median(times[2])
        rows.append([f"{n_slots}/{total}", f"{t1 * 1e3:.1f}", f"{t2 * 1e3:.1f}", f"{t2 / t1:.2f}",
                     f"{1.8 * t1 / t2:.2f}x", f"{1.6 * t1 / t2:.2f}x"])
        rt.detach()
        del eng, rt
        gc.collect()
    res.table("mtp", "MTP verify cost on the offloaded model",
              ["slots", "1-token step ms", "2-token verify ms", "verify / step", "speedup at 80% accept",
               "speedup at 60% accept"], rows,
              ["speedup = (1 + acceptance) * t_step / t_verify (drafting with the MTP layer costs one more layer)"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers (each 256 int4 experts = 5.6 GiB)")
    ap.add_argument("--fractions", default="0.25,0.5", help="expert slots as fractions of all experts")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (logic check on CPU)")
    ap.add_argument("--stages", default="copy,decode,accelerate,mtp")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and imports, measure nothing")
    a = ap.parse_args()
    if a.dry_run:
        import dsv3lite.offload.runtime  # noqa: F401
        from dsv3lite.quant.formats import get_format  # noqa: F401

        Results(a.out).table("dry_run", f"offload (dry run): stages {a.stages}, {a.layers} layers", ["fractions"],
                             [[a.fractions]])
        return
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_offload.py: no CUDA device (use --device cpu --tiny for a logic check)")
    from dsv3lite.quant.formats import get_format

    res = Results(a.out)
    stages = set(a.stages.split(","))
    args = model_args(TINY_SHAPES if a.tiny else V3_SHAPES, a.layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fmt = get_format("int4")
    layout = fmt.layout(args.moe_intermediate_size, args.hidden_size)
    fractions = [float(f) for f in a.fractions.split(",")]
    ctx = 1024
    copy_peak = stage_copy(res, layout, device) if "copy" in stages else None
    t0 = time.perf_counter()
    blobs = random_blobs(args, layout, device, pin=device.type == "cuda")
    print(f"# host tier: {sum(b.numel() for b in blobs.values()) / 2**30:.1f} GiB of int4 blobs in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    model = rows = None
    if "decode" in stages:
        model, _, rows = stage_decode(res, args, device, dtype, layout, fmt, blobs, fractions, a.prompt, a.tokens,
                                      copy_peak, ctx)
    if "mtp" in stages and model is not None:
        stage_mtp_cost(res, model, args, device, dtype, layout, fmt, blobs, fractions, ctx)
    if "accelerate" in stages and rows is not None:
        del model, blobs
        gc.collect()
        stage_accelerate(res, device, rows, len(args.moe_layer_ids))
    (a.out / "offload_done.json").write_text(json.dumps({"ok": True}))


if __name__ == "__main__":
    main()
