"""TensorBoard: the scalar series, and the real TensorBoard + torch-tb-profiler plugin served by
`trainprof tb` on loopback over a recorded 2-rank run's tb/ dir (its HTTP API, then a clean stop)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from trainprof.commands.tb import logdir_for
from trainprof.report.tensorboard import scalar_series, write_tensorboard_scalars

DATA = Path(__file__).parent / "data"
RUN = DATA / "zero3_2rank"
PROFILE = json.loads((RUN / "profile.json").read_text())
PLUGIN = "/data/plugin/pytorch_profiler"


def test_scalar_series_per_measured_step():
    series = scalar_series(PROFILE)
    measured = [s["step"] for s in PROFILE["steps"] if not s["warmup"]]
    for tag in ("phase/forward_ms", "phase/backward_ms", "phase/optimizer_ms", "phase/comm_exposed_ms",
                "step/tokens_per_s", "step/achieved_tflops", "memory/peak_backward_mib", "comm/exposed_ms"):
        assert [step for step, _ in series[tag]] == measured, tag
    top = [t for t in series if t.startswith("module/")]
    assert "module/model.layers.0.self_attn/forward_ms" in top  # per-step module times (steps[].modules_ms)
    first = next(s for s in PROFILE["steps"] if s["step"] == measured[0])
    assert series["phase/forward_ms"][0][1] == pytest.approx(first["phases_ms"]["forward"])
    # the run's tokens/s, as its summary counts them (both ranks' tokens), not rank 0's alone
    assert series["step/tokens_per_s"][0][1] == pytest.approx(2 * first["tokens"] / first["wall_ms"] * 1e3, rel=1e-3)
    assert PROFILE["summary"]["tokens_per_s"] == pytest.approx(
        statistics.median(v for _, v in series["step/tokens_per_s"]), rel=0.1)


def test_scalar_events_carry_the_steps_own_wall_times(tmp_path):
    """TensorBoard's relative axis reads the time the steps took: each step's event one wall_ms after the
    previous step's (every event carried the report's writing time, so the axis was flat)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shutil.copytree(RUN, tmp_path / "run")
    path = write_tensorboard_scalars(PROFILE, tmp_path / "run")
    acc = EventAccumulator(str(path.parent))
    acc.Reload()
    events = {e.step: e.wall_time for e in acc.Scalars("step/wall_ms")}
    walls = {s["step"]: s["wall_ms"] for s in PROFILE["steps"]}
    steps = sorted(events)
    assert len(steps) > 2
    for before, after in zip(steps, steps[1:]):
        gap = sum(walls[n] for n in walls if before < n <= after) / 1e3
        assert events[after] - events[before] == pytest.approx(gap, abs=1e-3), (before, after)


def test_scalars_of_a_run_dir_without_phases(tmp_path):
    shutil.copytree(DATA / "pre_profiler_run", tmp_path / "old")
    profile = json.loads((tmp_path / "old" / "profile.json").read_text())
    assert sorted(scalar_series(profile)) == ["memory/peak_step_mib", "step/loss", "step/tokens_per_s", "step/wall_ms"]
    path = write_tensorboard_scalars(profile, tmp_path / "old")
    again = write_tensorboard_scalars(profile, tmp_path / "old")  # replaces, does not add a second file
    assert not path.exists() or path == again
    assert len(list((tmp_path / "old" / "tb").rglob("events.out.tfevents.*"))) == 1
    assert path.parent == tmp_path / "old" / "tb" / "old"  # tb/<run name>/: TensorBoard lists the run by name


def test_several_runs_are_served_as_named_runs(tmp_path):
    for name in ("a", "b"):
        shutil.copytree(RUN, tmp_path / name)
    logdir, tmp = logdir_for([tmp_path / "a", tmp_path / "b"])
    try:
        assert sorted(p.name for p in logdir.iterdir()) == ["a", "b"]
        assert (logdir / "a").resolve() == (tmp_path / "a" / "tb").resolve()
    finally:
        shutil.rmtree(tmp)
    # one run whose traces sit directly in tb/ (written before tb/<run name>/) is linked under its name too
    logdir, tmp = logdir_for([RUN])
    try:
        assert [p.name for p in logdir.iterdir()] == ["zero3_2rank"] and tmp == logdir
    finally:
        shutil.rmtree(tmp)


