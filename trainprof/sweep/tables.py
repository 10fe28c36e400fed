"""Tables as Markdown, CSV (pandas-readable: one header row, empty cell for null) and standalone HTML,
and the matplotlib (Agg) bar charts; every output carries its "how measured" notes.
"""

from __future__ import annotations

import csv
import html
import io
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainprof.io import atomic_write_text


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    fmt: Callable[[Any], str] = str  # for md / html; csv writes the raw value


def fmt_num(digits: int = 1, *, thousands: bool = True) -> Callable[[Any], str]:
    def f(x: Any) -> str:
        if x is None or x == "":
            return "n/a"
        if isinstance(x, (int, float)):
            return f"{x:,.{digits}f}" if thousands else f"{x:.{digits}f}"
        return str(x)

    return f


def fmt_pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def fmt_text(x: Any) -> str:
    return "" if x is None else str(x)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(rows: list[dict[str, Any]], columns: list[Column], *, title: str, intro: list[str] = (),
                    notes: list[str] = (), image: str | None = None) -> str:
    lines = [f"# {title}", ""]
    lines += [*intro, ""] if intro else []
    lines.append("| " + " | ".join(c.header for c in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(_md_cell(c.fmt(row.get(c.key))) for c in columns) + " |")
    if image:
        lines += ["", f"![{title}]({image})"]
    if notes:
        lines += ["", "## How these figures were measured", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def render_csv(rows: list[dict[str, Any]], columns: list[Column]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([c.key for c in columns])
    for row in rows:
        writer.writerow(["" if row.get(c.key) is None else row.get(c.key) for c in columns])
    return buf.getvalue()


def render_html(rows: list[dict[str, Any]], columns: list[Column], *, title: str, intro: list[str] = (),
                notes: list[str] = (), image: str | None = None) -> str:
    e = html.escape
    head = "".join(f"<th>{e(c.header)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{e(c.fmt(row.get(c.key)))}</td>" for c in columns) + "</tr>\n"
                   for row in rows)
    parts = [f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{e(title)}</title>",
             "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #bbb;padding:3px 8px;text-align:right}th{background:#eee}"
             "td:first-child,th:first-child{text-align:left}</style></head><body>",
             f"<h1>{e(title)}</h1>", *(f"<p>{e(p)}</p>" for p in intro),
             f"<table><thead><tr>{head}</tr></thead><tbody>\n{body}</tbody></table>"]
    if image:
        parts.append(f"<p><img src='{e(image)}' alt='{e(title)}' style='max-width:100%'></p>")
    if notes:
        parts.append("<h2>How these figures were measured</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in notes)
                     + "</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def write_tables(stem: Path, rows: list[dict[str, Any]], columns: list[Column], *, title: str,
                 intro: list[str] = (), notes: list[str] = (), image: str | None = None) -> list[Path]:
    """Write <stem>.md, <stem>.csv and <stem>.html atomically; return their paths."""
    out = []
    for suffix, text in (
        (".md", render_markdown(rows, columns, title=title, intro=intro, notes=notes, image=image)),
        (".csv", render_csv(rows, columns)),
        (".html", render_html(rows, columns, title=title, intro=intro, notes=notes, image=image)),
    ):
        path = stem.with_suffix(suffix)
        atomic_write_text(path, text)
        out.append(path)
    return out


CAPTION_LINE_IN = 0.13  # inches per caption line at fontsize 7


def wrap_caption(lines: list[str], width: int = 160) -> list[str]:
    """The how-measured lines of a figure, wrapped to fit its width."""
    return [w for line in lines for w in textwrap.wrap(line, width)]


def figure(plt, ncols: int, *, width_in: float, plot_height_in: float, notes: list[str], **kwargs):
    """A figure with ncols panels above room for the how-measured caption.

    Returns:
        (fig, axes list, rect): pass rect to save_figure, which lays the panels out inside it.
    """
    wrapped = wrap_caption(notes, int(width_in * 13))
    cap_in = CAPTION_LINE_IN * len(wrapped) + 0.15
    fig, axes = plt.subplots(1, ncols, figsize=(width_in, plot_height_in + cap_in), squeeze=False, **kwargs)
    fig.text(0.01, 0.01, "\n".join(wrapped), fontsize=7, va="bottom", ha="left", family="monospace")
    return fig, list(axes[0]), (0, (cap_in + 0.1) / (plot_height_in + cap_in), 1, 1)


def save_figure(fig, path: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    """Lay out the panels inside rect, save the figure atomically (temp file, then rename) and close it."""
    import os
    import tempfile

    import matplotlib.pyplot as plt

    fig.tight_layout(rect=rect)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
        plt.close(fig)
    return path


def require_matplotlib() -> None:
    """Fail before any cell runs, not after, when the charts cannot be drawn."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from trainprof.errors import UserError

        raise UserError("charts need matplotlib; pip install 'trainprof[report]' (or matplotlib)")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
