"""DeepSeek-V4 whole models against llama.cpp on this CPU, same weights, same threads, alternating rounds (issue 30's
tables b and c; table a, one expert, is benchmarks/peer_v4.py):

  (b) the real-width V4-Flash slice (hidden 4096, 64 heads x 512, MXFP4 experts 2048 wide; 3 layers: sliding, CSA,
      HCA; 16 experts): decode and prefill, dsv3lite as users run it (MXFP4 experts served as released, the FP8
      dense weights dequantized to fp32) against llama.cpp's GGUF of the same checkpoint. Its converter keeps the
      MXFP4 experts and writes V4's FP8 dense weights as Q8_0 whatever --outtype says (embeddings and head BF16,
      norms and mHC F32; the rows say "F32", the converter's --outtype): dsv3lite with its dense weights in fp32
      (as loaded) and packed to int8 (`--dense int8`, the bytes of Q8_0); and at 4 bits, dsv3lite's `--dense int4`
      against the same GGUF requantized by llama-quantize with its dense weights (head included) in Q4_0 and its
      MXFP4 experts copied as they are (kind MXFP4-Q4_0);
  (c) V4-Flash's geometry at tiny widths (43 layers, 256 experts, top-6, 3 hash layers, the released compression
      ratios, MXFP4 experts): host time per token, dsv3lite resident against llama.cpp F32, and offloaded on the
      simulated device tier at ~10% and ~25% of the experts against resident.

The checkpoints are written once (released layout, the demo's tokenizer, config.json naming DeepseekV4ForCausalLM
as the released one does) under ~/.cache/dsv3lite/bench/ and converted with llama.cpp's vendored
convert_hf_to_gguf.py (benchmarks/cpu_peer.py builds llama.cpp and holds the helpers). The geometry checkpoint uses
8 heads of 64, a 64-wide indexer head and HCA every 128 tokens: llama.cpp's deepseek4 graph rotates the indexer
keys by a 64-wide Hadamard matrix and expects the released ratios. MTP off (random MTP blocks draft nothing useful;
llama.cpp runs none). Run it under the exclusive lock, on a quiet machine:

    flock -x /tmp/dsv3lite-cpu.lock python benchmarks/peer_v4_models.py --threads 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import cpu_peer  # noqa: E402  (the llama.cpp build, conversion, llama-bench and the side-by-side loop)

GEOMETRY = dict(num_attention_heads=8, head_dim=64, qk_rope_head_dim=16, index_head_dim=64, compress_rate_hca=128)
ARCHITECTURE = "DeepseekV4ForCausalLM"          # what a released config.json names (the converter reads it)
SLOT_FRACTIONS = (0.10, 0.25)
# the slice's GGUF with its dense weights at 4 bits, the tensors dsv3lite's --dense int4 packs: the projections
# (attention, compressors, indexer), shared experts and head in Q4_0 (from the converter's Q8_0 / BF16:
# requantized); the MXFP4 experts copied as they are (the same type is not requantized); what --dense keeps as it is
# kept too: the mHC matrices and the compressors' ape in F32, the embeddings and routers in BF16
KEEP_AS = {"ffn_gate_exps": "mxfp4", "ffn_up_exps": "mxfp4", "ffn_down_exps": "mxfp4", "hc_attn_fn": "f32",
           "hc_ffn_fn": "f32", "output_hc_fn": "f32", "compressor_ape": "f32"}
cpu_peer.QUANTIZE_AS["MXFP4-Q4_0"] = ("Q4_0", [
    "--allow-requantize", "--output-tensor-type", "q4_0", "--token-embedding-type", "bf16",
    *(arg for name, kind in KEEP_AS.items() for arg in ("--tensor-type", f"{name}={kind}"))])


def write_checkpoint(name: str, cfg: dict) -> Path:
    """The released-layout checkpoint `name` under the bench cache, written once."""
    import dsv3lite
    from dsv3lite.testing_v4 import write_v4_official

    path = cpu_peer.CACHE / "bench" / name
    if (path / "config.json").exists():
        return path
    partial = path.with_suffix(".partial")
    cpu_peer.log(f"writing {path}")
    write_v4_official(partial, cfg, tokenizer_from=Path(dsv3lite.__file__).parent / "demo")
    conf = json.loads((partial / "config.json").read_text())
    conf["architectures"] = [ARCHITECTURE]
    (partial / "config.json").write_text(json.dumps(conf, indent=1))
    partial.rename(path)
    return path


def slice_checkpoint() -> Path:
    from dsv3lite.testing_v4 import v4_flash_slice_config

    return write_checkpoint("v4-flash-slice-3l-16e", v4_flash_slice_config())


def geometry_checkpoint() -> Path:
    from dsv3lite.testing_v4 import v4_geometry_config

    return write_checkpoint("v4-geometry-llama", dict(v4_geometry_config(), **GEOMETRY))


def offloaded(path: Path, fraction: float, ctx: int) -> tuple[str, dict]:
    """A dsv3lite.load configuration holding `fraction` of the routed experts in slots (misses fetched)."""
    from dsv3lite.config import ModelArgs
    from dsv3lite.testing import offload_budget

    a = ModelArgs.from_dir(path)
    slots = round(fraction * len(a.moe_layer_ids) * a.n_routed_experts)
    return (f"offloaded {fraction:.0%} ({slots:,} slots)",
            dict(gpu_mem=offload_budget(str(path), slots, None, ctx=ctx, mtp=False), miss_policy="fetch"))


def prompt(n: int, vocab: int) -> list[int]:
    import torch

    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(0)).tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables", default="bc")
    ap.add_argument("--dense", default="all", choices=("all", "fp32", "int8", "int4"),
                    help="table b: the slice's rows of this dense format only")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quiet", type=float, default=0.5, help="wait for a 1-minute load below this")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for it at most")
    a = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, {a.threads} threads, "
          f"{a.rounds} alternating rounds, {a.prompt}-token prompt then {a.tokens} tokens")
    ctx = a.prompt + a.tokens + 16
    same = dict(threads=a.threads, ctx_size=ctx)
    if "b" in a.tables:
        path = slice_checkpoint()
        configs = [("mxfp4 experts + fp32 dense", same, "F32"),
                   ("mxfp4 experts + int8 dense", dict(same, dense="int8"), "F32"),
                   ("mxfp4 experts + int4 dense", dict(same, dense="int4"), "MXFP4-Q4_0")]
        configs = [c for c in configs if a.dense in ("all", c[1].get("dense", "fp32"))]
        load = cpu_peer.wait_for_quiet(a.quiet, a.wait)
        res = cpu_peer.compare_models(configs, path, cpu_peer.CACHE / "bench" / "v4-slice-gguf", "F32", a.threads,
                                      a.rounds, prompt(a.prompt, 4096), a.tokens, with_mtp=False)
        cpu_peer.print_models(f"(b) V4-Flash real-width slice, 1-minute load {load:.2f} at the start (llama.cpp: "
                              f"MXFP4 experts; F32: Q8_0 dense as its converter writes V4; MXFP4-Q4_0: Q4_0 dense)",
                              res, configs)
    if "c" in a.tables:
        path = geometry_checkpoint()
        configs = [("resident", same, "F32")] + [
            (label, dict(same, **opts), "F32") for label, opts in (offloaded(path, f, ctx) for f in SLOT_FRACTIONS)]
        load = cpu_peer.wait_for_quiet(a.quiet, a.wait)
        res = cpu_peer.compare_models(configs, path, cpu_peer.CACHE / "bench" / "v4-geometry-gguf", "F32", a.threads,
                                      a.rounds, prompt(a.prompt, 4096), a.tokens, with_mtp=False)
        cpu_peer.print_models(f"(c) V4-Flash geometry, 1-minute load {load:.2f} at the start", res, configs)
        base = res["resident"]["decode"]
        print("\n| dsv3lite | host ms / token | host ms / layer | vs resident |\n|---|---|---|---|")
        for label, _, _ in configs:
            d = res[label]["decode"]
            print(f"| {label} | {1e3 / d:.2f} | {1e3 / d / 43:.3f} | {d / base:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
