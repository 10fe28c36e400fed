"""`trainprof maxbatch` on CPU: under a per-rank memory cap, the search doubles then bisects, each try a
fresh process (a single rank, without torchrun), and reports the largest micro batch that ran with the
next one out of memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest

from conftest import QUICKSTART, QUIET, REPO

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
