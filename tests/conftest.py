"""Shared test helpers: launch real trainprof runs (torchrun, gloo, real DeepSpeed) into tmp dirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart_cpu.yaml"

# Small enough that a 2-rank DeepSpeed run takes seconds on 2 cores, long enough that the loss falls.
FAST = ["data.seq_len=64", "train.micro_batch_size=2", "train.steps=6", "train.warmup_steps=1"]


def run_trainprof(tmp_path: Path, nproc: int, *overrides: str, recipe: Path = QUICKSTART,
                  timeout: int = 240) -> tuple[Path, dict]:
    """Run `torchrun --nproc_per_node N -m trainprof.run RECIPE ...`; return (run dir, profile.json)."""
    out = tmp_path / "runs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "trainprof.run", str(recipe), *FAST, *overrides, f"output.dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, f"run failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    (run_dir,) = list(out.iterdir())
    return run_dir, json.loads((run_dir / "profile.json").read_text())


def pytest_collection_modifyitems(config, items):
    """GPU tests are skipped, not failed, where there is no CUDA: plain `pytest` is the CPU suite."""
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
