"""Run cells one after another, each as its own process tree (sweep/launch.py), recording each in the
state file.

A finished cell (done or failed) is never run again; a cell interrupted by Ctrl-C / SIGTERM is marked
`interrupted` and runs again on the next invocation. Every cell writes under <out>/cells/<cell id>/:
launch.log (torchrun's or the single rank's output) and the run dir trainprof.run makes there.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Iterable

from trainprof.errors import UserError
from trainprof.report.rundir import RunDirError, read_profile_file
from trainprof.sweep.launch import launch, launch_command
from trainprof.sweep.outcome import failure_record, find_run_dir, metrics_row
from trainprof.sweep.spec import Cell
from trainprof.sweep.state import SweepState, now


def interrupt_on_sigterm() -> None:
    """Treat SIGTERM (a batch scheduler's preemption, `kill`) like Ctrl-C: stop the cell, keep state."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, handler)


def cell_env() -> dict[str, str]:
    """The cells' environment: ours, with unbuffered output so launch.log is complete at a kill."""
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def run_cell(cell: Cell, out_dir: Path, state: SweepState, *, timeout_s: float) -> dict[str, Any]:
    """Launch one cell, wait for it (or its timeout), record done / failed in the state file.

    Raises:
        KeyboardInterrupt: after recording the cell as interrupted, when the sweep was interrupted.
    """
    cell_dir = out_dir / "cells" / cell.id
    previous = state.get(cell.key) or {}
    for stale in {cell.id, previous.get("id")} - {None}:  # an unfinished or retried attempt (maybe relabeled)
        if (out_dir / "cells" / stale).exists():
            shutil.rmtree(out_dir / "cells" / stale)
    state.update(cell.key, {**cell.to_dict(), "status": "running", "started": now(), "finished": None,
                           "attempts": previous.get("attempts", 0) + 1, "run_dir": None, "values": None,
                           "methods": None, "null_reasons": None, "failure": None})
    cmd = launch_command(cell.recipe_path, [*cell.overrides, f"output.dir={cell_dir}"],
                         nproc=cell.nproc, nnodes=cell.nnodes)
    result = launch(cmd, log_path=cell_dir / "launch.log", timeout_s=timeout_s, env=cell_env())
    run_dir = find_run_dir(cell_dir)
    common = {"finished": now(), "elapsed_s": round(result.elapsed_s, 1), "log": result.log,
              "run_dir": str(run_dir) if run_dir else None}
    if result.interrupted:
        state.update(cell.key, {**common, "status": "interrupted"})
        raise KeyboardInterrupt
    profile_path = run_dir / "profile.json" if run_dir else None
    unreadable = None
    if result.returncode == 0 and profile_path is not None and profile_path.is_file():
        try:
            profile = read_profile_file(profile_path)
        except (UserError, RunDirError) as err:  # a cut-short or foreign file fails this cell, not the sweep
            unreadable = str(err)
        else:
            values, methods, why = metrics_row(profile)
            return state.update(cell.key, {**common, "status": "done", "values": values, "methods": methods,
                                          "null_reasons": why})
    failure = failure_record(result, run_dir, cell.world_size)
    if result.returncode == 0 and failure["kind"] == "error" and failure["rank"] is None:
        failure["message"] = unreadable or "the launcher exited 0 but the run wrote no profile.json"
    return state.update(cell.key, {**common, "status": "failed", "failure": failure})


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
                bar.write(f"trainprof: cell '{cell.label}' failed: {f['kind']}{where}: {f['message'][:200]} "
                          f"(log: {rec['log']})", file=sys.stderr)
            bar.update()
    finally:
        bar.set_postfix_str(f"{counts['done']} done, {counts['failed']} failed", refresh=True)
        bar.close()
    return [state.get(c.key) for c in cells]
