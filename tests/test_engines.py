"""Real engines on CPU: DeepSpeed ZeRO-2/3/offload and torch DDP under torchrun (gloo)."""

from __future__ import annotations

import math

import pytest

from conftest import QUICKSTART_2RANK, QUIET, ZERO2_2RANK

# 2 ranks at ZeRO-3 and ZeRO-2 without offload: the shared runs of conftest.MEASURED (16 steps), made with the
# machine to itself under pytest-xdist (the ZeRO-3 one is test_projection's and test_report's source)
SHARED = {(2, 3, "none"): QUICKSTART_2RANK, (2, 2, "none"): ZERO2_2RANK}
ZERO = [pytest.param(nproc, stage, offload, id=f"{name}-{nproc}",
                     marks=[pytest.mark.timed] if (nproc, stage, offload) in SHARED else [])
        for name, (stage, offload) in {"zero2": (2, "none"), "zero3": (3, "none"),
                                       "zero3-offload": (3, "optimizer")}.items()
        for nproc in (1, 2)]


def assert_trained(profile: dict, world_size: int, grad_accum: int = 1, measured_steps: int = 6) -> None:
    steps = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(steps) == measured_steps
    assert profile["env"]["world_size"] == world_size
    assert profile["env"]["host_allocator"]["mode"] == "cache"  # train.cpu_allocator's default on CPU
    assert all(math.isfinite(s["loss"]) and s["wall_ms"] > 0 for s in steps)
    # the synthetic task is a repeating pattern: a model that really trains gets its loss down
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [s["loss"] for s in steps]
    # micro batch x grad accumulation x seq_len x ranks
    assert profile["summary"]["tokens_per_step"] * world_size == 2 * grad_accum * 64 * world_size


@pytest.mark.slow
@pytest.mark.parametrize("nproc,stage,offload", ZERO)
def test_deepspeed_zero(shared_run, nproc, stage, offload):
    shared = SHARED.get((nproc, stage, offload))
    # neither calibration nor operator traces are asserted on here: off, where the run is not shared
    run_dir, profile = shared_run(*shared) if shared else \
        shared_run(nproc, f"engine.zero_stage={stage}", f"engine.offload={offload}", *QUIET)
    assert_trained(profile, nproc, measured_steps=16 if shared else 6)
    cfg = profile["engine"]["config"]
    assert profile["engine"]["kind"] == "deepspeed"
    assert cfg["zero_optimization"]["stage"] == stage
    assert ("offload_optimizer" in cfg["zero_optimization"]) == (offload != "none")
    assert (run_dir / "recipe.yaml").is_file()
    assert sorted(p.name for p in run_dir.glob("rank*.json")) == [f"rank{r}.json" for r in range(nproc)]
    # ZeRO-3 partitions parameters, yet the count reported is the model's real size
    assert profile["params"]["total"] == 664_192


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_under_deepspeed_zero(shared_run, stage):
    """LoRA adapters train under ZeRO-2 and ZeRO-3 on two ranks. ZeRO-3 creates them partitioned in the
    model dtype and refused peft's fp32 adapters beside them (an AssertionError inside DeepSpeed)."""
    _, profile = shared_run(2, "task.kind=lora", f"engine.zero_stage={stage}", *QUIET)
    steps = [s for s in profile["steps"] if not s.get("warmup")]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert steps[-1]["loss"] < steps[0]["loss"], [s["loss"] for s in steps]
    assert 0 < profile["params"]["trainable"] < profile["params"]["total"] / 50  # the adapters only
    assert profile["engine"]["config"]["zero_optimization"]["stage"] == stage


@pytest.mark.slow
def test_torch_ddp_two_ranks(shared_run):
    _, profile = shared_run(2, "engine.kind=torch", "engine.zero_stage=0", "train.grad_accum=2", *QUIET)
    assert_trained(profile, 2, grad_accum=2)
    assert profile["engine"]["config"]["ddp"] is True
    # its all-reduces are recorded, and the profile says where DDP's wait for them went
    assert any(c["op"] == "all_reduce" for c in profile["comm"])
    assert "counted in backward, not comm_exposed" in profile["measurement"]["comm_exposed_ddp"]


@pytest.mark.slow
def test_param_offload_zero3(shared_run):
    _, profile = shared_run(2, "engine.zero_stage=3", "engine.offload=optimizer+params", *QUIET)
    assert_trained(profile, 2)
    assert profile["engine"]["config"]["zero_optimization"]["offload_param"]["device"] == "cpu"


@pytest.mark.slow
def test_oom_run_is_recorded_as_oom(tmp_path):
    """A run over its memory cap fails with failure-rank0.json kind oom and no finished-rank file."""
    import json
    import subprocess
    import sys

    from conftest import FAST, QUICKSTART, REPO

    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "trainprof.run", str(QUICKSTART), *FAST, "engine.zero_stage=0",
                           "train.memory_cap_gb=0.000001", f"output.dir={out}"],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode != 0
    (run_dir,) = list(out.iterdir())
    failure = json.loads((run_dir / "failure-rank0.json").read_text())
    assert failure["kind"] == "oom" and "train.memory_cap_gb" in failure["message"]
    assert not (run_dir / "rank0.json").exists()  # not mistaken for a finished rank


@pytest.mark.slow
def test_sigterm_mid_run_keeps_finished_steps_marked_partial(tmp_path):
    """SIGTERM (what torchrun sends surviving ranks) after a few steps: the rank records it and keeps
    the steps it finished in rank0.partial.json."""
    import json
    import re
    import signal
    import subprocess
    import sys
    import threading
    import time

    from conftest import QUICKSTART, REPO

    out = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "trainprof.run", str(QUICKSTART), "data.seq_len=64",
                             "train.steps=100000", "train.warmup_steps=0", "engine.zero_stage=0", "profile.ops=false",
                             f"output.dir={out}"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, cwd=REPO)
    seen = bytearray()
    reader = threading.Thread(target=lambda: [seen.extend(c) for c in iter(lambda: proc.stderr.read(64), b"")],
                              daemon=True)
    reader.start()
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline:  # the progress bar shows steps done
            done = [int(n) for n in re.findall(rb" (\d+)/100000 ", bytes(seen))]
            if done and max(done) >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("the run showed no progress in 180 s")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    (run_dir,) = list(out.iterdir())
    failure = json.loads((run_dir / "failure-rank0.json").read_text())
    assert failure["kind"] == "interrupted" and failure["signal"] == "SIGTERM"
    partial = json.loads((run_dir / "rank0.partial.json").read_text())
    assert partial["partial"] is True and len(partial["steps"]) >= 3
    assert not (run_dir / "rank0.json").exists()
