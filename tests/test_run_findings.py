"""What a run says about itself where it used to mislead: the memory-cap failures' figures and lines, the
FLOPs cross-check under DDP, a pipeline's parameter count and CPU oversubscription."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import FAST, QUICKSTART, QUIET, REPO

DDP = ("engine.kind=torch", "engine.zero_stage=0", "train.grad_accum=2", *QUIET)  # test_engines' DDP run
PIPELINE = ("engine.kind=torch", "engine.zero_stage=0", "model.dtype=fp32", "model.num_layers=3",
            "engine.pipeline_stages=2", "engine.pipeline_layers=[2,1]", *QUIET)


def failures(out) -> list[dict]:
    (run_dir,) = list(out.iterdir())
    return [json.loads(f.read_text()) for f in sorted(run_dir.glob("failure-rank*.json"))]


@pytest.mark.slow
def test_ddp_has_the_analytic_flops_cross_check(shared_run):
    from trainprof.models import resolve_shape
    from trainprof.recipe import load_recipe

    _, profile = shared_run(2, *DDP)
    s = profile["summary"]
    layers = resolve_shape(load_recipe(QUICKSTART, [*FAST, *DDP]).model).num_layers
    assert s["analytic"] is not None and s["analytic"]["layers"] == layers, s.get("analytic_reason")
    assert 0.8 < s["measured_over_analytic"] < 1.3
    assert "oversubscribed" in profile["env"]
    if len(os.sched_getaffinity(0)) >= 2:  # 2 ranks x OMP_NUM_THREADS=1
        assert profile["env"]["oversubscribed"] is None


@pytest.mark.slow
def test_a_pipeline_counts_the_parameters_of_every_stage(shared_run):
    from trainprof.models import build_model, count_params
    from trainprof.recipe import load_recipe

    _, profile = shared_run(2, *PIPELINE)
    whole = count_params(build_model(load_recipe(QUICKSTART, [*FAST, *PIPELINE])))
    assert profile["params"] == whole


@pytest.mark.slow
def test_a_cap_under_the_baseline_fails_each_rank_in_one_line(tmp_path):
    from trainprof.sweep.launch import launch_command

    out = tmp_path / "runs"
    cmd = launch_command(str(QUICKSTART), [*FAST, *QUIET, "engine.kind=torch", "engine.zero_stage=0",
                                           "train.memory_cap_gb=0.1", f"output.dir={out}"], nproc=2)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    # no rank's traceback: torchrun's own report follows, naming the ranks' lines as its root cause
    assert "trainprof/run.py" not in proc.stderr and "Root Cause" in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("trainprof: rank")]
    assert len(lines) == 2 and all("before the first step" in line and "train.memory_cap_gb=0.1" in line
                                   and "raise train.memory_cap_gb above" in line for line in lines), lines
    records = failures(out)
    assert [r["kind"] for r in records] == ["oom", "oom"]
    assert all(r["peak_memory_bytes"] > 0.1 * 2**30 and "before the first step" in r["message"] for r in records)


@pytest.mark.slow
def test_a_failed_step_records_the_peak_its_message_names(tmp_path):
    """The cap trips after a step; the failure file's figure is the one that tripped it, not the peak
    window's after the profiler reset it."""
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "trainprof.run", str(QUICKSTART), *FAST, *QUIET,
                           "engine.kind=torch", "engine.zero_stage=0", "model.attention=eager", "data.seq_len=512",
                           "train.micro_batch_size=12", "train.memory_cap_gb=0.6", f"output.dir={out}"],
                          capture_output=True, text=True, timeout=240, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (record,) = failures(out)
    assert record["kind"] == "oom" and "checked after each step" in record["message"], record
    said = float(re.search(r"peak RSS ([\d,.]+) MiB", record["message"])[1].replace(",", ""))
    assert round(record["peak_memory_bytes"] / 2**20, 1) == said > 0.6 * 1024


@pytest.mark.slow
def test_maxbatch_says_why_none_fits(tmp_path, cli):
    proc = cli("maxbatch", QUICKSTART, *QUIET, "engine.kind=torch", "engine.zero_stage=0", "data.seq_len=64",
               "train.memory_cap_gb=0.1", "--max", "1", "--steps", "1", "--out", tmp_path / "mb")
    assert proc.returncode == 1 and "max micro batch None (none fits)" in proc.stderr
    assert re.search(r"none fits: micro batch 1 does not fit: out of memory before the first step.*"
                     r"raise train.memory_cap_gb above", proc.stderr), proc.stderr[-2000:]


