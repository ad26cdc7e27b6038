"""Small self-contained SVG charts for the web UI (no plotting library): a layer x expert heat map and a bar chart."""
from __future__ import annotations

import base64
import html
import struct
import zlib

ROW_PX = 16          # heat-map row height (until the chart reaches its maximum height)
LABEL_PX = 14        # vertical room one 11 px label needs

# a few stops of a perceptual dark-blue -> green -> yellow colour map (viridis-like)
_STOPS = [(68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37)]


def _colour(x: float) -> tuple[int, int, int]:
    x = min(max(x, 0.0), 1.0) * (len(_STOPS) - 1)
    i = min(int(x), len(_STOPS) - 2)
    f = x - i
    a, b = _STOPS[i], _STOPS[i + 1]
    return tuple(round(a[k] + (b[k] - a[k]) * f) for k in range(3))


def _png(rows: list[bytes], width: int) -> bytes:
    """Encode RGB rows (3 bytes per pixel) as a PNG."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + row for row in rows)
    header = struct.pack(">IIBBBBB", width, len(rows), 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b"")


def _ticks(n: int, most: int) -> list[int]:
    """At most `most` evenly spaced indices of 0..n-1, the last one included (a regular tick too close to it
    is dropped, so their labels never overlap)."""
    step = max(1, -(-n // max(most, 1)))
    ticks = [i for i in range(0, n, step) if n - 1 - i >= step]
    return sorted(set(ticks + [n - 1]))


def heatmap_svg(counts: list[list[int]], row_labels: list[str], title: str) -> str:
    """counts[row][col] (layers x experts) as an image with axes; one pixel per cell, scaled up without smoothing."""
    top = max((max(r) for r in counts if r), default=0)
    if top <= 0:
        return _empty(title)
    n_rows, n_cols = len(counts), len(counts[0])
    rows = [bytes(v for c in r for v in _colour(c / top)) for r in counts]
    image = base64.b64encode(_png(rows, n_cols)).decode()
    left, right, head, foot = 56, 70, 28, 36
    w = 560
    plot_w, plot_h = w - left - right, min(max(ROW_PX * n_rows, 64), 420)   # rows of >= ROW_PX until 420 px
    h = plot_h + head + foot
    cw, rh = plot_w / n_cols, plot_h / n_rows
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" role="img" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>',
             f'<image x="{left}" y="{head}" width="{plot_w}" height="{plot_h}" preserveAspectRatio="none" '
             f'style="image-rendering:pixelated" href="data:image/png;base64,{image}"/>']
    for r in _ticks(n_rows, int(plot_h // LABEL_PX)):
        parts.append(f'<text x="{left - 6}" y="{head + (r + 0.5) * rh + 4:.1f}" text-anchor="end">'
                     f'{html.escape(row_labels[r])}</text>')
    for c in _ticks(n_cols, int(plot_w // (3 * LABEL_PX))):
        parts.append(f'<text x="{left + (c + 0.5) * cw:.1f}" y="{head + plot_h + 14}" text-anchor="middle">{c}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{h - 4}" text-anchor="middle">expert</text>')
    parts.append(f'<text x="12" y="{head + plot_h / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 12 {head + plot_h / 2})">layer</text>')
    # colour scale
    legend = base64.b64encode(_png([bytes(_colour(1 - i / 63)) for i in range(64)], 1)).decode()
    lx = w - right + 14
    parts.append(f'<image x="{lx}" y="{head}" width="12" height="{plot_h}" preserveAspectRatio="none" '
                 f'href="data:image/png;base64,{legend}"/>')
    parts.append(f'<text x="{lx + 16}" y="{head + 9}">{top}</text>')
    parts.append(f'<text x="{lx + 16}" y="{head + plot_h}">0</text>')
    parts.append("</svg>")
    return "".join(parts)


def bar_chart_svg(labels: list[str], values: list[float], title: str, y_max: float = 1.0, percent: bool = True) -> str:
    """Vertical bars (e.g. hit rate per layer, values in 0..y_max)."""
    if not values:
        return _empty(title)
    left, right, head, foot = 44, 10, 28, 36
    w, h = 560, 240
    plot_w, plot_h = w - left - right, h - head - foot
    bw = plot_w / len(values)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="100%" role="img" '
             f'font-family="sans-serif" font-size="11">',
             f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="13">{html.escape(title)}</text>']
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        y = head + plot_h * (1 - frac)
        label = f"{frac * y_max:.0%}" if percent else f"{frac * y_max:g}"
        parts.append(f'<line x1="{left}" x2="{w - right}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end">{label}</text>')
    for i, v in enumerate(values):
        bh = plot_h * min(max(v / y_max, 0.0), 1.0)
        r, g, b = _colour(v / y_max)
        parts.append(f'<rect x="{left + i * bw + bw * 0.1:.1f}" y="{head + plot_h - bh:.1f}" width="{bw * 0.8:.1f}" '
                     f'height="{bh:.1f}" fill="rgb({r},{g},{b})"><title>{html.escape(labels[i])}: '
                     f'{v:.1%}</title></rect>')
    for i in _ticks(len(values), 16):
        parts.append(f'<text x="{left + (i + 0.5) * bw:.1f}" y="{head + plot_h + 14}" text-anchor="middle">'
                     f'{html.escape(labels[i])}</text>')
    parts.append(f'<text x="{left + plot_w / 2}" y="{h - 4}" text-anchor="middle">layer</text></svg>')
    return "".join(parts)


def _empty(title: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 560 60" width="100%" font-family="sans-serif">'
            f'<text x="280" y="34" text-anchor="middle" font-size="13" fill="#888">{html.escape(title)}: '
            f'no data yet</text></svg>')
