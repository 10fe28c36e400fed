"""The suite's warm starts (helpers/warm.py): a run whose ranks were forked from a warm server is the run
a user launches with torchrun, less the imports; a failing or overdue run ends as torchrun would end it."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest

from conftest import COLD, QUIET, run_trainprof

pytestmark = pytest.mark.skipif(COLD, reason="TRAINPROF_TEST_COLD=1: no warm starts to check")

CONFIG = ("engine.zero_stage=3", *QUIET)


@pytest.mark.slow
def test_a_warm_run_is_the_torchrun_run_less_its_imports(tmp_path):
    _, warm = run_trainprof(tmp_path / "warm", 2, *CONFIG)
    _, cold = run_trainprof(tmp_path / "cold", 2, *CONFIG, cold=True)  # through torchrun
    # the same training, bit for bit (seeded, on the same engine and ranks)
    assert [s["loss"] for s in warm["steps"]] == [s["loss"] for s in cold["steps"]]
    assert warm["env"]["world_size"] == cold["env"]["world_size"] == 2
    assert warm["params"] == cold["params"] and warm["engine"]["config"] == cold["engine"]["config"]
    assert {m["name"] for m in warm["modules"]} == {m["name"] for m in cold["modules"]}
    # a forked rank's resident memory leaves out the library pages that only the imports touched (a fresh
    # process maps them in; 65-75 MiB of 450-520 here): memory compares between the suite's runs, not with
    # a user's
    warm_peak, cold_peak = warm["summary"]["peak_memory_bytes_max"], cold["summary"]["peak_memory_bytes_max"]
    assert 0.7 * cold_peak < warm_peak < cold_peak, (warm_peak, cold_peak)


def test_a_failing_rank_fails_the_run_with_its_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"run failed \(2\)[\s\S]*model.num_layers"):
        run_trainprof(tmp_path, 2, "model.num_layers=0")
    assert time.monotonic() - start < 30


def test_an_overdue_run_is_stopped_whole(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(subprocess.TimeoutExpired):
        run_trainprof(tmp_path, 2, "train.steps=1000", *QUIET, timeout=3)
    time.sleep(0.5)
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
            and "warm.py" not in " ".join(p.cmdline())]
    assert not left, [p.cmdline() for p in left]
