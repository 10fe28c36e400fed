"""GPU ground truth: modules whose forward and backward launch torch.cuda._sleep kernels of a known number
of GPU clock cycles. The host enqueues far ahead of the GPU, so only the GPU timeline knows when each
module ran: the CUDA-event timer must recover every module's forward and backward within 5% of the
cycles' duration, with no synchronize inside the step (sync debug mode "error" proves it). Skipped
without CUDA (conftest.py)."""

from __future__ import annotations

import statistics

import pytest
import torch

from helpers.checks import check_closure, module_rows_per_step

pytestmark = pytest.mark.gpu

REL = 0.05
# module -> (forward ms, backward ms) of its own sleep; "block" only holds its children
LEAVES = {"a": (4.0, 8.0), "block.c": (2.0, 5.0), "block.d": (6.0, 3.0), "e": (3.0, 4.0)}


def cycles_per_ms() -> float:
    """The GPU's _sleep cycles per millisecond (the SM clock), timed with CUDA events: median of 5 sleeps
    of about 10 ms, after 0.1 s of spinning that lets the clock leave its idle state."""
    torch.cuda._sleep(200_000_000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    rates = []
    for _ in range(5):
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rates.append(20_000_000 / start.elapsed_time(end))
    return statistics.median(rates)


class SleepFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_cycles: int, bwd_cycles: int) -> torch.Tensor:
        torch.cuda._sleep(fwd_cycles)
        ctx.bwd_cycles = bwd_cycles
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        torch.cuda._sleep(ctx.bwd_cycles)
        return grad, None, None


class Sleeper(torch.nn.Module):
    def __init__(self, fwd_ms: float, bwd_ms: float, rate: float) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1, device="cuda"))
        self.cycles = (int(fwd_ms * rate), int(bwd_ms * rate))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SleepFn.apply(x * self.w, *self.cycles)


class Block(torch.nn.Module):
    def __init__(self, c: Sleeper, d: Sleeper) -> None:
        super().__init__()
        self.c, self.d = c, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d(self.c(x))


class SleepModel(torch.nn.Module):
    def __init__(self, rate: float) -> None:
        super().__init__()
        s = {name: Sleeper(*ms, rate) for name, ms in LEAVES.items()}
        self.a, self.block, self.e = s["a"], Block(s["block.c"], s["block.d"]), s["e"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.e(self.block(self.a(x))).sum()


def expected_ms(name: str, phase: str) -> float:
    i = 0 if phase == "forward" else 1
    return sum(ms[i] for leaf, ms in LEAVES.items() if name == "" or leaf == name or leaf.startswith(name + "."))


def test_cuda_sleep_cycles_recovered_per_module_without_a_synchronize():
    from trainprof.profiler import Profiler

    rate = cycles_per_ms()
    model = SleepModel(rate)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, device="cuda")
    with Profiler(model, optimizer=opt, module_depth=2, warmup_steps=2, flops=False) as prof:
        for _ in range(7):
            with prof.step():
                torch.cuda.set_sync_debug_mode("error")  # any synchronize in the hooks raises here
                try:
                    model(x).backward()
                    opt.step()
                    opt.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
    result = prof.result()
    rate_after = cycles_per_ms()  # a clock that moved during the steps would move the truth: say so on failure
    assert result["env"]["timer"] == "cuda_event"
    rows, index = module_rows_per_step(prof)
    assert len(rows) == 5
    failures = []
    for name in ["a", "block", "block.c", "block.d", "e", ""]:
        for phase in ("forward", "backward"):
            truth = expected_ms(name, phase)
            measured = statistics.median(r[index[name]][f"{phase}_ms"] for r in rows)
            if abs(measured - truth) > REL * truth:
                failures.append(f"{name or '(model)'} {phase}: {measured:.3f} ms against {truth:.3f} ms")
    assert not failures, (failures, f"SM cycles per ms {rate:.0f} before, {rate_after:.0f} after the steps")
    step_truth = expected_ms("", "forward") + expected_ms("", "backward")
    assert result["summary"]["step_ms"]["median"] == pytest.approx(step_truth, rel=REL)
    check_closure(result)
