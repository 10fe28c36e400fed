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
FLOPs are the profiler's `with_flops` estimates (matmul / conv), null where it has none; with_flops
makes Kineto record input shapes, so it is on only with record_shapes.

Which steps: a torch.profiler schedule (wait, warm-up, active; once) over the measured steps, so the
trace is bounded by the recipe (profile.trace_wait / trace_warmup / ops_steps), not by the run. The
trace is written per rank in the TensorBoard plugin's layout with `ProfilerStep#N` markers (N = the
profile.json step) and distributedInfo, which Holistic Trace Analysis needs.
"""

from __future__ import annotations

import bisect
import json
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from trainprof.analysis.records import RANGE_PREFIX, ROOT_LABEL, ModuleInfo, module_label
from trainprof.analysis.trace import op_name
from trainprof.env import forget_profiler_memory, native_chatter_to

KINETO_LOG = "kineto.log"  # Kineto's USDT lines, kept off the terminal (env.native_chatter_to)


def range_names(modules: list[ModuleInfo]) -> list[dict[str, str]]:
    """record_function names per module and phase."""
    return [{phase: f"{RANGE_PREFIX}{phase}::{module_label(m.name)}" for phase in ("forward", "recompute", "backward")}
            for m in modules]


def region_range_name(label: str) -> str:
    return f"{RANGE_PREFIX}{label}"


STEP_PREFIX = "ProfilerStep#"
STEP_NAMES = ("ProfilerStep#", "ProfilerStep*")


class _StepNumberedProfile(torch.profiler.profile):
    """torch.profiler.profile whose `ProfilerStep#N` markers use trainprof's step numbers (N = the step
    in profile.json), so a trace step and a profile step are the same thing."""

    first_step = 0

    def start(self) -> None:
        self.step_num = self.first_step
        self.current_action = self.schedule(self.step_num)
        self._prev_schedule_action = self.current_action
        super().start()


class OpTracer:
    """torch.profiler over a schedule of measured steps (wait, warm-up, active, once); aggregates the
    active steps' aten ops and writes one Kineto trace per rank in the TensorBoard plugin's layout:
    `<trace_dir>/rank<r>.<ms timestamp>.pt.trace.json[.gz]` (worker = rank<r>, span = the timestamp).

    The trace carries `ProfilerStep#N` markers (N = the profile.json step), the trainprof module and
    phase ranges, `distributedInfo` (Kineto's own when torch.distributed is initialized; else rank 0 of
    1) and a `trainprof` metadata block (rank, world size, steps, range prefix).

    Args:
        cuda: also record CUDA kernels (self time on GPU is kernel time).
        trace_dir: where to write the trace, or None (ops are still aggregated).
        rank, world_size: this rank and the world size, for file names and metadata.
        wait, warmup, active: the torch.profiler schedule, counted in measured steps from the first one
            the tracer is offered. Warm-up steps run under the profiler and are discarded.
        record_shapes: record operator input shapes (and per-operator FLOP estimates, which need them).
        with_stack: record Python stacks per operator (large traces).
        gzip: write .pt.trace.json.gz.
    """

    def __init__(self, *, cuda: bool, trace_dir: str | Path | None, rank: int, world_size: int = 1,
                 wait: int = 0, warmup: int = 0, active: int = 1, record_shapes: bool = True,
                 with_stack: bool = False, gzip: bool = False) -> None:
        self.cuda = cuda
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.rank, self.world_size = rank, world_size
        self.wait, self.warmup, self.active = wait, warmup, active
        self.record_shapes, self.with_stack, self.gzip = record_shapes, with_stack, gzip
        self.files: list[Path] = []
        self.recorded_steps: list[int] = []
        self.done = False
        self._prof: _StepNumberedProfile | None = None
        self._first: int | None = None
        self._lookup: dict[str, tuple[str, str]] = {}
        self._rows: list[list[dict[str, Any]]] | None = None

    @property
    def chatter_log(self) -> Path | None:
        """Where Kineto's USDT lines go instead of the terminal (beside the trace)."""
        return self.trace_dir / KINETO_LOG if self.trace_dir is not None else None

    def phase(self, step: int) -> str | None:
        """Where `step` falls in the schedule: "wait", "warmup", "active" or None (before or after)."""
        if self._first is None or self.done or step < self._first:
            return None
        k = step - self._first
        if k < self.wait:
            return "wait"
        if k < self.wait + self.warmup:
            return "warmup"
        return "active" if k < self.wait + self.warmup + self.active else None

    @property
    def recording(self) -> bool:
        """Whether the torch profiler is collecting right now (warm-up or active step)."""
        return self._prof is not None and self._prof.current_action != torch.profiler.ProfilerAction.NONE

    def begin_step(self, step: int, names: list[dict[str, str]], module_names: list[str]) -> str | None:
        """Called when measured step `step` begins; starts the profiler on the first call.

        Args:
            step: the profile.json step number.
            names: module range names from `range_names`; module_names: the modules in the same order.
        Returns:
            The step's place in the schedule ("wait", "warmup", "active") or None when done.
        """
        if self.done:
            return None
        if self._prof is None:
            self._first = step
            self._lookup = {name: (module_names[i], phase) for i, per_phase in enumerate(names)
                            for phase, name in per_phase.items()}
            self._start(step)
        return self.phase(step)

    def _start(self, first: int) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with warnings.catch_warnings():  # warm-up 0 is the caller's choice (the recipe default is 1)
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            cycle = torch.profiler.schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1)

        def schedule(n: int) -> torch.profiler.ProfilerAction:
            return torch.profiler.ProfilerAction.NONE if n < first else cycle(n - first)

        # with_flops makes Kineto record input shapes too, so it follows record_shapes
        prof = _StepNumberedProfile(activities=activities, schedule=schedule, on_trace_ready=self._trace_ready,
                                    record_shapes=self.record_shapes, with_stack=self.with_stack,
                                    with_flops=self.record_shapes)
        prof.first_step = first
        active = list(range(first + self.wait + self.warmup, first + self.wait + self.warmup + self.active))
        meta = {"rank": self.rank, "world_size": self.world_size, "steps": active, "range_prefix": RANGE_PREFIX,
                "ranges": "trainprof::<phase>::<module> per module call (forward, backward, recompute; the "
                          f"model itself is {ROOT_LABEL}) and trainprof::<phase> for phase regions"}
        prof.preset_metadata_json("trainprof", json.dumps(meta))
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            prof.preset_metadata_json("distributedInfo", json.dumps(
                {"backend": "none", "rank": self.rank, "world_size": self.world_size}))
        with native_chatter_to(self.chatter_log):
            prof.__enter__()
        self._prof = prof

    def end_step(self, step: int) -> list[list[dict[str, Any]]] | None:
        """Called when measured step `step` ends: advance the schedule. After the last active step the
        trace is written and the profiler stopped.

        Returns:
            Per active step, its operator rows; None until the schedule is complete.
        """
        if self._prof is None or self.done:
            return None
        with native_chatter_to(self.chatter_log):  # starting, stopping and writing the trace print USDT lines
            self._prof.step()
        if self.phase(step + 1) is None:
            return self.close()
        return None

    def close(self) -> list[list[dict[str, Any]]] | None:
        """Stop the profiler (a trace cut short by the end of training is still written)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            with native_chatter_to(self.chatter_log):
                prof.__exit__(None, None, None)
        self.done = True
        rows, self._rows = self._rows, None
        if prof is not None and not self.cuda:  # a GPU run's meter is the device's, which the trace leaves
            del prof
            forget_profiler_memory()
        return rows

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        if self.trace_dir is not None:
            self.trace_dir.mkdir(parents=True, exist_ok=True)
            suffix = ".pt.trace.json.gz" if self.gzip else ".pt.trace.json"
            path = self.trace_dir / f"rank{self.rank}.{int(time.time() * 1000)}{suffix}"
            prof.export_chrome_trace(str(path))
            self.files.append(path)
        per_step = aggregate_events(prof.events(), self._lookup, cuda=self.cuda, by_step=True)
        self.recorded_steps = sorted(per_step)
        self._rows = [per_step[s] for s in self.recorded_steps]

    def info(self) -> dict[str, Any]:
        """What profile.json's ops_info says about the trace."""
        sizes = [p.stat().st_size for p in self.files if p.exists()]
        n = len(self.recorded_steps)
        return {
            "schedule": {"wait": self.wait, "warmup": self.warmup, "active": self.active,
                         "first_step": self._first},
            "trace_steps": self.recorded_steps,
            "trace_files": [p.name for p in self.files],
            "trace_bytes": sum(sizes) if sizes else None,
            "trace_bytes_per_step": sum(sizes) / n if sizes and n else None,
            "trace_gzip": self.gzip, "record_shapes": self.record_shapes, "with_stack": self.with_stack,
        }


