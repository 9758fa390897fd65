"""The pieces every HTML report is made of: one self-contained page (inline CSS and SVG, no script, nothing
fetched: its Content-Security-Policy forbids any load), headings, tables and stacked bars.

Every figure a page shows is read from the command's JSON document and carries where it came from: an element
showing one has `data-key` (its path in the JSON, dot-separated: `per_gpu.params`, `rows.3.per_gpu.peak`) and
`data-value` (the JSON value itself, bytes as ints), and shows it in the report's units. The tests read the
page's DOM in a browser and hold every such value to the JSON.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from zeroplan.report.common import CATEGORY_LABELS, amount
from zeroplan.spec.units import UNIT_POWERS

CATEGORY_COLORS = {
    # Tableau 10, the palette of PyTorch's memory viewer (torch/utils/viz/MemoryViz.js schemeTableau10)
    "params": "#4e79a7",
    "grads": "#f28e2c",
    "optimizer_states": "#e15759",
    "activations": "#76b7b2",
    "buffers": "#59a14f",
    "temporaries": "#edc949",
    "overhead": "#af7aa1",
}
FIGURE_COLORS = {"allocated": "#4e79a7", "reserved": "#76b7b2", "outside": "#9c755f"}
"""The three figures on the GPU (the device's is reserved plus what lives outside the allocator)."""

_CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 24px auto;
       max-width: 1280px; padding: 0 16px; background: #fff; }
div.scroll { overflow-x: auto; }
h1 { font-size: 20px; margin: 0 0 4px; } h2 { font-size: 16px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
p.lead { margin: 2px 0; color: #444; }
table { border-collapse: collapse; margin: 6px 0 12px; font-variant-numeric: tabular-nums; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; vertical-align: top; white-space: nowrap; }
th { background: #f4f4f4; } td.text, th.text { text-align: left; } td.wrap { text-align: left; min-width: 280px; max-width: 520px; white-space: normal; }
tr.marked td { background: #fff6d5; }
.legend span { display: inline-block; margin-right: 14px; } .legend i { display: inline-block; width: 11px;
  height: 11px; margin-right: 5px; vertical-align: -1px; }
svg text { font: 12px system-ui, sans-serif; fill: #222; } ul.notes { color: #444; }
.miss { color: #b00; font-weight: 600; } .ok { color: #2a7a2a; }
"""

# nothing may be loaded: no script, no font, no image, no frame (the page is read offline and in CI without network)
_POLICY = "default-src 'none'; style-src 'unsafe-inline'"


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def data_attrs(key: str | None, value: Any) -> str:
    """The attributes that tie a shown figure to its place in the JSON."""
    if key is None:
        return ""
    shown = "null" if value is None else ("true" if value is True else "false" if value is False else value)
    return f' data-key="{esc(key)}" data-value="{esc(shown)}"'


def page(title: str, lead: Sequence[str], sections: Iterable[str]) -> str:
    """The whole document: a title, the lines that say what was computed, then the sections."""
    lines = "".join(f'<p class="lead">{esc(line)}</p>' for line in lead if line)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_POLICY}\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n<body>\n<h1>{esc(title)}</h1>{lines}\n"
            + "\n".join(section for section in sections if section) + "\n</body></html>\n")


def section(heading: str, *parts: str) -> str:
    return f"<section><h2>{esc(heading)}</h2>\n" + "\n".join(part for part in parts if part) + "\n</section>"


def paragraph(text: str) -> str:
    return f"<p>{esc(text)}</p>"


def notes(items: Iterable[str]) -> str:
    items = list(items)
    return "" if not items else '<ul class="notes">' + "".join(f"<li>{esc(item)}</li>" for item in items) + "</ul>"


class Cell(NamedTuple):
    """A table cell: its text, and where its figure comes from in the JSON (`key`, `value`), if it shows one."""

    text: str
    key: str | None = None
    value: Any = None
    kind: str = ""  # "text" (left-aligned), "wrap" (long text), "miss" / "ok" (a verdict), or "" (a figure)


def size(size_bytes: int | None, units: str, key: str | None = None, decimals: int = 2) -> Cell:
    """A byte count in `units`, tied to its JSON key."""
    return Cell("" if size_bytes is None else amount(size_bytes, units, decimals), key, size_bytes)


def text(value: Any, key: str | None = None, kind: str = "text") -> Cell:
    return Cell("" if value is None else str(value), key, value, kind)


def table(headers: Sequence[str], rows: Iterable[Sequence[Cell]], marked: Iterable[int] = ()) -> str:
    """A table; a column whose first cell is text is left-aligned, figures right-aligned; rows in `marked`
    highlighted (the peak, the worst rank)."""
    marked, rows = set(marked), list(rows)
    kinds = [cell.kind for cell in rows[0]] if rows else [""] * len(headers)
    head = "".join(f'<th class="{"text" if kind in ("text", "wrap") else ""}">{esc(h)}</th>'
                   for h, kind in zip(headers, kinds))
    body = []
    for index, row in enumerate(rows):
        cells = "".join(f'<td class="{c.kind}"{data_attrs(c.key, c.value)}>{esc(c.text)}</td>' for c in row)
        body.append(f'<tr class="{"marked" if index in marked else ""}">{cells}</tr>')
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


class Part(NamedTuple):
    """One piece of a stacked bar: its category (the colour), its size (bytes, or seconds on a cost bar) and JSON key."""

    category: str
    size_bytes: int | float
    key: str | None = None


class Bar(NamedTuple):
    label: str
    parts: Sequence[Part]
    total_bytes: int | float  # the figure written after the bar (the peak, a phase's total)
    total_key: str | None = None
    marker: str = ""  # said after the total: "peak", "worst"


def palette(names: Iterable[str]) -> dict[str, str]:
    """Colours for names that are not categories (the terms of a step's cost), in order."""
    colors = ("#4e79a7", "#f28e2c", "#e15759", "#76b7b2", "#59a14f", "#edc949", "#af7aa1", "#ff9da7", "#9c755f",
              "#bab0ab")
    return {name: colors[i % len(colors)] for i, name in enumerate(dict.fromkeys(names))}


def legend(categories: Iterable[str], colors: dict[str, str] = CATEGORY_COLORS) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{colors[c]}"></i>{esc(CATEGORY_LABELS.get(c, c.replace("_", " ")))}</span>' for c in categories) + "</div>"


_LABEL_W, _BAR_W, _VALUE_W, _ROW_H = 310, 560, 170, 22


def stacked_bars(bars: Sequence[Bar], units: str, *, colors: dict[str, str] = CATEGORY_COLORS,
                 limit_bytes: int | None = None, limit_label: str = "",
                 shown: Callable[[int | float], str] | None = None) -> str:
    """Horizontal bars on one scale, each the sum of its parts in category colours, the total written after it;
    `limit_bytes` draws a line (the GPU's memory, a budget) on the same scale. `shown` writes a value (default:
    bytes in `units`)."""
    if not bars:
        return ""
    shown = shown or (lambda value: f"{amount(value, units)} {units}")
    scale_to = max([bar.total_bytes for bar in bars] + [sum(p.size_bytes for p in bar.parts) for bar in bars]
                   + [limit_bytes or 0]) or 1
    height = _ROW_H * len(bars) + (18 if limit_bytes else 6)
    out = [f'<svg role="img" width="{_LABEL_W + _BAR_W + _VALUE_W}" '
           f'height="{height}" viewBox="0 0 {_LABEL_W + _BAR_W + _VALUE_W} {height}">']
    for row, bar in enumerate(bars):
        y = row * _ROW_H + 3
        out.append(f'<text x="{_LABEL_W - 8}" y="{y + 13}" text-anchor="end">{esc(_clip(bar.label))}</text>')
        x = float(_LABEL_W)
        for part in bar.parts:
            if part.size_bytes <= 0:
                continue
            width = part.size_bytes / scale_to * _BAR_W
            tip = f"{bar.label}: {CATEGORY_LABELS.get(part.category, part.category)} {shown(part.size_bytes)}"
            out.append(f'<rect x="{x:.2f}" y="{y}" width="{width:.2f}" height="{_ROW_H - 6}" fill="{colors[part.category]}"'
                       f'{data_attrs(part.key, part.size_bytes)}><title>{esc(tip)}</title></rect>')
            x += width
        after = shown(bar.total_bytes) + (f"  {bar.marker}" if bar.marker else "")
        out.append(f'<text x="{x + 6:.2f}" y="{y + 13}"{data_attrs(bar.total_key, bar.total_bytes)}>{esc(after)}</text>')
    if limit_bytes:
        x = _LABEL_W + limit_bytes / scale_to * _BAR_W
        out.append(f'<line x1="{x:.2f}" y1="0" x2="{x:.2f}" y2="{height - 14}" stroke="#b00" stroke-dasharray="4 3"/>'
                   f'<text x="{x:.2f}" y="{height - 2}" text-anchor="middle" fill="#b00">'
                   f'{esc(limit_label)} {esc(shown(limit_bytes))}</text>')
    out.append("</svg>")
    return "".join(out)


def _clip(label: str, most: int = 44) -> str:
    return label if len(label) <= most else label[: most - 1] + "…"


def category_parts(figures: dict[str, int], key: str, categories: Iterable[str] = CATEGORY_LABELS) -> list[Part]:
    """The parts of a bar from a dict of category -> bytes at JSON path `key`."""
    return [Part(c, figures[c], f"{key}.{c}") for c in categories if c in figures]


def unit_note(units: str) -> str:
    return f"{units} = {UNIT_POWERS[units]} bytes; hover a bar for its figure"


def histogram(values: Sequence[float], edges: Sequence[float], labels: Sequence[str], caption: str, name: str) -> str:
    """How many of `values` fall in each bin (bin i: from edges[i] up to edges[i + 1]; the first and last take
    everything beyond), as vertical bars labelled `labels`; each bar carries its count (`data-count`, and
    `data-histogram` = `name`), a figure the page derives from the JSON rather than one it holds."""
    counts = [0] * (len(edges) - 1)
    for value in values:
        counts[next((i for i in range(len(counts)) if value < edges[i + 1]), len(counts) - 1)] += 1
    width, height, pad = 64, 160, 12
    top = max(counts) or 1
    out = [f'<svg role="img" width="{pad * 2 + width * len(counts)}" height="{height + 56}">']
    for i, count in enumerate(counts):
        h = count / top * height
        x = pad + i * width
        out.append(f'<rect x="{x + 3}" y="{height - h + 14:.2f}" width="{width - 6}" height="{h:.2f}" fill="#4e79a7" '
                   f'data-histogram="{esc(name)}" data-count="{count}"><title>{esc(labels[i])}: {count}</title></rect>'
                   f'<text x="{x + width / 2}" y="{height - h + 10:.2f}" text-anchor="middle">{count}</text>'
                   f'<text x="{x + width / 2}" y="{height + 30}" text-anchor="middle" font-size="10">{esc(labels[i])}</text>')
    out.append(f'<text x="{pad}" y="{height + 50}">{esc(caption)}</text></svg>')
    return "".join(out)
