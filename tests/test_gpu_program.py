"""The GPU program (scripts/gpu_check.sh --program, issue 27) checked on a CPU before GPU time is spent on
it: its dry run lists every command and loads every recipe and override it uses, a broken one is named,
and the overhead bench's GPU path runs end to end on a tiny model, its JSON recomputable like the real one."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from helpers.evidence import check_overhead_config, median_ci

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def dry_run(tmp_path, part: str) -> tuple[subprocess.CompletedProcess, list[tuple[str, str]]]:
    out = tmp_path / part
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--program", part, "--dry-run", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240, env=ENV)
    rows = [tuple(line.split("\t", 1)) for line in (out / "commands.tsv").read_text().splitlines()]
    return proc, rows


@pytest.mark.parametrize("part,names", [
    ("core", ["GPU tests", "llama1b_zero3_sdpa-torch-gpubound", "llama1b_zero3_sdpa-gpubound",
              "profiler overhead bench", "llama1b_zero3_sdpa-hostbound", "llama1b_zero3_sdpa-torch-hostbound"]),
    ("lora", ["llama7b_lora", "llama7b_qlora"]),
    ("pair", ["llama1b_zero3_sdpa-torch-gpubound", "llama1b_zero3_sdpa-gpubound"]),
    ("zero2", ["llama1b_zero3_sdpa-zero2-hostbound", "llama1b_zero3_sdpa-zero2-gpubound"]),
    ("offload", ["llama1b_zero3_sdpa-offload-hostbound", "llama1b_zero3_sdpa-zero2-offload-hostbound"]),
    ("qlora_shapes", ["llama70b_qlora-2layers", "llama13b_qlora-8layers", "llama7b_qlora-mb4", "llama7b_qlora-16layers"]),
])
def test_dry_run_lists_every_command_and_loads_every_recipe(tmp_path, part, names):
    proc, rows = dry_run(tmp_path, part)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert [name for name, _ in rows] == names
    checked = [line for line in proc.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    assert len(checked) == len(names) and all(line.startswith("ok ") for line in checked), checked
    for name, command in rows:
        words = shlex.split(command)
        if "trainprof.run" in words:  # every kept run traces one step without stacks, with calibration
            for key in ("profile.ops=true", "profile.ops_steps=1", "profile.with_stack=false",
                        "profile.calibrate=true"):
                assert key in words, (name, key)
    if part == "core":
        import bench_overhead_cuda

        gpu_bound = shlex.split(dict(rows)["llama1b_zero3_sdpa-torch-gpubound"])
        _, recipe, overrides = bench_overhead_cuda.CONFIGS[0]  # the bench times the same GPU-bound step
        assert recipe in gpu_bound and all(o in gpu_bound for o in overrides)


def test_command_check_names_a_bad_override_and_a_missing_test(tmp_path):
    tsv = tmp_path / "commands.tsv"
    tsv.write_text("bad run\tpython3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run "
                   "recipes/llama1b_zero3_sdpa.yaml train.micro_batch_size=0 output.dir=/tmp/x\n"
                   "bad tests\tpython3 -m pytest -q -m gpu tests/test_no_such_file.py\n"
                   "good run\tpython3 -m torch.distributed.run --nproc_per_node 1 -m trainprof.run "
                   "recipes/llama13b_lora.yaml model.name=llama2-7b\n")
    proc = subprocess.run([sys.executable, "scripts/gpu_check_commands.py", str(tsv)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("FAIL bad run: RecipeError: recipe key 'train.micro_batch_size'"), lines
    assert lines[1].startswith("FAIL bad tests: FileNotFoundError") and "tests/test_no_such_file.py" in lines[1]
    assert lines[2].startswith("ok   good run: recipes/llama13b_lora.yaml: llama2-7b, lora"), lines


def test_bench_gpu_path_runs_on_a_tiny_model_on_cpu(tmp_path):
    """bench_overhead_cuda.bench_config is what --device cuda runs per configuration; here on the tiny
    Llama on CPU, with the same recomputation the kept GPU JSON gets (tests/test_gpu_evidence.py)."""
    import bench_overhead_cuda

    cfg = bench_overhead_cuda.bench_config(
        "tiny", "recipes/quickstart_cpu.yaml",
        ["engine.kind=torch", "engine.zero_stage=0", "train.micro_batch_size=2", "data.seq_len=32"], 4,
        median_ci(), torch.device("cpu"))
    ratios = check_overhead_config(cfg)
    assert set(ratios) == {"A/A control: unprofiled vs unprofiled", "one Profiler (as a run)",
                           "a fresh Profiler a step"}
    assert cfg["module_calls_per_step"] > 0 and cfg["gpu_busy_frac"] is None
    assert cfg["telemetry"].startswith("the device is cpu")


def test_bench_refuses_cuda_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, "scripts/bench_overhead.py", "--device", "cuda", "--pairs", "2"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("bench_overhead.py --device cuda: no CUDA device here; run it "
                                                    "on a GPU machine")


def test_the_program_keeps_the_trace_where_a_run_writes_it(shared_run):
    """keep() copies rank 0's trace by TRACE_GLOB; on the H200's first call it looked in tb/ while the
    run writes tb/<run>/, and four traces were lost. A real traced run's dir must match it."""
    from conftest import QUICKSTART_2RANK

    script = (REPO / "scripts" / "gpu_check.sh").read_text()
    pattern = re.search(r"^TRACE_GLOB='([^']+)'", script, re.M).group(1)
    run_dir, profile = shared_run(*QUICKSTART_2RANK)
    found = sorted(run_dir.glob(pattern))
    assert [p.name for p in found] == [n for n in profile["ops_info"]["trace_files"] if n.startswith("rank0.")]
