"""GPU: CUDA-event timing (no synchronize per module) recovers the synthetic model's known costs.
Skipped without CUDA (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from helpers.checks import check_closure, check_modules, module_rows_per_step
from helpers.synthetic import Synthetic, train

pytestmark = pytest.mark.gpu


def test_cuda_event_timer_recovers_module_times():
    model = Synthetic().cuda()
    # the synthetic waits are host-side; with an idle stream each event is stamped when the host
    # records it, so the GPU timeline shows the same durations
    import helpers.synthetic as synthetic

    original = synthetic.busy_loader
    synthetic.busy_loader = lambda n, **kw: (x.cuda() for x in original(n, **kw))
    try:
        prof, ledger = train(model, {"module_depth": 2, "flops": False}, warmup=1, steps=3)
    finally:
        synthetic.busy_loader = original
    result = prof.result()
    assert result["env"]["timer"] == "cuda_event"
    rows, index = module_rows_per_step(prof)
    check_modules(rows, index, ledger, ["embed", "block", "shared", "ckpt.body", "head"])
    check_closure(result)
    assert result["summary"]["peak_memory_bytes"]["forward"] > 0
    assert "cuda_allocator_peak" in result["summary"]["peak_memory_method"]
    assert torch.cuda.is_available()
