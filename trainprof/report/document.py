"""A small document model (sections of paragraphs, tables, figures, missing-part notes) with two
renderers: Markdown and one self-contained HTML file (CSS inline, images as data: URIs, no script, no
network), and tables as CSV. Every report (run, diff, inference, sweep tables via report/tables.py)
builds a `Document` and renders it, so the formats never say different things.
"""

from __future__ import annotations

import base64
import csv
import html
import io
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass
class Table:
    """A table; `method` says how its figures were measured and is printed under it."""

    columns: list[str]
    rows: list[list[Any]]
    method: str | None = None
    id: str | None = None  # html id (tests and links find tables by it)
    numeric: list[bool] | None = None  # right-align these columns (default: guessed from the first row)


@dataclass
class Figure:
    """A PNG image (bytes) with a caption; in Markdown it links `file` (written beside the .md)."""

    png: bytes
    caption: str
    file: str
    id: str | None = None


@dataclass
class Missing:
    """A part of the report that the run dir cannot supply, and why."""

    what: str
    why: str


@dataclass
class Para:
    text: str


@dataclass
class Facts:
    """Key / value lines (run facts)."""

    items: list[tuple[str, str]]


@dataclass
class Bullets:
    """A bulleted list (notes)."""

    items: list[str]


@dataclass
class Image:
    """An image file beside the rendered file, linked rather than embedded (a sweep's chart)."""

    file: str
    caption: str


@dataclass
class Pre:
    """Preformatted text (a text timeline): a fenced block in Markdown, <pre> in HTML."""

    text: str


@dataclass
class Details:
    """Collapsed raw text (the resolved recipe) in HTML, a fenced block in Markdown."""

    summary: str
    text: str


Block = Union[Table, Figure, Image, Missing, Para, Facts, Bullets, Pre, Details]


@dataclass
class Section:
    title: str  # "" = no heading (the blocks continue the document's opening)
    blocks: list[Block] = field(default_factory=list)
    id: str | None = None


@dataclass
class Document:
    """A report. Section builders read `plots` (False: no matplotlib figures; text stands in where it can)
    and `compact` (True: the short form, e.g. summary.md, without per-step and per-module detail)."""

    title: str
    subtitle: str = ""
    sections: list[Section] = field(default_factory=list)
    plots: bool = True
    compact: bool = False

    def section(self, title: str, id: str | None = None) -> Section:
        s = Section(title, id=id)
        self.sections.append(s)
        return s

    def figures(self) -> list[Figure]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, Figure)]

    def missing(self) -> list[Missing]:
        return [b for s in self.sections for b in s.blocks if isinstance(b, Missing)]


# -- cell formatting ---------------------------------------------------------------------------------

def fmt(value: Any, digits: int = 2) -> str:
    """A table cell: None -> 'n/a', floats with `digits` decimals, ints with thousands separators."""
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and abs(value) < 10 ** -digits:
            return f"{value:.{digits}e}"
        return f"{value:,.{digits}f}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- Markdown ----------------------------------------------------------------------------------------

def _md_cell(value: Any) -> str:
    return fmt(value).replace("|", "\\|").replace("\n", " ")


def render_markdown(doc: Document) -> str:
    lines = [f"# {doc.title}", ""]
    if doc.subtitle:
        lines += [doc.subtitle, ""]
    for sec in doc.sections:
        lines += [f"## {sec.title}", ""] if sec.title else []
        for b in sec.blocks:
            if isinstance(b, Para):
                lines += [b.text, ""]
            elif isinstance(b, Facts):
                lines += [f"- **{k}**: {v}" for k, v in b.items] + [""]
            elif isinstance(b, Bullets):
                lines += [f"- {item}" for item in b.items] + [""]
            elif isinstance(b, Pre):
                lines += ["```", b.text.rstrip(), "```", ""]
            elif isinstance(b, Image):
                lines += [f"![{b.caption}]({b.file})", ""]
            elif isinstance(b, Missing):
                lines += [f"> **not available: {b.what}** — {b.why}", ""]
            elif isinstance(b, Figure):
                lines += [f"![{b.caption}]({b.file})", "", f"*{b.caption}*", ""]
            elif isinstance(b, Details):
                lines += [f"<details><summary>{b.summary}</summary>", "", "```yaml", b.text.rstrip(), "```", "",
                          "</details>", ""]
            elif isinstance(b, Table):
                lines.append("| " + " | ".join(b.columns) + " |")
                lines.append("|" + "|".join("---:" if n else "---" for n in _numeric(b)) + "|")
                lines += ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in b.rows]
                lines.append("")
                if b.method:
                    lines += [f"*How measured: {b.method}*", ""]
    return "\n".join(lines).rstrip() + "\n"


