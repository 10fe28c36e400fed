"""`trainprof scale` on CPU at 1 and 2 ranks: the efficiency table and chart, with efficiencies that match
the throughputs in the run dirs, and the same answer when the run dirs are given back with --runs."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from trainprof.sweep.scaling import PARTS

from conftest import FAST, QUICKSTART, QUIET, REPO, TRAINPROF_CELLS


def scale(*args: str, timeout: int = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*TRAINPROF_CELLS, "scale", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


def check_report(out: Path, mode: str, batches: list[int]) -> pd.DataFrame:
    df = pd.read_csv(out / "scaling.csv")
    assert list(df["world_size"]) == [1, 2]
    profiles = [json.loads((Path(d) / "profile.json").read_text()) for d in df["run_dir"]]
    tput = [p["summary"]["tokens_per_s"] for p in profiles]
    assert df["tokens_per_s"].tolist() == pytest.approx(tput)
    assert df["efficiency"].tolist() == pytest.approx([1.0, tput[1] / (2 * tput[0])])
    lost = df[[f"{k}_lost" for k in PARTS]].fillna(0).sum(axis=1)
    assert (df["efficiency"] + lost).tolist() == pytest.approx([1.0, 1.0])
    assert [p["recipe"]["train"]["micro_batch_size"] for p in profiles] == batches
    assert (out / "scaling.png").stat().st_size > 0
    md = (out / "scaling.md").read_text()
    assert "efficiency = tput(N) * N0 / (N * tput(N0))" in md and f"scaling mode: {mode}" in md
    for suffix in ("html", "md", "csv"):
        assert (out / f"scaling_comm.{suffix}").is_file()
    return df


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_scale_one_and_two_ranks(tmp_path):
    out = tmp_path / "scale"
    proc = scale(str(QUICKSTART), *FAST, *QUIET, "--nproc", "1,2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    weak = check_report(out, "weak", batches=[2, 2])  # weak scaling: the per-rank micro batch stays 2
    # the projected table beside the measured one, from the N=1 run (the calls below skip it: --no-project)
    projected = pd.read_csv(out / "scaling_projected.csv")
    assert list(projected["world_size"]) == [1, 2], projected

    # the same runs read back from their dirs, as when collected from a cluster
    again = scale("--runs", *weak["run_dir"], "--no-project", "--out", str(tmp_path / "collected"), timeout=60)
    assert again.returncode == 0, again.stderr[-2000:]
    collected = pd.read_csv(tmp_path / "collected" / "scaling.csv")
    assert collected["efficiency"].tolist() == pytest.approx(weak["efficiency"].tolist())

    # strong scaling keeps the global batch (2): 1 sample per rank at N=2. Same output dir: the N=1 run is
    # the same configuration, so it is reused rather than run again
    proc = scale(str(QUICKSTART), *FAST, *QUIET, "--nproc", "1,2", "--strong", "--no-project", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    strong = check_report(out, "strong", batches=[2, 1])
    assert strong["run_dir"][0] == weak["run_dir"][0]
