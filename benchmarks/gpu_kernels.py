"""Triton kernels on one GPU against their PyTorch twins and the machine's own peaks, with DeepSeek-V3 shapes.

  peaks  device-to-device copy GB/s and bf16 matmul TFLOP/s, measured here: the roofline for the rest
  moe    fused_moe per MoE layer (8 of 256 experts, D=7168 I=2048; M = 1 and 2 tokens; int4 / fp8 / int4g32
         (Kimi-K2's released experts) / bf16 blobs in a 64-slot pool, so consecutive calls read different slots
         and L2 cannot hold them) vs reading its weight bytes at copy bandwidth, and vs the twin (dequantize +
         matmul)
  mla    mla_decode at 4K/32K/128K context, batch 1/8/32 (128 heads, 512 + 64) vs its twin, and vs
         scaled_dot_product_attention over the latent expanded per head (only to 8K context and batch 8)
  gemv   w4a16 / w8a16 on 7168x2048 and 2048x7168 (M = 1 and 16), weights rotated through 64 copies (> L2),
         vs cuBLAS bf16 on the same shapes and vs the twins
  sweep  each batch-1 kernel's candidate configurations (kernels/tuning.py) against its default; the winners
         (more than 3% faster) go to --tuning-out, a JSON file for DSV3LITE_TUNING
  prefill the grouped kernels (expert-major, weights decoded in registers) against the dequantizing path, one
         MoE layer over 512 and 2048 prompt tokens with all 256 experts resident (int4 / fp8 / int4g32)
  v4moe  DeepSeek-V4-Flash's routed experts as released (mxfp4, SwiGLU clamped at 10; D=4096 I=2048, top-6 of
         256): the moe table (M = 1 and 2) and the prefill table (512 tokens)
  v4attn v4_decode_attention at V4-Flash's widths (64 heads, 512-wide key = value rows, window 128): CSA top-512
         of 16,384 entries (64K context), HCA at 64K and 1M, sliding, an MTP verify pass; batch 1 / 8 / 32; vs the
         bytes it reads at copy bandwidth and vs its twin; then index_scores, the indexer's scan of every key (64
         heads x 128) at 64K and 1M

Every kernel is checked against its twin once before it is timed (max error in the tables; a failed check
makes the exit status 1). Timing: CUDA events, warmup, median of several repetitions; "GPU" times replay
the calls from a CUDA graph (no launch overhead), "eager" times include Python launch cost.

    python benchmarks/gpu_kernels.py RESULTS_DIR [--budget-s 90] [--sections peaks,moe,mla,gemv,sweep,prefill]
                                                 [--tuning-out FILE.json]
    python benchmarks/gpu_kernels.py RESULTS_DIR --tiny     # logic check on CPU in Triton's interpreter
    python benchmarks/gpu_kernels.py RESULTS_DIR --dry-run  # arguments and imports only
Each section writes RESULTS_DIR/kernels_<section>.md (and kernels.json) as soon as it is measured.
"""
from __future__ import annotations

import sys

if "--tiny" in sys.argv:   # must precede the first import of triton
    import os
    os.environ["TRITON_INTERPRET"] = "1"

import argparse
import json
import math
import platform
import statistics
import time
import traceback
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

V3 = dict(hidden=7168, inter=2048, experts=256, top_k=8, slots=64, heads=128, kv_lora_rank=512, rope_dim=64,
          contexts=(4096, 32768, 131072), batches=(1, 8, 32), gemv=((7168, 2048), (2048, 7168)), gemv_rows=(1, 16),
          copies=64, sdpa_max_context=8192, sdpa_max_batch=8, copy_bytes=2 << 30, matmul=8192,
          reps=5, max_calls=16, prefill_tokens=(512, 2048))
TINY = dict(hidden=72, inter=40, experts=16, top_k=4, slots=8, heads=4, kv_lora_rank=32, rope_dim=8,
            contexts=(40, 130), batches=(1, 3), gemv=((40, 72), (72, 40)), gemv_rows=(1, 5),
            copies=2, sdpa_max_context=64, sdpa_max_batch=2, copy_bytes=1 << 20, matmul=128,
            reps=1, max_calls=2, prefill_tokens=(24,))
# DeepSeek-V4-Flash (docs/dsv4-math.md §1.1): its routed experts in the moe / prefill tables' keys, its attention
# (layer, entries, top-k (0: HCA, all visible), Sq, batches)
V3["v4"] = dict(V3, hidden=4096, inter=2048, experts=256, top_k=6, prefill_tokens=(512,), swiglu_limit=10.0,
                heads=64, head_dim=512, window=128, ring=131,
                attention=(("CSA 64K", 16384, 512, 1, (1, 8, 32)), ("HCA 64K", 512, 0, 1, (1, 8, 32)),
                           ("HCA 1M", 8192, 0, 1, (1, 8)), ("sliding", 0, 0, 1, (1, 32)),
                           ("CSA 64K verify", 16384, 512, 4, (1,))),
                index_heads=64, index_dim=128, indexer=((16384, (1, 8)), (262144, (1,))),
                compressors=(("CSA", 512, 4, True, (1, 8)), ("CSA indexer", 128, 4, True, (1, 8)),
                             ("HCA", 512, 128, False, (1, 8))))
