"""`trainprof plan` for a CPU run: the resident-set estimate in the text, and its per-sample growth
checked against real runs of the CPU quickstart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainprof.cli import main
from trainprof.plan import estimate_plan
from trainprof.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart_cpu.yaml"
MIB = 2**20


def plan_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["plan", str(QUICKSTART), "--nproc", "2", *args]) == 0
    return capsys.readouterr().out


def test_cpu_text_shows_the_resident_set_and_no_gpu_only_rows(capsys: pytest.CaptureFixture[str]) -> None:
    text = plan_text(capsys, "--device", "cpu")
    resident = estimate_plan(load_recipe(QUICKSTART, []), 2)["resident_per_rank"]["value"]
    line = next(line for line in text.splitlines() if line.startswith("Resident set per rank"))
    assert f"{resident / 2**30:,.2f}" in line
    assert "Python" in line and "heap" in line  # what the figure leaves out of a measured peak RSS
    assert "GPU total per rank" not in text and "GPU GiB" not in text
    rows = [line.split()[0] for line in text.splitlines() if line.startswith("  ") and line.strip()]
    for gpu_only in ("cuda_context", "allocator_rounding"):  # named as left out, not shown as a row
        assert gpu_only not in rows, gpu_only


def test_gpu_text_keeps_the_device_rows(capsys: pytest.CaptureFixture[str]) -> None:
    text = plan_text(capsys, "--device", "cuda")
    for label in ("GPU memory per rank", "cuda_context", "allocator_rounding", "GPU total per rank",
                  "Host memory per rank"):
        assert label in text, label
    assert "Resident set per rank" not in text


def test_resident_source_names_what_it_leaves_out() -> None:
    source = estimate_plan(load_recipe(QUICKSTART, []), 1)["resident_per_rank"]["source"]
    assert "Python" in source and "heap" in source


# -- real runs: the plan's growth per sample against a measured peak RSS ---------------------------

# glibc with a fixed 64 KiB mmap threshold and trim threshold: every tensor above 64 KiB is mapped
# fresh and unmapped when freed, so the peak RSS follows the live tensors and not the freed blocks a
# heap keeps (train.cpu_allocator=system leaves these settings to the environment: trainprof/env.py)
UNCACHED_HEAP = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "131072"}
MICRO_BATCHES = (4, 12)


def _run(tmp: Path, micro_batch: int, allocator: str, env: dict[str, str]) -> int:
    name = f"mb{micro_batch}_{allocator}"
    subprocess.run(
        [sys.executable, "-m", "trainprof.run", str(QUICKSTART), f"train.micro_batch_size={micro_batch}",
         f"train.cpu_allocator={allocator}", "train.steps=2", "train.warmup_steps=1", "profile.ops=false",
         f"output.dir={tmp}", f"output.name={name}"],
        check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env}, timeout=600)
    profile = json.loads(next(tmp.glob(f"{name}-*/profile.json")).read_text())
    return max(profile["summary"]["peak_memory_bytes"].values())


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, int]]:
    """Peak RSS of the quickstart on one process at two micro batches, with glibc keeping no freed
    heap (UNCACHED_HEAP) and with trainprof's default cache allocator."""
    tmp = tmp_path_factory.mktemp("cpu_resident")
    return {"uncached": {mb: _run(tmp, mb, "system", UNCACHED_HEAP) for mb in MICRO_BATCHES},
            "cache": {mb: _run(tmp, mb, "cache", {}) for mb in MICRO_BATCHES}}


def _slope(bytes_by_mb: dict[int, int]) -> float:
    low, high = MICRO_BATCHES
    return (bytes_by_mb[high] - bytes_by_mb[low]) / (high - low)


def _plan_slope() -> float:
    planned = {mb: estimate_plan(load_recipe(QUICKSTART, [f"train.micro_batch_size={mb}"]), 1)
               ["resident_per_rank"]["value"] for mb in MICRO_BATCHES}
    return _slope(planned)


def test_plan_slope_matches_the_live_tensors_peak_rss(measured: dict[str, dict[int, int]]) -> None:
    """The plan counts the live tensors: with no freed heap kept, the peak RSS grows as it does (6.1
    MiB per sample here), within 15% (2-core run-to-run spread of a step's peak)."""
    planned, live = _plan_slope(), _slope(measured["uncached"])
    assert planned == pytest.approx(live, rel=0.15), (planned / MIB, live / MIB)


def test_cache_allocator_keeps_more_than_the_plan_counts(measured: dict[str, dict[int, int]]) -> None:
    """Under the default cache allocator the heap keeps freed blocks it cannot reuse, so the peak RSS
    grows faster than the live tensors (about 9.5-10.5 MiB per sample measured here): what the plan's
    resident figure says it leaves out, not a term it can derive (docs/projection.md, the heap probe)."""
    assert _slope(measured["cache"]) > _plan_slope()