def _step_spans(events: Any) -> list[tuple[float, float, int]]:
    """(start us, end us, step) of every `ProfilerStep#N` range, sorted by start."""
    spans = []
    for ev in events:
        if ev.name.startswith(STEP_NAMES):
            name = getattr(ev, "trace_name", None) or ev.name
            tail = name[len(STEP_PREFIX):]
            spans.append((ev.time_range.start, ev.time_range.end, int(tail) if tail.isdigit() else -1))
    return sorted(spans)


def _step_at(spans: list[tuple[float, float, int]], start_us: float) -> int | None:
    i = bisect.bisect_right(spans, (start_us, float("inf"), 0)) - 1
    return spans[i][2] if i >= 0 and spans[i][0] <= start_us <= spans[i][1] else None


def aggregate_events(events: Any, lookup: dict[str, tuple[str, str]], *, cuda: bool,
                     by_step: bool = False) -> Any:
    """Sum profiler FunctionEvents of aten ops (and compiled-code ranges, see op_name) by (op, innermost
    trainprof range); on CUDA also the kernels other events launched themselves, as `kernel::<name>` rows.

    Args:
        events: torch.profiler EventList (FunctionEvents with cpu_parent links).
        lookup: module range name -> (module name, phase).
        cuda: use device self time as self_ms.
        by_step: split by the enclosing `ProfilerStep#N` range.
    Returns:
        rows sorted by self_ms, largest first; with by_step, {step: rows} (ops outside any step marker
        are left out).
    """
    steps: dict[Any, dict[tuple[str, Any, str], dict[str, Any]]] = defaultdict(lambda: defaultdict(
        lambda: {"calls": 0, "self_ms": 0.0, "self_cpu_ms": 0.0, "flops": None}))
    step_spans = _step_spans(events) if by_step else []
    # Kineto's parser can also link an operator's kernels to other, non-operator events (seen on an H100:
    # AdamW's foreach kernels counted 8-40 times over, 557 ms in a 445 ms step); a kernel that any aten op
    # launched is the op's, so only the names no op launched get rows of their own
    op_kernels = {k.name for ev in events if cuda and op_name(ev.name) for k in ev.kernels}
    for ev in events:
        op = op_name(ev.name)
        if op is None:
            if cuda and ev.kernels:
                _place_kernels(ev, steps, lookup, step_spans, by_step, op_kernels)
            continue
        module, phase, step = _place(ev.cpu_parent, ev, lookup, step_spans, by_step)
        if by_step and step is None:
            continue
        row = steps[step][(op, module, phase)]
        row["calls"] += 1
        self_cpu = ev.self_cpu_time_total / 1e3
        row["self_cpu_ms"] += self_cpu
        row["self_ms"] += (ev.self_device_time_total / 1e3) if cuda else self_cpu
        if getattr(ev, "flops", 0):
            row["flops"] = (row["flops"] or 0) + int(ev.flops)

    def rows_of(rows: dict[tuple[str, Any, str], dict[str, Any]]) -> list[dict[str, Any]]:
        out = [{"name": name, "module": module, "phase": phase, **values}
               for (name, module, phase), values in rows.items()]
        out.sort(key=lambda r: r["self_ms"], reverse=True)
        return out

    if by_step:
        return {step: rows_of(rows) for step, rows in steps.items()}
    return rows_of(steps[None])


