"""`trainprof wrap` / `torchrun -m trainprof.wrap` on an unmodified HF Accelerate script (real accelerate,
CPU): one process, DDP on 2 ranks over gloo, and Accelerate's DeepSpeed plugin (ZeRO-2) on 2 ranks. One
optimizer step (2 `accumulate` micro batches) is one profiled step; exit codes pass through. Accelerate's
FSDP plugin only applies to GPU-type setups (on CPU Accelerate trains with DDP), so it is not run here."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from test_integrations import STEPS, assert_profiled, the_run, wrap

TOKENS = 2 * 2 * 32  # micro batch x accumulation x seq


def test_wrap_accelerate_one_process(tmp_path):
    proc, out = wrap(tmp_path, "accelerate_loop.py", "--steps", str(STEPS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"accelerate done: {STEPS} optimizer steps, LlamaForCausalLM" in proc.stdout
    run_dir, profile = the_run(out, "accelerate_loop")
    assert_profiled(run_dir, profile, tokens_per_step=TOKENS, kind="accelerate")
    cfg = profile["engine"]["config"]
    assert cfg["gradient_accumulation_steps"] == 2 and cfg["optimizer"] == "AcceleratedOptimizer"
    # the micro batches' own losses, averaged (random init over a 256-token vocab: about ln 256)
    assert all(abs(s["loss"] - math.log(256)) < 0.5 for s in profile["steps"])
    assert not profile["comm"]


@pytest.mark.slow
def test_wrap_accelerate_ddp_two_ranks(tmp_path):
    proc, out = wrap(tmp_path, "accelerate_loop.py", "--steps", str(STEPS), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DistributedDataParallel" in proc.stdout
    run_dir, profile = the_run(out, "accelerate_loop")
    assert_profiled(run_dir, profile, tokens_per_step=TOKENS, kind="accelerate")
    assert profile["env"]["world_size"] == 2 and len(profile["ranks"]) == 2
    assert profile["engine"]["config"]["distributed_type"] == "DistributedType.MULTI_CPU"
    # DDP's gradient all-reduce, once per optimizer step: accumulate() skips the sync on the first micro batch
    (allreduce,) = [c for c in profile["comm"] if c["op"] == "all_reduce"]
    assert allreduce["calls"] == 1 and allreduce["phase"] == "backward"


@pytest.mark.slow
def test_wrap_accelerate_deepspeed_plugin_two_ranks(tmp_path):
    """Accelerate builds a ZeRO-2 engine: trainprof's DeepSpeed instrumentation profiles it (engine forward,
    backward and step are phases; the engine marks the steps) under the name accelerate+deepspeed."""
    proc, out = wrap(tmp_path, "accelerate_loop.py", "--steps", str(STEPS), "--deepspeed", "2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DeepSpeedEngine" in proc.stdout
    run_dir, profile = the_run(out, "accelerate_loop")
    assert_profiled(run_dir, profile, tokens_per_step=TOKENS, kind="accelerate+deepspeed")
    assert profile["engine"]["config"]["zero_optimization"]["stage"] == 2
    assert profile["summary"]["phases_ms"]["comm_exposed"] > 0 and profile["comm"]


def test_wrap_accelerate_failure_passes_the_exit_code_through(tmp_path):
    """A script that dies inside its Accelerate loop: its exit code and traceback come through, no profile."""
    script = tmp_path / "dies.py"
    script.write_text(
        "import sys\n"
        "from accelerate import Accelerator\n"
        "import torch\n"
        "acc = Accelerator(cpu=True)\n"
        "model, opt = acc.prepare(torch.nn.Linear(4, 1), torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))\n"
        "print('prepared', type(model).__name__)\n"
        "sys.exit(7)\n")
    proc = subprocess.run([sys.executable, "-m", "trainprof.wrap", str(script)], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=wrap_env(tmp_path))
    assert proc.returncode == 7, proc.stderr[-3000:]
    assert "prepared Linear" in proc.stdout
    assert not (tmp_path / "runs").exists()  # no optimizer step was taken: no run dir


def wrap_env(tmp_path):
    import os

    from conftest import REPO

    return {**os.environ, "OMP_NUM_THREADS": "1", "TRAINPROF_OUTPUT_DIR": str(tmp_path / "runs"), "PYTHONPATH": str(REPO)}
