"""One rank's profile: per-step breakdowns rolled up over the module tree (self times, inclusive
recompute and communication) and summarised over steps (medians), with FLOPs, memory and collectives.

Which steps count: the summary and module medians use the measured steps that ran without extra
instrumentation (the FLOP-counting step and operator-traced steps are slower by construction); when
every step was instrumented they use all of them and `summary.steps_used` says so.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from trainprof.analysis.bandwidth import bandwidth_gbps
from trainprof.analysis.breakdown import CommEvent, ModuleStep, StepBreakdown, analyze_step
from trainprof.phases import PIPELINE_PHASES
from trainprof.analysis.pipeline import step_pipeline
from trainprof.analysis.records import Event, ModuleInfo

SCHEMA_VERSION = 1
_TIME_FIELDS = ("forward_ms", "backward_ms", "recompute_ms", "self_forward_ms", "self_backward_ms",
                "self_recompute_ms", "comm_ms", "comm_exposed_ms", "self_comm_ms")
_COUNT_FIELDS = ("calls", "recompute_calls", "comm_calls", "self_comm_calls")


@dataclass
class StepRecord:
    """What the profiler keeps of one recorded step. `breakdown`, `loss` and `pipeline` are filled in by
    `complete_step` from the step's timeline (the Profiler does that when its steps are read)."""

    step: int
    breakdown: StepBreakdown | None
    loss: float | None = None
    tokens: int | None = None
    memory: dict[str, int] = field(default_factory=dict)
    instrumented: list[str] = field(default_factory=list)  # "flops", "ops", "trace_warmup"
    warmup: bool = False
    pipeline: dict[str, Any] | None = None  # pipeline stage: this step's timeline (analysis/pipeline.py)


@dataclass(slots=True, kw_only=True)
class StepTimeline:
    """A recorded step as the hooks left it, stamps resolved to ms since the step began: kept until
    `complete_step` analyses it, so the analysis runs after training rather than between its steps."""

    codes: list[int]  # the profiler log's columns (profiler/log.py StepLog), in recording order
    subjects: list[Any]
    ms: list[float]  # the stamps, in ms since the step began
    comms: list[CommEvent]
    wall_ms: float
    losses: list[float] = field(default_factory=list)  # the micro batches' losses
    origin_unix_ns: int | None = None  # pipeline stages: time.time_ns() of the step's start
    pipelined: bool = False  # a pipeline stage: keep the stage timeline (analysis/pipeline.py)

    def events(self) -> list[Event]:
        """The timeline's points as Events, in recording order."""
        return [Event(code, subject, t) for code, subject, t in zip(self.codes, self.subjects, self.ms)]


def complete_step(record: StepRecord, timeline: StepTimeline, parents: list[int] | None) -> None:
    """Fill `record` in from its timeline: the breakdown, the mean loss, a pipeline stage's timeline.

    Args:
        record: the step as the profiler recorded it.
        timeline: its events and collectives.
        parents: parent index per profiled module (to credit recompute bursts), None without modules.
    """
    events = timeline.events()
    record.breakdown = analyze_step(events, timeline.comms, timeline.wall_ms, parents=parents)
    if timeline.pipelined:
        record.pipeline = step_pipeline(events, timeline.comms, timeline.origin_unix_ns)
    record.loss = statistics.fmean(timeline.losses) if timeline.losses else None


