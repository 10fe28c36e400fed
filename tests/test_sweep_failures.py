"""Sweep reliability on CPU: an out-of-memory cell and a cell whose rank is killed mid-run are recorded
(kind, rank, signal, memory) while the sweep goes on; a re-run skips finished cells; SIGINT leaves a
state that resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from conftest import QUICKSTART, QUIET, REPO
from helpers.processes import descendants_alive

COMMON = f"[data.seq_len=32, train.micro_batch_size=1, engine.zero_stage=0, train.warmup_steps=0, {', '.join(QUIET)}]"


def start_sweep(sweep: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Ctrl-C's default, whatever an earlier test in this process left (an ignored SIGINT is inherited)
    return subprocess.Popen([sys.executable, "-m", "trainprof", "sweep", str(sweep), "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def wait_for_run_dir(out: Path, cell_prefix: str, proc: subprocess.Popen, timeout: float = 120) -> Path:
    """The cell's run dir, once trainprof.run has made it (the ranks are initialised and about to train)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list(out.glob(f"cells/{cell_prefix}*/*/recipe.yaml"))
        if found:
            return found[0].parent
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    raise AssertionError(f"cell {cell_prefix} never started")


def rank_process(sweep_pid: int, rank: int) -> psutil.Process:
    for p in psutil.Process(sweep_pid).children(recursive=True):
        try:
            if "trainprof.run" in p.cmdline() and p.environ().get("RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} process under the sweep")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_failed_cells_are_recorded_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "failures.yaml"
    sweep.write_text(f"""recipe: {QUICKSTART}
timeout_s: 300
overrides: {COMMON}
cells:
  - {{name: fine, overrides: [train.steps=2]}}
  - {{name: oom, overrides: [train.steps=2, train.memory_cap_gb=0.05]}}
  - {{name: killed, overrides: [train.steps=100000], nproc: 2}}
  - {{name: after, overrides: [train.steps=3]}}
""")
    out = tmp_path / "out"
    proc = start_sweep(sweep, out)
    wait_for_run_dir(out, "killed", proc)
    time.sleep(2)  # into its steps
    victim = rank_process(proc.pid, 1)
    victim.send_signal(signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    # the killed cell is the sweep's failure; the OOM cell is a result (it does not fit)
    assert proc.returncode == 1, stderr[-3000:]
    assert "1 cell(s) failed other than out of memory (killed n=2)" in stderr, stderr[-3000:]

    df = pd.read_csv(out / "results.csv").set_index("cell")
    assert list(df.index) == ["fine", "oom", "killed n=2", "after"]
    assert list(df["status"]) == ["done", "failed", "failed", "done"]
    oom = df.loc["oom"]
    assert oom["failure_kind"] == "oom" and oom["failed_rank"] == 0 and oom["failure_memory_mib"] > 50
    assert "train.memory_cap_gb=0.05" in oom["failure_message"]
    killed = df.loc["killed n=2"]
    assert (killed["failure_kind"], killed["failed_rank"], killed["signal"]) == ("killed", 1, "SIGKILL")
    assert "failed: killed rank 1" in stderr  # said as it happened
    state = json.loads((out / "sweep.json").read_text())
    rec = next(c for c in state["cells"].values() if c["label"] == "killed n=2")
    # rank 1 left no record; rank 0 may have (a gloo error) or not (torchrun stopped it first)
    assert 1 in rec["failure"]["ranks_silent"] and rec["elapsed_s"] < 120  # torchrun noticed: no hang

    # a re-run runs nothing: done and failed cells are finished
    again = start_sweep(sweep, out)
    _, stderr = again.communicate(timeout=120)
    assert again.returncode == 1, stderr[-2000:]
    state2 = json.loads((out / "sweep.json").read_text())
    assert [c["attempts"] for c in state2["cells"].values()] == [1, 1, 1, 1]
    assert "2 done, 2 failed" in stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigint_leaves_a_resumable_sweep(tmp_path):
    sweep = tmp_path / "interrupt.yaml"
    sweep.write_text(f"""recipe: {QUICKSTART}
timeout_s: 300
overrides: {COMMON}
cells:
  - {{name: first, overrides: [train.steps=2]}}
  - {{name: second, overrides: [train.steps=300]}}
""")
    out = tmp_path / "out"
    proc = start_sweep(sweep, out)
    wait_for_run_dir(out, "second", proc)
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the sweep (its cells run in their own sessions)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr[-3000:]
    assert "run the same command again to resume" in stderr
    time.sleep(0.5)
    assert descendants_alive(tree) == []  # no rank outlives the sweep
    state = json.loads((out / "sweep.json").read_text())
    status = {c["label"]: c["status"] for c in state["cells"].values()}
    assert status == {"first": "done", "second": "interrupted"}
    df = pd.read_csv(out / "results.csv")  # the tables are written on the way out, too
    assert list(df["status"]) == ["done", "interrupted"]

    resumed = start_sweep(sweep, out)
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr[-3000:]
    state = json.loads((out / "sweep.json").read_text())
    attempts = {c["label"]: (c["status"], c["attempts"]) for c in state["cells"].values()}
    assert attempts == {"first": ("done", 1), "second": ("done", 2)}
    # the interrupted attempt's files are moved aside, not deleted, and the resume says where
    second = next(c for c in state["cells"].values() if c["label"] == "second")
    kept = out / "cells" / f"{second['id']}.attempt1"
    assert second["earlier_attempts"][0]["dir"] == str(kept) and second["earlier_attempts"][0]["status"] == "interrupted"
    assert (kept / "launch.log").is_file() and list(kept.glob("*/recipe.yaml"))
    assert "attempt 1 (interrupted" in stderr and str(kept) in stderr
