"""GPU: CUDA-event timing (no synchronize per module) recovers the synthetic model's known costs.
Skipped without CUDA (conftest.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers.checks import check_closure, check_modules, module_rows_per_step
from helpers.synthetic import Synthetic, train

pytestmark = [pytest.mark.gpu, pytest.mark.timed]


def test_cuda_event_timer_recovers_module_times():
    model = Synthetic(scale=2).cuda()  # longer waits: the launches' offsets at each boundary a smaller part of a module
    # the synthetic waits are host-side; with an idle stream each event is stamped when the host
    # records it, so the GPU timeline shows the same durations
    import helpers.synthetic as synthetic

    original = synthetic.busy_loader
    synthetic.busy_loader = lambda n, **kw: (x.cuda() for x in original(n, **kw))
    try:
        # two warm-up steps, the last one profiled (FLOP counting), as the runner does: on an H100 the
        # first profiled step carried ~235 ms of one-time cost that no phase owns (unattributed 66%)
        prof, ledger = train(model, {"module_depth": 2}, warmup=2, steps=4)
    finally:
        synthetic.busy_loader = original
    result = prof.result()
    if os.environ.get("TRAINPROF_GPU_TEST_OUT"):  # the steps as measured, for a GPU session's notes
        Path(os.environ["TRAINPROF_GPU_TEST_OUT"]).write_text(json.dumps(
            {"steps": result["steps"], "modules": rows_for_notes(prof)}, indent=1, default=str))
    assert result["env"]["timer"] == "cuda_event"
    # the capacity the memory-headroom advice divides by (a run's summary said "n/a" before)
    assert result["env"]["device_memory_bytes"] == torch.cuda.get_device_properties(0).total_memory
    rows, index = module_rows_per_step(prof)
    check_modules(rows, index, ledger, ["embed", "block", "shared", "ckpt.body", "head"])
    check_closure(result)
    assert result["summary"]["peak_memory_bytes"]["forward"] > 0
    assert "cuda_allocator_peak" in result["summary"]["peak_memory_method"]
    assert torch.cuda.is_available()


def rows_for_notes(prof) -> list:
    rows, index = module_rows_per_step(prof)
    return [{name: row[i] for name, i in index.items()} for row in rows]
