"""`trainprof report` on a run dir when a package a part needs does not import (made to fail in this
process through sys.modules, not uninstalled): the other parts are written, and the missing part is one
line on stderr naming the package and how to install it, exit code 2, no traceback."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from trainprof.cli import main

DATA = Path(__file__).parent / "data"


def _block(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """`import package` (and its submodules already loaded) raises ImportError from now on."""
    for name in [n for n in sys.modules if n == package or n.startswith(package + ".")] + [package]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("missing, part", [(("matplotlib",), "plots"), (("tensorboard",), "TensorBoard scalars"),
                                           (("matplotlib", "tensorboard"), "plots")])
def test_a_missing_package_is_one_line_exit_2_and_the_rest_is_written(tmp_path, monkeypatch, capsys, missing, part):
    run = tmp_path / "zero3_2rank"
    shutil.copytree(DATA / "zero3_2rank", run)
    for package in missing:
        _block(monkeypatch, package)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith("trainprof: ") and part in line and "Traceback" not in err
    assert all(p in line for p in missing) and f"pip install {' '.join(sorted(missing))}" in line
    for name in ("report.md", "report.html", "summary.md", "modules.csv"):
        assert (run / name).stat().st_size > 0, name
    html = (run / "report.html").read_text()
    assert ("not available: plots</strong>" in html) == ("matplotlib" in missing)
    assert ('src="data:image/png;base64,' in html) == ("matplotlib" not in missing)
    assert bool(list((run / "tb").rglob("events.out.tfevents.*"))) == ("tensorboard" not in missing)


def test_every_recorded_run_dir_reports_without_a_traceback(tmp_path, monkeypatch, capsys):
    """The recorded run dirs (with traces, from before the profiler, a failure only) with neither
    matplotlib nor tensorboard importable: one line for each run that had something to plot, exit 2,
    never a traceback."""
    (tmp_path / "failed").mkdir()
    (tmp_path / "failed" / "failure-rank0.json").write_text('{"rank": 0, "kind": "oom", "message": "out of memory"}')
    runs = [tmp_path / "failed"]
    for name in ("zero3_2rank", "pre_profiler_run"):
        shutil.copytree(DATA / name, tmp_path / name)
        runs.append(tmp_path / name)
    for package in ("matplotlib", "tensorboard"):
        _block(monkeypatch, package)
    assert main(["report", *map(str, runs)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for run in runs:
        assert (run / "report.html").is_file()
    assert len([ln for ln in err.splitlines() if ln.startswith("trainprof: ")]) == 2
    assert f"trainprof report: wrote {runs[0] / 'report.md'}" in err  # nothing to plot in a failed run


def test_the_report_command_says_what_else_it_rewrote(tmp_path, capsys):
    """Besides report.md and report.html, `trainprof report` rewrites summary.md, the CSV tables and the
    TensorBoard scalars; its line said only the first two."""
    run = tmp_path / "zero3_2rank"
    shutil.copytree(DATA / "zero3_2rank", run)
    assert main(["report", str(run)]) == 0
    err = capsys.readouterr().err
    assert f"; refreshed summary.md and the CSV tables and the TensorBoard scalars in {run / 'tb'}" in err, err
