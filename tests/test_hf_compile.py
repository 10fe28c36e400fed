"""The HF Trainer's `TrainingArguments(torch_compile=True)` under trainprof's HF callback: the Trainer (through
Accelerate) runs `torch.compile(model)`, and the callback profiles that wrapper as one compiled region, as the
Profiler profiles a script's own `torch.compile(model)` (tests/test_compile.py). Before, the callback hooked the
unwrapped model inside the compiled graph: dynamo traced the hooks, recompiled each call up to its recompile
limit, fell back to eager, and the profile called the run eager. A real Trainer and inductor on CPU, in a
subprocess (dynamo's counters and caches start empty there; the first compile takes ~30 s on 2 cores)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = REPO / "tests" / "data" / "scripts" / "hf_trainer.py"
STEPS = 4  # the callback's default warm-up 1 (the compiling step): 3 measured steps


def run_script(tmp_path: Path, steps: int, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRAINPROF_OUTPUT_DIR": str(out),
           "PYTHONPATH": str(REPO), **env}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "hf"), "--steps", str(steps), "--own-callback",
                           "--compile"],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


@pytest.mark.slow
def test_hf_trainer_torch_compile_is_profiled_as_one_compiled_region(tmp_path):
    proc, out = run_script(tmp_path, STEPS)
    assert "runs OptimizedModule" in proc.stdout  # the Trainer did run the model torch.compile'd
    # trainprof's hooks were not traced by dynamo: no recompilation per call, no builtins it cannot trace
    assert "recompile_limit" not in proc.stderr, proc.stderr[-3000:]
    assert "trainprof/profiler" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    profile = json.loads((run_dir / "profile.json").read_text())

    c = profile["compile"]
    assert c["compiled"] is True and c["module_granularity"] == "compiled_region"
    assert c["regions"] == [""] and c["region_style"] == ["torch.compile wrapper"]
    dynamo = c["dynamo"]
    assert dynamo["while_profiled"]["graphs_captured"] > 0
    assert dynamo["during_measured_steps"]["frames_converted"] == 0  # no recompilation, no fallback while measured
    assert dynamo["total"]["graph_breaks"] == 0, dynamo  # no trainprof hook inside the graph, even while warming up
    assert profile["workload"]["model"]["compile"] is True
    assert [m["name"] for m in profile["modules"]] == [""]  # the region; nothing inside it hooked
    assert profile["modules"][0]["forward_ms"] > 0 and profile["modules"][0]["backward_ms"] > 0

    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(measured) == STEPS - 1
    assert all(s["tokens"] == 2 * 2 * 32 for s in measured), [s["tokens"] for s in measured]
    assert all(math.isfinite(s["loss"]) for s in measured)  # the loss hook sits on the wrapper, outside dynamo
    assert "torch.compile, 1 compiled region(s)" in (run_dir / "summary.md").read_text()


@pytest.mark.slow
def test_hf_trainer_regional_compilation_is_profiled_by_its_compiled_blocks(tmp_path):
    """Accelerate's regional compilation (each repeated block, the embedding and the head torch.compile'd in a
    copy of the model): the copy the Trainer calls is profiled, each compiled block a region, nothing traced."""
    proc, out = run_script(tmp_path, 3, ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION="1")
    assert "runs LlamaForCausalLM" in proc.stdout  # Accelerate's copy of the model, with compiled blocks
    assert "recompile_limit" not in proc.stderr and "trainprof/profiler" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    profile = json.loads((run_dir / "profile.json").read_text())
    c = profile["compile"]
    assert c["compiled"] is True and {"model.layers.0", "model.layers.1"} <= set(c["regions"]), c["regions"]
    assert c["dynamo"]["during_measured_steps"]["frames_converted"] == 0
    layers = [m for m in profile["modules"] if m["name"] in ("model.layers.0", "model.layers.1")]
    assert len(layers) == 2 and all(m["forward_ms"] > 0 and m["backward_ms"] > 0 for m in layers), layers
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(measured) == 2 and all(s["tokens"] == 2 * 2 * 32 for s in measured), measured