TINY["v4"] = dict(TINY, top_k=3, swiglu_limit=0.5, head_dim=32, window=8, ring=11,
                  attention=(("CSA", 20, 6, 1, (1, 2)), ("HCA", 5, 0, 2, (1,)), ("sliding", 0, 0, 1, (1,))),
                  index_heads=9, index_dim=16, indexer=((300, (1, 2)),),
                  compressors=(("CSA", 32, 4, True, (1, 2)), ("HCA", 32, 16, False, (1,))))
# V3's softmax scale: 192^-0.5 * mscale^2, mscale = 0.1 * ln(40) + 1 (YaRN factor 40, mscale_all_dim 1)
MLA_SCALE = 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2
L2_DEFEAT_BYTES = 256 << 20   # rotate through copies until this many bytes separate two reads of one copy


class Bench:
    """Timing, checks and result files for one run."""

    def __init__(self, out: Path, device: torch.device, budget_s: float, reps: int):
        self.out, self.device, self.cuda, self.reps = out, device, device.type == "cuda", reps
        self.start, self.budget_s = time.time(), budget_s
        self.failures: list[str] = []
        self.results: dict[str, list[dict]] = {}
        self.copy_gbs: float | None = None
        self.matmul_tflops: float | None = None
        self.tuning: dict = {}                 # the sweep's choices
        out.mkdir(parents=True, exist_ok=True)

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.start)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    # --- timing ---------------------------------------------------------------------------------

    def eager_ms(self, calls, reps=None, warmup=2) -> float:
        """Median over reps of (time of all calls) / len(calls), launch overhead included."""
        reps = (reps or self.reps) if self.cuda else 1
        for call in calls[:warmup if self.cuda else 1]:
            call()
        self.sync()
        times = []
        for _ in range(reps):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for call in calls:
                    call()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / len(calls))
            else:
                t0 = time.perf_counter()
                for call in calls:
                    call()
                times.append((time.perf_counter() - t0) * 1e3 / len(calls))
        return statistics.median(times)

    def gpu_ms(self, calls, reps=None) -> float | None:
        """Median per-call time of the calls replayed from one CUDA graph (no launch overhead); None off CUDA."""
        if not self.cuda:
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for call in calls[:2]:
                    call()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for call in calls:
                    call()
            graph.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(reps or self.reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / len(calls))
            del graph
            return statistics.median(times)
        except Exception as e:   # capture can fail for reasons unrelated to the kernel: report, keep going
            print(f"  (CUDA graph capture failed: {type(e).__name__}: {e}; eager times only)", file=sys.stderr)
            torch.cuda.synchronize()
            return None

    # --- checks and output ----------------------------------------------------------------------

    def check(self, what: str, got: torch.Tensor, want: torch.Tensor, rel_tol: float,
              record: bool = True) -> tuple[str, bool]:
        """'max abs err (relative to max |want|)' and whether it is within rel_tol; records failures."""
        got, want = got.float(), want.float()
        scale = max(want.abs().max().item(), 1e-30)
        err = (got - want).abs().max().item()
        ok = math.isfinite(err) and err <= rel_tol * scale
        if not ok and record:
            self.failures.append(f"{what}: max abs err {err:.3g} > {rel_tol} x {scale:.3g}")
        return f"{err:.2e} ({err / scale:.1e})", ok

    def table(self, section: str, title: str, header: list[str], rows: list[list], notes=()):
        lines = [f"### {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
        lines += [""] + [f"- {n}" for n in notes] + [""]
        text = "\n".join(lines)
        path = self.out / f"kernels_{section}.md"
        with path.open("a") as f:
            f.write(text + "\n")
        print(text, flush=True)
        self.results.setdefault(section, []).append({"title": title, "header": header, "rows": rows})
        (self.out / "kernels.json").write_text(json.dumps(self.results, indent=1, default=str))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "ok" if v else "**FAIL**"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def ms_us(ms):
    return None if ms is None else ms * 1e3


def rotated(make, bytes_each: int, max_copies: int) -> list:
    """Copies of a buffer, enough that cycling through them defeats L2 (at least one, at most max_copies)."""
    n = max(1, min(max_copies, -(-L2_DEFEAT_BYTES // max(bytes_each, 1))))
    return [make(i) for i in range(n)]


def free():
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------

def section_peaks(b: Bench, S: dict):
    n = S["copy_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=b.device).fill_(1)
    dst = torch.empty_like(src)
    copy_ms = b.eager_ms([lambda: dst.copy_(src)] * 4, reps=7)
    b.copy_gbs = 2 * n / copy_ms / 1e6   # read + write
    del src, dst
    d = S["matmul"]
    dtype = torch.bfloat16 if b.cuda else torch.float32
    a = torch.randn(d, d, device=b.device, dtype=dtype)
    w = torch.randn(d, d, device=b.device, dtype=dtype)
    mm_ms = b.eager_ms([lambda: a @ w] * 4, reps=7)
    b.matmul_tflops = 2 * d ** 3 / mm_ms / 1e9
    del a, w
    free()
    b.table("peaks", "Measured peaks (the roofline below)", ["what", "size", "time (ms)", "rate"], [
        ["device copy (read + write)", f"{n >> 20} MiB", copy_ms, f"{b.copy_gbs:.0f} GB/s"],
        [f"{dtype} matmul", f"{d}^3", mm_ms, f"{b.matmul_tflops:.1f} TFLOP/s"],
    ], [f"GPU: {_device_name(b)}"])


def _expert_blobs(fmt, inter, hidden, n_real, device):
    gen = torch.Generator(device="cpu").manual_seed(0)
    blobs = []
    for _ in range(n_real):
        mats = [(torch.randn(shape, generator=gen) * 0.02).to(device)
                for shape in ((inter, hidden), (inter, hidden), (hidden, inter))]
        blobs.append(fmt.pack(*mats))
    return blobs


def _moe_routing(m: int, call: int, S: dict, device):
    """ids [M, 8] of resident experts: a different window of the pool per call; token 1 shares 4 with token 0."""
    k, slots = S["top_k"], S["slots"]
    base = call * k * m
    rows = [[(base + j) % slots for j in range(k)]]
    if m > 1:
        rows += [[(base + j) % slots for j in range(k // 2)] + [(base + k + j) % slots for j in range(k - k // 2)]
                 for _ in range(m - 1)]
    gen = torch.Generator(device="cpu").manual_seed(call)
    ids = torch.tensor(rows, dtype=torch.int64)
    weights = torch.rand(m, k, generator=gen) + 0.1
    return ids.to(device), weights.to(device)


def section_moe(b: Bench, S: dict, formats=("int4", "fp8", "int4g32", "bf16"), section="moe"):
    from dsv3lite.kernels.fused_moe import fused_moe, fused_moe_ref
    from dsv3lite.quant.formats import get_format

    hidden, inter, slots = S["hidden"], S["inter"], S["slots"]
    limit = S.get("swiglu_limit")
    dtype = torch.bfloat16
    rows = []
    for name in formats:
        if b.left_s() < 15:
            print(f"  moe: budget spent, skipping {name}", file=sys.stderr)
            break
        fmt = get_format(name, 128)
        layout = fmt.layout(inter, hidden)
        real = _expert_blobs(fmt, inter, hidden, 2, b.device)
        pool = torch.empty(slots, layout.blob_bytes, dtype=torch.uint8, device=b.device)
        for s in range(slots):
            pool[s].copy_(real[s % len(real)])
        del real
        # experts 0..slots-1 resident, scattered over the pool; the rest of the layer's experts are not
        slot_of_expert = torch.full((S["experts"],), -1, dtype=torch.int32)
        slot_of_expert[:slots] = torch.randperm(slots, generator=torch.Generator().manual_seed(1)).to(torch.int32)
        slot_of_expert = slot_of_expert.to(b.device)
        for m in ((1, 2) if name != "bf16" else (1,)):
            x = torch.randn(m, hidden, device=b.device, dtype=dtype)
            n_calls = max(1, min(S["max_calls"], slots // (S["top_k"] * m)))
            routes = [_moe_routing(m, i, S, b.device) for i in range(n_calls)]
            args = lambda r: (x, r[0], r[1], slot_of_expert, pool, layout)   # noqa: E731
            kernel, twin_fn = partial(fused_moe, limit=limit), partial(fused_moe_ref, limit=limit)
            # the twin rounds each expert's weighted output to bf16 and adds in bf16; the kernel adds in fp32
            err, ok = b.check(f"fused_moe {name} M={m}", kernel(*args(routes[0])), twin_fn(*args(routes[0])), 5e-2)
            calls = [partial(kernel, *args(r)) for r in routes]
            gpu, eager = b.gpu_ms(calls), b.eager_ms(calls)
            twin = b.eager_ms([partial(twin_fn, *args(r)) for r in routes[:2]], reps=2, warmup=1)
            distinct = len(set(routes[0][0].flatten().tolist()))
            nbytes = distinct * layout.blob_bytes
            t = gpu if gpu is not None else eager
            roof_ms = nbytes / (b.copy_gbs * 1e6) if b.copy_gbs else None
            rows.append([name, m, distinct, nbytes / 1e6, ms_us(gpu), ms_us(eager), nbytes / t / 1e6,
                         None if roof_ms is None else 100 * roof_ms / t, ms_us(twin), twin / t, err, ok])
        del pool
        free()
    clamp = f", SwiGLU clamped at {limit:g}" if limit else ""
    b.table(section, f"fused_moe: one MoE layer ({S['top_k']} experts per token, D={hidden}, I={inter}, bf16{clamp})",
            ["format", "M", "experts read", "MB read", "GPU us", "eager us", "GB/s", "% of copy peak",
             "twin us", "twin / kernel", "max err (rel)", "check"], rows,
            ["GPU us: calls replayed from a CUDA graph; eager us: Python launches included (2 kernels per call)",
             f"% of copy peak: time to read the experts' blobs at the measured copy bandwidth "
             f"({b.copy_gbs or 0:.0f} GB/s) over the kernel's time",
             "twin: fused_moe_ref (dequantize each expert to bf16, then matmuls, combine in bf16)",
             "int4: group 128; int4g32: Kimi-K2-Thinking / K2.5's released experts (symmetric, group 32, bf16 scales); "
             "mxfp4: DeepSeek-V4's released experts (e2m1 codes, a ue8m0 scale per 32)"])


def section_mla(b: Bench, S: dict):
    from dsv3lite.kernels.mla_decode import mla_decode, mla_decode_ref

    heads, rank, rope = S["heads"], S["kv_lora_rank"], S["rope_dim"]
    dk = rank + rope
    dtype = torch.bfloat16 if b.cuda else torch.float32
    rows = []
    for ctx in S["contexts"]:
        for batch in S["batches"]:
            if b.left_s() < 10:
                print(f"  mla: budget spent, skipping ctx={ctx} batch={batch}", file=sys.stderr)
                continue
            cache_bytes = batch * ctx * dk * dtype.itemsize
            q = torch.randn(batch, 1, heads, dk, device=b.device, dtype=dtype)
            caches = rotated(lambda i: torch.randn(batch, ctx, dk, device=b.device, dtype=dtype), cache_bytes, 32)
            seqlens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
            out, lse = mla_decode(q, caches[0], seqlens, MLA_SCALE, rank)
            ref_out, ref_lse = mla_decode_ref(q, caches[0], seqlens, MLA_SCALE, rank)
            err, ok = b.check(f"mla ctx={ctx} batch={batch}", out, ref_out, 2e-2)
            _, ok_lse = b.check(f"mla lse ctx={ctx} batch={batch}", lse, ref_lse, 1e-3)
            del ref_out, ref_lse
            calls = [partial(mla_decode, q, c, seqlens, MLA_SCALE, rank) for c in caches]
            gpu, eager = b.gpu_ms(calls), b.eager_ms(calls)
            twin = b.eager_ms([partial(mla_decode_ref, q, caches[0], seqlens, MLA_SCALE, rank)], reps=2, warmup=1)
            sdpa = sdpa_err = None
            if ctx <= S["sdpa_max_context"] and batch <= S["sdpa_max_batch"]:
                keys = caches[0][:, None].expand(batch, heads, ctx, dk).contiguous()   # [B, H, T, Dk]
                qh = q.transpose(1, 2)                                                   # [B, H, 1, Dk]
                run = partial(F.scaled_dot_product_attention, qh, keys, keys[..., :rank], scale=MLA_SCALE)
                # a baseline's accuracy: reported, not a failure of ours
                sdpa_err, _ = b.check(f"sdpa ctx={ctx} batch={batch}", run().transpose(1, 2), out, 3e-2, record=False)
                sdpa = b.gpu_ms([run]) or b.eager_ms([run])
                del keys
            t = gpu if gpu is not None else eager
            flops = 2 * batch * heads * ctx * (dk + rank)
            rows.append([ctx, batch, cache_bytes / 1e6, ms_us(gpu), ms_us(eager), cache_bytes / t / 1e6,
                         None if not b.copy_gbs else 100 * cache_bytes / t / 1e6 / b.copy_gbs,
                         flops / t / 1e9, ms_us(twin), twin / t, ms_us(sdpa), None if sdpa is None else sdpa / t,
                         sdpa_err, err, ok and ok_lse])
            del caches, q, out, lse
            free()
    b.table("mla", f"mla_decode: absorbed MLA decode, {heads} heads x ({rank} + {rope}), Sq = 1, {dtype}",
            ["context", "batch", "cache MB", "GPU us", "eager us", "GB/s", "% of copy peak", "TFLOP/s",
             "twin us", "twin / kernel", "SDPA us", "SDPA / kernel", "SDPA err", "max err (rel)", "check"], rows,
            [f"bytes: the latent cache read once; FLOPs: 2 x B x H x T x ({dk} + {rank})",
             "SDPA: F.scaled_dot_product_attention over the latent expanded to every head (materialized "
             "beforehand, not timed), only up to 8K context and batch 8",
             f"bf16 matmul peak measured: {b.matmul_tflops or 0:.0f} TFLOP/s"])


def _gemv_weights(fmt: str, n: int, k: int, S: dict, device):
    """(copies of the packed weight as argument tuples, bytes of one copy, the float weight)."""
    from dsv3lite.quant.fp8 import fp8_block_quantize
    from dsv3lite.quant.int4 import int4_quantize

    w = torch.randn(n, k, device=device) * 0.02
    if fmt == "int4":
        packed = int4_quantize(w, 128)
    elif fmt == "fp8":
        packed = fp8_block_quantize(w)
    else:
        packed = (w.to(torch.bfloat16),)
    nbytes = sum(t.numel() * t.element_size() for t in packed)
    copies = rotated(lambda i: tuple(t.clone() for t in packed), nbytes, S["copies"])[:S["copies"]]
    return copies, nbytes, w


def section_gemv(b: Bench, S: dict):
    from dsv3lite.kernels.quant_matmul import w4a16_matmul, w4a16_matmul_ref, w8a16_matmul, w8a16_matmul_ref

    dtype = torch.bfloat16
    rows = []
    for n, k in S["gemv"]:
        bf16_copies, bf16_bytes, _ = _gemv_weights("bf16", n, k, S, b.device)
        for fmt in ("int4", "fp8"):
            if b.left_s() < 8:
                print(f"  gemv: budget spent, skipping {fmt} {n}x{k}", file=sys.stderr)
                continue
            copies, nbytes, _ = _gemv_weights(fmt, n, k, S, b.device)
            if fmt == "int4":
                kernel = partial(w4a16_matmul, k=k, group_size=128)
                twin = partial(w4a16_matmul_ref, k=k, group_size=128)
            else:
                kernel, twin = w8a16_matmul, w8a16_matmul_ref
            for m in S["gemv_rows"]:
                x = torch.randn(m, k, device=b.device, dtype=dtype)
                err, ok = b.check(f"{fmt} {n}x{k} M={m}", kernel(x, *copies[0]), twin(x, *copies[0]), 2e-2)
                calls = [partial(kernel, x, *c) for c in copies]
                gpu, eager = b.gpu_ms(calls), b.eager_ms(calls)
                t = gpu if gpu is not None else eager
                twin_ms = b.eager_ms([partial(twin, x, *copies[0])], reps=3)
                dense = [partial(F.linear, x, c[0]) for c in bf16_copies]
                dense_ms = b.gpu_ms(dense) or b.eager_ms(dense)
                rows.append([fmt, f"{n}x{k}", m, nbytes / 1e6, ms_us(gpu), ms_us(eager), nbytes / t / 1e6,
                             None if not b.copy_gbs else 100 * nbytes / t / 1e6 / b.copy_gbs,
                             2 * m * n * k / t / 1e9, ms_us(dense_ms), dense_ms / t, ms_us(twin_ms), err, ok])
            del copies
            free()
        del bf16_copies
        free()
    b.table("gemv", "w4a16 / w8a16 (x [M, K] bf16, weight [N, K]; rotated through copies > L2)",
            ["format", "N x K", "M", "weight MB", "GPU us", "eager us", "GB/s", "% of copy peak", "TFLOP/s",
             "cuBLAS bf16 us", "bf16 / kernel", "twin us", "max err (rel)", "check"], rows,
            ["int4: group 128 (weight MB includes scales and zeros); fp8: 128x128 block scales",
             "cuBLAS bf16: F.linear on bf16 copies of the same shape (4x the int4 bytes, 2x the fp8 bytes)"])


def _sweep_calls(kernel: str, S: dict, device):
    """(calls of `kernel` at batch 1 on rotating weights, weight bytes a call reads, a check against the twin)."""
    from dsv3lite.kernels.fused_moe import fused_moe, fused_moe_ref
    from dsv3lite.kernels.quant_matmul import w4a16_matmul, w4a16_matmul_ref
    from dsv3lite.quant.formats import get_format

    if kernel == "gemv":
        copies, nbytes, _ = _gemv_weights("int4", *S["gemv"][0], S, device)
        k = S["gemv"][0][1]
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        calls = [partial(w4a16_matmul, x, *c, k=k, group_size=128) for c in copies[:S["max_calls"] * 4]]
        return calls, nbytes, lambda: (calls[0](), w4a16_matmul_ref(x, *copies[0], k, 128))
    hidden, inter, slots = S["hidden"], S["inter"], S["slots"]
    fmt = get_format("int4", 128)
    layout = fmt.layout(inter, hidden)
    pool = _expert_blobs(fmt, inter, hidden, 1, device)[0].expand(slots, -1).contiguous()
    slot_of_expert = torch.full((S["experts"],), -1, dtype=torch.int32)
    slot_of_expert[:slots] = torch.arange(slots, dtype=torch.int32)
    slot_of_expert = slot_of_expert.to(device)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    routes = [_moe_routing(1, i, S, device) for i in range(max(1, min(S["max_calls"], slots // S["top_k"])))]
    args = lambda r: (x, r[0], r[1], slot_of_expert, pool, layout)   # noqa: E731
    nbytes = S["top_k"] * layout.blob_bytes
    return [partial(fused_moe, *args(r)) for r in routes], nbytes, \
        lambda: (fused_moe(*args(routes[0])), fused_moe_ref(*args(routes[0])))


def section_sweep(b: Bench, S: dict):
    """Each batch-1 kernel's candidate configurations (kernels/tuning.py) against its default, while the budget
    lasts; the fastest of each, when it beats the default by more than 3%, goes into tuning.json (--tuning-out),
    which later stages and runs take with DSV3LITE_TUNING."""
    from dsv3lite.kernels import tuning

    rows, chosen = [], {}
    for kernel, candidates in tuning.CANDIDATES.items():
        if b.left_s() < 8:
            print(f"  sweep: budget spent, skipping {kernel}", file=sys.stderr)
            break
        calls, nbytes, check = _sweep_calls(kernel, S, b.device)
        timed = []
        for knobs in [{}] + candidates:
            if b.left_s() < 4:
                break
            with tuning.trying(kernel, "rows", knobs):
                try:
                    got, want = check()
                    err, ok = b.check(f"sweep {kernel} {knobs}", got, want, 5e-2)
                    t = b.gpu_ms(calls) or b.eager_ms(calls)
                except Exception as e:                  # a candidate that fails is reported, never chosen
                    rows.append([kernel, knobs or "default", None, None, None, f"{type(e).__name__}: {e}"[:80], False])
                    continue
            timed.append((t, knobs, ok))
            rows.append([kernel, knobs or "default", ms_us(t), nbytes / t / 1e6,
                         None if not b.copy_gbs else 100 * nbytes / t / 1e6 / b.copy_gbs, err, ok])
        default = next((t for t, k, ok in timed if not k), None)
        best = min(((t, k) for t, k, ok in timed if ok and k), default=None, key=lambda tk: tk[0])
        if default is not None and best is not None and best[0] < 0.97 * default:
            chosen[kernel] = {"rows": best[1]}
        free()
    b.tuning = chosen
    b.table("sweep", "Batch-1 configurations (GPU time; the first row of each kernel is the default; int4, bf16)",
            ["kernel", "config", "GPU us", "GB/s", "% of copy peak", "max err (rel)", "check"], rows,
            [f"chosen (tuning.json, DSV3LITE_TUNING): {json.dumps(chosen) if chosen else 'the defaults'}",
             "fused_moe rows time the whole layer (both launches) with the candidate on one of them"])


def section_prefill(b: Bench, S: dict, formats=("int4", "fp8", "int4g32"), section="prefill"):
    """The grouped kernels against the dequantizing path they replace, one MoE layer of a prompt."""
    from dsv3lite.kernels.fused_moe import fused_moe_grouped, fused_moe_grouped_ref
    from dsv3lite.quant.formats import get_format

    hidden, inter, experts, top_k = S["hidden"], S["inter"], S["experts"], S["top_k"]
    limit = S.get("swiglu_limit")
    rows = []
    for name in formats:
        if b.left_s() < 10:
            break
        fmt = get_format(name, 128)
        layout = fmt.layout(inter, hidden)
        real = _expert_blobs(fmt, inter, hidden, 2, b.device)
        pool = torch.stack([real[e % 2] for e in range(experts)])         # every expert of the layer resident
        del real
        slot_of_expert = torch.arange(experts, dtype=torch.int32, device=b.device)
        for tokens in S["prefill_tokens"]:
            if b.left_s() < 8:
                break
            gen = torch.Generator().manual_seed(tokens)
            ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(b.device)
            weights = (torch.rand(tokens, top_k, generator=gen) + 0.1).to(b.device)
            x = torch.randn(tokens, hidden, device=b.device, dtype=torch.bfloat16)
            args = (x, ids, weights, slot_of_expert, pool, layout)
            kernel = partial(fused_moe_grouped, *args, limit=limit)
            twin_fn = partial(fused_moe_grouped_ref, *args, limit=limit)
            got, want = kernel(), twin_fn()
            err, ok = b.check(f"grouped {name} {tokens} tokens", got, want, 5e-2)
            del got, want
            t = b.eager_ms([kernel], reps=3)
            twin = b.eager_ms([twin_fn], reps=1, warmup=1)
            flops = 2 * 3 * tokens * top_k * hidden * inter
            rows.append([name, tokens, len(set(ids.flatten().tolist())), t, twin, twin / t, flops / t / 1e9,
                         None if not b.matmul_tflops else 100 * flops / t / 1e9 / b.matmul_tflops, err, ok])
        del pool
        free()
    clamp = f", SwiGLU clamped at {limit:g}" if limit else ""
    b.table(section, f"Routed experts of one MoE layer over a prompt ({experts} experts, top-{top_k}, D={hidden}, "
            f"I={inter}, bf16{clamp}): grouped kernels vs dequantizing each expert",
            ["format", "tokens", "experts hit", "grouped ms", "dequantizing ms", "speedup", "TFLOP/s",
             "% of bf16 matmul peak", "max err (rel)", "check"], rows,
            ["grouped: fused_moe_grouped (expert-major tiles, weights decoded in registers, no host sync); "
             "dequantizing: fused_moe_grouped_ref, the path prefill took before (each expert dequantized through "
             "fp32, then matmuls)"])


def section_v4moe(b: Bench, S: dict):
    """DeepSeek-V4-Flash's mxfp4 experts with their clamp: decode (the moe table), then prefill."""
    section_moe(b, S["v4"], ("mxfp4",), "v4moe")
    if b.left_s() > 10:
        section_prefill(b, S["v4"], ("mxfp4",), "v4moe")


def section_v4attn(b: Bench, S: dict):
    from dsv3lite.kernels.v4_attention import v4_decode_attention, v4_decode_attention_ref

    V = S["v4"]
    heads, dim, window, ring = V["heads"], V["head_dim"], V["window"], V["ring"]
    dtype = torch.bfloat16 if b.cuda else torch.float32
    scale = dim ** -0.5
    rows = []
    for name, n_entries, topk, sq, batches in V["attention"]:
        for batch in batches:
            if b.left_s() < 6:
                print(f"  v4attn: budget spent, skipping {name} batch={batch}", file=sys.stderr)
                continue
            ratio = 4 if topk else 128
            start = max(n_entries * ratio, 4 * window)                 # the context the entries summarise
            gen = torch.Generator().manual_seed(batch)
            q = torch.randn(batch, sq, heads, dim, generator=gen).to(b.device, dtype)
            sink = torch.randn(heads, generator=gen).to(b.device)
            state_bytes = batch * (ring + n_entries) * dim * dtype.itemsize
            states = rotated(lambda i: (torch.randn(batch, ring, dim, device=b.device, dtype=dtype),
                                        torch.randn(batch, n_entries, dim, device=b.device, dtype=dtype)
                                        if n_entries else None), state_bytes, 16)
            idx = None
            if topk:
                idx = torch.stack([torch.randperm(n_entries, generator=gen)[:topk] for _ in range(batch * sq)])
                idx = idx.view(batch, sq, topk).to(torch.int32).to(b.device)

            def run(st, f=v4_decode_attention):
                return f(q, st[0], start, window, sink, scale, st[1], idx, ratio)
            err, ok = b.check(f"v4attn {name} batch={batch}", run(states[0]), run(states[0], v4_decode_attention_ref),
                              2e-2)
            calls = [partial(run, st) for st in states]
            gpu, eager = b.gpu_ms(calls), b.eager_ms(calls)
            twin = b.eager_ms([partial(run, states[0], v4_decode_attention_ref)], reps=2, warmup=1)
            keys = window + (topk or (min(n_entries, (start + 1) // ratio) if n_entries else 0))
            nbytes = batch * keys * dim * dtype.itemsize          # each key row once (the head blocks share it)
            t = gpu if gpu is not None else eager
            rows.append([name, sq, batch, keys, nbytes / 1e6, ms_us(gpu), ms_us(eager), nbytes / t / 1e6,
                         None if not b.copy_gbs else 100 * nbytes / t / 1e6 / b.copy_gbs, ms_us(twin), twin / t,
                         err, ok])
            del states, q
            free()
    b.table("v4attn", f"v4_decode_attention: DeepSeek-V4 decode, {heads} heads over {dim}-wide key = value rows "
            f"(MQA), window {window} + compressed entries, the sink, {dtype}",
            ["layer", "Sq", "batch", "keys a query", "MB read", "GPU us", "eager us", "GB/s", "% of copy peak",
             "twin us", "twin / kernel", "max err (rel)", "check"], rows,
            ["MB read: each key row once per sequence (window rows from the ring, then the CSA top-k or every "
             "visible HCA entry); the 16-head blocks of a query read the same rows (from L2)",
             "states rotated through copies > L2; twin: v4_decode_attention_ref (the eager attention's math)"])
    _v4_indexer_table(b, V, dtype)


def _v4_indexer_table(b: Bench, V: dict, dtype):
    from dsv3lite.kernels.v4_indexer import index_scores, index_scores_ref

    heads, dim = V["index_heads"], V["index_dim"]
    rows = []
    for n, batches in V["indexer"]:
        for batch in batches:
            if b.left_s() < 5:
                print(f"  v4attn: budget spent, skipping the indexer over {n} keys", file=sys.stderr)
                continue
            gen = torch.Generator().manual_seed(n + batch)
            q = torch.randn(batch, 1, heads, dim, generator=gen).to(b.device, dtype)
            weights = (torch.randn(batch, 1, heads, generator=gen) * heads ** -0.5).to(b.device)
            nbytes = batch * n * dim * dtype.itemsize
            copies = rotated(lambda i: torch.randn(batch, n, dim, device=b.device, dtype=dtype), nbytes, 16)
            start = 4 * n
            got = index_scores(q, weights, copies[0], start, 4)
            err, ok = b.check(f"indexer {n} keys batch={batch}", got,
                              index_scores_ref(q, weights, copies[0], torch.tensor([start], device=b.device), 4), 1e-2)
            calls = [partial(index_scores, q, weights, k, start, 4) for k in copies]
            gpu, eager = b.gpu_ms(calls), b.eager_ms(calls)
            t = gpu if gpu is not None else eager
            rows.append([n, 4 * n, batch, nbytes / 1e6, ms_us(gpu), ms_us(eager), nbytes / t / 1e6,
                         None if not b.copy_gbs else 100 * nbytes / t / 1e6 / b.copy_gbs, err, ok])
            del copies, got
            free()
    b.table("v4attn", f"index_scores: the lightning indexer's scan at decode ({heads} heads x {dim}, every key, "
            f"{dtype}; the top-k after it is torch's)", ["keys", "context", "batch", "MB read", "GPU us", "eager us",
                                                      "GB/s", "% of copy peak", "max err (rel)", "check"], rows,
            ["at 1M context this scan is the largest read of a V4-Flash decode step (docs/dsv4-math.md §8)"])
    _v4_compressor_table(b, V, dtype)


def _v4_compressor_table(b: Bench, V: dict, dtype):
    from dsv3lite.kernels.v4_compressor import compress_entry, compress_entry_ref

    rows = []
    for name, width, ratio, overlap, batches in V["compressors"]:
        for batch in batches:
            if b.left_s() < 4:
                print(f"  v4attn: budget spent, skipping the {name} compressor batch={batch}", file=sys.stderr)
                continue
            gen = torch.Generator().manual_seed(width + batch)
            ring_rows, channels = ratio * (2 if overlap else 1) + 3, width * (2 if overlap else 1)
            cv = torch.randn(batch, ring_rows, channels, generator=gen).to(b.device)
            g = torch.randn(batch, ring_rows, channels, generator=gen).to(b.device)
            weight = torch.rand(width, generator=gen).to(b.device) + 0.5
            window = 1000
            angles = torch.rand(V["rope_dim"] // 2, generator=gen) * 6
            cos, sin = angles.cos().to(b.device, dtype), angles.sin().to(b.device, dtype)
            entries = torch.zeros(batch, window + 1, width, device=b.device, dtype=dtype)
            kernel = partial(compress_entry, cv, g, entries, window, ratio, overlap, weight, 1e-6, cos, sin)
            twin = partial(compress_entry_ref, cv, g, window, ratio, overlap, weight, 1e-6, cos, sin, dtype)
            kernel()
            err, ok = b.check(f"compressor {name} batch={batch}", entries[:, window], twin(), 2e-2)
            gpu, eager, ops = b.gpu_ms([kernel]), b.eager_ms([kernel]), b.eager_ms([twin])
            nbytes = batch * (2 if overlap else 1) * ratio * width * 2 * 4        # the window's Cv and G, fp32
            rows.append([name, width, ratio, batch, nbytes / 1e6, ms_us(gpu), ms_us(eager), ms_us(ops), ops / eager,
                         err, ok])
            del cv, g, entries
            free()
    b.table("v4attn", f"compress_entry: a compressor's entry at decode (pooled from the fp32 rings, normed, rotated; "
            f"{dtype})", ["compressor", "width", "ratio", "batch", "MB read", "GPU us", "eager us", "operators us",
                          "operators / kernel (eager)", "max err (rel)", "check"], rows,
            ["operators: the twin, the eager path's operators (ring gathers, softmax, norm, rotation) that the kernel "
             "replaces; both timed as launched", "a CSA layer pools two entries every 4 tokens, an HCA layer one "
             "every 128"])


SECTIONS = {"peaks": section_peaks, "moe": section_moe, "mla": section_mla, "gemv": section_gemv,
            "sweep": section_sweep, "prefill": section_prefill, "v4moe": section_v4moe, "v4attn": section_v4attn}


def _device_name(b: Bench) -> str:
    if b.cuda:
        p = torch.cuda.get_device_properties(b.device)
        return f"{p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB"
    return f"CPU ({platform.processor() or platform.machine()}), Triton interpreter"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="results directory")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, in this order")
    ap.add_argument("--budget-s", type=float, default=90.0, help="soft time limit: later work is skipped past it")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in Triton's interpreter (logic check)")
    ap.add_argument("--tuning-out", type=Path, help="where the sweep writes its choices (JSON for DSV3LITE_TUNING)")
    ap.add_argument("--dry-run", action="store_true", help="check the arguments and imports, measure nothing")
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"gpu_kernels.py: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("gpu_kernels.py: needs Triton (pip install triton)", file=sys.stderr)
        return 2
    if args.dry_run:
        import dsv3lite.kernels.fused_moe, dsv3lite.kernels.mla_decode, dsv3lite.kernels.quant_matmul  # noqa: F401
        import dsv3lite.kernels.v4_attention, dsv3lite.kernels.v4_compressor  # noqa: F401
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"kernels_{'_'.join(sections)}.md").write_text(
            f"### kernels (dry run): sections {', '.join(sections)}, budget {args.budget_s:.0f} s\n")
        if args.tuning_out is not None:
            args.tuning_out.write_text("{}\n")         # what a sweep that keeps the defaults writes
        print(f"gpu_kernels.py: dry run: sections {', '.join(sections)}")
        return 0
    if not args.tiny and not torch.cuda.is_available():
        print("gpu_kernels.py: needs a CUDA GPU (torch.cuda.is_available() is False); "
              "run with --tiny for a logic check on CPU", file=sys.stderr)
        return 2

    device = torch.device("cpu" if args.tiny else "cuda")
    S = TINY if args.tiny else V3
    b = Bench(args.out, device, args.budget_s, S["reps"])
    header = (f"# dsv3lite kernels, {time.strftime('%Y-%m-%d %H:%M:%S')}\n\n- device: {_device_name(b)}\n"
              f"- torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}\n"
              f"- command: python {' '.join(sys.argv)}\n")
    (args.out / "kernels_env.md").write_text(header)
    print(header, flush=True)
    torch.manual_seed(0)
    errors = []
    for name in sections:
        if b.left_s() <= 0:
            print(f"== {name}: skipped, time budget of {args.budget_s:.0f} s spent", file=sys.stderr)
            continue
        t0 = time.time()
        print(f"== {name}", flush=True)
        try:
            SECTIONS[name](b, S)
        except Exception as e:   # keep what the other sections measure
            traceback.print_exc()
            errors.append(f"{name}: {type(e).__name__}: {e}")
            with (args.out / f"kernels_{name}.md").open("a") as f:
                f.write(f"### {name}: FAILED\n\n```\n{traceback.format_exc()[-3000:]}\n```\n\n")
            free()
        print(f"== {name}: {time.time() - t0:.1f} s", flush=True)
    if args.tuning_out is not None and "sweep" in sections:
        args.tuning_out.write_text(json.dumps(b.tuning, indent=1) + "\n")
    summary = [f"total {time.time() - b.start:.1f} s"] + [f"check failed: {f}" for f in b.failures] + \
              [f"section failed: {e}" for e in errors]
    with (args.out / "kernels_env.md").open("a") as f:
        f.write("\n" + "\n".join(f"- {s}" for s in summary) + "\n")
    print("\n".join(summary), flush=True)
    return 1 if (b.failures or errors) else 0


if __name__ == "__main__":
    sys.exit(main())
