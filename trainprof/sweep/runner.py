"""Run cells one after another, each as its own process tree (sweep/launch.py), recording each in the
state file.

A finished cell (done or failed) is never run again; a cell interrupted by Ctrl-C / SIGTERM is marked
`interrupted` and runs again on the next invocation, unless it had written its whole profile.json (the
stop came during calibration or the report files): that cell is done, with a note. Every cell writes under <out>/cells/<cell id>/:
launch.log (torchrun's or the single rank's output) and the run dir trainprof.run makes there. A cell
run again (resumed, retried) first moves its earlier attempt's dir aside to <cell id>.attempt<N>/: what
that attempt measured is kept, never deleted. A cell that failed or was stopped after some measured
steps keeps their figures, marked partial (the state's `partial`), as `trainprof report` reads them.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Iterable

from trainprof.errors import UserError
from trainprof.report.rundir import RunDirError, load_run, read_profile_file
from trainprof.sweep.launch import launch, launch_command
from trainprof.sweep.outcome import failure_record, find_run_dir, metrics_row
from trainprof.sweep.spec import Cell
from trainprof.sweep.state import SweepState, now


def interrupt_on_sigterm() -> None:
    """Treat SIGTERM (a batch scheduler's preemption, `kill`) like Ctrl-C: stop the cell, keep state."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


CELL_TIMEOUT_ENV = "TRAINPROF_CELL_TIMEOUT_S"  # read by trainprof/run.py for its failure message


def cell_env(timeout_s: float | None = None) -> dict[str, str]:
    """The cells' environment: ours, with unbuffered output so launch.log is complete at a kill, and the
    cell's timeout, so a rank stopped by the launcher can say what stopped it (trainprof/run.py)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if timeout_s is not None:
        env[CELL_TIMEOUT_ENV] = f"{timeout_s:g}"
    return env


def _say(message: str) -> None:
    """A line on stderr that does not break a progress bar being drawn there."""
    from tqdm import tqdm

    tqdm.write(message, file=sys.stderr)


def keep_earlier_attempt(out_dir: Path, cell: Cell, previous: dict[str, Any]) -> list[dict[str, Any]]:
    """Move the dir of the cell's earlier attempt (and of an earlier label of the same configuration) aside
    to cells/<id>.attempt<N>/ instead of deleting it; returns the state's `earlier_attempts`, this one added."""
    kept = list(previous.get("earlier_attempts") or [])
    attempt = previous.get("attempts", 0)
    for stale in dict.fromkeys(i for i in (cell.id, previous.get("id")) if i):
        old = out_dir / "cells" / stale
        if not old.exists():
            continue
        new, n = out_dir / "cells" / f"{stale}.attempt{attempt}", 1
        while new.exists():
            n += 1
            new = out_dir / "cells" / f"{stale}.attempt{attempt}-{n}"
        old.rename(new)
        partial = previous.get("partial") or {}
        measured = f", figures from {partial['steps']} steps" if partial.get("steps") else ""
        kept.append({"attempt": attempt, "dir": str(new), "status": previous.get("status"),
                     "partial": previous.get("partial")})
        _say(f"trainprof: cell '{cell.label}': attempt {attempt} ({previous.get('status', 'unfinished')}"
             f"{measured}) kept in {new}")
    return kept


def partial_figures(run_dir: Path | None) -> dict[str, Any] | None:
    """The figures of the steps a failed or stopped cell measured, read as `trainprof report` reads a
    partial run (profile.rank*.partial.json, or the killed ranks' journals); None where it measured none."""
    if run_dir is None:
        return None
    try:
        run = load_run(run_dir)
    except Exception:  # noqa: BLE001  the failure matters more than what it left half-written
        return None
    if run.profile is None or not run.measured_steps:
        return None
    values, methods, why = metrics_row(run.profile)
    if values["steps_measured"] is None:
        values["steps_measured"] = len(run.measured_steps)
    # `steps`: what the figures stand on (medians over the untraced steps), not every step it measured
    return {"steps": values["steps_used"] or values["steps_measured"], "reason": run.profile.get("partial_reason"),
            "source": run.source, "values": values, "methods": methods, "null_reasons": why}


def complete_profile(run_dir: Path | None) -> tuple[dict[str, Any] | None, str | None]:
    """(profile, why not): the run's profile.json when it is there, readable and not partial."""
    path = run_dir / "profile.json" if run_dir else None
    if path is None or not path.is_file():
        return None, None
    try:
        profile = read_profile_file(path)
    except (UserError, RunDirError) as err:  # a cut-short or foreign file fails this cell, not the sweep
        return None, str(err)
    if profile.get("partial"):
        return None, f"{path} is a partial profile"
    return profile, None


def run_cell(cell: Cell, out_dir: Path, state: SweepState, *, timeout_s: float) -> dict[str, Any]:
    """Launch one cell, wait for it (or its timeout), record done / failed in the state file.

    Raises:
        KeyboardInterrupt: after recording the cell (interrupted, or done when its profile.json was whole),
            when the sweep was interrupted.
    """
    cell_dir = out_dir / "cells" / cell.id
    previous = state.get(cell.key) or {}
    earlier = keep_earlier_attempt(out_dir, cell, previous)  # an unfinished or retried attempt (maybe relabeled)
    state.update(cell.key, {**cell.to_dict(), "status": "running", "started": now(), "finished": None,
                           "attempts": previous.get("attempts", 0) + 1, "run_dir": None, "values": None,
                           "methods": None, "null_reasons": None, "failure": None, "partial": None, "note": None,
                           "earlier_attempts": earlier or None})
    # the run dir is named after the cell (as its TensorBoard run and report title are), unless the cell names it
    named = any(o.startswith("output.name=") for o in cell.overrides)
    cmd = launch_command(cell.recipe_path, [*cell.overrides, f"output.dir={cell_dir}",
                                            *([] if named else [f"output.name={cell.id}"])],
                         nproc=cell.nproc, nnodes=cell.nnodes)
    result = launch(cmd, log_path=cell_dir / "launch.log", timeout_s=timeout_s, env=cell_env(timeout_s))
    run_dir = find_run_dir(cell_dir)
    common = {"finished": now(), "elapsed_s": round(result.elapsed_s, 1), "log": result.log,
              "run_dir": str(run_dir) if run_dir else None}
    profile, unreadable = complete_profile(run_dir)
    # training finished and its profile.json is whole: a stop after it (calibration, report files) loses no figure
    if profile is not None and (result.returncode == 0 or result.interrupted):
        values, methods, why = metrics_row(profile)
        note = "interrupted after its profile.json was written: calibration.json or later files may be missing" \
            if result.interrupted else None
        rec = state.update(cell.key, {**common, "status": "done", "values": values, "methods": methods,
                                      "null_reasons": why, "note": note})
        if result.interrupted:
            raise KeyboardInterrupt
        return rec
    if result.interrupted:
        state.update(cell.key, {**common, "status": "interrupted", "partial": partial_figures(run_dir)})
        raise KeyboardInterrupt
    failure = failure_record(result, run_dir, cell.world_size)
    if result.returncode == 0 and failure["kind"] == "error" and failure["rank"] is None:
        failure["message"] = unreadable or "the launcher exited 0 but the run wrote no profile.json"
    return state.update(cell.key, {**common, "status": "failed", "failure": failure,
                                   "partial": partial_figures(run_dir)})


def run_cells(cells: Iterable[Cell], out_dir: Path, state: SweepState, *, timeout_s: float,
              retry_failed: bool = False, desc: str = "cells") -> list[dict[str, Any]]:
    """Run the cells that are not finished yet, in order, with a progress bar over all of them.

    Returns:
        The state record of every cell, in the given order.
    Raises:
        KeyboardInterrupt: the sweep was interrupted; every finished cell is in the state file.
    """
    from tqdm import tqdm

    from trainprof.env import progress_interval

    cells = list(cells)
    todo = [c for c in cells if state.should_run(c.key, retry_failed=retry_failed)]
    bar = tqdm(total=len(cells), initial=len(cells) - len(todo), desc=desc, unit="cell", file=sys.stderr,
               dynamic_ncols=True, mininterval=progress_interval())
    counts = {"done": 0, "failed": 0}
    todo_keys = {c.key for c in todo}
    for c in cells:
        if c.key not in todo_keys:
            counts[state.get(c.key)["status"]] += 1
    try:
        for cell in todo:
            bar.set_postfix_str(f"{cell.label} (n={cell.world_size})", refresh=True)
            rec = run_cell(cell, out_dir, state, timeout_s=timeout_s)
            counts[rec["status"]] += 1
            if rec["status"] == "failed":
                f = rec["failure"]
                where = f" rank {f['rank']}" if f.get("rank") is not None else ""
                kept = f"; its figures from {rec['partial']['steps']} steps are kept, marked partial" \
                    if rec.get("partial") else ""
                bar.write(f"trainprof: cell '{cell.label}' failed: {f['kind']}{where}: {f['message'][:200]} "
                          f"(log: {rec['log']}){kept}", file=sys.stderr)
            bar.update()
    finally:
        bar.set_postfix_str(f"{counts['done']} done, {counts['failed']} failed", refresh=True)
        bar.close()
    return [state.get(c.key) for c in cells]