def _get(url: str, timeout: float = 30) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = r.read().decode()
    return json.loads(body)


def _wait_for_runs(base: str, timeout_s: float = 90) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        data = _get(f"{base}{PLUGIN}/runs")
        if data["runs"] and not data["loading"]:
            return data["runs"]
        time.sleep(0.5)
    raise AssertionError(f"the profiler plugin listed no run within {timeout_s} s")


@pytest.mark.slow
def test_trainprof_tb_serves_plugin_views_and_scalars_then_stops(tmp_path):
    run = tmp_path / "zero3_2rank"
    shutil.copytree(RUN, run)
    write_tensorboard_scalars(PROFILE, run)
    proc = subprocess.Popen([sys.executable, "-m", "trainprof", "tb", str(run)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            start_new_session=True)
    try:
        line = proc.stdout.readline()  # printed once TensorBoard answers (bounded inside trainprof tb)
        assert line.startswith("TensorBoard: http://127.0.0.1:"), line
        base = line.split()[1].split("/#")[0]
        port = int(urllib.parse.urlsplit(base).port)
        assert _wait_for_runs(base) == ["zero3_2rank"]  # the run's name, not `tb`

        def q(route: str, **kw: str) -> object:
            return _get(f"{base}{PLUGIN}/{route}?" + urllib.parse.urlencode({"run": "zero3_2rank", **kw}))

        assert {"Overview", "Operator", "Trace"} <= set(q("views"))
        assert q("workers", view="Overview") == ["rank0", "rank1"]  # each rank is a worker
        for worker in ("rank0", "rank1"):
            (span,) = q("spans", worker=worker)
            overview = q("overview", worker=worker, span=span)
            assert [row[0] for row in overview["steps"]["rows"]] == ["1", "2"]  # ProfilerStep#1, #2
            ops = q("operation", worker=worker, span=span, group_by="Operation")
            assert "aten::mm" in [row[0] for row in ops["host_total_time"]["rows"]]
            table = q("operation/table", worker=worker, span=span, group_by="Operation")
            assert any(r["name"] == "aten::mm" and r["calls"] > 0 for r in table["data"])
        tags = _get(f"{base}/data/plugin/scalars/tags")
        assert "phase/forward_ms" in tags["zero3_2rank"] and "phase/comm_exposed_ms" in tags["zero3_2rank"]
        points = _get(f"{base}/data/plugin/scalars/scalars?run=zero3_2rank&tag=phase%2Fbackward_ms")
        assert [p[1] for p in points] == [s["step"] for s in PROFILE["steps"] if not s["warmup"]]
    finally:
        proc.send_signal(signal.SIGTERM)  # trainprof tb stops TensorBoard and exits
        rc = proc.wait(timeout=30)
    assert rc == 0
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0, "TensorBoard still listening after trainprof tb exited"


@pytest.mark.slow
def test_tensorboard_lists_a_fresh_run_by_its_name(tmp_path):
    """A run written now keeps its traces and scalars in tb/<run name>/, so `tensorboard --logdir
    <run>/tb` (the README's command) lists it by name in both the profiler plugin and the scalars."""
    import torch

    from trainprof.commands.tb import start_tensorboard, stop_tensorboard
    from trainprof.models import build_model
    from trainprof.profiler import Profiler
    from trainprof.recipe import Recipe
    from trainprof.report.run_report import write_reports

    recipe = Recipe()
    recipe.model.dtype = "fp32"
    recipe.profile.ops, recipe.profile.ops_steps, recipe.train.warmup_steps, recipe.train.steps = True, 1, 1, 3
    run_dir = tmp_path / "quickstart-20260101-000000"
    torch.manual_seed(0)
    model = build_model(recipe, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 32))
    with Profiler.for_recipe(model, opt, recipe, run_dir=run_dir, device=torch.device("cpu")) as prof:
        for batch in prof.wrap_loader([{"input_ids": ids, "labels": ids}] * 4):
            with prof.step():
                model(**batch).loss.backward()
                opt.step()
                opt.zero_grad()
    prof.save(run_dir, recipe=recipe.to_dict())
    write_reports(run_dir)
    assert {p.name for p in (run_dir / "tb").iterdir()} == {run_dir.name}
    proc, base = start_tensorboard(run_dir / "tb")
    try:
        assert _wait_for_runs(base) == [run_dir.name]
        tags = _get(f"{base}/data/plugin/scalars/tags")
        assert "phase/forward_ms" in tags[run_dir.name]
    finally:
        stop_tensorboard(proc)


