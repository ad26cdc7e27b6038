"""dsv3lite against llama.cpp on this CPU, side by side, at equal bits and equal threads.

Tables (medians of alternating rounds, both sides with the same thread count):
  (a) one DeepSeek-V3 routed expert (gate/up 2048x7168, down 7168x2048) at batch 1, weights rotated past the
      caches: dsv3lite's CPU kernel per format (one expert a call, and 8 a call as a decode step does) next to
      ggml Q4_0 / Q4_K / Q8_0 / BF16 (a small ggml program: the same SwiGLU through ggml's CPU backend, weights
      in the buffer llama.cpp would put them in: its AMX or repack buffer where it has one; for Q4_0 / Q8_0 also
      the AVX2 / AVX-512 buffers a CPU without AMX uses), in ms, GB/s and fraction of the read bandwidth
      measured here (the best of plain and prefetched streaming reads);
  (b) the bundled demo, 64-token prompt then 128 tokens: dsv3lite fp32 / int4 / 8-bit (int8 and fp8 experts) vs
      llama.cpp F32 / Q4_0 / Q8_0 (llama-bench), decode and prefill, MTP off (llama.cpp has none for V3) and
      dsv3lite with MTP;
  (c) a slice of DeepSeek-V3 at its real widths (3 layers of which 1 dense, 16 routed experts, bf16 HF checkpoint
      written by dsv3lite.testing_realwidth): decode, dsv3lite's CPU configurations vs llama.cpp Q4_0 and Q8_0;
  (k) one Kimi-K2-Thinking / K2.5 routed expert (the same 7168 x 2048 shape) at batch 1: int4g32, the int4 its
      experts are released in, next to int4 g128 and ggml Q4_0 as in (a), and each kernel's error against the
      exact product of its own weights (its int8 activations per group: 32 for int4g32, 128 for int4).

llama.cpp is built once into ~/.cache/dsv3lite/llama.cpp from the llama-cpp-python source package (pip download,
cmake, CPU backend, native flags; about 8 minutes on 2 cores), only when this script needs it and never in tests or
CI; checkpoints are converted with its vendored convert_hf_to_gguf.py (the demo tokenizer's BPE pre-tokenizer,
unknown to it, mapped to gpt-2) and quantized with llama-quantize. Before each table it waits (up to --wait s)
for the 1-minute load average to fall below --quiet, and reports the load it started at.

    python benchmarks/cpu_peer.py                          # tables a, b, c; 2 threads; 5 rounds
    python benchmarks/cpu_peer.py --tables a --threads 1,2 --rounds 7
    python benchmarks/cpu_peer.py --tables q               # the kernels' numerics: quality on the demo
    python benchmarks/cpu_peer.py --tables k --rounds 7    # Kimi's int4g32 expert against int4 and Q4_0
    python benchmarks/cpu_peer.py --tables ABC             # DeepSeek-V4's tables (benchmarks/peer_v4.py)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

LLAMA_VERSION = "0.3.36"                     # llama-cpp-python source package (ggml 0.25.3)
CACHE = Path(os.environ.get("DSV3LITE_BENCH_CACHE", Path.home() / ".cache" / "dsv3lite"))
LLAMA_ROOT = CACHE / "llama.cpp"
TARGETS = ("llama-bench", "llama-quantize")
EXPERT_I, EXPERT_D = 2048, 7168              # DeepSeek-V3 routed expert
ROTATE_BYTES = 400e6                         # weights touched per round: past a 105 MiB L3
# ggml types and buffers: llama.cpp's own choice (auto: AMX where the CPU has it), and for Q4_0 / Q8_0 also the
# AVX2 / AVX-512 paths a CPU without AMX runs (CPU_REPACK: Q4_0 interleaved 8x8; CPU: plain blocks)
GGML_ROWS = (("q4_0", "auto"), ("q4_0", "CPU_REPACK"), ("q4_k", "auto"), ("q8_0", "auto"), ("q8_0", "CPU"),
             ("bf16", "auto"))
KIMI_FORMATS = ("int4g32", "int4")          # table k: Kimi's released int4 and dsv3lite's own, beside Q4_0
KIMI_GGML_ROWS = (("q4_0", "auto"), ("q4_0", "CPU_REPACK"))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wait_for_quiet(threshold: float, max_wait: float) -> float:
    """Sleep until the 1-minute load average is below `threshold` (at most `max_wait` s); returns it."""
    t0 = time.time()
    while True:
        load = os.getloadavg()[0]
        if load < threshold or time.time() - t0 > max_wait:
            return load
        log(f"load {load:.2f} >= {threshold}: waiting")
        time.sleep(20)


# --- llama.cpp: source package, build, conversion -------------------------------------------------------------

def llama_src() -> Path:
    src = LLAMA_ROOT / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    if src.is_dir():
        return src
    LLAMA_ROOT.mkdir(parents=True, exist_ok=True)
    sdist = LLAMA_ROOT / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz"
    if not sdist.exists():
        log(f"downloading the llama-cpp-python {LLAMA_VERSION} source package")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={LLAMA_VERSION}", "-d", str(LLAMA_ROOT)], check=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(LLAMA_ROOT, filter="data")
    return src


def llama_bin(name: str) -> Path:
    return llama_src() / "build" / "bin" / name


def build_llama() -> Path:
    src = llama_src()
    if all(llama_bin(t).exists() for t in TARGETS):
        return src
    log("building llama.cpp (CPU backend, native): about 8 minutes on 2 cores")
    gen = ["-G", "Ninja"] if subprocess.run(["which", "ninja"], capture_output=True).returncode == 0 else []
    subprocess.run(["cmake", "-B", "build", *gen, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_SERVER=OFF"], cwd=src, check=True,
                   stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", "build", "-j", str(os.cpu_count() or 2), "--target", *TARGETS], cwd=src,
                   check=True, stdout=subprocess.DEVNULL)
    return src


# a 2-line wrapper around the vendored converter: a BPE pre-tokenizer it does not know is taken as gpt-2's
CONVERT = """
import runpy, sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[1:]
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""


