"""Where a run's files go: the timestamped run dir and the TensorBoard run dir inside its tb/."""

from __future__ import annotations

import datetime as dt
import os
import tempfile
from pathlib import Path


def new_run_dir(parent: str | Path, name: str, *, stamp_first: bool = False) -> Path:
    """Create <parent>/<name>-<UTC timestamp>/ (or <UTC timestamp>-<name>/ with `stamp_first`, so that the
    folders sort by time) with a suffix -2, -3... when it exists, and return it."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = Path(parent) / (f"{stamp}-{name}" if stamp_first else f"{name}-{stamp}")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    path.mkdir(parents=True)
    return path


def tb_run_dir(run_dir: str | Path) -> Path:
    """<run_dir>/tb/<run dir name>/: the Kineto traces and the scalars of a run. TensorBoard and its
    PyTorch Profiler plugin name a run after the folder holding its files, so `tensorboard --logdir
    <run_dir>/tb` lists the run by its name (files directly in tb/ would be listed as `tb`)."""
    run_dir = Path(run_dir)
    return run_dir / "tb" / run_dir.name


# every way a run gets operator traces, for the messages that find none
TRACES_HOW = ("profile.ops=true in a recipe, `trainprof wrap --ops`, ops=True on the HF/Lightning callbacks, or "
              "Profiler(ops=True, trace_dir=...)")


def output_dir_problem(output_dir: str | Path) -> str | None:
    """Why run dirs cannot be created under `output_dir` (None when they can): checked before a run or a
    wrapped script starts, so an unusable dir is not found only after training. Leaves nothing behind: the
    deepest existing dir gets one empty dir made and removed, since permission bits do not tell (root may
    write anywhere by them, yet /proc refuses new entries)."""
    path = Path(output_dir).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"'{existing}' is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"'{existing}' is not writable"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".trainprof-check-", dir=existing))
    except OSError as err:
        return f"'{existing}' refuses new entries ({err.strerror or err})"
    return None