KERNEL_PREFIX = "kernel::"  # ops-table rows of device work launched outside any aten op


def counted_again(rows: list[dict[str, Any]], op_kernels: set[str] | frozenset[str]) -> list[dict[str, Any]]:
    """The `kernel::` rows of an ops table whose kernel an aten op launched (op_kernels: their names), which
    the rule in aggregate_events leaves out: tables written before it could hold them."""
    return [r for r in rows if r["name"].startswith(KERNEL_PREFIX) and r["name"][len(KERNEL_PREFIX):] in op_kernels]


def _place_kernels(ev: Any, steps: Any, lookup: dict[str, tuple[str, str]], step_spans: list, by_step: bool,
                   op_kernels: set[str]) -> None:
    """Rows for the kernels an event that is not an operator launched itself: libraries that call the CUDA
    driver directly (bitsandbytes' dequantize, DeepSpeed's fused optimizer) link their kernels to the
    innermost profiler range, a trainprof module range among them, and no aten op would count them."""
    module, phase, step = _place(ev, ev, lookup, step_spans, by_step)
    if by_step and step is None:
        return
    for kernel in ev.kernels:
        if kernel.name in op_kernels:
            continue
        row = steps[step][(KERNEL_PREFIX + kernel.name, module, phase)]
        row["calls"] += 1
        row["self_ms"] += kernel.duration / 1e3


def _place(parent: Any, ev: Any, lookup: dict[str, tuple[str, str]], step_spans: list,
           by_step: bool) -> tuple[Any, str, Any]:
    """(module, phase, step) of `ev` from the innermost trainprof range at or above `parent`; step is
    None when by_step is off or no step holds the event."""
    module, phase, found, step = None, "other", False, None
    while parent is not None:
        if not found and parent.name.startswith(RANGE_PREFIX):
            found = True
            if parent.name in lookup:
                module, phase = lookup[parent.name]
            else:
                phase = parent.name[len(RANGE_PREFIX):]
            if not by_step:
                break
        elif by_step and parent.name.startswith(STEP_NAMES):
            # EventList names every step "ProfilerStep*"; trace_name keeps "ProfilerStep#N"
            name = getattr(parent, "trace_name", None) or parent.name
            step = int(name[len(STEP_PREFIX):]) if name[len(STEP_PREFIX):].isdigit() else -1
            break
        parent = parent.cpu_parent
    if by_step and step is None:
        # another thread's op (on CUDA the autograd engine runs backward on its own device thread,
        # outside the step marker's thread): the step whose span holds its start
        step = _step_at(step_spans, ev.time_range.start)
    return module, phase, step
