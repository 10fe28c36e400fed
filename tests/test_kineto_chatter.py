"""Kineto's `USDT: ... profiler_start/stop` lines (printed from C++ on file descriptor 2 when
torch.profiler starts and stops) stay off the terminal, where they break the progress bar: they go to
kineto.log beside the trace, and every other line written meanwhile still reaches stderr."""

from __future__ import annotations

import os

import torch

from trainprof.env import native_chatter_to
from trainprof.profiler.ops import KINETO_LOG, OpTracer


def test_chatter_goes_to_the_log_and_errors_still_show(tmp_path, capfd):
    log = tmp_path / "native.log"
    with native_chatter_to(log):
        os.write(2, b"USDT:2026-01-01 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"a real error from native code\n")
    err = capfd.readouterr().err
    assert "a real error from native code" in err and "USDT" not in err
    assert log.read_text().startswith("USDT:") and "real error" not in log.read_text()


def test_tracing_a_step_prints_no_usdt_line(tmp_path, capfd):
    model = torch.nn.Linear(16, 16)
    tracer = OpTracer(cuda=False, trace_dir=tmp_path, rank=0, warmup=0, active=1, record_shapes=False)
    x = torch.randn(4, 16)
    for step in range(2):
        if tracer.begin_step(step, [], []) is None:
            break
        model(x).sum().backward()
        tracer.end_step(step)
    tracer.close()
    err = capfd.readouterr().err
    assert "USDT" not in err, err
    assert list(tmp_path.glob("rank0.*.pt.trace.json")), "the trace was written"
    assert "profiler_start" in (tmp_path / KINETO_LOG).read_text()  # what Kineto printed, kept beside the trace