def test_oversubscription_is_warned_and_recorded():
    from trainprof.env import cpu_oversubscription, oversubscription_warning

    line = oversubscription_warning(4, 1, 2)
    assert line.count("\n") == 0 and "4 rank(s) x 1 thread(s)" in line and "--nproc 2" in line
    assert oversubscription_warning(2, 1, 2) is None
    pinned = [{"host": "a", "threads": 1, "cores": [0]}, {"host": "a", "threads": 1, "cores": [1]}]
    assert cpu_oversubscription(pinned) is None
    shared = [{"host": "a", "threads": 2, "cores": [0, 1]}, {"host": "a", "threads": 2, "cores": [0, 1]}]
    assert cpu_oversubscription(shared) | {"how": ""} == {"host": "a", "ranks": 2, "threads": 4, "cores": 2,
                                                          "how": ""}


def test_the_launch_warns_when_ranks_outnumber_the_cores(monkeypatch, capsys):
    from trainprof.commands.run import warn_oversubscribed

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    warn_oversubscribed(cores + 1, 8)  # torchrun's default of one thread per rank
    assert f"{cores + 1} rank(s) x 1 thread(s)" in capsys.readouterr().err
    warn_oversubscribed(1, cores)  # one process, torch's own threads
    assert capsys.readouterr().err == ""


def test_an_override_without_a_value_after_an_option_gets_the_recipes_own_line(cli, tmp_path):
    """`run R.yaml --nproc 2 train.steps output.dir=D`: argparse leaves the positionals after the option to
    trainprof, which hands them to the recipe's checks (one line naming the override) instead of refusing the
    valid one beside it as an unrecognized argument."""
    proc = cli("run", QUICKSTART, "--nproc", "2", "train.steps", f"output.dir={tmp_path}")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "override 'train.steps' must look like key=value" in proc.stderr and "unrecognized" not in proc.stderr
    assert not any(tmp_path.iterdir())  # refused before any run
    proc = cli("run", QUICKSTART, "--nproc", "2", "train.steps=2", "--bogus")
    assert proc.returncode == 2 and proc.stderr.rstrip().endswith("unrecognized arguments: --bogus"), proc.stderr


def _baseline_check_on_rank(rank: int, port: int, peaks_mib: tuple[int, ...], results) -> None:
    import torch
    import torch.distributed as dist

    from trainprof import env

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(peaks_mib))
    env.peak_memory_bytes = lambda device: peaks_mib[rank] * 2**20  # this rank's baseline, chosen
    try:
        env.check_memory_cap(torch.device("cpu"), 0.1, before_steps=True)
        results.put((rank, None, None))
    except env.MemoryCapExceeded as err:
        results.put((rank, str(err), err.every_rank))
    dist.destroy_process_group()


def test_ranks_decide_the_baseline_cap_together():
    """One rank over the cap before the first step fails every rank (gloo all-reduce): a rank under it says
    another rank's figure beside its own, instead of going on alone into a step the other never starts."""
    import torch.multiprocessing as mp

    from trainprof.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_baseline_check_on_rank, args=(r, port, (300, 50), results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    got = dict((rank, (message, together)) for rank, message, together in (results.get(timeout=120) for _ in ranks))
    for p in ranks:
        p.join(timeout=60)
    (over, over_together), (under, under_together) = got[0], got[1]
    assert over_together and under_together
    assert "this rank's peak RSS once the model is built is already 300.0 MiB" in over
    assert "another rank's peak RSS once the model is built is already 300.0 MiB" in under
    assert "(this rank's: 50.0 MiB)" in under
    assert all("raise train.memory_cap_gb above 0.3 plus" in m for m in (over, under))


RANK_LINES = """
import sys, time
from trainprof.run import say_line
while time.time() < float(sys.argv[2]):
    pass
for _ in range(300):
    say_line(f"trainprof: rank {sys.argv[1]}: " + "x" * 300)
"""


def test_ranks_that_say_their_lines_at_once_keep_them_whole():
    """Ranks share torchrun's stderr; decided together, they print at the same moment, and print()'s two writes
    (text, newline) under PYTHONUNBUFFERED joined two ranks' lines into one (the CI saw one line of two: 2 to 134
    of 600 lines joined in a trial). say_line writes each whole: two processes, 300 lines each, at once."""
    import time

    read, write = os.pipe()
    start = time.time() + 3  # both past their imports
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_LINES, str(rank), str(start)], stderr=write, cwd=REPO,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}) for rank in (0, 1)]
    os.close(write)
    data = b""
    while chunk := os.read(read, 65536):
        data += chunk
    os.close(read)
    assert [p.wait(timeout=60) for p in ranks] == [0, 0], data[-2000:]
    lines = data.decode().splitlines()
    assert len(lines) == 600 and all(line.startswith("trainprof: rank ") and line.count("trainprof:") == 1
                                     for line in lines), [line[:40] for line in lines if line.count("trainprof:") != 1]
