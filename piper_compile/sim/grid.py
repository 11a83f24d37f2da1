"""Schedule grid picture: one row per rank, time to the right, a box per compute instruction coloured
by pass (F, B, BI, BW, UPDATE) with its micro-batch number inside. SVG written by hand (no plotting
dependency); a ``.png`` path uses matplotlib when it is installed."""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from piper_compile.errors import PiperError
from piper_compile.ir.dag import Kind
from piper_compile.sim.trace import COMPUTE_STREAM, Span, read_spans

COLORS = {"F": "#4C78A8", "B": "#54A24B", "BI": "#F58518", "BW": "#B279A2", "UPDATE": "#9D9D9D", "other": "#BAB0AC"}
_ROW, _LEFT, _TOP, _WIDTH = 30, 64, 40, 960


def _spans(source: Any) -> tuple[list[Span], str]:
    if isinstance(source, (str, os.PathLike)):
        return read_spans(source), Path(source).name
    if hasattr(source, "spans"):
        return list(source.spans), f"simulated step {source.step_time:.4g}, bubble {source.bubble:.1%}"
    return list(source), ""


def _category(s: Span) -> str:
    if s.kind == Kind.UPDATE.value:
        return "UPDATE"
    return s.pass_ if s.pass_ in COLORS else "other"


def _boxes(spans: list[Span]) -> tuple[list[tuple[int, float, float, str, str]], list[int], float]:
    """(rank, start, end, category, micro-batch) per compute span, times from the first one; the ranks;
    the time the picture spans (up to the last end of anything, steps included)."""
    work = [s for s in spans if s.stream == COMPUTE_STREAM]
    if not work:
        raise PiperError("piper: nothing to draw: the trace has no compute spans")
    t0 = min(s.start for s in work)
    ranks = sorted({s.rank for s in spans})
    boxes = [(s.rank, s.start - t0, s.end - t0, _category(s), "" if s.mb is None else str(s.mb)) for s in work]
    return boxes, ranks, max(s.end for s in spans) - t0


def _ticks(span: float) -> list[float]:
    """About 8 round-numbered ticks (1, 2 or 5 times a power of ten apart) over [0, span]."""
    if span <= 0:
        return [0.0]
    raw = span / 8
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def grid_svg(source: Any, title: str | None = None) -> str:
    """SVG text of the schedule grid of ``source`` (a ``SimResult``, a list of ``Span`` or a trace path)."""
    spans, default_title = _spans(source)
    boxes, ranks, span = _boxes(spans)
    row_of = {r: i for i, r in enumerate(ranks)}
    scale = _WIDTH / span if span > 0 else 1.0
    height = _TOP + _ROW * len(ranks) + 56
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 20}" height="{height}" '
           f'font-family="sans-serif" font-size="11">',
           '<rect width="100%" height="100%" fill="white"/>',
           f'<text x="{_LEFT}" y="18" font-size="13">{escape(title or default_title)}</text>']
    for r, i in row_of.items():
        y = _TOP + i * _ROW
        out.append(f'<text x="8" y="{y + _ROW / 2 + 4:.1f}">rank {r}</text>')
        out.append(f'<line x1="{_LEFT}" y1="{y + _ROW:.1f}" x2="{_LEFT + _WIDTH}" y2="{y + _ROW:.1f}" stroke="#ddd"/>')
    for rank, a, b, cat, mb in boxes:
        x, w, y = _LEFT + a * scale, max((b - a) * scale, 0.5), _TOP + row_of[rank] * _ROW + 3
        out.append(f'<rect x="{x:.2f}" y="{y:.1f}" width="{w:.2f}" height="{_ROW - 6}" fill="{COLORS[cat]}" '
                   f'stroke="white" stroke-width="0.5"><title>{escape(cat)} mb{escape(mb)} '
                   f'{a:.6g}-{b:.6g}</title></rect>')
        if mb and w >= 7 * len(mb):
            out.append(f'<text x="{x + w / 2:.2f}" y="{y + (_ROW - 6) / 2 + 4:.1f}" fill="white" '
                       f'text-anchor="middle">{escape(mb)}</text>')
    axis_y = _TOP + len(ranks) * _ROW + 14
    for t in _ticks(span):
        x = _LEFT + t * scale
        out.append(f'<line x1="{x:.2f}" y1="{axis_y - 10}" x2="{x:.2f}" y2="{axis_y - 6}" stroke="#555"/>')
        out.append(f'<text x="{x:.2f}" y="{axis_y + 4}" text-anchor="middle" fill="#555">{t:.4g}</text>')
    lx = _LEFT
    for cat in ("F", "B", "BI", "BW", "UPDATE"):
        out.append(f'<rect x="{lx}" y="{height - 22}" width="12" height="12" fill="{COLORS[cat]}"/>')
        out.append(f'<text x="{lx + 16}" y="{height - 12}">{cat}</text>')
        lx += 70
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _png(source: Any, path: Path, title: str | None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PiperError("piper: a .png grid needs matplotlib (pip install matplotlib); write .svg instead") from None
    spans, default_title = _spans(source)
    boxes, ranks, span = _boxes(spans)
    row_of = {r: i for i, r in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(ranks) + 1.2))
    for rank, a, b, cat, mb in boxes:
        ax.barh(row_of[rank], b - a, left=a, color=COLORS[cat], edgecolor="white", height=0.8)
        if mb:
            ax.text((a + b) / 2, row_of[rank], mb, ha="center", va="center", color="white", fontsize=7)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_title(title or default_title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def draw_grid(source: Any, path: str | os.PathLike[str], title: str | None = None) -> str:
    """Draw the schedule grid of ``source`` (``SimResult``, spans, or a trace file/directory) to
    ``path`` (``.svg``, or ``.png`` with matplotlib); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".png":
        _png(source, path, title)
    else:
        path.write_text(grid_svg(source, title))
    return str(path)
