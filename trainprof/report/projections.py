"""The run report's Projected section: every projection `trainprof project` wrote for this run, newest
first, rendered from its file alone (the report does not import the projection code).

Contract: `trainprof project` writes one folder per call, <run dir>/projections/<UTC stamp>-<label>/,
holding projection.json with at least
    title        str    what was projected, in a few words
    created_utc  str    when (ISO 8601, UTC)
    command      str    the command that made it
    table        {columns: [str], rows: [[str | number | null]]}
    notes        [str]  how the figures were made (assumptions, expected error)
Other fields are the projection's own and are ignored here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprof.report.document import Bullets, Document, Missing, Para, Table
from trainprof.report.rundir import RunData

PROJECTIONS_DIR = "projections"
PROJECTION_FILE = "projection.json"
REQUIRED = {"title": str, "created_utc": str, "command": str, "table": dict, "notes": list}


@dataclass(slots=True, kw_only=True)
class Projection:
    """One projection.json as the report reads it."""

    folder: Path
    title: str
    created_utc: str
    command: str
    columns: list[str]
    rows: list[list[Any]]
    notes: list[str]


class ProjectionFileError(ValueError):
    """A projection.json the report cannot read (named in the report, not raised to the user)."""


def read_projection(path: Path) -> Projection:
    """Parse one projection.json.

    Raises:
        ProjectionFileError: not JSON, or a required field is missing or of the wrong type.
    """
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ProjectionFileError(f"not readable JSON ({err})") from None
    if not isinstance(doc, dict):
        raise ProjectionFileError("not a JSON object")
    for key, kind in REQUIRED.items():
        if not isinstance(doc.get(key), kind):
            raise ProjectionFileError(f"field '{key}' is missing or not a {kind.__name__}")
    columns, rows = doc["table"].get("columns"), doc["table"].get("rows")
    if not isinstance(columns, list) or not isinstance(rows, list) or any(
            not isinstance(r, list) or len(r) != len(columns) for r in rows):
        raise ProjectionFileError("field 'table' needs columns (a list) and rows (lists as long as columns)")
    return Projection(folder=path.parent, title=doc["title"], created_utc=doc["created_utc"], command=doc["command"],
                      columns=[str(c) for c in columns], rows=rows, notes=[str(n) for n in doc["notes"]])


def find_projections(run_dir: Path) -> tuple[list[Projection], list[tuple[Path, str]]]:
    """The run's projections, newest first, and the files that could not be read (path, why)."""
    found, broken = [], []
    for path in sorted(Path(run_dir).glob(f"{PROJECTIONS_DIR}/*/{PROJECTION_FILE}")):
        try:
            found.append(read_projection(path))
        except ProjectionFileError as err:
            broken.append((path, str(err)))
    found.sort(key=lambda p: (p.created_utc, p.folder.name), reverse=True)
    return found, broken


def projections_section(doc: Document, run: RunData) -> bool:
    """One part per projection (title, when, the command, its table, its notes). Returns False, adding
    nothing, when the run has none."""
    found, broken = find_projections(run.path)
    if not found and not broken:
        return False
    sec = doc.section("Projected", id="projected")
    sec.blocks.append(Para(f"{len(found)} projection(s) of this run by `trainprof project`, newest first; each "
                           "predicts from this run's measurements (its notes say how, and with what error)."))
    for i, proj in enumerate(found):
        sec.blocks.append(Para(f"{proj.title} ({proj.created_utc}; `{proj.command}`; "
                               f"{proj.folder.relative_to(run.path)})"))
        sec.blocks.append(Table(proj.columns, proj.rows, id="projection-table" if i == 0 else f"projection-table-{i + 1}"))
        if proj.notes:
            sec.blocks.append(Bullets(proj.notes))
    for path, why in broken:
        sec.blocks.append(Missing(f"projection {path.relative_to(run.path)}", why))
    return True


def how_to_project(run: RunData) -> str:
    """The one line a report without projections says about them."""
    return (f"Projections of this run to other hardware, sizes or settings appear here once made: "
            f"`trainprof project {run.path} --to h100-sxm` (or key=value changes).")
