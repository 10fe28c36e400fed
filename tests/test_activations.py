"""Activation bytes: what autograd saves for backward during forward, counted on the FLOP-counting step."""

from __future__ import annotations

import torch

from trainprof.profiler import Profiler
from trainprof.profiler.memory import SavedActivations


def test_saved_activations_count_each_storage_once_and_no_parameters():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    with SavedActivations(lin) as meter:
        y = torch.relu(lin(x))  # linear saves x and a transposed view of its weight; relu saves y
        loss = (y * y).sum()  # mul saves y twice: one storage
        meter.backward_begins()
        # what backward saves (e.g. a recomputed layer) is not kept activation memory
        with torch.enable_grad():
            (torch.relu(lin(x)) * 2).sum().backward()
        loss.backward()
        meter.backward_ends()
    assert meter.max_bytes == x.numel() * 4 + y.numel() * 4


def test_profiler_reports_activation_bytes_and_the_larger_micro_batch():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = [4, 12]  # two micro batches in one optimizer step: the larger one is the figure
    with Profiler(model, opt, warmup_steps=1) as prof:
        for _ in range(3):
            with prof.step():
                for n in sizes:
                    model(torch.randn(n, 32)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
    s = prof.result()["summary"]
    n = max(sizes)
    # Linear 1 saves its input (n x 32); ReLU its output (n x 64), which Linear 2 saves too; pow saves
    # the output of Linear 2 (n x 8); mean saves nothing. fp32 throughout.
    assert s["activation_bytes"] == 4 * n * (32 + 64 + 8)
    assert "saved_tensors_hooks" in s["activation_bytes_method"]


def test_a_pipeline_schedules_forwards_are_counted_one_micro_batch_at_a_time():
    """GPipe runs every micro batch's forward before the first backward: each forward action closes its micro
    batch's count, so the figure is one micro batch's (it grew with the number of micro batches: 23.2 MiB at
    2, 54.6 MiB at 6 on the pipeline CPU recipe)."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    figures = []
    for m in (2, 6):
        with Profiler(model, module_depth=1) as prof:
            with prof.step():
                losses = []
                for i in range(m):
                    with prof.pipeline_action("forward", i):
                        losses.append(model(torch.randn(32, 64)).square().sum())
                for i in range(m):
                    with prof.pipeline_action("backward", i):
                        losses[i].backward()
        figures.append(prof.activation_bytes)
    # Linear 1 saves its input (32 x 64); ReLU its output (32 x 256), which Linear 2 saves too; square saves
    # Linear 2's output (32 x 64). fp32.
    assert figures == [4 * 32 * (64 + 256 + 64)] * 2
