"""Shared test helpers: launch real trainprof runs (torchrun, gloo, real DeepSpeed) into tmp dirs, and
share one run among the tests that need the same configuration (the `shared_run` fixture)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.machine import MachineLock, file_lock
from helpers.warm import PIN_CPU, WarmPool

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart_cpu.yaml"

# Small enough that a 2-rank DeepSpeed run takes seconds on 2 cores, long enough that the loss falls.
FAST = ["data.seq_len=64", "train.micro_batch_size=2", "train.steps=6", "train.warmup_steps=1"]
# The quickstart turns both on; a run whose test asserts on neither skips their seconds: the end-of-run
# microbenchmarks (calibration.json) and the Kineto-traced steps (tb/, ops.csv).
NO_CALIBRATION = "profile.calibrate=false"
NO_OPS = "profile.ops=false"
QUIET = [NO_CALIBRATION, NO_OPS]
# Two configurations several files assert on, each one run for the session (see shared_run): the
# quickstart on 2 ranks with 16 measured steps (medians of 12 for `trainprof project`), traced and
# calibrated as the quickstart is: test_projection's source, test_report's traced run and test_engines'
# ZeRO-3 run; and the same at ZeRO-2 without calibration: test_engines' ZeRO-2 run, and the settings of
# test_projection's real runs of its ZeRO-2 what-if (made beside runs of the source's settings).
QUICKSTART_2RANK = (2, "train.steps=16", "profile.ops=true", "profile.ops_steps=2", "profile.calibrate=true")
ZERO2_2RANK = (2, "train.steps=16", "engine.zero_stage=2", "profile.ops=true", NO_CALIBRATION)
# made with the machine to itself under pytest-xdist: test_projection compares the source's step times, and
# the two are the machine's speed lines in the summary
MEASURED = (QUICKSTART_2RANK, ZERO2_2RANK)


# TRAINPROF_TEST_COLD=1: run_trainprof launches `torchrun`/`python -m trainprof.run` processes, as a user
# does, instead of forking the ranks from a warm server (helpers/warm.py)
COLD = os.environ.get("TRAINPROF_TEST_COLD") == "1"
WARM = WarmPool(Path(tempfile.gettempdir()) / f"trainprof-warm-{os.getpid()}.log")
# `trainprof` for a command that runs cells (sweep, scale): its cells' ranks forked from warm servers too
TRAINPROF_CELLS = [sys.executable, "-m", "trainprof"] if COLD else \
    [sys.executable, str(REPO / "tests" / "helpers" / "warm_cli.py")]


def run_trainprof(tmp_path: Path, nproc: int, *overrides: str, recipe: Path = QUICKSTART,
                  timeout: int = 240, cold: bool = COLD, cpu: int | None = None) -> tuple[Path, dict]:
    """Run `torchrun --nproc_per_node N -m trainprof.run RECIPE ...` (one rank: `python -m trainprof.run`,
    as a sweep's cell runs, without torchrun's 2-3 s of start-up); return (run dir, profile.json). The ranks
    are forked from a warm server that has done their imports (helpers/warm.py), unless `cold`; `cpu` pins
    them to that core."""
    from trainprof.sweep.launch import launch_command

    out = tmp_path / "runs"
    args = [str(recipe), *FAST, *overrides, f"output.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if cpu is not None:
        env[PIN_CPU] = str(cpu)
    if cold:
        cmd = launch_command(args[0], args[1:], nproc=nproc)
        cmd = cmd if cpu is None else ["taskset", "-c", str(cpu), *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
        code, stderr = proc.returncode, proc.stderr
    else:
        logs = tmp_path / "warm-logs"
        logs.mkdir(parents=True, exist_ok=True)
        reply = WARM.run(args, nproc=nproc, env=env, cwd=REPO, logs=logs / "run", timeout=timeout)
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(["trainprof.run", *args], timeout)
        code = reply["code"]
        stderr = "".join(f"[rank {r}] " + (logs / f"run.rank{r}.err").read_text()[-4000 // nproc:]
                         for r in range(nproc))
    assert code == 0, f"run failed ({code}):\n{stderr[-4000:]}"
    (run_dir,) = list(out.iterdir())
    return run_dir, json.loads((run_dir / "profile.json").read_text())


def run_key(nproc: int, recipe: Path, overrides: tuple[str, ...]) -> str:
    """The configuration a run_trainprof call trains: the resolved recipe (short keys, defaults and
    repeated keys settled, the output dir left out) and the number of ranks."""
    from trainprof.recipe import load_recipe

    resolved = load_recipe(recipe, [*FAST, *overrides]).to_dict()
    resolved["output"].pop("dir")
    return json.dumps({"nproc": nproc, "recipe": resolved}, sort_keys=True)


class SharedRuns:
    """One real run per configuration for the whole session, pytest-xdist's workers included; each
    test gets its own copy of the run dir (tests write reports and projections into theirs). The first
    test that asks makes the run, so the tests stay independent of their order; a run that failed
    fails the later askers at once."""

    def __init__(self, root: Path, machine: MachineLock | None) -> None:
        self.root, self.machine = root, machine

    def slot(self, key: str) -> Path:
        return self.root / hashlib.sha1(key.encode()).hexdigest()[:16]

    def made(self, nproc: int, *overrides: str, recipe: Path = QUICKSTART, timeout: int = 240) -> Path:
        key = run_key(nproc, recipe, overrides)
        slot = self.slot(key)
        slot.mkdir(parents=True, exist_ok=True)
        made, failed = slot / "run_dir.txt", slot / "failure.txt"
        if not (made.exists() or failed.exists()):
            measured = self.machine is not None and (nproc, *overrides) in MEASURED
            with self.machine.alone() if measured else contextlib.nullcontext(), file_lock(slot / "lock"):
                if not (made.exists() or failed.exists()):  # another worker's test may have made it meanwhile
                    (slot / "key.json").write_text(key)
                    try:
                        run_dir, _ = run_trainprof(slot, nproc, *overrides, recipe=recipe, timeout=timeout)
                    except (AssertionError, subprocess.TimeoutExpired) as err:
                        failed.write_text(f"{type(err).__name__}: {str(err)[-4000:]}")
                        raise
                    (slot / "run_dir.tmp").write_text(str(run_dir))
                    os.replace(slot / "run_dir.tmp", made)  # whole, or not there, for a worker that looks
        if failed.exists():
            pytest.fail(f"the shared run of this configuration failed in an earlier test: {failed.read_text()}")
        return Path(made.read_text())

    def copy(self, dest: Path, nproc: int, *overrides: str, recipe: Path = QUICKSTART,
             timeout: int = 240) -> tuple[Path, dict]:
        """A copy, under `dest`, of the run of this configuration; returns (run dir, profile.json)."""
        source = self.made(nproc, *overrides, recipe=recipe, timeout=timeout)
        parent, n = dest / "runs", 0
        while (parent / source.name).exists():  # a second run in the same test
            n += 1
            parent = dest / f"runs{n}"
        run_dir = parent / source.name
        shutil.copytree(source, run_dir)
        return run_dir, json.loads((run_dir / "profile.json").read_text())


def session_dir(config: pytest.Config) -> Path:
    """A dir of this test session that every pytest-xdist worker sees (the parent of the workers' own)."""
    base = config._tmp_path_factory.getbasetemp()  # what the tmp_path_factory fixture returns
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


MACHINE = pytest.StashKey["MachineLock | None"]()


def machine_lock(config: pytest.Config) -> MachineLock | None:
    """This pytest-xdist worker's hold on the machine; None without pytest-xdist (one test at a time)."""
    if MACHINE not in config.stash:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        config.stash[MACHINE] = MachineLock(session_dir(config)) if worker else None
    return config.stash[MACHINE]


@pytest.fixture(scope="session")
def shared_runs(pytestconfig) -> SharedRuns:
    root = session_dir(pytestconfig) / "shared_runs"
    root.mkdir(exist_ok=True)
    return SharedRuns(root, machine_lock(pytestconfig))


@pytest.fixture
def shared_run(shared_runs, tmp_path):
    """`shared_run(nproc, *overrides)`: run_trainprof's (run dir, profile.json), from the session's run
    of that configuration, copied into this test's tmp_path."""

    def get(nproc: int, *overrides: str, recipe: Path = QUICKSTART, timeout: int = 240) -> tuple[Path, dict]:
        return shared_runs.copy(tmp_path, nproc, *overrides, recipe=recipe, timeout=timeout)

    return get


@dataclass(slots=True, kw_only=True)
class CliResult:
    """What `trainprof ARGS` returned and printed (the fields of subprocess.CompletedProcess)."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys):
    """`cli(*args)`: `trainprof ARGS` run in this process (trainprof.cli.main), for tests of what a
    command computes and prints rather than of the process around it: no interpreter start-up and no
    second import of torch and transformers (seconds per call)."""
    from trainprof.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()  # only this command's output
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:  # argparse: --help, and usage errors
            code = 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
        out = capsys.readouterr()
        return CliResult(returncode=code, stdout=out.out, stderr=out.err)

    return run


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outside pytest-timeout's timer: waiting for the machine is no hang
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist (one worker per core: pyproject.toml's addopts), a test marked `timed` has the
    machine to itself from its setup to its teardown, module fixtures' runs included; the other tests
    share it with the other workers' tests."""
    machine = machine_lock(item.config)
    if machine is None:
        return (yield)
    with machine.held(alone=item.get_closest_marker("timed") is not None):
        return (yield)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The machine's speed during this session, for comparing suite times across sessions: the median
    step of the shared quickstart runs that were made with the machine to themselves (the same 2-core
    machine has run them 1.7x slower on some hours than on others)."""
    runs = SharedRuns(session_dir(config) / "shared_runs", None)
    for nproc, *overrides in MEASURED:
        made = runs.slot(run_key(nproc, QUICKSTART, tuple(overrides))) / "run_dir.txt"
        if made.exists():
            profile = json.loads((Path(made.read_text()) / "profile.json").read_text())
            terminalreporter.write_line(
                f"machine speed: shared run ({nproc} ranks, {' '.join(overrides)}) median step "
                f"{profile['summary']['across_ranks']['step_ms_median']['max']:.1f} ms (slowest rank, made alone)")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist names the groups in the node ids
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, the order the workers take tests in; and GPU tests are skipped, not failed,
    where there is no CUDA: plain `pytest` is the CPU suite."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order_for_workers(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def order_for_workers(items: list[pytest.Item]) -> None:
    """The workers take tests, or whole xdist_groups, in collection order (pyproject.toml: --dist
    loadgroup --no-loadscope-reorder): first the tests that launch torchrun jobs (marked slow), two at a
    time, the longest first (the timeout a test sets is what pytest knows of its length before running
    it), so that none is left running alone at the end; then the quick ones; last the timed ones, which
    run one at a time: the switch to them waits only for a quick test. Every worker sorts alike, as
    pytest-xdist requires."""

    def unit(item: pytest.Item) -> str:
        group = item.get_closest_marker("xdist_group")
        return f"group {group.args[0]}" if group else item.nodeid

    rank: dict[str, tuple[int, float]] = {}
    for item in items:
        kind = 2 if item.get_closest_marker("timed") else 0 if item.get_closest_marker("slow") else 1
        timeout = item.get_closest_marker("timeout")
        length = float(timeout.args[0]) if timeout and timeout.args else 0.0
        before = rank.get(unit(item), (0, 0.0))
        rank[unit(item)] = (max(before[0], kind), max(before[1], length))
    items.sort(key=lambda item: (rank[unit(item)][0], -rank[unit(item)][1]))
