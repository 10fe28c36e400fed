"""The run report's Projected section, from hand-made projection.json files (the contract with
`trainprof project`, report/projections.py): every projection, newest first, right after the advice,
rendered from title, created_utc, command, table and notes alone; none -> no section, one line on how
to make one; an unreadable file is named, not raised. The report never imports trainprof.projection."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from trainprof.report.run_report import write_reports

DATA = Path(__file__).parent / "data"
FIXTURES = DATA / "projection_fixtures"


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "zero3_2rank"
    shutil.copytree(DATA / "zero3_2rank", run)
    return run


def test_projections_listed_newest_first_after_the_advice(tmp_path):
    run = _run(tmp_path)
    shutil.copytree(FIXTURES, run / "projections")
    (run / "projections" / "20260103-000000-broken").mkdir()
    (run / "projections" / "20260103-000000-broken" / "projection.json").write_text(json.dumps({"title": "x"}))
    written = write_reports(run, scalars=False)
    md, html = written["md"].read_text(), written["html"].read_text()
    assert md.index("## What to change") < md.index("## Projected") < md.index("## Run facts")
    section = md.split("## Projected")[1].split("\n## ")[0]
    assert section.index("What if: micro batch 8") < section.index("Other hardware: H100 SXM and RTX 4090")
    assert "`trainprof project runs/quickstart --to h100-sxm,rtx4090`" in section and "2026-01-01T12:00:00Z" in section
    assert "| hardware | GPUs | step ms | tokens/s | expected error % |" in section
    assert "| h100-sxm | 8 | 12.50 | 91,000.00 | 7.10 |" in section and "| rtx4090 | 1 | 40.25 | 7,200 | n/a |" in section
    assert "- expected error: validated step-time MAPE" in section
    assert "not available: projection projections/20260103-000000-broken/projection.json** — field " in section
    assert 'id="projection-table"' in html and 'id="projection-table-2"' in html
    assert "ignored" not in md  # fields outside the contract are the projection's own


def test_no_projection_no_section_one_line(tmp_path):
    run = _run(tmp_path)
    md = write_reports(run, scalars=False)["md"].read_text()
    assert "## Projected" not in md
    advice = md.split("## What to change")[1].split("\n## ")[0]
    assert f"`trainprof project {run} --to h100-sxm`" in advice


def test_the_report_does_not_import_the_projection(tmp_path):
    run = _run(tmp_path)
    shutil.copytree(FIXTURES, run / "projections")
    code = ("import sys; from trainprof.report.run_report import write_reports; "
            f"write_reports({str(run)!r}, scalars=False); "
            "print(sorted(m for m in sys.modules if m.startswith('trainprof.projection')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
