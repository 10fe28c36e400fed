"""`trainprof maxbatch` on CPU: under a per-rank memory cap, the search doubles then bisects, each try a
fresh process (a single rank, without torchrun), and reports the largest micro batch that ran with the
next one out of memory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pandas as pd
import pytest

from conftest import QUICKSTART, QUIET, REPO


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()

# eager attention at seq 512 on 4 layers: every extra sample adds ~65 MiB of peak RSS over a ~0.45 GiB
# baseline, so a 0.7 GiB cap lands between 2 and 4 samples
SETTINGS = ["engine.kind=torch", "engine.zero_stage=0", "model.num_layers=4", "model.attention=eager",
            "data.seq_len=512", "train.memory_cap_gb=0.7", *QUIET]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_maxbatch_finds_the_largest_micro_batch_under_a_cap(tmp_path):
    out = tmp_path / "mb"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "trainprof", "maxbatch", str(QUICKSTART), *SETTINGS, "--max", "16", "--steps", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = pd.read_csv(out / "maxbatch.csv").to_dict("records")
    tries = pd.read_csv(out / "maxbatch_tries.csv")
    best = int(row["max_micro_batch"])
    assert row["status"] == "found" and 1 <= best < 16 and int(row["first_fail"]) == best + 1
    outcome = dict(zip(tries["micro_batch_size"], tries["status"]))
    assert outcome[best] == "done" and outcome[best + 1] == "failed"
    assert all(s == "done" for b, s in outcome.items() if b <= best)
    assert all(s == "failed" for b, s in outcome.items() if b > best)
    assert set(tries.loc[tries["status"] == "failed", "failure_kind"]) == {"oom"}
    # each try's tokens/s says how few steps it stands on (--steps 1: one, so no spread to read, not 0.0%)
    done = tries[tries["status"] == "done"]
    assert set(done["steps_used"]) == {1} and done["step_spread"].isna().all()
    tries_md = (out / "maxbatch_tries.md").read_text()
    assert "differences within the spread are noise" in tries_md and "| 1 | n/a |" in tries_md
    # ... and that step ran untraced (the recipe's profile.ops=true would trace every step of a short try)
    for cell_id in done["cell_id"]:
        (profile,) = (out / "cells" / cell_id).glob("*/profile.json")
        steps = json.loads(profile.read_text())["steps"]
        assert [s["instrumented"] for s in steps if not s["warmup"]] == [[]], steps
    # doubling from 1, then bisection: the powers of two up to the first failure, then the halvings
    doubled = [b for b in sorted(outcome) if b & (b - 1) == 0]
    assert doubled == [2**i for i in range(len(doubled))] and doubled[-1] > best
    # the failing try recorded the memory that broke the cap (the fitting ones' per-phase peaks are not compared
    # with the cap: the cap reads the process's peak RSS, which the step profiler's per-phase reset also resets)
    assert row["tries"] == len(tries) and row["failure_memory_mib"] > 0.7 * 1024
    assert (out / "maxbatch.png").stat().st_size > 0 and (out / "maxbatch.html").is_file()

    # resumable: the same command makes no new try
    state = json.loads((out / "maxbatch.json").read_text())
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert again.returncode == 0, again.stderr[-2000:]
    state2 = json.loads((out / "maxbatch.json").read_text())
    assert [c["attempts"] for c in state2["cells"].values()] == [c["attempts"] for c in state["cells"].values()]


@pytest.mark.skipif(torch_cuda_available(), reason="the guard is for CPUs")
def test_maxbatch_on_a_cpu_without_a_memory_cap_is_refused(tmp_path, cli):
    """Without train.memory_cap_gb the tries would grow until the kernel's OOM killer stops one."""
    # --max 2: without the guard this would run two small tries, not double toward the OOM killer
    proc = cli("maxbatch", QUICKSTART, "--max", "2", "--steps", "1", "--out", tmp_path / "mb")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "needs train.memory_cap_gb" in proc.stderr and re.search(r"this machine has [\d.]+ GiB available",
                                                                      proc.stderr)
    assert "--no-cap" in proc.stderr and not (tmp_path / "mb").exists()


def test_nproc_with_a_sweep_file_is_refused(tmp_path, cli):
    """A sweep file sets its cells' ranks: --nproc beside it is a one-line error, as overrides are, not ignored."""
    sweep = REPO / "recipes" / "sweeps" / "pretrain_maxbatch_cpu.yaml"
    proc = cli("maxbatch", sweep, "--nproc", "2", "--out", tmp_path / "mb")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("trainprof: --nproc 2 applies to a recipe") and "`nproc:`" in proc.stderr
    assert not (tmp_path / "mb").exists()


def test_an_interrupted_search_reports_its_best_so_far_marked_partial(tmp_path, cli, monkeypatch):
    """Micro batches 1 and 2 fit, then the search is interrupted during 4: maxbatch.md says 2, marked partial."""
    from trainprof.sweep import maxbatch

    def fake_try(cell, out_dir, state, *, timeout_s):
        batch = int(next(o for o in cell.overrides if o.startswith("train.micro_batch_size=")).split("=")[1])
        if batch <= 2:
            return state.update(cell.key, {**cell.to_dict(), "status": "done", "run_dir": f"run{batch}",
                                           "values": {"tokens_per_s": 100.0 * batch, "peak_memory_mib": 10.0 * batch}})
        state.update(cell.key, {**cell.to_dict(), "status": "interrupted"})
        raise KeyboardInterrupt

    monkeypatch.setattr(maxbatch, "run_cell", fake_try)
    sigterm = signal.getsignal(signal.SIGTERM)  # the command turns SIGTERM into an interrupt
    try:
        proc = cli("maxbatch", QUICKSTART, "train.memory_cap_gb=1", "--out", tmp_path / "mb")
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert proc.returncode == 130, proc.stderr
    (row,) = pd.read_csv(tmp_path / "mb" / "maxbatch.csv").to_dict("records")
    assert row["status"] == "interrupted (partial)" and row["max_micro_batch"] == 2 and row["tries"] == 2
    assert row["tokens_per_s"] == 200.0 and "best so far" in row["note"]
    assert "interrupted (partial)" in (tmp_path / "mb" / "maxbatch.md").read_text()


def test_the_cpu_memory_cap_message_shows_figures_that_differ(monkeypatch):
    """0.52 GiB peak against a 0.52 GiB cap read as the same number: say MiB, and by how much."""
    import torch

    from trainprof import env

    cap = 0.52
    monkeypatch.setattr(env, "peak_memory_bytes", lambda device: int(cap * 2**30) + 8192)
    with pytest.raises(MemoryError) as err:
        env.check_memory_cap(torch.device("cpu"), cap)
    assert "peak RSS 532.5 MiB exceeds train.memory_cap_gb=0.52 (532.5 MiB) by 8 KiB" in str(err.value)
    monkeypatch.setattr(env, "peak_memory_bytes", lambda device: int(cap * 2**30) - 1)
    env.check_memory_cap(torch.device("cpu"), cap)