@pytest.mark.slow
def test_no_wait_leaves_tensorboard_running_and_says_how_to_stop_it(tmp_path, cli):
    run = tmp_path / "zero3_2rank"
    shutil.copytree(RUN, run)
    out = cli("tb", "--no-wait", run)
    assert out.returncode == 0 and "Ctrl-C" not in out.stderr, out.stderr
    pid = int(out.stderr.split("keeps running as process ")[1].split(":")[0])
    assert f"`kill {pid}` stops it; then remove its link dir " in out.stderr  # traces directly in tb/: linked
    base = out.stdout.split()[1].split("/#")[0]
    port = int(urllib.parse.urlsplit(base).port)
    try:
        assert _wait_for_runs(base) == ["zero3_2rank"]
    finally:
        os.kill(pid, signal.SIGTERM)
        shutil.rmtree(out.stderr.split("then remove its link dir ")[1].split()[0], ignore_errors=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                break
        time.sleep(0.3)
    else:
        raise AssertionError("TensorBoard still listening after `kill PID`")


def test_tb_names_a_missing_dir_and_infers_own_trace_switch(tmp_path, cli):
    from trainprof.commands.tb import traces_from

    missing = cli("tb", tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and len(missing.stderr.splitlines()) == 1
    (tmp_path / "infer").mkdir()
    (tmp_path / "infer" / "inference.json").write_text("{}")
    assert traces_from([tmp_path / "infer"]).startswith("`trainprof infer` without --no-ops writes")
    assert "profile.ops=true" in traces_from([tmp_path])
    empty = cli("tb", tmp_path / "infer")
    assert empty.returncode == 2 and "`trainprof infer` without --no-ops" in empty.stderr


def test_tb_says_in_one_line_why_a_port_or_a_path_cannot_serve(tmp_path, cli):
    """A port in use or out of range, or a file for a run dir: one line and exit 2, not a traceback after
    TensorBoard's start-up ("exited with code 255 before answering", its reason sent to nowhere)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = cli("tb", "--no-wait", "--port", str(port), RUN)
    assert busy.returncode == 2 and len(busy.stderr.splitlines()) == 1, busy.stderr
    assert f"--port {port}: cannot listen on 127.0.0.1:{port}" in busy.stderr and "pick another port" in busy.stderr
    out_of_range = cli("tb", "--no-wait", "--port", "99999", RUN)
    assert out_of_range.returncode == 2 and "expected a TCP port from 1 to 65535, got '99999'" in out_of_range.stderr
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    a_file = cli("tb", script)
    assert a_file.returncode == 2 and "is a file: give a run dir" in a_file.stderr and "report" not in a_file.stderr


def test_a_tensorboard_that_exits_at_start_up_gives_its_last_words():
    """What TensorBoard said before it exited ends the error (its output is kept aside while it starts)."""
    from trainprof.commands.tb import start_tensorboard

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RuntimeError, match=r"exited with code \d+ before answering: TensorBoard could not bind "
                                               r"to port \d+, it was already in use$"):
            start_tensorboard(RUN / "tb", taken.getsockname()[1])
