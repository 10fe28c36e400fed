"""Operator level: aten operators attributed to (module, phase) on chosen steps, with torch.profiler.

Mechanism and why: on traced steps the module hooks also open `record_function` ranges named
`trainprof::<phase>::<module>` (forward, recompute and backward, at exactly the points that define the
module-level intervals, so both levels agree), and the step runs under torch.profiler (Kineto). Each
aten op is then attributed to its innermost trainprof range through the profiler's own parent links
(same thread, same clock: no timestamp alignment). Backward operators fall inside the backward ranges
the tensor hooks open, so they are attributed like forward ones. Chosen over a TorchDispatchMode
because Kineto records ops in C++ (a Python dispatch mode costs far more per op), gives kernel time
per op on GPU (a dispatch mode only sees host launches), and the same trace feeds TensorBoard.
Self time is the profiler's self time (children ops excluded): host time on CPU, kernel time on GPU;
FLOPs are the profiler's `with_flops` estimates (matmul / conv), null where it has none.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from trainprof.analysis.records import ModuleInfo

RANGE_PREFIX = "trainprof::"


def range_names(modules: list[ModuleInfo]) -> list[dict[str, str]]:
    """record_function names per module and phase."""
    return [{phase: f"{RANGE_PREFIX}{phase}::{m.name or '<model>'}" for phase in ("forward", "recompute", "backward")}
            for m in modules]


def region_range_name(label: str) -> str:
    return f"{RANGE_PREFIX}{label}"


class OpTracer:
    """Runs torch.profiler around one step and aggregates its aten ops.

    Args:
        cuda: also record CUDA kernels (self time on GPU is kernel time).
        trace_dir: where to write each traced step's Chrome/Perfetto trace (TensorBoard plugin file
            names), or None.
        rank: this rank, for trace file names.
    """

    def __init__(self, *, cuda: bool, trace_dir: str | Path | None, rank: int) -> None:
        self.cuda = cuda
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.rank = rank
        self._prof: torch.profiler.profile | None = None

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, with_flops=True)
        self._prof.__enter__()

    def stop(self, step: int, names: list[dict[str, str]], module_names: list[str]) -> list[dict[str, Any]]:
        """Stop the profiler and return this step's operator rows.

        Args:
            step: the step number (for the trace file name).
            names: module range names from `range_names`.
            module_names: module names in the same order.
        Returns:
            rows {name, module, phase, calls, self_ms, self_cpu_ms, flops}.
        """
        prof, self._prof = self._prof, None
        if prof is None:
            return []
        prof.__exit__(None, None, None)
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(self.trace_dir / f"rank{self.rank}.step{step}.pt.trace.json"))
        lookup = {name: (module_names[i], phase) for i, per_phase in enumerate(names)
                  for phase, name in per_phase.items()}
        return aggregate_events(prof.events(), lookup, cuda=self.cuda)


def aggregate_events(events: Any, lookup: dict[str, tuple[str, str]], *, cuda: bool) -> list[dict[str, Any]]:
    """Sum profiler FunctionEvents of aten ops by (op, innermost trainprof range).

    Args:
        events: torch.profiler EventList (FunctionEvents with cpu_parent links).
        lookup: module range name -> (module name, phase).
        cuda: use device self time as self_ms.
    Returns:
        rows sorted by self_ms, largest first.
    """
    rows: dict[tuple[str, Any, str], dict[str, Any]] = defaultdict(
        lambda: {"calls": 0, "self_ms": 0.0, "self_cpu_ms": 0.0, "flops": None})
    for ev in events:
        if not ev.name.startswith("aten::"):
            continue
        module, phase = None, "other"
        parent = ev.cpu_parent
        while parent is not None:
            if parent.name.startswith(RANGE_PREFIX):
                if parent.name in lookup:
                    module, phase = lookup[parent.name]
                else:
                    phase = parent.name[len(RANGE_PREFIX):]
                break
            parent = parent.cpu_parent
        row = rows[(ev.name, module, phase)]
        row["calls"] += 1
        self_cpu = ev.self_cpu_time_total / 1e3
        row["self_cpu_ms"] += self_cpu
        row["self_ms"] += (ev.self_device_time_total / 1e3) if cuda else self_cpu
        if getattr(ev, "flops", 0):
            row["flops"] = (row["flops"] or 0) + int(ev.flops)
    out = [{"name": name, "module": module, "phase": phase, **values}
           for (name, module, phase), values in rows.items()]
    out.sort(key=lambda r: r["self_ms"], reverse=True)
    return out
