"""The one-line summary of a generation's stats (engine.stats()), as the chat/generate stats line and the web UI
show it."""
from __future__ import annotations

from .utils import format_bytes


def offload_active(stats: dict) -> bool:
    """True when routed experts are offloaded (the expert-cache figures mean something)."""
    ec = stats.get("expert_cache") or {}
    return any(ec.get(k) for k in ("slots", "hits", "prefetch_hits", "demand_misses", "cpu_experts"))


def summary(stats: dict, finish_reason: str | None = None) -> str:
    """Prompt, reply tokens and why it ended, prefill and decode tok/s, TTFT, MTP acceptance (when on), expert
    cache (when offloading) and GPU peak, joined by ' | '."""
    s = stats
    cached = s.get("cached_prompt_tokens")
    reply = f"{s.get('generated_tokens', 0)} tok" + (f" ({finish_reason})" if finish_reason else "")
    parts = [f"{s.get('prompt_tokens', 0)} prompt tok" + (f" ({cached} cached)" if cached else ""), reply,
             f"prefill {s['prefill_tok_s']:.1f} tok/s", f"decode {s['decode_tok_s']:.1f} tok/s",
             f"TTFT {s['ttft_s']:.2f}s"]
    mtp = s.get("mtp") or {}
    if mtp.get("enabled"):
        parts.append(f"MTP accept {mtp['acceptance_rate']:.0%} ({mtp['tokens_per_forward']:.2f} tok/fwd)")
    if offload_active(s):
        ec = s["expert_cache"]
        parts.append(f"experts hit {ec['hit_rate']:.0%}, {ec['demand_misses']} misses, "
                     f"H2D {ec['h2d_gb_s']:.1f} GB/s, stall {ec['stall_ms']:.0f} ms")
    mem = s.get("memory") or {}
    if "gpu_peak_bytes" in mem:
        parts.append(f"GPU peak {format_bytes(mem['gpu_peak_bytes'])}")
    return " | ".join(parts)
