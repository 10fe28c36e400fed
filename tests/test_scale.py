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
    # the baseline is the source projected onto itself: it claims no expected error, and says so
    assert projected["expected_error_pct"].isna().tolist()[0], projected
    assert "N=1: the baseline" in (out / "scaling_projected.md").read_text()
    assert "marks" in projected.columns  # the rows' own confidence marks (a noisy probe), where the reader looks
    above = projected[projected["predicted_efficiency"] > 1]["world_size"].tolist()
    assert all(f"N={n}: projected efficiency above 100%: per rank " in (out / "scaling_projected.md").read_text()
               for n in above), above

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


def _run_dir(root: Path, n: int, tokens_per_s: float) -> Path:
    """A run dir whose profile.json holds what `scale --runs` reads (one recipe, world size n)."""
    d = root / f"n{n}"
    d.mkdir()
    (d / "profile.json").write_text(json.dumps({
        "recipe": {"train": {"micro_batch_size": 2, "grad_accum": 1}, "data": {"seq_len": 100},
                   "output": {"dir": str(d)}},
        "env": {"world_size": n, "timer": "host"},
        "summary": {"tokens_per_s": tokens_per_s, "step_ms": {"median": 200 * n / tokens_per_s * 1e3}},
        "ranks": [{"rank": r, "step_ms_median": 100.0} for r in range(n)]}))
    return d


def test_scale_says_it_is_projecting_and_labels_the_baseline(tmp_path, cli, monkeypatch):
    """The projection takes minutes with no output of its own: a line says it started. The smallest N is the
    baseline: its efficiency is 100% by definition, said so (the projection's own baseline, claiming no
    expected error, is checked on real runs in test_scale_one_and_two_ranks)."""
    from trainprof.projection import views

    def projected(points, extra, **_):
        return ([{"world_size": 1, "predicted_tokens_per_s": 722.0, "step_error_pct": -0.6, "expected_error_pct": None,
                  "predicted_efficiency": 1.0},
                 {"world_size": 2, "predicted_tokens_per_s": 1300.0, "step_error_pct": 3.0, "expected_error_pct": 2.1,
                  "predicted_efficiency": 0.9}], ["projected from the N=1 run", "N=1: the baseline, ..."])

    monkeypatch.setattr(views, "project_scaling", projected)
    dirs = [_run_dir(tmp_path, 1, 700.0), _run_dir(tmp_path, 2, 1200.0)]
    proc = cli("scale", "--runs", *dirs, "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert "trainprof: projecting N=1, 2 from the N=1 run" in proc.stderr
    assert "N=1: 700 tokens/s, efficiency 100.0% (the baseline: 100% by definition)" in proc.stderr
    assert "N=2: 1,200 tokens/s, efficiency 85.7%\n" in proc.stderr
    assert "N=1: projected 722 tokens/s, error -0.6% (the baseline, projected from itself)" in proc.stderr
    table = pd.read_csv(tmp_path / "out" / "scaling_projected.csv")
    assert table["expected_error_pct"].isna().tolist() == [True, False]
    measured = pd.read_csv(tmp_path / "out" / "scaling.csv")
    assert measured["label"].tolist() == ["n1 (baseline)", "n2"]
