"""The runner's peak memory survives the profiler's per-phase peak resets.

Process-level memory (RSS high-water marks) depends on everything a process did before, so the check
runs in a fresh interpreter and asks whether the reported peak includes a spike above what is resident
before it.
"""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

SCRIPT = r'''
import torch
from trainprof.env import peak_memory_bytes
from trainprof.profiler import Profiler

BIG = 300 * 2**20

class Spike(torch.nn.Module):
    """Touches BIG bytes in forward and frees them before returning."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
    def forward(self, x):
        scratch = torch.ones(BIG // 4)  # resident: every page written
        del scratch
        return self.lin(x)

cpu = torch.device("cpu")
model = Spike()
def resident_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

baseline = resident_bytes()  # what is resident now; imports may have peaked higher before
with Profiler(model, module_depth=1, device=cpu) as prof:
    assert prof.memory is not None and "clear_refs" in prof.memory.method, prof.memory  # the reset happens
    with prof.step():
        with prof.phase("forward"):
            out = model(torch.randn(4, 8))
        with prof.phase("backward"):  # resets the kernel's RSS high-water mark first
            out.sum().backward()
peak = peak_memory_bytes(cpu)
assert peak >= baseline + BIG * 0.9, (baseline, peak)
print("ok")
'''


def test_phase_resets_do_not_hide_the_forward_peak():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
