"""The runner's peak memory survives the profiler's per-phase peak resets."""

from __future__ import annotations

import torch

from trainprof.env import peak_memory_bytes
from trainprof.profiler import Profiler

BIG = 300 * 2**20


class Spike(torch.nn.Module):
    """Touches BIG bytes in forward and frees them before returning."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scratch = torch.ones(BIG // 4)  # resident: every page written
        del scratch
        return self.lin(x)


def test_phase_resets_do_not_hide_the_forward_peak():
    cpu = torch.device("cpu")
    model = Spike()
    baseline = peak_memory_bytes(cpu)
    with Profiler(model, module_depth=1, device=cpu) as prof:
        assert prof.memory is not None and "clear_refs" in prof.memory.method  # the reset really happens
        with prof.step():
            with prof.phase("forward"):
                out = model(torch.randn(4, 8))
            with prof.phase("backward"):  # resets the kernel's RSS high-water mark first
                out.sum().backward()
    assert peak_memory_bytes(cpu) >= baseline + BIG * 0.9