def _numeric(t: Table) -> list[bool]:
    if t.numeric is not None:
        return t.numeric
    if not t.rows:
        return [False] * len(t.columns)
    return [any(_is_number(r[i]) for r in t.rows) for i in range(len(t.columns))]


# -- HTML --------------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:2rem auto;max-width:1100px;
color:#1b1b1b;line-height:1.45;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem}h2{font-size:1.25rem;border-bottom:1px solid #ddd;padding-bottom:.2rem;
margin-top:2rem}.subtitle{color:#555;margin-top:0}
table{border-collapse:collapse;margin:.6rem 0;font-size:.86rem}th,td{border:1px solid #d6d6d6;padding:.2rem .5rem}
th{background:#f3f3f3;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}.method{color:#555;font-size:.82rem;margin:.1rem 0 1rem}
.missing{background:#fff6e0;border-left:4px solid #e0a800;padding:.4rem .7rem;margin:.6rem 0}
figure{margin:.8rem 0}figure img{max-width:100%;border:1px solid #eee}figcaption{color:#555;font-size:.85rem}
dl.facts{display:grid;grid-template-columns:max-content auto;gap:.15rem 1rem;font-size:.9rem}
dl.facts dt{font-weight:600}dl.facts dd{margin:0}pre{background:#f6f6f6;padding:.6rem;overflow:auto;font-size:.8rem}
nav a{margin-right:.8rem;font-size:.85rem}
"""


def _id(value: str | None) -> str:
    return f' id="{html.escape(value)}"' if value else ""


def render_html(doc: Document) -> str:
    """One HTML file with everything inline: it opens offline, from a mail attachment or a share."""
    e = html.escape
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{e(doc.title)}</title><style>{_CSS}</style></head><body>",
           f"<h1>{e(doc.title)}</h1>"]
    if doc.subtitle:
        out.append(f'<p class="subtitle">{e(doc.subtitle)}</p>')
    links = "".join(f'<a href="#{e(s.id)}">{e(s.title)}</a>' for s in doc.sections if s.id and s.title)
    if links:
        out.append(f"<nav>{links}</nav>")
    for sec in doc.sections:
        out.append(f"<section{_id(sec.id)}>" + (f"<h2>{e(sec.title)}</h2>" if sec.title else ""))
        for b in sec.blocks:
            if isinstance(b, Para):
                out.append(f"<p>{e(b.text)}</p>")
            elif isinstance(b, Bullets):
                out.append("<ul>" + "".join(f"<li>{e(item)}</li>" for item in b.items) + "</ul>")
            elif isinstance(b, Pre):
                out.append(f"<pre>{e(b.text)}</pre>")
            elif isinstance(b, Image):
                out.append(f'<figure><img alt="{e(b.caption)}" src="{e(b.file)}"></figure>')
            elif isinstance(b, Facts):
                out.append('<dl class="facts">' + "".join(f"<dt>{e(k)}</dt><dd>{e(v)}</dd>" for k, v in b.items)
                           + "</dl>")
            elif isinstance(b, Missing):
                out.append(f'<div class="missing"><strong>not available: {e(b.what)}</strong> — {e(b.why)}</div>')
            elif isinstance(b, Figure):
                data = base64.b64encode(b.png).decode("ascii")
                out.append(f'<figure{_id(b.id)}><img alt="{e(b.caption)}" src="data:image/png;base64,{data}">'
                           f"<figcaption>{e(b.caption)}</figcaption></figure>")
            elif isinstance(b, Details):
                out.append(f"<details><summary>{e(b.summary)}</summary><pre>{e(b.text)}</pre></details>")
            elif isinstance(b, Table):
                num = _numeric(b)
                out.append(f"<table{_id(b.id)}><thead><tr>" + "".join(f"<th>{e(c)}</th>" for c in b.columns)
                           + "</tr></thead><tbody>")
                for row in b.rows:
                    out.append("<tr>" + "".join(
                        f'<td class="num">{e(fmt(v))}</td>' if num[i] else f"<td>{e(fmt(v))}</td>"
                        for i, v in enumerate(row)) + "</tr>")
                out.append("</tbody></table>")
                if b.method:
                    out.append(f'<p class="method">How measured: {e(b.method)}</p>')
        out.append("</section>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def render_csv(table: Table) -> str:
    """A table as CSV with raw values (no thousands separators, None as empty)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(table.columns)
    for row in table.rows:
        w.writerow(["" if v is None else v for v in row])
    return buf.getvalue()
