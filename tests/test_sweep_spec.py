"""Sweep files, cell ids, failure parsing, the max-batch search, strong-scaling batches, the scaling
arithmetic, tables and the launcher's timeout: everything about sweeps that needs no training run."""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from trainprof.recipe import load_recipe
from trainprof.sweep.launch import launch
from trainprof.sweep.maxbatch import search_max_batch
from trainprof.sweep.outcome import failure_record, metrics_row
from trainprof.sweep.scaling import PARTS, analyze, comm_rows, strong_overrides
from trainprof.sweep.spec import SweepError, load_sweep
from trainprof.report.tables import Column, fmt_num, fmt_pct, write_tables

from conftest import QUICKSTART, REPO

SWEEPS = sorted((REPO / "recipes" / "sweeps").glob("*.yaml"))


def write_sweep(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"recipe: {QUICKSTART}\n" + text)
    return path


def test_shipped_sweeps_validate_and_open_with_their_command():
    assert SWEEPS, "recipes/sweeps/ ships sweep files"
    names = {p.stem for p in SWEEPS}
    for path in SWEEPS:
        first = path.read_text().splitlines()[0]
        assert first.startswith("# trainprof ") and first.endswith(f"recipes/sweeps/{path.name}"), path
        sweep = load_sweep(path, check_machine=False)  # GPU sweeps validate on a laptop too
        assert sweep.cells, path
        if path.stem.endswith("_gpu") and _trains_megatron(path):  # megatron-core trains on CUDA only:
            with pytest.raises(SweepError, match="'engine.kind': megatron trains on a CUDA GPU only"):
                load_sweep(path, check_machine=True, cuda_available=False)  # no CPU twin; a CPU refuses it
        elif path.stem.endswith("_gpu"):  # every other GPU table has a CPU version that runs here
            assert path.stem[: -len("_gpu")] + "_cpu" in names, f"{path.name} has no _cpu twin"
    for path in SWEEPS:
        if path.stem.endswith("_cpu"):
            load_sweep(path, check_machine=True, cuda_available=False)


def _trains_megatron(path: Path) -> bool:
    """Whether a sweep file has a cell on engine.kind megatron."""
    sweep = load_sweep(path, check_machine=False)
    return any(load_recipe(c.recipe_path, c.overrides).engine.kind == "megatron" for c in sweep.cells)


def test_matrix_crossed_with_cells_in_order_with_stable_ids(tmp_path):
    path = write_sweep(tmp_path, """
overrides: [data.seq_len=64]
cells:
  - {name: a}
  - {name: b, overrides: [engine.zero_stage=2], nproc: 2}
matrix:
  model.recompute: [false, true]
  model.attention: [eager, sdpa]
""")
    sweep = load_sweep(path)
    assert [c.label for c in sweep.cells][:4] == ["a recompute=false attention=eager", "a recompute=false attention=sdpa",
                                                  "a recompute=true attention=eager", "a recompute=true attention=sdpa"]
    assert len(sweep.cells) == 8 and [c.nproc for c in sweep.cells] == [1] * 4 + [2] * 4
    assert sweep.cells[4].overrides == ["data.seq_len=64", "engine.zero_stage=2", "model.recompute=false",
                                        "model.attention=eager"]
    # the id depends on the configuration, not on how its overrides are spelled or ordered
    again = write_sweep(tmp_path, """
cells:
  - {name: b, overrides: [model.attention=eager, recompute=false, zero_stage=2, seq_len=64], nproc: 2}
""", "again.yaml")
    assert load_sweep(again).cells[0].key == sweep.cells[4].key
    # a different world size or value is a different cell
    assert len({c.key for c in sweep.cells}) == 8 == len({c.id for c in sweep.cells})


def test_world_size_in_the_matrix(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path, "matrix: {nproc: [1, 2], engine.zero_stage: [0, 3]}\n"))
    assert [(c.nproc, c.overrides) for c in sweep.cells] == [
        (1, ["engine.zero_stage=0"]), (1, ["engine.zero_stage=3"]), (2, ["engine.zero_stage=0"]),
        (2, ["engine.zero_stage=3"])]


