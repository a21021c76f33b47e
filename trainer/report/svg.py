"""Inline SVG charts for the run report: line charts and stacked bar charts, no plotting dependency.

Contract: each function returns one self-contained ``<svg>`` string (no scripts, no external references)
with a title, axes with tick labels and a legend; every data point is drawn as a mark (a one-step run
still shows its point). Non-finite values are skipped. Empty data gives a chart that says "no data"
rather than an empty box. Colours come from one fixed palette so a series keeps its colour across charts.
"""

from __future__ import annotations

import math
from html import escape

WIDTH, HEIGHT = 560, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 150, 30, 40  # plot margins; the legend lives in the right margin
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf", "#bcbd22")


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000 or abs(v) < 0.01:
        return f"{v:.2g}"
    return f"{v:.3g}"


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def _frame(title: str, body: list[str], legend: list[tuple[str, str]]) -> str:
    parts = [
        (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
            f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" font-family="sans-serif" font-size="11">'
        ),
        f"<title>{escape(title)}</title>",
        f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>',
        f'<text x="{LEFT}" y="18" font-size="13" font-weight="bold">{escape(title)}</text>',
    ]
    parts += body
    for i, (name, colour) in enumerate(legend):
        y = TOP + 6 + 16 * i
        parts.append(
            f'<rect x="{WIDTH - RIGHT + 12}" y="{y - 8}" width="10" height="10" fill="{colour}"/>'
            f'<text x="{WIDTH - RIGHT + 26}" y="{y + 1}">{escape(name[:22])}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _axes(y_lo: float, y_hi: float, x_label: str) -> tuple[list[str], float, float]:
    """Axis lines and y ticks; returns the parts, plot width and plot height."""
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    parts = [
        f'<line x1="{LEFT}" y1="{TOP + h}" x2="{LEFT + w}" y2="{TOP + h}" stroke="#333"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{TOP + h}" stroke="#333"/>',
        f'<text x="{LEFT + w / 2}" y="{HEIGHT - 6}" text-anchor="middle">{escape(x_label)}</text>',
    ]
    for t in _ticks(y_lo, y_hi):
        y = TOP + h - (t - y_lo) / (y_hi - y_lo or 1.0) * h
        parts.append(
            f'<line x1="{LEFT - 4}" y1="{y:.1f}" x2="{LEFT + w}" y2="{y:.1f}" stroke="#ddd"/>'
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>'
        )
    return parts, w, h


def _no_data(title: str) -> str:
    return _frame(
        title,
        [(f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" fill="#666">no data in this run</text>')],
        [],
    )


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], x_label: str = "step") -> str:
    """One polyline plus point marks per series; x and y ranges cover every finite point."""
    clean = {
        k: [(float(x), float(y)) for x, y in pts if math.isfinite(x) and math.isfinite(y)] for k, pts in series.items()
    }
    clean = {k: v for k, v in clean.items() if v}
    if not clean:
        return _no_data(title)
    xs = [x for pts in clean.values() for x, _ in pts]
    ys = [y for pts in clean.values() for _, y in pts]
    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if y_hi - y_lo < 1e-12:  # a flat series: centre it in a band of +-1 (or +-10%)
        pad = abs(y_lo) * 0.1 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad
    parts, w, h = _axes(y_lo, y_hi, x_label)
    x_span = (x_hi - x_lo) or 1.0

    def px(x: float) -> float:
        return LEFT + (0.5 if x_hi == x_lo else (x - x_lo) / x_span) * w

    def py(y: float) -> float:
        return TOP + h - (y - y_lo) / (y_hi - y_lo) * h

    for t in sorted(set(xs))[:: max(1, len(set(xs)) // 8)]:
        parts.append(f'<text x="{px(t):.1f}" y="{TOP + h + 14}" text-anchor="middle">{_fmt(t)}</text>')
    legend = []
    for i, (name, pts) in enumerate(clean.items()):
        colour = PALETTE[i % len(PALETTE)]
        legend.append((name, colour))
        pts = sorted(pts)
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        if len(pts) > 1:
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{colour}" stroke-width="1.8"/>')
        parts += [f'<circle class="mark" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{colour}"/>' for x, y in pts]
    return _frame(title, parts, legend)


def bar_chart(
    title: str, categories: list[str], stacks: dict[str, list[float]], x_label: str = "", normalise: bool = False
) -> str:
    """Stacked bars: one bar per category, one segment per stack name (``stacks[name][i]`` for category i).

    ``normalise`` draws shares (each bar sums to 1) instead of counts.
    """
    values = {k: [max(0.0, float(v)) for v in vs] for k, vs in stacks.items()}
    totals = [sum(vs[i] for vs in values.values()) for i in range(len(categories))]
    if not categories or not any(totals):
        return _no_data(title)
    if normalise:
        values = {k: [v / t if t else 0.0 for v, t in zip(vs, totals, strict=True)] for k, vs in values.items()}
        totals = [1.0 if t else 0.0 for t in totals]
    y_hi = max(totals)
    parts, w, h = _axes(0.0, y_hi, x_label)
    slot = w / len(categories)
    bar_w = min(48.0, slot * 0.7)
    legend = [(name, PALETTE[i % len(PALETTE)]) for i, name in enumerate(values)]
    for j, cat in enumerate(categories):
        x = LEFT + slot * j + (slot - bar_w) / 2
        base = 0.0
        for (name, colour), vs in zip(legend, values.values(), strict=True):
            v = vs[j]
            if v <= 0:
                continue
            y0, y1 = TOP + h - base / y_hi * h, TOP + h - (base + v) / y_hi * h
            parts.append(
                f'<rect class="mark" x="{x:.1f}" y="{y1:.1f}" width="{bar_w:.1f}" height="{y0 - y1:.1f}" '
                f'fill="{colour}"><title>{escape(cat)} {escape(name)}: {_fmt(v)}</title></rect>'
            )
            base += v
        parts.append(f'<text x="{x + bar_w / 2:.1f}" y="{TOP + h + 14}" text-anchor="middle">{escape(cat[:14])}</text>')
    return _frame(title, parts, legend)