def _median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _mean(values: list[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def module_tree_step(infos: list[ModuleInfo], mods: dict[int, ModuleStep]) -> dict[int, dict[str, float]]:
    """Roll one step's module windows up the tree.

    A module's parent for self times is its nearest ancestor that ran this step (containers such as
    ModuleList never run themselves). Recompute is inclusive: a module's own re-run windows, or, when
    it was not re-run itself, the sum over its children. Communication is inclusive of children.

    Args:
        infos: the profiled modules, parents before children.
        mods: this step's windows per module index.
    Returns:
        module index -> row of the per-step fields (modules that did not run are absent).
    """
    active = [i in mods and mods[i].active for i in range(len(infos))]
    parent_of = []
    for info in infos:
        p = info.parent
        while p != -1 and not active[p]:
            p = infos[p].parent
        parent_of.append(p)
    children: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    rows: dict[int, dict[str, float]] = {}
    for i in reversed(range(len(infos))):
        if not active[i]:
            continue
        m, kids = mods[i], children[i]
        if m.recompute_burst_calls:  # the module's forward re-run as a whole (see breakdown: bursts)
            recompute = m.recompute_burst_ms
        elif m.recompute_calls:  # re-run inside an ancestor's re-run: its own windows
            recompute = m.recompute_ms
        else:
            recompute = kids["recompute_ms"]
        row = {
            "calls": m.calls,
            "recompute_calls": m.recompute_burst_calls or m.recompute_calls,
            "forward_ms": m.forward_ms,
            "backward_ms": m.backward_ms,
            "recompute_ms": recompute,
            "self_forward_ms": m.forward_ms - kids["forward_ms"],
            "self_backward_ms": m.backward_ms - kids["backward_ms"],
            "self_recompute_ms": recompute - kids["recompute_ms"],
            "comm_ms": m.self_comm_ms + kids["comm_ms"],
            "comm_exposed_ms": m.self_comm_exposed_ms + kids["comm_exposed_ms"],
            "comm_calls": m.self_comm_calls + kids["comm_calls"],
            "self_comm_ms": m.self_comm_ms,
            "self_comm_calls": m.self_comm_calls,
            "self_comm_ops": dict(m.self_comm_ops),
        }
        rows[i] = row
        p = parent_of[i]
        if p >= 0:
            for key in ("forward_ms", "backward_ms", "recompute_ms", "comm_ms", "comm_exposed_ms", "comm_calls"):
                children[p][key] += row[key]
    return rows


def select_steps(steps: list[StepRecord]) -> tuple[list[StepRecord], str]:
    """The steps the medians use, and a description of them that names the trace warm-up step (traced and
    discarded before the operator trace) only where the run had one, as left out or kept."""
    measured = [s for s in steps if not s.warmup]
    clean = [s for s in measured if not s.instrumented]
    trace_warmup = sum("trace_warmup" in s.instrumented for s in measured)
    warmup = ("its trace warm-up step" if trace_warmup == 1 else f"its {trace_warmup} trace warm-up steps")
    if clean:
        return clean, ("measured steps without FLOP counting or operator tracing"
                       + (f" ({warmup} left out too)" if trace_warmup else ""))
    return measured, ("all measured steps (every one was instrumented: FLOP counting and/or operator tracing"
                      + (f"; {warmup} kept" if trace_warmup else "") + ")")


def module_rows(infos: list[ModuleInfo], steps: list[StepRecord],
                flops_by_module: dict[int, dict[str, int]] | None) -> list[dict[str, Any]]:
    """Per-module medians over steps (a step in which a module did not run counts as zeros)."""
    per_step = [module_tree_step(infos, s.breakdown.modules) for s in steps]
    out = []
    for info in infos:
        seen = [rows[info.index] for rows in per_step if info.index in rows]
        if not seen:
            continue
        n_missing = len(per_step) - len(seen)
        row: dict[str, Any] = {"name": info.name, "type": info.type, "depth": info.depth,
                               "parent": infos[info.parent].name if info.parent >= 0 else None}
        for key in _COUNT_FIELDS:
            row[key] = int(round(_median([r[key] for r in seen] + [0] * n_missing)))
        for key in _TIME_FIELDS:
            row[key] = _median([r[key] for r in seen] + [0.0] * n_missing)
        ops: dict[str, int] = defaultdict(int)
        for r in seen:
            for op, n in r["self_comm_ops"].items():
                ops[op] += n
        row["self_comm_ops"] = {op: n / len(per_step) for op, n in sorted(ops.items())}
        flops = (flops_by_module or {}).get(info.index)
        row["flops"] = flops["total"] if flops else None
        row["flops_by_phase"] = {k: v for k, v in flops.items() if k != "total"} if flops else None
        row["params"] = info.params
        row["params_trainable"] = info.params_trainable
        row["params_local"] = info.params_local
        out.append(row)
    return out


def comm_rows(steps: list[StepRecord]) -> list[dict[str, Any]]:
    """Per-(op, phase) medians over steps (0 for a step that ran none) with algbw/busbw by the nccl-tests
    formulas (see comm.py); `steps` counts the steps that ran it, so a one-off collective is told from none."""
    keys: dict[tuple[str, str], int] = {}
    for s in steps:
        for r in s.breakdown.comm:
            keys[(r["op"], r["phase"])] = max(keys.get((r["op"], r["phase"]), 1), r["group_size"])
    out = []
    for (op, phase), group_size in sorted(keys.items()):
        rows = [next((r for r in s.breakdown.comm if r["op"] == op and r["phase"] == phase), None) for s in steps]
        present = [r for r in rows if r is not None]
        missing = len(rows) - len(present)
        totals = [r["total_ms"] for r in present]
        total = None if any(t is None for t in totals) else _median(totals + [0.0] * missing)
        nbytes = _median([r["bytes"] for r in present] + [0] * missing)
        algbw, busbw = bandwidth_gbps(op, nbytes, total / 1e3 if total else None, group_size)
        peers = {r["peer"] for r in present if r.get("peer") is not None}
        out.append({
            "op": op, "phase": phase, "group_size": group_size,
            "calls": int(round(_median([r["calls"] for r in present] + [0] * missing))),
            "steps": len(present),
            "bytes": int(nbytes),
            "total_ms": total,
            "exposed_ms": _median([r["exposed_ms"] for r in present] + [0.0] * missing),
            "algbw_gbps": algbw,
            "busbw_gbps": busbw,
            **({"peer": min(peers)} if len(peers) == 1 else {}),
        })
    return out


def flops_by_module(infos: list[ModuleInfo], counts: dict[tuple[int, str], int]) -> dict[int, dict[str, int]]:
    """Inclusive FLOPs per module and phase from counts attributed to the innermost module."""
    own: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (mi, phase), n in counts.items():
        if mi >= 0:
            own[mi][phase] += n
    inclusive: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for info in reversed(infos):
        for phase, n in own[info.index].items():
            inclusive[info.index][phase] += n
        if info.parent >= 0:
            for phase, n in inclusive[info.index].items():
                inclusive[info.parent][phase] += n
    result = {}
    for i, phases in inclusive.items():
        row = {p: int(phases.get(p, 0)) for p in ("forward", "backward", "recompute")}
        row["total"] = int(sum(phases.values()))
        result[i] = row
    return result


def summarize(steps_used: list[StepRecord], all_steps: list[StepRecord], *, flops: dict[str, Any] | None,
              flops_convention: str, memory_method: str | None, peak: dict[str, Any] | None,
              peak_reason: str) -> dict[str, Any]:
    """The `summary` block of one rank's profile."""
    walls = [s.breakdown.wall_ms for s in steps_used]
    median_ms = _median(walls)
    tokens = [s.tokens for s in steps_used if s.tokens]
    fracs = [s.breakdown.unattributed_ms / s.breakdown.wall_ms for s in steps_used if s.breakdown.wall_ms > 0]
    summary: dict[str, Any] = {
        "steps_used": len(steps_used),
        "step_ms": {"min": min(walls) if walls else None, "median": median_ms if walls else None,
                    "max": max(walls) if walls else None},
        "tokens_per_step": _median(tokens) if tokens else None,
        "tokens_per_s": (_median(tokens) / (median_ms / 1e3)) if tokens and median_ms else None,
        "phases_ms": {p: _median([s.breakdown.phases_ms[p] for s in steps_used]) for p in PIPELINE_PHASES},
        "unattributed_ms": _median([s.breakdown.unattributed_ms for s in steps_used]),
        "unattributed_frac": _median(fracs) if fracs else None,
        "unattributed_frac_max": max(fracs) if fracs else None,
    }
    summary.update(flops_summary(flops, median_ms, peak, peak_reason))
    summary["flops_convention"] = flops_convention
    measured = [s for s in all_steps if not s.warmup] or all_steps
    peaks = {}
    for phase in ("forward", "backward", "optimizer"):
        values = [s.memory[phase] for s in measured if phase in s.memory]
        peaks[phase] = max(values) if values else None
    summary["peak_memory_bytes"] = peaks
    summary["peak_memory_method"] = memory_method
    return summary


def flops_summary(flops: dict[str, Any] | None, median_ms: float, peak: dict[str, Any] | None,
                  peak_reason: str) -> dict[str, Any]:
    """FLOPs per step, achieved TFLOP/s and MFU (null with a reason when no peak is known)."""
    out: dict[str, Any] = {}
    if not flops:
        out.update(flops_per_step=None, model_flops_per_step=None, achieved_tflops=None, mfu=None,
                   mfu_reason="FLOPs were not counted (no FLOP-counting step ran)")
        return out
    total = flops["total"]
    model = total - flops["by_phase"].get("recompute", 0)
    seconds = median_ms / 1e3 if median_ms else None
    out["flops_per_step"] = total
    out["flops_by_phase"] = flops["by_phase"]
    out["model_flops_per_step"] = model
    out["flops_uncounted_ops"] = flops.get("uncounted", {})
    out["achieved_tflops"] = total / seconds / 1e12 if seconds else None
    out["model_tflops"] = model / seconds / 1e12 if seconds else None
    analytic = flops.get("analytic")
    out["analytic"] = analytic
    if analytic and analytic.get("flops_per_step"):
        out["measured_over_analytic"] = model / analytic["flops_per_step"]
    if peak is not None and seconds:
        out["mfu"] = model / seconds / 1e12 / peak["tflops"]
        out["mfu_reason"] = None
        out["peak"] = peak
    else:
        out["mfu"] = None
        out["mfu_reason"] = peak_reason or "no step time"
        out["peak"] = None
    return out


def step_entries(steps: list[StepRecord]) -> list[dict[str, Any]]:
    return [{
        "step": s.step,
        "wall_ms": s.breakdown.wall_ms,
        "loss": s.loss,
        "tokens": s.tokens,
        "unattributed_ms": s.breakdown.unattributed_ms,
        "phases_ms": dict(s.breakdown.phases_ms),
        "peak_memory_bytes": {p: s.memory.get(p) for p in ("forward", "backward", "optimizer")},
        "warmup": s.warmup,
        "instrumented": list(s.instrumented),
    } for s in steps]


def rank_entry(rank: int, steps_used: list[StepRecord]) -> dict[str, Any]:
    """Per-rank medians used by the merge and the straggler test. `busy_ms` is the step minus the time
    spent blocked in collectives, waiting for data and (pipeline stages) waiting for a neighbour: the
    rank's own work. The means are kept too: unlike medians they add up (each step's phases and its
    unattributed time sum to its wall time), which the projection's split of a step needs."""
    walls = [s.breakdown.wall_ms for s in steps_used]
    busy = [s.breakdown.wall_ms - s.breakdown.phases_ms["comm_exposed"] - s.breakdown.phases_ms["data_wait"]
            - s.breakdown.phases_ms.get("pipeline_bubble", 0.0) for s in steps_used]
    return {
        "rank": rank,
        "step_ms_median": _median(walls),
        "busy_ms_median": _median(busy),
        "phases_ms": {p: _median([s.breakdown.phases_ms[p] for s in steps_used]) for p in PIPELINE_PHASES},
        "unattributed_ms": _median([s.breakdown.unattributed_ms for s in steps_used]),
        "step_ms_mean": _mean(walls),
        "phases_ms_mean": {p: _mean([s.breakdown.phases_ms[p] for s in steps_used]) for p in PIPELINE_PHASES},
        "unattributed_ms_mean": _mean([s.breakdown.unattributed_ms for s in steps_used]),
    }