@pytest.mark.parametrize("text,message", [
    ("celss: [{name: a}]\n", "unknown key 'celss'; did you mean 'cells'?"),
    ("cells: [{name: a, overides: [x=1]}]\n", "cell 1: unknown key 'overides'; did you mean 'overrides'?"),
    ("cells: [{name: a, overrides: [engine.zero_stagee=2]}]\n", "cell 'a': unknown recipe key 'engine.zero_stagee'"),
    ("matrix: {engine.zero_stage: [0, 7]}\n", "cell 'zero_stage=7': recipe key 'engine.zero_stage': 7 is out of range"),
    ("overrides: [engine.zero_stage=2]\nmatrix: {engine.offload: [optimizer+params]}\n",
     "parameter offload needs ZeRO stage 3"),
    ("cells: [{name: a}, {name: b}]\n", "cells 'a' and 'b' are the same configuration"),
    ("matrix: {nproc: [0]}\n", "must be an integer >= 1"),
    ("timeout_s: -1\ncells: [{}]\n", "'timeout_s' must be a number of seconds > 0"),
    ("cells: [{overrides: zero_stage=2}]\n", "must be a list of key=value strings"),
])
def test_bad_sweep_files_are_one_line_errors(tmp_path, text, message):
    with pytest.raises(SweepError) as err:
        load_sweep(write_sweep(tmp_path, text), cuda_available=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_cli_bad_sweep_exits_2_before_running_anything(tmp_path, cli):
    path = write_sweep(tmp_path, "cells:\n  - {name: ok}\n  - {name: bad, overrides: [model.attention=flash2]}\n")
    proc = cli("sweep", path, "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("trainprof: sweep file")
    assert "flash2 needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "out").exists()  # validated up front: not even the first cell ran
    missing = cli("sweep", tmp_path / "nope.yaml")
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_scale_runs_that_are_not_profiles_are_one_line_errors(tmp_path, cli):
    for name, text, message in (("cut", '{"steps": [', "not valid JSON (line 2 col 1)"),
                                ("list", "[1, 2]", "is not a trainprof profile")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "profile.json").write_text(text + "\n")
        proc = cli("scale", "--runs", tmp_path / name, "--out", tmp_path / "out")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
        assert f"{name}/profile.json" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_help_of_each_command(cli):
    for command in ("sweep", "maxbatch", "scale"):
        proc = cli(command, "--help")
        assert proc.returncode == 0 and "usage: trainprof " + command in proc.stdout


def test_maxbatch_search_doubles_then_bisects():
    tried = []

    def fits(b):
        tried.append(b)
        return b <= 37

    s = search_max_batch(fits, start=1, limit=1024)
    assert (s.max_fit, s.first_fail, s.bounded) == (37, 38, True)
    assert tried == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    none = search_max_batch(lambda b: False, start=4)
    assert none.max_fit is None and none.first_fail == 4
    unbounded = search_max_batch(lambda b: True, start=3, limit=20)
    assert unbounded.max_fit == 20 and not unbounded.bounded and unbounded.tried == [3, 6, 12, 20]


def test_strong_scaling_keeps_the_global_batch():
    assert strong_overrides(4, 1, 1, 2) == ["train.micro_batch_size=2", "train.grad_accum=1"]
    assert strong_overrides(4, 2, 1, 4) == ["train.micro_batch_size=2", "train.grad_accum=1"]
    assert strong_overrides(3, 2, 1, 2) == ["train.micro_batch_size=3", "train.grad_accum=1"]
    assert strong_overrides(4, 1, 1, 1) == ["train.micro_batch_size=4", "train.grad_accum=1"]
    with pytest.raises(Exception, match="does not split over 8 ranks"):
        strong_overrides(4, 1, 1, 8)


def _profile(n: int, tput: float, step_ms: float, phases: dict[str, float], *, busy: list[float] | None = None,
             comm: list[dict] | None = None, unattributed: float = 0.0) -> dict:
    """A merged profile.json as the step profiler writes it (only the fields scaling reads)."""
    busy = busy or [step_ms] * n
    return {
        "recipe": {"train": {"micro_batch_size": 2, "grad_accum": 1}, "data": {"seq_len": 100}},
        "env": {"world_size": n, "timer": "host"},
        "summary": {"tokens_per_s": tput, "step_ms": {"median": step_ms}, "phases_ms": phases,
                    "unattributed_ms": unattributed,
                    "across_ranks": {"phases_ms": {p: {"median": v} for p, v in phases.items()}}},
        "ranks": [{"rank": r, "step_ms_median": step_ms, "busy_ms_median": b} for r, b in enumerate(busy)],
        "comm": comm or [],
    }


def test_scaling_efficiency_and_where_the_loss_went():
    ph1 = {"data_wait": 1.0, "forward": 30.0, "backward": 60.0, "recompute": 0.0, "optimizer": 9.0,
           "comm_exposed": 0.0, "other": 0.0}
    # N=2: 25 ms more exposed communication (5 of it waiting for the straggler), 5 ms more compute,
    # 3 ms more idle: a 133 ms step instead of 100
    ph2 = dict(ph1, comm_exposed=25.0, forward=35.0, data_wait=4.0)
    t1 = 200 / 0.100  # 200 global tokens per step at N=1 (2 x 100 x 1), 100 ms
    t2 = 400 / 0.133
    points = [{"label": "two", "world_size": 2, "run_dir": "b",
               "profile": _profile(2, t2, 133.0, ph2, busy=[100.0, 110.0],
                                   comm=[{"op": "all_reduce", "phase": "backward", "calls": 2, "bytes": 4e6,
                                          "total_ms": 20.0, "exposed_ms": 15.0, "group_size": 2},
                                         {"op": "all_reduce", "phase": "optimizer", "calls": 1, "bytes": 1e6,
                                          "total_ms": 5.0, "exposed_ms": 5.0, "group_size": 2}])},
              {"label": "one", "world_size": 1, "run_dir": "a", "profile": _profile(1, t1, 100.0, ph1)}]
    rows, notes = analyze(points)
    one, two = rows
    assert one["efficiency"] == pytest.approx(1.0) and all(one[f"{k}_ms"] == pytest.approx(0) for k in PARTS)
    assert two["efficiency"] == pytest.approx(t2 / (2 * t1)) == pytest.approx(100 / 133)
    assert two["excess_ms"] == pytest.approx(33.0)
    assert two["imbalance_ms"] == pytest.approx(110 - 105)  # max - median busy
    assert two["comm_ms"] == pytest.approx(25 - 5)
    assert two["compute_ms"] == pytest.approx(5.0) and two["idle_ms"] == pytest.approx(3.0)
    assert two["other_ms"] == pytest.approx(0.0)
    assert two["efficiency"] + sum(two[f"{k}_lost"] for k in PARTS) == pytest.approx(1.0)
    (bw,) = comm_rows(points)
    assert bw["bytes"] == 5e6 and bw["total_ms"] == 25.0
    assert bw["busbw_gbps"] == pytest.approx(5e6 / 0.025 / 1e9 * 2 * (2 - 1) / 2)  # nccl-tests all_reduce
    assert not notes


def test_scaling_without_phases_puts_the_loss_in_other():
    p1 = {"recipe": {"train": {"micro_batch_size": 1, "grad_accum": 1}, "data": {"seq_len": 10}},
          "env": {"world_size": 1}, "summary": {"tokens_per_s": 100.0, "step_ms": {"median": 100.0}},
          "ranks": [{"rank": 0, "step_ms_median": 100.0}]}
    p2 = json.loads(json.dumps(p1))
    p2["env"]["world_size"] = 2
    p2["summary"] = {"tokens_per_s": 160.0, "step_ms": {"median": 125.0}}
    p2["ranks"] = [{"rank": 0, "step_ms_median": 125.0}, {"rank": 1, "step_ms_median": 125.0}]
    rows, notes = analyze([{"world_size": 1, "run_dir": "a", "profile": p1},
                           {"world_size": 2, "run_dir": "b", "profile": p2}])
    assert rows[1]["efficiency"] == pytest.approx(0.8)
    assert rows[1]["comm_ms"] is None and rows[1]["other_lost"] == pytest.approx(0.2)
    assert any("phases_ms" in n for n in notes)


TORCHRUN_KILLED = """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
trainprof.run FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-21_10:08:06
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 22709)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 22709
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-21_10:08:06
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 22710)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 22710
=======================================================
"""


def test_failure_record_names_the_killed_rank_and_signal(tmp_path):
    from trainprof.sweep.launch import Launch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "failure-rank0.json").write_text(json.dumps(
        {"rank": 0, "kind": "error", "type": "RuntimeError", "message": "Connection reset by peer",
         "peak_memory_bytes": 1}))
    log = tmp_path / "launch.log"
    log.write_text(TORCHRUN_KILLED)
    f = failure_record(Launch(returncode=1, elapsed_s=3.0, log=str(log)), run_dir, world_size=2)
    assert (f["kind"], f["rank"], f["signal"]) == ("killed", 1, "SIGKILL")
    assert f["ranks_silent"] == [1] and f["ranks_with_failure_file"] == [0]
    # without a signal in torchrun's report the ranks' own records decide: oom before error
    log.write_text("Traceback ...\nRuntimeError: boom\n")
    (run_dir / "failure-rank1.json").write_text(json.dumps(
        {"rank": 1, "kind": "oom", "type": "MemoryError", "message": "out of memory", "peak_memory_bytes": 123}))
    f = failure_record(Launch(returncode=1, elapsed_s=3.0, log=str(log)), run_dir, world_size=2)
    assert (f["kind"], f["rank"], f["peak_memory_bytes"]) == ("oom", 1, 123)
    timed = failure_record(Launch(returncode=-9, elapsed_s=9.0, timed_out=True, log=str(log)), run_dir, world_size=2)
    assert timed["kind"] == "timeout"


def test_a_single_rank_cell_runs_without_torchrun_and_its_kill_names_rank_0(tmp_path):
    from trainprof.sweep.launch import launch_command

    assert launch_command("r.yaml", ["a=1"], nproc=1) == [sys.executable, "-m", "trainprof.run", "r.yaml", "a=1"]
    # the launcher is the rank: its own death by a signal is the cell's root cause, with no torchrun report
    suicide = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    result = launch(suicide, log_path=tmp_path / "launch.log", timeout_s=60)
    assert result.returncode == -signal.SIGKILL
    f = failure_record(result, None, world_size=1)
    assert (f["kind"], f["rank"], f["signal"]) == ("killed", 0, "SIGKILL") and "OOM killer" in f["message"]
    assert f["ranks_silent"] == [0]
    # with several ranks and no report naming one, which rank it was is not known
    assert failure_record(result, None, world_size=2)["rank"] is None


def test_a_cell_whose_profile_is_cut_short_fails_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """A profile.json cut short (a disk filled, a copy stopped) marks its cell failed, naming the file, rather
    than ending the sweep with a traceback and losing the cells after it."""
    from trainprof.sweep import runner
    from trainprof.sweep.spec import make_cell
    from trainprof.sweep.state import SweepState

    def writes_half_a_profile(recipe, overrides, **_):
        run_dir = Path(next(o for o in overrides if o.startswith("output.dir=")).split("=", 1)[1]) / "run"
        script = (f"import pathlib; d = pathlib.Path({str(run_dir)!r}); d.mkdir(parents=True); "
                  "(d / 'recipe.yaml').write_text('{}'); (d / 'profile.json').write_text('{\"steps\": [1, ')")
        return [sys.executable, "-c", script]

    monkeypatch.setattr(runner, "launch_command", writes_half_a_profile)
    cells = [make_cell(QUICKSTART, [f"train.steps={n}"], label=f"c{n}")[0] for n in (2, 3)]
    state = SweepState(tmp_path / "sweep.json", kind="sweep", name="t", meta={})
    recs = runner.run_cells(cells, tmp_path, state, timeout_s=60)
    assert [r["status"] for r in recs] == ["failed", "failed"]
    message = recs[0]["failure"]["message"]
    assert "profile.json: not valid JSON (line 1" in message and "stopped while writing it" in message


def test_metrics_row_reads_absent_fields_as_null_with_a_reason():
    values, methods, why = metrics_row({"env": {"world_size": 2, "timer": "host"},
                                        "summary": {"tokens_per_s": 10.0, "step_ms": {"median": 5.0}}})
    assert values["tokens_per_s"] == 10.0 and values["mfu"] is None and values["forward_ms"] is None
    assert {"mfu", "achieved_tflops", "phases_ms", "peak_memory_mib"} <= set(why)
    assert "tokens_per_s" in methods and "step_ms" in methods


def test_tables_md_csv_html(tmp_path):
    rows = [{"cell": "a|b", "x": 1234.5}, {"cell": "c", "x": None}]
    paths = write_tables(tmp_path / "t", rows, [Column("cell", "cell"), Column("x", "x ms", fmt_num(1))],
                         title="T", notes=["x: host clock"])
    assert [p.suffix for p in paths] == [".md", ".csv", ".html"]
    df = pd.read_csv(tmp_path / "t.csv")
    assert list(df.columns) == ["cell", "x"] and df["x"].isna().tolist() == [False, True]
    md = (tmp_path / "t.md").read_text()
    assert "| a\\|b | 1,234.5 |" in md and "| c | n/a |" in md and "x: host clock" in md
    assert "<td>a|b</td>" in (tmp_path / "t.html").read_text()
    # a share too small for one decimal keeps two significant digits (a tiny model's MFU on an H200), zero stays 0.0%
    assert [fmt_pct(x) for x in (0.283, 3.164e-5, 0.0, None)] == ["28.3%", "0.0032%", "0.0%", "n/a"]


def test_launch_timeout_kills_the_whole_tree(tmp_path):
    """A hung cell is killed whole, ranks in sessions of their own included (as torchrun starts them)."""
    pidfile = tmp_path / "pid"
    script = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)'], start_new_session=True); open({str(pidfile)!r}, 'w').write(str(p.pid)); "
              "time.sleep(600)")
    start = time.monotonic()
    result = launch([sys.executable, "-c", script], log_path=tmp_path / "log", timeout_s=3)
    assert result.timed_out and time.monotonic() - start < 30
    grandchild = int(pidfile.read_text())
    time.sleep(0.5)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_multi_node_cells_use_srun_inside_slurm_only(monkeypatch):
    from trainprof.errors import UserError
    from trainprof.sweep.launch import launch_command

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    single = launch_command("r.yaml", ["a=1"], nproc=2)
    assert single[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    with pytest.raises(UserError, match="needs a SLURM allocation"):
        launch_command("r.yaml", [], nproc=8, nnodes=2)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("TRAINPROF_RDZV_HOST", "node7")
    cmd = launch_command("r.yaml", ["a=1"], nproc=8, nnodes=2)
    assert cmd[:3] == ["srun", "--nodes=2", "--ntasks-per-node=1"]
    assert "--nnodes=2" in cmd and "--nproc_per_node=8" in cmd and "--rdzv_endpoint=node7:29500" in cmd
    assert cmd[-4:] == ["-m", "trainprof.run", "r.yaml", "a=1"]


def _fake_partial_cell(run_dir_of: str) -> str:
    """A cell's script that leaves what a rank stopped after 20 measured steps leaves (its partial profile,
    made from the checked-in CPU reference profile, and its failure record), then hangs until stopped."""
    source = REPO / "profiles" / "cpu-x86_64-quickstart_cpu" / "profile.json"
    return (f"import json, pathlib, time; d = pathlib.Path({run_dir_of!r}) / 'run'; d.mkdir(parents=True); "
            "(d / 'recipe.yaml').write_text('{}'); "
            f"p = json.loads(pathlib.Path({str(source)!r}).read_text()); "
            "p.update(rank=0, partial=True, partial_reason='rank 0 stopped after 20 profiled steps: Terminated'); "
            "(d / 'profile.rank0.partial.json').write_text(json.dumps(p)); "
            "(d / 'failure-rank0.json').write_text(json.dumps({'rank': 0, 'kind': 'interrupted', "
            "'type': 'Terminated', 'signal': 'SIGTERM', 'message': 'terminated', 'peak_memory_bytes': 3 * 2**20})); "
            "print('ready', flush=True); time.sleep(120)")


def test_a_timed_out_cell_keeps_its_partial_figures_and_a_rerun_keeps_the_earlier_attempt(tmp_path, monkeypatch):
    """A cell stopped at its timeout after measuring steps: its figures are kept, marked partial (never as a
    finished cell's), its failure says the timeout and the time it took, with the memory its rank recorded;
    running it again moves the earlier attempt aside instead of deleting what it measured."""
    from trainprof.sweep import runner
    from trainprof.sweep.report import sweep_rows, write_sweep_report
    from trainprof.sweep.spec import Sweep, make_cell
    from trainprof.sweep.state import SweepState

    launched = []

    def hangs_after_measuring(recipe, overrides, **_):
        launched.append(overrides)
        cell_dir = next(o for o in overrides if o.startswith("output.dir=")).split("=", 1)[1]
        return [sys.executable, "-c", _fake_partial_cell(cell_dir)]

    monkeypatch.setattr(runner, "launch_command", hangs_after_measuring)
    cell = make_cell(QUICKSTART, ["train.steps=200"], label="long")[0]
    state = SweepState(tmp_path / "sweep.json", kind="sweep", name="t", meta={})
    rec = runner.run_cell(cell, tmp_path, state, timeout_s=5)
    assert f"output.name={cell.id}" in launched[0]  # its run dir named after the cell, as TensorBoard lists it
    assert rec["status"] == "failed" and rec["values"] is None  # not a finished cell
    f = rec["failure"]
    assert f["kind"] == "timeout" and "timeout of 5 s" in f["message"]
    assert re.search(r"; \d+ s elapsed", f["message"])
    assert f["peak_memory_bytes"] == 3 * 2**20  # what the rank recorded as it was stopped
    # the figures are medians over the 17 of its 20 measured steps that were not traced: the label counts those
    assert rec["partial"]["steps"] == 17 and rec["partial"]["values"]["tokens_per_s"] > 0
    label = "partial: 17 of 20 measured steps (3 traced or FLOP-counted) before it failed"

    sweep = Sweep(name="t", path="", recipe_path=str(QUICKSTART), cells=[cell])
    (row,) = sweep_rows(sweep, [rec])
    assert row["status"] == "failed" and row["figures"] == label
    assert row["tokens_per_s"] == rec["partial"]["values"]["tokens_per_s"] and row["failure_memory_mib"] == 3
    write_sweep_report(tmp_path, sweep, [rec])
    df = pd.read_csv(tmp_path / "results.csv")
    assert df["figures"].tolist() == [label]
    assert df["tokens_per_s"].notna().all() and "figures from `partial`" in (tmp_path / "results.md").read_text()

    # run again (--retry-failed, or a resume): the first attempt's files are moved aside, not deleted
    first = Path(rec["run_dir"])
    again = runner.run_cell(cell, tmp_path, state, timeout_s=5)
    kept = tmp_path / "cells" / f"{cell.id}.attempt1"
    assert (kept / first.name / "profile.rank0.partial.json").is_file() and (kept / "launch.log").is_file()
    assert again["attempts"] == 2 and again["earlier_attempts"][0]["dir"] == str(kept)
    assert again["earlier_attempts"][0]["partial"]["steps"] == 17


def test_an_interrupt_after_the_profile_is_written_leaves_the_cell_done(tmp_path, monkeypatch):
    """Ctrl-C / SIGTERM during what a run does after training (calibration, report files): its profile.json is
    whole, so the cell is done (noted), not `interrupted` and run again with its figures labelled partial."""
    import _thread
    import threading

    from trainprof.sweep import runner
    from trainprof.sweep.report import sweep_rows
    from trainprof.sweep.spec import Sweep, make_cell
    from trainprof.sweep.state import SweepState

    source = REPO / "profiles" / "cpu-x86_64-quickstart_cpu" / "profile.json"

    def calibrates_after_the_profile(recipe, overrides, **_):
        cell_dir = next(o for o in overrides if o.startswith("output.dir=")).split("=", 1)[1]
        script = (f"import pathlib, shutil, time; d = pathlib.Path({cell_dir!r}) / 'run'; d.mkdir(parents=True); "
                  f"(d / 'recipe.yaml').write_text('{{}}'); shutil.copy({str(source)!r}, d / 'profile.json'); "
                  "time.sleep(120)")  # the calibration the interrupt arrives in
        return [sys.executable, "-c", script]

    def interrupt_once_the_profile_is_written():
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("cells/*/run/profile.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        _thread.interrupt_main()  # what Ctrl-C does to the sweep's process

    monkeypatch.setattr(runner, "launch_command", calibrates_after_the_profile)
    cell = make_cell(QUICKSTART, ["train.steps=20"], label="calibrating")[0]
    state = SweepState(tmp_path / "sweep.json", kind="sweep", name="t", meta={})
    threading.Thread(target=interrupt_once_the_profile_is_written, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):  # the sweep still stops
        runner.run_cell(cell, tmp_path, state, timeout_s=100)
    rec = state.get(cell.key)
    assert rec["status"] == "done" and rec["partial"] is None and "interrupted after its profile.json" in rec["note"]
    assert rec["values"]["steps_used"] == 17 and rec["values"]["tokens_per_s"] > 0
    assert not state.should_run(cell.key)  # a resume does not run it again
    (row,) = sweep_rows(Sweep(name="t", path="", recipe_path=str(QUICKSTART), cells=[cell]), [rec])
    assert row["figures"] == "17 of 20 measured steps (3 traced or FLOP-counted)"


def test_a_bad_command_line_override_is_named_not_the_first_cell():
    """`trainprof sweep FILE engine.zero_stage=7`: the command line is wrong, not the file's first cell; an
    override valid alone but not with a cell names both; a wrong cell is still the cell's."""
    sweep = REPO / "recipes" / "sweeps" / "zero_recompute_attention_cpu.yaml"
    with pytest.raises(SweepError) as err:
        load_sweep(sweep, check_machine=False, extra_overrides=["train.steps=1", "engine.zero_stage=7"])
    assert str(err.value).startswith("command-line override 'engine.zero_stage=7': recipe key 'engine.zero_stage'")
    assert "cell" not in str(err.value)
    with pytest.raises(SweepError) as err:  # fine on the base recipe (ZeRO-3), not with the ZeRO-0 cells
        load_sweep(sweep, check_machine=False, extra_overrides=["engine.offload=optimizer+params"])
    assert str(err.value).startswith("command-line override 'engine.offload=optimizer+params' with sweep file")
    assert "cell 'zero_stage=0 recompute=false attention=eager'" in str(err.value)


def test_shipped_cpu_sweeps_time_untraced_steps():
    """The CPU sweep tables compare cells by tokens/s: their medians must not be a single step left over from
    operator tracing (pretrain_methods_cpu traced 3 of its 4 steps). maxbatch files: its tries set it."""
    for path in SWEEPS:
        if not (path.stem.endswith("_cpu") and path.read_text().startswith("# trainprof sweep ")):
            continue
        for cell in load_sweep(path, check_machine=False).cells:
            recipe = load_recipe(cell.recipe_path, cell.overrides)
            assert not recipe.profile.ops, (path.name, cell.label)


def test_a_sigterm_names_what_sent_it(monkeypatch):
    """A single-rank cell stopped by the sweep's timeout was told torchrun stopped it, with no torchrun."""
    from trainprof.run import _who_sent_sigterm

    for var in ("TRAINPROF_CELL_TIMEOUT_S", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    assert "torchrun" not in _who_sent_sigterm()
    monkeypatch.setenv("TRAINPROF_CELL_TIMEOUT_S", "35")
    alone = _who_sent_sigterm()
    assert "timeout of 35 s" in alone and "torchrun" not in alone
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert "through torchrun" in _who_sent_sigterm()
    monkeypatch.delenv("TRAINPROF_CELL_TIMEOUT_S")
    assert _who_sent_sigterm().startswith("from torchrun")


def test_scale_of_one_world_size_is_refused_before_launching(tmp_path, cli):
    proc = cli("scale", QUICKSTART, "--nproc", "2", "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "at least two world sizes" in proc.stderr and "N=2" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args", [("scale", QUICKSTART, "--timeout", "-5"), ("scale", QUICKSTART, "--timeout", "0"),
                                  ("maxbatch", QUICKSTART, "--steps", "-1")])
def test_negative_timeouts_and_steps_are_refused(tmp_path, cli, args):
    proc = cli(*args, "--out", tmp_path / "out")
    assert proc.returncode == 2 and "must be an integer >=" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def _run_dirs(tmp_path: Path, *profiles: dict) -> list[Path]:
    dirs = []
    for i, profile in enumerate(profiles):
        d = tmp_path / f"run{i}"
        d.mkdir()
        (d / "profile.json").write_text(json.dumps(profile))
        dirs.append(d)
    return dirs


def _recipe(profile: dict, **values) -> dict:
    """The profile with its recipe's dotted keys set."""
    for key, value in values.items():
        section, leaf = key.split("__")
        profile["recipe"].setdefault(section, {})[leaf] = value
    return profile


PH = {"data_wait": 1.0, "forward": 30.0, "backward": 60.0, "recompute": 0.0, "optimizer": 9.0, "comm_exposed": 0.0,
      "other": 0.0}


def test_scale_runs_with_different_settings_are_refused_unless_asked(tmp_path, cli):
    one = _recipe(_profile(1, 2000.0, 100.0, PH), engine__zero_stage=2, output__dir="a")
    two = _recipe(_profile(2, 3000.0, 133.0, PH), engine__zero_stage=3, output__dir="b")
    two["recipe"]["train"]["micro_batch_size"] = 4  # neither per-rank (2) nor global (2 x 1) batch kept
    dirs = _run_dirs(tmp_path, one, two)
    proc = cli("scale", "--runs", *dirs, "--no-project", "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "engine.zero_stage (N=1: 2, N=2: 3)" in proc.stderr
    assert "train.micro_batch_size x train.grad_accum (N=1: 2x1, N=2: 4x1)" in proc.stderr
    assert "output.dir" not in proc.stderr and not (tmp_path / "out").exists()
    anyway = cli("scale", "--runs", *dirs, "--no-project", "--allow-different-settings", "--out", tmp_path / "out")
    assert anyway.returncode == 0, anyway.stderr
    assert "warning: the runs differ in engine.zero_stage" in anyway.stderr
    assert "settings differ between the runs" in (tmp_path / "out" / "scaling.md").read_text()


def test_strong_and_weak_scaling_batches_are_not_setting_differences():
    from trainprof.sweep.scaling import setting_differences

    def point(n: int, mbs: int, accum: int = 1) -> dict:
        p = _profile(n, 1.0, 1.0, PH)
        p["recipe"]["train"].update(micro_batch_size=mbs, grad_accum=accum)
        p["recipe"]["output"] = {"dir": f"d{n}"}
        return {"world_size": n, "run_dir": f"d{n}", "profile": p}

    assert setting_differences([point(1, 2), point(2, 2)]) == []  # weak: the per-rank batch kept
    longer = point(2, 2)
    longer["profile"]["recipe"]["train"].update(steps=40, seed=7)
    longer["profile"]["recipe"]["profile"] = {"ops": True}
    assert setting_differences([point(1, 2), longer]) == []  # how long, seeded or traced: not the step's work
    assert setting_differences([point(1, 4), point(2, 1, 2), point(4, 1)]) == []  # strong: global batch 4 kept
    (diff,) = setting_differences([point(1, 4), point(2, 1)])
    assert diff.key == "train.micro_batch_size x train.grad_accum" and diff.values == {1: "4x1", 2: "1x1"}


def test_a_profile_with_a_string_world_size_is_a_one_line_error(tmp_path, cli):
    bad = _profile(1, 2000.0, 100.0, PH)
    bad["env"]["world_size"] = "2"
    dirs = _run_dirs(tmp_path, _profile(1, 2000.0, 100.0, PH), bad)
    proc = cli("scale", "--runs", *dirs, "--no-project", "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "env.world_size is '2' (str)" in proc.stderr and "run1/profile.json" in proc.stderr


def test_scaling_labels_its_baseline_and_notes_fewer_cpu_threads_per_rank():
    from trainprof.sweep.scaling import measurement_notes

    one, two = _profile(1, 2000.0, 100.0, PH), _profile(2, 3000.0, 133.0, PH)
    one["env"]["cpu_threads"], two["env"]["cpu_threads"] = 2, 1
    points = [{"label": "N=1", "world_size": 1, "run_dir": "a", "profile": one},
              {"label": "N=2", "world_size": 2, "run_dir": "b", "profile": two}]
    rows, _ = analyze(points)
    assert rows[0]["label"] == "N=1 (baseline)" and rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["label"] == "N=2"
    notes = measurement_notes(points, "weak")
    (threads,) = [n for n in notes if "env.cpu_threads" in n]
    assert "N=1: 2, N=2: 1" in threads and "compute slowdown" in threads
    assert any(n.startswith("baseline:") and "100% by definition" in n for n in notes)
    two["env"]["cpu_threads"] = 2
    assert not any("env.cpu_threads" in n for n in measurement_notes(points, "weak"))


def test_charts_draw_no_empty_legend(tmp_path):
    """matplotlib's "No artists with labels found" must not reach the user's terminal."""
    import warnings

    from trainprof.sweep.maxbatch import _chart as maxbatch_chart
    from trainprof.sweep.scaling import write_scale_report

    rows, _ = analyze([{"world_size": 1, "run_dir": "a", "profile": _profile(1, 2000.0, 100.0, PH)},
                       {"world_size": 2, "run_dir": "b", "profile": _profile(2, 3000.0, 133.0, PH)}])
    # collectives whose bandwidth is unknown: the bandwidth panel has nothing to label
    comms = [{"world_size": 2, "op": "all_reduce", "group_size": 2, "calls": 1, "bytes": 0, "total_ms": 0.0,
              "exposed_ms": 0.0, "algbw_gbps": None, "busbw_gbps": None}]
    every_try_failed = [{"config": "c", "micro_batch_size": 1, "status": "failed", "failure_memory_mib": 5.0,
                         "peak_memory_mib": None}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_scale_report(tmp_path, rows, comms, ["note"], title="t")
        maxbatch_chart(tmp_path / "mb.png", [{"config": "c", "world_size": 1, "max_micro_batch": None,
                                              "status": "none fits"}], every_try_failed, ["note"])


def test_a_catalog_entry_without_a_required_key_is_a_one_line_error(tmp_path, cli):
    cat = tmp_path / "cat.yaml"
    cat.write_text("accelerators: {foo: {bf16: 1}}\n")
    proc = cli("hardware", "--catalog", cat)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"catalog file '{cat}': accelerators.foo has no 'name:'" in proc.stderr
    cat.write_text("links: {l1: {name: my link}}\n")
    proc = cli("hardware", "--catalog", cat)
    assert proc.returncode == 2 and "links.l1 has no 'gbps_per_direction:'" in proc.stderr
    cat.write_text("accelerators: {g: {name: G, peak_bf16_dense_tflops: 5}}\n")
    proc = cli("hardware", "--catalog", cat)
    assert proc.returncode == 2 and f"catalog file '{cat}': accelerators.g.peak_bf16_dense_tflops" in proc.stderr


def test_an_unknown_option_gets_its_commands_usage(cli):
    for args in (("infer", QUICKSTART, "--bogus"), ("diff", "a", "b", "--bogus"), ("run", QUICKSTART, "--bogus")):
        proc = cli(*args)
        assert proc.returncode == 2 and f"usage: trainprof {args[0]} " in proc.stderr, proc.stderr
        assert proc.stderr.rstrip().endswith(f"trainprof {args[0]}: error: unrecognized arguments: --bogus")
