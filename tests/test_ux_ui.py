"""Pieces of the web UI that need no browser: chart labels that never overlap, the stats panel (one expert-cache
rule with the CLI's stats line, the finish reason) and the Gradio queue's polling interval."""
from __future__ import annotations

import re

import pytest

from dsv3lite.app.charts import LABEL_PX, _ticks, bar_chart_svg, heatmap_svg
from dsv3lite.stats import offload_active, summary


def label_positions(svg: str, anchor: str, axis: str) -> list[tuple[float, str]]:
    pattern = rf'<text x="([0-9.]+)" y="([0-9.]+)" text-anchor="{anchor}">([^<]+)</text>'
    return [(float(m.group(1 if axis == "x" else 2)), m.group(3)) for m in re.finditer(pattern, svg)]


@pytest.mark.parametrize("n_rows", [2, 6, 27, 62])
def test_heatmap_row_labels_never_overlap(n_rows):
    labels = [str(i) for i in range(n_rows - 1)] + ["MTP"]
    svg = heatmap_svg([[r * 32 + c for c in range(32)] for r in range(n_rows)], labels, "t")
    rows = label_positions(svg, "end", "y")
    assert rows[0][1] == "0" and rows[-1][1] == "MTP"                   # first and last layer always labelled
    gaps = [b[0] - a[0] for a, b in zip(rows, rows[1:])]
    assert min(gaps) >= LABEL_PX, gaps
    cols = label_positions(svg, "middle", "x")
    col_ticks = [(x, t) for x, t in cols if t.isdigit()]
    assert col_ticks[-1][1] == "31"
    assert min(b[0] - a[0] for a, b in zip(col_ticks, col_ticks[1:])) >= 2 * LABEL_PX


@pytest.mark.parametrize("n,most", [(32, 10), (256, 12), (61, 30), (5, 16), (7, 3)])
def test_ticks_are_spread_and_end_at_the_last(n, most):
    ticks = _ticks(n, most)
    assert ticks[0] == 0 and ticks[-1] == n - 1 and len(ticks) <= most + 1
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1
    assert all(b - a >= step for a, b in zip(ticks, ticks[1:]))


def test_bar_chart_labels_do_not_overlap():
    svg = bar_chart_svg([str(i) for i in range(61)], [0.5] * 61, "hit rate")
    xs = [x for x, t in label_positions(svg, "middle", "x") if t.isdigit()]
    assert min(b - a for a, b in zip(xs, xs[1:])) >= 2 * LABEL_PX


STATS = {"prompt_tokens": 7, "cached_prompt_tokens": 0, "generated_tokens": 9, "prefill_tok_s": 90.0,
         "decode_tok_s": 30.0, "ttft_s": 0.08, "mtp": {"enabled": False, "reason": "off"},
         "expert_cache": {"hits": 0, "prefetch_hits": 0, "demand_misses": 0, "cpu_experts": 0, "hit_rate": 0.0,
                          "h2d_bytes": 0, "h2d_gb_s": 0.0, "stall_ms": 0.0}, "memory": {}}


def test_stats_panel_and_line_share_the_expert_cache_rule():
    pytest.importorskip("gradio")
    from dsv3lite.app.ui import format_stats

    assert "No reply yet" in format_stats(None) and "No reply yet" in format_stats({})
    panel = format_stats(STATS, finish="stopped")
    assert "| reply | 9 tok (stopped) |" in panel and "all experts resident" in panel
    assert summary(STATS, "stopped") in panel.replace("&#x27;", "'")
    # an offload whose first reply hit only prefetched experts: both say so
    offloaded = {**STATS, "expert_cache": {**STATS["expert_cache"], "prefetch_hits": 12, "hit_rate": 1.0,
                                           "slots": 40}}
    assert offload_active(offloaded) and not offload_active(STATS)
    from dsv3lite.offload.stats import empty_expert_cache_stats
    assert not offload_active({**STATS, "expert_cache": empty_expert_cache_stats()})   # every key, all zero
    assert "experts hit 100%" in summary(offloaded) and "100% hit" in format_stats(offloaded)


def test_gradio_queue_polls_slowly_when_idle():
    gr = pytest.importorskip("gradio")
    from dsv3lite.app.ui import PROGRESS_POLL_S, QUEUE_POLL_S, quiet_queue

    with gr.Blocks() as demo:
        gr.Markdown("x")
    quiet_queue(demo)
    assert demo._queue.sleep_when_free >= QUEUE_POLL_S and demo._queue.progress_update_sleep_when_free >= PROGRESS_POLL_S
