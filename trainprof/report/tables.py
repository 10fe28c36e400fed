"""Row tables (a list of dicts and the columns to show) written as Markdown, CSV (pandas-readable: one
header row, empty cell for null) and HTML, each with its "how measured" notes: sweeps, max-batch
searches, scaling and projections. Rendered through report/document.py like every other report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainprof.io import atomic_write_text
from trainprof.report.document import Bullets, Document, Image, Para, Section, Table, render_csv, render_html
from trainprof.report.document import render_markdown

NOTES_TITLE = "How these figures were measured"


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
    if x is None:
        return "n/a"
    if 0 < abs(x) < 0.0005:  # a tiny model's MFU on a big GPU: two significant digits, not a 0.0% that reads as none
        return f"{100 * x:.2g}%"
    return f"{100 * x:.1f}%"


def fmt_text(x: Any) -> str:
    return "" if x is None else str(x)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def table_document(rows: list[dict[str, Any]], columns: list[Column], *, title: str, intro: list[str] = (),
                   notes: list[str] = (), image: str | None = None) -> Document:
    """The table as a Document: intro paragraphs, the formatted table, the chart file, the notes."""
    body = Section("", blocks=[*(Para(p) for p in intro), Table(
        [c.header for c in columns], [[c.fmt(row.get(c.key)) for c in columns] for row in rows],
        numeric=[any(_is_number(row.get(c.key)) for row in rows) for c in columns])])
    if image:
        body.blocks.append(Image(image, title))
    doc = Document(title, sections=[body])
    if notes:
        doc.sections.append(Section(NOTES_TITLE, blocks=[Bullets(list(notes))]))
    return doc


def write_tables(stem: Path, rows: list[dict[str, Any]], columns: list[Column], *, title: str,
                 intro: list[str] = (), notes: list[str] = (), image: str | None = None,
                 csv: tuple[list[str], list[dict[str, Any]]] | None = None) -> list[Path]:
    """Write <stem>.md, <stem>.csv and <stem>.html atomically; return their paths. The csv holds the rows'
    raw values under the columns' keys, or `csv` (keys, rows) where the shown cells are text a frame cannot
    sort or group by."""
    doc = table_document(rows, columns, title=title, intro=intro, notes=notes, image=image)
    keys, raw_rows = csv or ([c.key for c in columns], rows)
    raw = Table(list(keys), [[row.get(k) for k in keys] for row in raw_rows])
    out = []
    for suffix, text in ((".md", render_markdown(doc)), (".csv", render_csv(raw)), (".html", render_html(doc))):
        path = stem.with_suffix(suffix)
        atomic_write_text(path, text)
        out.append(path)
    return out