# GGUF kinds beyond llama-quantize's own types: kind -> (its type argument, options before the paths)
QUANTIZE_AS: dict[str, tuple[str, list[str]]] = {}


def gguf(hf_dir: Path, kind: str, out_dir: Path, base: str = "BF16") -> Path:
    """The checkpoint as a GGUF of `kind` (F32 | BF16 | Q4_0 | Q8_0, or a kind of QUANTIZE_AS), converted to `base`
    and quantized from it, once."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"model-{kind}.gguf"
    if path.exists():
        return path
    src = build_llama()
    base = "F32" if kind == "F32" else base
    base_path = out_dir / f"model-{base}.gguf"
    if not base_path.exists():
        log(f"converting {hf_dir} to {base_path.name}")
        subprocess.run([sys.executable, "-c", CONVERT.format(src=str(src)), str(hf_dir), "--outtype", base.lower(),
                        "--outfile", str(base_path)], check=True, stdout=subprocess.DEVNULL)
    if kind != base:
        log(f"quantizing {base_path.name} to {kind}")
        qtype, options = QUANTIZE_AS.get(kind, (kind, []))
        subprocess.run([str(llama_bin("llama-quantize")), *options, str(base_path), str(path), qtype], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return path


NO_REPACK: set[Path] = set()                 # models whose run aborts with weights repacked (ggml 0.25.3, small shapes)


def llama_bench(model: Path, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    """{"prefill": tok/s of a n_prompt-token batch, "decode": tok/s of n_gen tokens} from one llama-bench run. The
    weights are repacked as llama.cpp does by default; where that aborts, the run is repeated without (--repack 0)."""
    cmd = [str(llama_bin("llama-bench")), "-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
           "-r", "1", "-o", "json"]
    run = subprocess.run(cmd + (["--repack", "0"] if model in NO_REPACK else []), capture_output=True, text=True)
    if run.returncode != 0 and model not in NO_REPACK:
        log(f"llama-bench aborts on {model.name} with repacked weights: --repack 0")
        NO_REPACK.add(model)
        run = subprocess.run(cmd + ["--repack", "0"], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"llama-bench failed on {model}: {run.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(run.stdout)
    res = {}
    for r in rows:
        res["prefill" if r["n_prompt"] else "decode"] = float(r["avg_ts"])
    return res


# --- (a) one real-width expert -----------------------------------------------------------------------------

GGML_EXPERT_CPP = r'''
// One routed expert (DeepSeek-V3's gate/up 2048x7168, down 7168x2048, or I x D) through ggml's CPU backend at batch 1
// (mul_mat, mul_mat, swiglu, mul_mat) over COPIES copies of the weights, in ggml's repack buffer where it has a layout
// for the type; and a read-bandwidth probe.
//   ggml_expert TYPE COPIES THREADS REPS [BUFFER [I D]]  -> "ms <median per expert> bytes <weight bytes> buffer <name>"
//   (BUFFER: auto = llama.cpp's choice, or AMX | CPU_REPACK | CPU)
//   ggml_expert bw THREADS                -> "gbs <GB/s>"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

static int bandwidth(int threads) {    // the best of plain and software-prefetched streaming reads of 1 GiB
  const size_t n = size_t(1) << 30;
  uint8_t* buf = static_cast<uint8_t*>(aligned_alloc(64, n));
  for (size_t i = 0; i < n; ++i) buf[i] = static_cast<uint8_t>(i);
  double best = 1e9;
  std::atomic<long> sink{0};
  for (int pf : {0, 1024, 4096, 8192})
    for (int rep = 0; rep < 4; ++rep) {
      double t0 = now();
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          const uint8_t* base = buf + n / threads * t;
          __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
          for (size_t i = 0; i < n / threads; i += 128) {
            if (pf) {
              _mm_prefetch(reinterpret_cast<const char*>(base + i + pf), _MM_HINT_T0);
              _mm_prefetch(reinterpret_cast<const char*>(base + i + pf + 64), _MM_HINT_T0);
            }
            const __m256i* p = reinterpret_cast<const __m256i*>(base + i);
            a0 = _mm256_add_epi8(a0, _mm256_load_si256(p)); a1 = _mm256_add_epi8(a1, _mm256_load_si256(p + 1));
            a2 = _mm256_add_epi8(a2, _mm256_load_si256(p + 2)); a3 = _mm256_add_epi8(a3, _mm256_load_si256(p + 3));
          }
          a0 = _mm256_add_epi8(_mm256_add_epi8(a0, a1), _mm256_add_epi8(a2, a3));
          sink += _mm256_extract_epi8(a0, 0);
        });
      for (auto& t : ts) t.join();
      best = std::min(best, now() - t0);
    }
  printf("gbs %.3f\n", n / best / 1e9);
  return 0;
}

int main(int argc, char** argv) {
  if (argc >= 3 && std::string(argv[1]) == "bw") return bandwidth(atoi(argv[2]));
  if (argc < 5) { fprintf(stderr, "usage: ggml_expert TYPE COPIES THREADS REPS | bw THREADS\n"); return 2; }
  std::string tn = argv[1];
  ggml_type type = tn == "q4_0" ? GGML_TYPE_Q4_0 : tn == "q4_k" ? GGML_TYPE_Q4_K : tn == "q8_0" ? GGML_TYPE_Q8_0
                 : tn == "bf16" ? GGML_TYPE_BF16 : tn == "mxfp4" ? GGML_TYPE_MXFP4 : GGML_TYPE_F32;
  const int copies = atoi(argv[2]), threads = atoi(argv[3]), reps = atoi(argv[4]);
  const int64_t I = argc > 7 ? atoll(argv[6]) : 2048, D = argc > 7 ? atoll(argv[7]) : 7168;
  ggml_backend_load_all();
  ggml_backend_t backend = ggml_backend_cpu_init();
  ggml_backend_cpu_set_n_threads(backend, threads);
  ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
  auto get_extra = (ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(
      ggml_backend_dev_backend_reg(dev), "ggml_backend_dev_get_extra_bufts");
  std::vector<ggml_backend_buffer_type_t> bufts;        // llama.cpp's order: extra buffers (AMX, CPU_REPACK), then CPU
  if (get_extra) for (ggml_backend_buffer_type_t* b = get_extra(dev); b && *b; ++b) bufts.push_back(*b);
  bufts.push_back(ggml_backend_dev_buffer_type(dev));
  const std::string want = argc > 5 ? argv[5] : "auto";
  ggml_init_params wp = {size_t(copies) * 3 * ggml_tensor_overhead() + 1024, nullptr, true};
  ggml_context* wctx = ggml_init(wp);
  std::vector<ggml_tensor*> gate(copies), up(copies), down(copies);
  for (int c = 0; c < copies; ++c) {
    gate[c] = ggml_new_tensor_2d(wctx, type, D, I);
    up[c] = ggml_new_tensor_2d(wctx, type, D, I);
    down[c] = ggml_new_tensor_2d(wctx, type, I, D);
  }
  // the first buffer type whose tensors the CPU backend computes a batch-1 mul_mat from (as llama.cpp chooses)
  ggml_init_params pp = {ggml_tensor_overhead() * 8, nullptr, true};
  ggml_context* probe = ggml_init(pp);
  ggml_tensor* px = ggml_new_tensor_2d(probe, GGML_TYPE_F32, D, 1);
  ggml_tensor* ph = ggml_new_tensor_2d(probe, GGML_TYPE_F32, I, 1);
  ggml_tensor* pg = ggml_mul_mat(probe, gate[0], px);
  ggml_tensor* pd = ggml_mul_mat(probe, down[0], ph);
  ggml_backend_buffer_t wbuf = nullptr;
  const char* used = "none";
  for (ggml_backend_buffer_type_t b : bufts) {
    if (want != "auto" && want != ggml_backend_buft_name(b)) continue;
    wbuf = ggml_backend_alloc_ctx_tensors_from_buft(wctx, b);
    // CPU_REPACK takes a tensor only where it has a layout for it (it sets tensor->extra)
    const bool laid_out = std::string(ggml_backend_buft_name(b)) != "CPU_REPACK" || (gate[0]->extra && down[0]->extra);
    if (wbuf && laid_out && ggml_backend_dev_supports_op(dev, pg) && ggml_backend_dev_supports_op(dev, pd)) {
      used = ggml_backend_buft_name(b);
      break;
    }
    if (wbuf) ggml_backend_buffer_free(wbuf);
    wbuf = nullptr;
    for (ggml_tensor* t = ggml_get_first_tensor(wctx); t; t = ggml_get_next_tensor(wctx, t))
      t->buffer = nullptr, t->data = nullptr, t->extra = nullptr;
  }
  if (!wbuf) { fprintf(stderr, "no buffer type takes these weights\n"); return 1; }
  std::mt19937 rng(0);
  std::normal_distribution<float> nd(0.f, 0.02f);
  auto fill = [&](ggml_tensor* t) {
    const int64_t k = t->ne[0], n = t->ne[1];
    std::vector<float> src(k * n);
    for (auto& v : src) v = nd(rng);
    std::vector<uint8_t> dst(ggml_row_size(type, k) * n);
    if (type == GGML_TYPE_F32) memcpy(dst.data(), src.data(), dst.size());
    else if (type == GGML_TYPE_BF16) ggml_fp32_to_bf16_row(src.data(), (ggml_bf16_t*) dst.data(), k * n);
    else ggml_quantize_chunk(type, src.data(), dst.data(), 0, n, k, nullptr);
    return dst;
  };
  {
    auto g = fill(gate[0]), u = fill(up[0]), d = fill(down[0]);
    for (int c = 0; c < copies; ++c) {
      ggml_backend_tensor_set(gate[c], g.data(), 0, g.size());
      ggml_backend_tensor_set(up[c], u.data(), 0, u.size());
      ggml_backend_tensor_set(down[c], d.data(), 0, d.size());
    }
  }
  ggml_init_params cp = {ggml_tensor_overhead() * (copies * 6 + 8) + ggml_graph_overhead_custom(copies * 8, false) + 1024,
                         nullptr, true};
  ggml_context* cctx = ggml_init(cp);
  ggml_tensor* x = ggml_new_tensor_2d(cctx, GGML_TYPE_F32, D, 1);
  ggml_cgraph* gf = ggml_new_graph_custom(cctx, copies * 8, false);
  for (int c = 0; c < copies; ++c) {
    ggml_tensor* h = ggml_swiglu_split(cctx, ggml_mul_mat(cctx, gate[c], x), ggml_mul_mat(cctx, up[c], x));
    ggml_build_forward_expand(gf, ggml_mul_mat(cctx, down[c], h));
  }
  ggml_gallocr_t galloc = ggml_gallocr_new(ggml_backend_get_default_buffer_type(backend));
  ggml_gallocr_alloc_graph(galloc, gf);
  std::vector<float> xv(D);
  for (auto& v : xv) v = nd(rng) * 50;
  ggml_backend_tensor_set(x, xv.data(), 0, xv.size() * 4);
  ggml_backend_graph_compute(backend, gf);
  std::vector<double> ts;
  for (int r = 0; r < reps; ++r) {
    double t0 = now();
    ggml_backend_graph_compute(backend, gf);
    ts.push_back((now() - t0) / copies);
  }
  std::sort(ts.begin(), ts.end());
  printf("ms %.4f bytes %zu buffer %s\n", ts[ts.size() / 2] * 1e3, ggml_nbytes(gate[0]) + ggml_nbytes(up[0]) +
         ggml_nbytes(down[0]), used);
  return 0;
}
'''


def ggml_expert_bin() -> Path:
    src = build_llama()
    exe = LLAMA_ROOT / "ggml_expert"
    cpp = LLAMA_ROOT / "ggml_expert.cpp"
    if not exe.exists() or cpp.read_text() != GGML_EXPERT_CPP:
        cpp.write_text(GGML_EXPERT_CPP)
        lib = src / "build" / "bin"
        subprocess.run(["g++", "-O2", "-march=native", "-std=c++17", f"-I{src}/ggml/include", str(cpp), f"-L{lib}",
                        "-lggml", "-lggml-base", "-lggml-cpu", f"-Wl,-rpath,{lib}", "-lpthread", "-o", str(exe)],
                       check=True)
    return exe


BITS = {"q4_0": 4.5, "q4_k": 4.5, "q8_0": 8.5, "bf16": 16, "mxfp4": 4.25}      # ggml bits per weight


def ggml_expert(kind: str, threads: int, reps: int = 5, buffer: str = "auto", inter: int = EXPERT_I,
                dim: int = EXPERT_D) -> tuple[float, int, str]:
    """(ms per expert, weight bytes, buffer type) of ggml type `kind` for an expert of gate/up inter x dim; buffer
    auto: the one llama.cpp picks."""
    copies = int(ROTATE_BYTES // (3 * inter * dim * BITS[kind] / 8)) + 1
    out = subprocess.run([str(ggml_expert_bin()), kind, str(copies), str(threads), str(reps), buffer, str(inter),
                          str(dim)], capture_output=True, text=True, check=True).stdout.split()
    return float(out[1]), int(out[3]), out[5]


def read_bandwidth(threads: int) -> float:
    out = subprocess.run([str(ggml_expert_bin()), "bw", str(threads)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[1])


class ExpertPool:
    """Copies of one random real-width expert in a dsv3lite format, enough of them to rotate past the caches."""

    def __init__(self, name: str, inter: int = EXPERT_I, dim: int = EXPERT_D, act: str | None = None):
        from dsv3lite.quant.formats import get_format
        from dsv3lite.quant.int4 import Int4Format

        self.name, self.act = name, act            # act: the mxfp4 kernel's activations (None: its default)
        fmt = Int4Format(128, clip_search=False) if name == "int4" else get_format(name)   # same layout, quicker
        self.fmt, self.layout = fmt, fmt.layout(inter, dim)
        n = max(int(ROTATE_BYTES // self.layout.blob_bytes) + 1, 9)
        gen = torch.Generator().manual_seed(0)
        w = [torch.randn(inter, dim, generator=gen) * 0.02, torch.randn(inter, dim, generator=gen) * 0.02,
             torch.randn(dim, inter, generator=gen) * 0.02]
        self.pool = torch.empty(n, self.layout.blob_bytes, dtype=torch.uint8)
        fmt.pack(*w, out=self.pool[0])
        for i in range(1, n):
            self.pool[i].copy_(self.pool[0])
        self.x = torch.randn(1, dim, generator=gen)

    def error(self) -> float:
        """Relative error of the kernel's output for self.x against the exact product of the blob's own weights
        (dequantized in fp32): what its rounding of the activations costs."""
        from dsv3lite.kernels.cpu_experts import cpu_experts_forward, expert_weights_ref
        from dsv3lite.quant.layout import swiglu_ref

        one = torch.zeros(1, 1, dtype=torch.long)
        got = cpu_experts_forward(self.x, one, torch.ones(1, 1), self.pool[:1], self.layout, act=self.act)
        want = swiglu_ref(self.x.double(), *(w.double() for w in expert_weights_ref(self.pool[0], self.layout)))
        return ((got.double() - want).norm() / want.norm()).item()

    def time(self, per_call: int, reps: int = 5) -> float:
        """Median seconds per expert, `per_call` experts of one token in each call."""
        from dsv3lite.kernels.cpu_experts import blob_pointers, cpu_experts_forward

        n = self.pool.shape[0]
        ptrs = blob_pointers(self.pool, n, self.layout)
        calls = [torch.arange(j, j + per_call)[None] for j in range(0, n - per_call + 1, per_call)]
        w = torch.full((1, per_call), 1.0 / per_call)
        run = (lambda ids: cpu_experts_forward(self.x, ids, w, self.pool, self.layout, ptrs=ptrs, act=self.act)) \
            if self.name != "nf4" else (lambda ids: self.fmt.expert_forward(self.pool[int(ids[0, 0])], self.x, self.layout))
        for ids in calls:
            run(ids)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for ids in calls:
                run(ids)
            ts.append((time.perf_counter() - t0) / (len(calls) * per_call))
        return statistics.median(ts)


def table_a(threads: list[int], rounds: int, formats: list[str], ggml_rows=GGML_ROWS) -> dict:
    from dsv3lite.kernels import cpu_build

    log(f"CPU kernels: {cpu_build.status()}")
    pools = {f: ExpertPool(f) for f in formats}
    res = {"threads": {}}
    for t in threads:
        torch.set_num_threads(t)
        bw = statistics.median(read_bandwidth(t) for _ in range(3))
        ours = {f"{f} x{k}": [] for f in formats for k in ((1,) if f == "nf4" else (1, 8))}
        theirs = {f"{k} {b}": [] for k, b in ggml_rows}
        sizes, used = {}, {}
        for _ in range(rounds):
            for f, p in pools.items():
                for k in ((1,) if f == "nf4" else (1, 8)):
                    ours[f"{f} x{k}"].append(p.time(k))
                sizes[f] = p.layout.blob_bytes
            for k, b in ggml_rows:
                ms, nbytes, buffer = ggml_expert(k, t, buffer=b)
                theirs[f"{k} {b}"].append(ms / 1e3)
                sizes[k], used[f"{k} {b}"] = nbytes, buffer
        res["threads"][t] = {"bandwidth_gbs": bw, "ours": {k: statistics.median(v) for k, v in ours.items()},
                             "ggml": {k: statistics.median(v) for k, v in theirs.items()}, "bytes": sizes,
                             "buffers": used}
    res["errors"] = {f: p.error() for f, p in pools.items() if f != "nf4"}
    return res


def print_a(res: dict, title: str = "(a) one DeepSeek-V3 routed expert") -> None:
    print(f"\n### {title}, batch 1 (median ms; GB/s of weight bytes; fraction of read bandwidth)\n")
    for t, r in res["threads"].items():
        bw = r["bandwidth_gbs"]
        print(f"{t} thread(s), read bandwidth {bw:.1f} GB/s\n")
        print("| | bytes | ms | GB/s | of bandwidth |")
        print("|---|---|---|---|---|")
        for k, s in r["ours"].items():
            f = k.split()[0]
            gbs = r["bytes"][f] / s / 1e9
            label = f"dsv3lite {f}" + (" (8 experts a call)" if k.endswith("x8") else "")
            print(f"| {label} | {r['bytes'][f] / 1e6:.1f} MB | {s * 1e3:.2f} | {gbs:.1f} | {gbs / bw:.2f} |")
        for k, s in r["ggml"].items():
            kind = k.split()[0]
            gbs = r["bytes"][kind] / s / 1e9
            print(f"| ggml {kind.upper()} ({r['buffers'][k]} buffer) | {r['bytes'][kind] / 1e6:.1f} MB | {s * 1e3:.2f} | "
                  f"{gbs:.1f} | {gbs / bw:.2f} |")
        print()
    print("kernel output against the exact product of its weights (relative error): " +
          ", ".join(f"{f} {e:.2e}" for f, e in res["errors"].items()) + "\n")


# --- (b), (c): whole models ----------------------------------------------------------------------------------

def dsv3_run(llm, prompt: list[int], n_gen: int) -> dict[str, float]:
    llm.reset()
    llm.stop_ids = set()
    list(llm.generate(prompt, max_tokens=n_gen))
    s = llm.stats()
    return {"prefill": s["prefill_tok_s"], "decode": s["decode_tok_s"]}


def compare_models(configs: list[tuple[str, dict, str]], hf_dir: Path, gguf_dir: Path, base: str, threads: int,
                   rounds: int, prompt: list[int], n_gen: int, with_mtp: bool) -> dict:
    """configs: (label, dsv3lite.load options, llama.cpp GGUF kind). Alternating rounds; medians."""
    import dsv3lite

    quiet = dict(progress=False, log=lambda m: None)
    engines, models = {}, {}
    for label, opts, kind in configs:
        log(f"loading dsv3lite {label} and the llama.cpp {kind} GGUF")
        engines[label] = dsv3lite.load(str(hf_dir), device="cpu", mtp=False, **opts, **quiet)
        if with_mtp:
            engines[label + " +MTP"] = dsv3lite.load(str(hf_dir), device="cpu", mtp=True, mtp_adaptive=False,
                                                     **opts, **quiet)
        models[label] = gguf(hf_dir, kind, gguf_dir, base)
    torch.set_num_threads(threads)
    rows = {k: [] for k in engines} | {f"llama.cpp {kind}": [] for _, _, kind in configs}
    for llm in engines.values():
        dsv3_run(llm, prompt, 8)
    for _ in range(rounds):
        benched = set()
        for label, _, kind in configs:
            rows[label].append(dsv3_run(engines[label], prompt, n_gen))
            if with_mtp:
                rows[label + " +MTP"].append(dsv3_run(engines[label + " +MTP"], prompt, n_gen))
            if kind not in benched:                   # one llama.cpp run per GGUF and round
                rows[f"llama.cpp {kind}"].append(llama_bench(models[label], threads, len(prompt), n_gen))
                benched.add(kind)
    res = {k: {m: statistics.median(r[m] for r in v) for m in ("prefill", "decode")} for k, v in rows.items()}
    for label, _, kind in configs:
        res[f"llama.cpp {kind}"]["repack"] = models[label] not in NO_REPACK
    return res



def print_models(title: str, res: dict, configs) -> None:
    print(f"\n### {title}\n")
    print("| dsv3lite | prefill tok/s | decode tok/s | llama.cpp | prefill tok/s | decode tok/s | decode ratio | prefill ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for label, _, kind in configs:
        peer = res[f"llama.cpp {kind}"]
        kind += "" if peer["repack"] else " (--repack 0)"
        for name in (label, label + " +MTP"):
            if name not in res:
                continue
            ours = res[name]
            print(f"| {name} | {ours['prefill']:.0f} | {ours['decode']:.1f} | {kind} | {peer['prefill']:.0f} | "
                  f"{peer['decode']:.1f} | {ours['decode'] / peer['decode']:.2f} | {ours['prefill'] / peer['prefill']:.2f} |")


DEMO_CONFIGS = [("fp32", {}, "F32"),
                ("int4 experts + int4 dense", {"experts": "int4", "dense": "int4"}, "Q4_0"),
                ("int8 experts + int8 dense", {"experts": "int8", "dense": "int8"}, "Q8_0"),
                ("fp8 experts + int8 dense", {"experts": "fp8", "dense": "int8"}, "Q8_0")]
SLICE_CONFIGS = DEMO_CONFIGS[1:]


def demo_prompt(llm, n: int) -> list[int]:
    from dsv3lite import DEMO_DIR

    card = (DEMO_DIR / "README.md").read_text(encoding="utf-8").split("<!-- reference-slice -->", 1)[1]
    return llm.tokenizer.encode(card.split("```text\n", 1)[1].split("\n```", 1)[0], add_bos=True)[:n]


def slice_dir() -> Path:
    from dsv3lite.testing_realwidth import write_realwidth_checkpoint

    path = CACHE / "bench" / "realwidth-3l-16e-bf16"
    if not (path / "config.json").exists():
        log(f"writing the real-width slice to {path} (about 5 GB)")
        write_realwidth_checkpoint(path.with_suffix(".partial"), layers=3, dense_layers=1, experts=16, vocab=4096)
        path.with_suffix(".partial").rename(path)
    return path


def table_q() -> None:
    """Perplexity, top-1 agreement and logit error on the demo's reference slice, per expert / dense dtype, against
    the fp32 model; for expert formats also the format's dequantizing path (the kernels forced off)."""
    import math

    import dsv3lite
    import torch.nn.functional as F

    quiet = dict(progress=False, log=lambda m: None)
    plain = dsv3lite.load(device="cpu", mtp=False, **quiet)
    ids = torch.tensor([demo_prompt(plain, 512)])
    want = plain.forward(ids)

    def figures(logits):
        ppl = math.exp(F.cross_entropy(logits[0, :-1], ids[0, 1:]).item())
        top1 = (logits.argmax(-1) == want.argmax(-1)).float().mean().item()
        return f"{ppl:.3f} | {top1:.3f} | {((logits - want).norm() / want.norm()).item():.4f} | " \
               f"{(logits - want).abs().max().item():.3f}"

    print("\n### quality on the demo's reference slice (512 tokens) against fp32\n")
    print("| configuration | perplexity | top-1 = fp32 | logit error | max abs logit diff | dequantizing path: perplexity "
          "| top-1 | logit error | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = [(e, None) for e in ("bf16", "fp8", "int8", "int4")] + [(None, d) for d in ("bf16", "fp8", "int8", "int4")] \
        + [("int4", "int4"), ("int8", "int8"), ("fp8", "int8")]
    for experts, dense in rows:
        llm = dsv3lite.load(device="cpu", mtp=False, experts=experts, dense=dense, **quiet)
        got = llm.forward(ids)
        ref = " |  |  | "
        if dense is None:
            os.environ["DSV3LITE_CPU_KERNELS"] = "ref"
            ref = figures(llm.forward(ids))
            del os.environ["DSV3LITE_CPU_KERNELS"]
        print(f"| experts {experts or 'fp32'}, dense {dense or 'fp32'} | {figures(got)} | {ref} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", default="abc")
    ap.add_argument("--threads", default="2", help="comma-separated thread counts (table a); b and c use the last")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--formats", default="int4,int8,fp8,bf16", help="dsv3lite expert formats for table a (nf4 too)")
    ap.add_argument("--quiet", type=float, default=0.5, help="wait for a 1-minute load below this")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for it at most")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    import dsv3lite
    from dsv3lite import DEMO_DIR

    print(f"# cpu_peer: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"llama.cpp from llama-cpp-python {LLAMA_VERSION}, {time.strftime('%Y-%m-%d')}")
    out = {}
    if "a" in args.tables:
        load = wait_for_quiet(args.quiet, args.wait)
        out["a"] = table_a(threads, args.rounds, args.formats.split(","))
        out["a"]["load"] = load
        print(f"\n(load average at start: {load:.2f})")
        print_a(out["a"])
    if "A" in args.tables:
        import peer_v4

        load = wait_for_quiet(args.quiet, args.wait)
        out["A"] = peer_v4.table_a(threads, args.rounds)
        out["A"]["load"] = load
        print(f"\n(load average at start: {load:.2f})")
        peer_v4.print_a(out["A"])
    if "k" in args.tables:
        load = wait_for_quiet(args.quiet, args.wait)
        out["k"] = table_a(threads, args.rounds, list(KIMI_FORMATS), KIMI_GGML_ROWS)
        out["k"]["load"] = load
        print(f"\n(load average at start: {load:.2f})")
        print_a(out["k"], "(k) one Kimi-K2-Thinking / K2.5 routed expert (gate/up 2048x7168, down 7168x2048)")
    t = threads[-1]
    if "b" in args.tables:
        load = wait_for_quiet(args.quiet, args.wait)
        prompt = demo_prompt(dsv3lite.load(device="cpu", progress=False, log=lambda m: None), 64)
        res = compare_models(DEMO_CONFIGS, DEMO_DIR, CACHE / "bench" / "demo-gguf", "F32", t, args.rounds, prompt, 128,
                             True)
        out["b"] = {"load": load, "threads": t, "rows": res}
        print_models(f"(b) demo, {len(prompt)}-token prompt then 128 tokens, {t} thread(s), load {load:.2f}", res,
                     DEMO_CONFIGS)
    if "c" in args.tables:
        hf = slice_dir()
        load = wait_for_quiet(args.quiet, args.wait)
        prompt = demo_prompt(dsv3lite.load(device="cpu", progress=False, log=lambda m: None), 16)
        res = compare_models(SLICE_CONFIGS, hf, CACHE / "bench" / "realwidth-gguf", "BF16", t, args.rounds, prompt, 32,
                             False)
        out["c"] = {"load": load, "threads": t, "rows": res}
        print_models(f"(c) real-width slice (3 layers, 1 dense, 16 experts), 16-token prompt then 32 tokens, "
                     f"{t} thread(s), load {load:.2f}", res, SLICE_CONFIGS)
    if "q" in args.tables:
        table_q()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
