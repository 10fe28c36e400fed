"""summary.md, the CSV tables (modules.csv, ops.csv, comm.csv) and the terminal summary of a profile.

summary.md is the short form of the run report (report/run_report.py), built from the same sections
(report/sections.py) without plots or per-step detail: what to change, the headline figures, Zhang et
al.'s (arXiv 2311.03687) Llama2-7B table (embedding, decoder layers, attention, MLP, norms, LM head,
optimizer; forward / backward / recompute), phases and their closure, pipeline stages, ranks, top
modules, communication, operators, memory, and how each figure was measured.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from trainprof.analysis import records
from trainprof.io import atomic_write_text
from trainprof.report.advisor import advice_lines
from trainprof.report.document import Bullets, Document, Facts, render_markdown
from trainprof.report.gpu import gpu_section
from trainprof.report.pipeline import pipeline_section, timeline_text
from trainprof.report.rundir import RunData
from trainprof.report.sections import (advice_result, categories_section, comm_section, headline_facts,
                                       memory_section, methods_section, ops_section, phases_section, ranks_section,
                                       top_modules_section)

MODULE_COLUMNS = ("name", "type", "depth", "calls", "forward_ms", "backward_ms", "recompute_ms", "self_forward_ms",
                  "self_backward_ms", "self_recompute_ms", "comm_ms", "comm_exposed_ms", "self_comm_ms", "flops",
                  "params", "params_trainable", "params_local")
OP_COLUMNS = ("name", "module", "phase", "calls", "self_ms", "self_cpu_ms", "flops")
COMM_COLUMNS = ("op", "phase", "group_size", "calls", "steps", "bytes", "total_ms", "exposed_ms", "algbw_gbps",
                "busbw_gbps")

# per CSV table, the column that names a module: the model itself ("" in profile.json, which pandas reads as NaN)
# is written as every table names it, <whole model>; an operator outside every module (None) stays empty
MODULE_NAME_COLUMN = {"modules.csv": "name", "ops.csv": "module"}


def _csv(rows: list[dict[str, Any]], columns: tuple[str, ...], module_column: str | None = None) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        cells = {k: ("" if row.get(k) is None else row.get(k)) for k in columns}
        if module_column is not None and row.get(module_column) is not None:
            cells[module_column] = records.module_label(row[module_column])
        writer.writerow(cells)
    return buf.getvalue()


def _advice_bullets(doc: Document, run: RunData) -> None:
    doc.section("What to change", id="advice").blocks.append(Bullets(advice_lines(advice_result(run))))


def _measurements(doc: Document, run: RunData) -> None:
    doc.section("Measurements", id="measurements").blocks.append(Facts(headline_facts(run)))


# summary.md's sections, in order
SUMMARY_SECTIONS = (_advice_bullets, _measurements, categories_section, phases_section, pipeline_section,
                    ranks_section, top_modules_section, gpu_section, comm_section, ops_section, memory_section,
                    methods_section)


def build_summary(run: RunData) -> Document:
    """summary.md as a Document: the run report's sections in their short form, no plots."""
    doc = Document("trainprof profile", plots=False, compact=True)
    for build in SUMMARY_SECTIONS:
        build(doc, run)
    return doc


def render_summary(profile: dict[str, Any], run_dir: str | Path = ".") -> str:
    """summary.md for a merged (or single-rank) profile."""
    return render_markdown(build_summary(RunData.of_profile(profile, run_dir)))


def write_summary(profile: dict[str, Any], run_dir: str | Path) -> None:
    """Write modules.csv, ops.csv, comm.csv and summary.md next to profile.json.

    Args:
        profile: the merged profile.
        run_dir: the run directory.
    """
    run_dir = Path(run_dir)
    for name, key, columns in (("modules.csv", "modules", MODULE_COLUMNS), ("ops.csv", "ops", OP_COLUMNS),
                               ("comm.csv", "comm", COMM_COLUMNS)):
        atomic_write_text(run_dir / name, _csv(profile.get(key) or [], columns, MODULE_NAME_COLUMN.get(name)))
    atomic_write_text(run_dir / "summary.md", render_summary(profile, run_dir))


def terminal_summary(profile: dict[str, Any], run_dir: str | Path) -> str:
    """The short table rank 0 prints at the end of a run: what to change, then the headline figures."""
    run = RunData.of_profile(profile, run_dir)
    rows = [("run dir", str(run_dir)), *headline_facts(run)]
    width = max(len(k) for k, _ in rows)
    timeline: list[str] = []
    tl = (profile.get("pipeline") or {}).get("timeline")
    if tl and "stages" in profile["pipeline"]:
        timeline = [f"  stage timeline, step {tl['step']} (F/B forward/backward, . waiting for a neighbour, "
                    "c collective, o optimizer):",
                    *("    " + line for line in timeline_text(tl["stages"], width=60).splitlines())]
    return "\n".join(["", "trainprof run summary", "what to change:",
                      *(f"  - {line}" for line in advice_lines(advice_result(run))),
                      *(f"  {k:<{width}}  {v}" for k, v in rows), *timeline])
