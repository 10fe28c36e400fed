"""One step's breakdown: module x phase times, the phase partition of the wall time and its closure,
and the collectives, from the events the hooks recorded (times already in ms since the step began).

Phase partition: every instant of the step gets one label, the highest-priority one covering it:
pipeline_bubble = comm_exposed > recompute > data_wait > optimizer > backward = forward > other. forward / backward /
recompute are the module windows (any profiled module, so the union is the model's time) and the
explicit regions a runner marks with `Profiler.phase`; optimizer is the optimizer's step (hooked or
marked); data_wait the loader's `next()`; comm_exposed the time a collective blocked this rank;
pipeline_bubble the time a pipeline stage blocked waiting to receive its neighbour's activations or
gradients (see analysis/pipeline.py; 0 without pipeline parallelism). Time
no label covers (the loop's own code between them) is `unattributed_ms`, so
    sum(phases_ms) + unattributed_ms == wall_ms
holds exactly and the size of unattributed_ms is the closure error.

Module times are compute times: a forward or recompute window minus the exposed communication inside
it, a backward window minus the recomputation and exposed communication inside it. Communication is
attributed to the innermost module open when it was issued.

Recompute bursts: re-run windows that follow each other with no other event between them are one
re-run of their common ancestor's forward (transformers checkpoints a layer's `forward`, whose own
hooks therefore do not fire again, only its children's, or the sentinels' recorded under the layer).
The burst, from the first re-run's start to the last one's end, is the recompute interval (the
ancestor's glue between children included) and one re-run of that ancestor.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from trainprof.analysis.intervals import IntervalSet, label_timeline
from trainprof.analysis.records import MODULE_CLOSE, MODULE_OPEN, R_CLOSE, R_OPEN, REGION_CLOSE, REGION_OPEN, Event
from trainprof.phases import MODULE_PHASES, PIPELINE_PHASES

PRIORITY = {"other": 1, "forward": 2, "backward": 2, "optimizer": 3, "data_wait": 4, "recompute": 5,
            "comm_exposed": 6, "pipeline_bubble": 6}  # one thread cannot wait on both at once


@dataclass(slots=True, kw_only=True)
class CommEvent:
    """One collective with its stamps in ms since the step began."""

    op: str
    nbytes: int
    group_size: int
    module: int
    is_async: bool
    issue: float
    ret: float
    waits: list[tuple[float, float]] = field(default_factory=list)
    total_ms: float | None = None
    peer: int | None = None  # point-to-point: the other rank
    phase: str | None = None  # set for pipeline transfers: what they carry (forward activations / backward gradients)
    exposed_as: str = "comm_exposed"  # the phase its blocking time counts as (pipeline receives: pipeline_bubble)

    def exposed_intervals(self) -> list[tuple[float, float]]:
        """Where this rank was blocked: the whole call if synchronous, the waits if async; for an async
        point-to-point op the call too (gloo can hold the caller in isend/irecv)."""
        if not self.is_async:
            return [(self.issue, self.ret)]
        if self.peer is not None:
            return [(self.issue, self.ret), *self.waits]
        return list(self.waits)


@dataclass(slots=True, kw_only=True)
class ModuleStep:
    """One module in one step: own windows summed over its calls (inclusive of children)."""

    calls: int = 0  # forward calls (recompute re-runs not counted)
    forward_ms: float = 0.0
    backward_ms: float = 0.0
    recompute_ms: float = 0.0
    recompute_calls: int = 0
    recompute_burst_ms: float = 0.0  # bursts whose outermost re-runs have this module as common ancestor
    recompute_burst_calls: int = 0
    backward_calls: int = 0
    self_comm_ms: float = 0.0  # total time of collectives issued while this module was innermost
    self_comm_exposed_ms: float = 0.0
    self_comm_calls: int = 0
    self_comm_ops: dict[str, int] = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return bool(self.calls or self.recompute_calls or self.backward_calls or self.recompute_burst_calls)


@dataclass(slots=True, kw_only=True)
class StepBreakdown:
    """One step broken down: its phase partition, closure, module windows and collectives (see the module docstring)."""

    wall_ms: float
    phases_ms: dict[str, float]
    unattributed_ms: float
    modules: dict[int, ModuleStep]
    comm: list[dict[str, Any]]


def _pair_windows(events: list[Event], wall_ms: float) -> tuple[
        dict[str, list[tuple[int, float, float]]], list[tuple[float, float, str]]]:
    """Module windows per kind as (module, t0, t1), and phase regions as (t0, t1, label)."""
    open_modules: dict[tuple[str, int], list[float]] = defaultdict(list)
    open_regions: dict[str, list[float]] = defaultdict(list)
    windows: dict[str, list[tuple[int, float, float]]] = {k: [] for k in MODULE_PHASES}
    regions: list[tuple[float, float, str]] = []
    for e in events:
        code, t = e.code, e.at
        if code in MODULE_OPEN:
            open_modules[(MODULE_OPEN[code], e.subject)].append(t)
        elif code in MODULE_CLOSE:
            stack = open_modules.get((MODULE_CLOSE[code], e.subject))
            if stack:
                windows[MODULE_CLOSE[code]].append((e.subject, stack.pop(), t))
        elif code == REGION_OPEN:
            open_regions[e.subject].append(t)
        elif code == REGION_CLOSE:
            stack = open_regions.get(e.subject)
            if stack:
                regions.append((stack.pop(), t, e.subject))
    for (kind, mi), stack in open_modules.items():  # never closed (should not happen): clip at step end
        windows[kind].extend((mi, t0, wall_ms) for t0 in stack)
    for label, stack in open_regions.items():
        regions.extend((t0, wall_ms, label) for t0 in stack)
    return windows, regions


def recompute_bursts(events: list[Event]) -> list[tuple[float, float, list[int]]]:
    """Back-to-back re-run windows merged: (start, end, modules re-run at the outermost level)."""
    bursts: list[tuple[float, float, list[int]]] = []
    depth, start, end, outer = 0, 0.0, 0.0, []
    pending = False  # a burst ended at depth 0; the next event decides whether it continues
    for e in events:
        code = e.code
        if code == R_OPEN:
            if depth == 0:
                if not pending:
                    start, outer = e.at, []
                outer.append(e.subject)
            pending = False
            depth += 1
        elif code == R_CLOSE and depth:
            depth -= 1
            if depth == 0:
                end, pending = e.at, True
        elif pending:
            bursts.append((start, end, outer))
            pending = False
    if pending:
        bursts.append((start, end, outer))
    return bursts


def _common_ancestor(modules: list[int], parents: list[int]) -> int:
    def chain(m: int) -> list[int]:
        out = [m]
        while parents[out[-1]] >= 0:
            out.append(parents[out[-1]])
        return out

    common = chain(modules[0])
    for m in modules[1:]:
        ancestors = set(chain(m))
        common = [c for c in common if c in ancestors]
    return common[0] if common else 0


def analyze_step(events: list[Event], comms: list[CommEvent], wall_ms: float,
                 parents: list[int] | None = None) -> StepBreakdown:
    """Break one step down.

    Args:
        events: the step's timeline in recording order, stamps in ms (analysis.records.Event).
        comms: the step's collectives.
        wall_ms: the step's measured wall time (events lie in [0, wall_ms]).
        parents: parent index per module (-1 for the model), to credit recompute bursts.
    Returns:
        The step's phases, closure, per-module windows and per-(op, phase) collectives.
    """
    windows, regions = _pair_windows(events, wall_ms)
    bursts = recompute_bursts(events)
    exposed = [iv for c in comms for iv in c.exposed_intervals()]
    exposed_labeled = [(a, b, c.exposed_as) for c in comms for a, b in c.exposed_intervals()]
    comm_set = IntervalSet(exposed)
    recompute_or_comm = IntervalSet([(a, b) for a, b, _ in bursts] + exposed)

    modules: dict[int, ModuleStep] = defaultdict(ModuleStep)
    for a, b, outer in bursts:
        distinct = sorted(set(outer))
        if len(distinct) == 1 or parents is not None:
            m = modules[distinct[0] if len(distinct) == 1 else _common_ancestor(distinct, parents)]
            m.recompute_burst_calls += 1
            m.recompute_burst_ms += (b - a) - comm_set.overlap(a, b)
    for mi, a, b in windows["forward"]:
        m = modules[mi]
        m.calls += 1
        m.forward_ms += (b - a) - comm_set.overlap(a, b)
    for mi, a, b in windows["recompute"]:
        m = modules[mi]
        m.recompute_calls += 1
        m.recompute_ms += (b - a) - comm_set.overlap(a, b)
    for mi, a, b in windows["backward"]:
        m = modules[mi]
        m.backward_calls += 1
        m.backward_ms += (b - a) - recompute_or_comm.overlap(a, b)

    labeled = ([(a, b, kind) for kind in ("forward", "backward") for _, a, b in windows[kind]]
               + [(a, b, "recompute") for a, b, _ in bursts] + list(regions))
    without_comm = label_timeline(labeled, PRIORITY, 0.0, wall_ms)
    segments = label_timeline(labeled + exposed_labeled, PRIORITY, 0.0, wall_ms) if exposed_labeled else without_comm
    phases = {p: 0.0 for p in PIPELINE_PHASES}  # pipeline_bubble stays 0 off pipelines
    for a, b, label in segments:
        phases[label] += b - a
    unattributed = wall_ms - sum(phases.values())

    starts = [s[0] for s in without_comm]
    comm_rows: dict[tuple[str, str], dict[str, Any]] = {}
    for c in comms:
        i = bisect.bisect_right(starts, c.issue) - 1
        phase = without_comm[i][2] if i >= 0 and c.issue < without_comm[i][1] else "other"
        phase = c.phase or phase
        exposed_ms = sum(b - a for a, b in c.exposed_intervals())
        row = comm_rows.setdefault((c.op, phase), {"op": c.op, "phase": phase, "calls": 0, "bytes": 0,
                                                   "total_ms": 0.0, "exposed_ms": 0.0, "group_size": c.group_size})
        if c.peer is not None:
            row["peer"] = c.peer
        row["calls"] += 1
        row["bytes"] += c.nbytes
        row["exposed_ms"] += exposed_ms
        row["group_size"] = max(row["group_size"], c.group_size)
        if row["total_ms"] is not None:
            row["total_ms"] = None if c.total_ms is None else row["total_ms"] + c.total_ms
        if c.module >= 0:
            m = modules[c.module]
            m.self_comm_calls += 1
            m.self_comm_exposed_ms += exposed_ms
            m.self_comm_ms += c.total_ms if c.total_ms is not None else exposed_ms
            m.self_comm_ops[c.op] = m.self_comm_ops.get(c.op, 0) + 1
    return StepBreakdown(wall_ms=wall_ms, phases_ms=phases, unattributed_ms=unattributed, modules=dict(modules),
                         comm=list(comm_rows.values()))
