"""`trainprof plan`'s GPU memory against the GPU reference profiles (profiles/h100-*, profiles/h200-*):
each recipe planned at the world size it ran with, the plan's peaks against the CUDA allocator's measured
peaks. CPU only: the measurements are the checked-in profile.json files.

The bound, 3%: the least exact row is the HF Llama activation count, which tests/test_plan.py holds to
autograd's saved tensors within 3% on CPU; the other rows are buffer sizes DeepSpeed and PyTorch allocate
exactly (tests/test_plan_deepspeed_buffers.py checks ZeRO-3's against DeepSpeed's own objects); the
H100 and H200 runs measured identical peaks, so run-to-run noise adds nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.evidence import gpu_folders, known_miss, load
from trainprof.plan import estimate_plan
from trainprof.recipe import load_recipe

GPU_PROFILES = gpu_folders()
BOUND = 0.03


def test_there_are_gpu_reference_profiles() -> None:
    assert len(GPU_PROFILES) >= 4, GPU_PROFILES


# Measured misses of the plan, open in issue 24 (docs/memory.md); strict: a plan that comes within the
# bound makes the test fail until its entry is removed.
HELD_RERUN = ("measured while the profiler held every re-run graph of the step to its end (fixed in 7288cef; "
              "memory_at_peak.py found the blocks freed in hooks.end_step: profiles/h100-memory)")
KNOWN_MISSES = {
    # the same recipes measured again with the fix are within the bound: <kind>-llama7b_qlora-v2 and
    # <kind>-llama1b_zero3_sdpa-gpubound32-v2
    "h200-llama7b_qlora": f"QLoRA with recompute, 9.89 GiB against 5.02 planned: {HELD_RERUN}",
    "h100-llama7b_qlora": f"as on the H200: {HELD_RERUN}",
    "h100-llama1b_zero3_sdpa-gpubound32": f"ZeRO-3 with recompute at 32 x 1024, 47.49 GiB against 34.70 planned: "
                                          f"{HELD_RERUN}",
}


@pytest.mark.parametrize("folder", [known_miss(KNOWN_MISSES, f.name, f) for f in GPU_PROFILES])
def test_planned_peaks_match_the_measured_allocator_peaks(folder: Path) -> None:
    profile = load(folder)
    # the profiler's GPU meter: torch.cuda.max_memory_allocated, reset at every phase start
    assert profile["env"]["memory_meter"].startswith("cuda_allocator_peak")
    measured = profile["summary"]["peak_memory_bytes"]
    plan = estimate_plan(load_recipe(folder / "recipe.yaml"), profile["env"]["world_size"])
    peaks = plan["gpu_memory"]["peaks"]
    errors = {
        "allocated peak": plan["gpu_allocated_per_rank"]["value"] / max(measured.values()) - 1,
        "forward/backward": peaks["forward_backward"]["gpu_bytes"] / max(measured["forward"], measured["backward"]) - 1,
        "optimizer step": peaks["optimizer_step"]["gpu_bytes"] / measured["optimizer"] - 1,
    }
    print(f"\n{folder.name}: " + ", ".join(f"{k} {100 * v:+.2f}%" for k, v in errors.items())
          + f" (measured max {max(measured.values()) / 2**30:.2f} GiB, "
            f"planned {plan['gpu_allocated_per_rank']['value'] / 2**30:.2f} GiB)")
    for what, error in errors.items():
        assert abs(error) <= BOUND, f"{folder.name} {what}: {100 * error:+.2f}% (bound {100 * BOUND:.0f}%)"
