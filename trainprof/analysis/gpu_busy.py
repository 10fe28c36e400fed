"""How busy the GPU was in each phase of a step: device (kernel) time over the phase's wall time, and the
rest, the GPU idle while its host prepares work (Python, hooks, engine bookkeeping, kernel launches).
Zhang et al. (arXiv 2311.03687, Figure 5) found 5-10% of a step idle at micro batch 1.

Two sources, the same Kineto events:
- the operator table (profile.json `ops`): on a CUDA run each row's self_ms is the device self time of
  the traced step(s)' operators, attributed to the trainprof phase range they ran in; divided by the
  phase's median ms over the untraced steps (CUDA events on the GPU stream, so a phase's wall time is
  GPU-timeline time). Kernels on several streams at once can add up past the phase: capped at 1.
- the Kineto trace itself (`trace_device_time`): the union of the kernel, memcpy and memset intervals,
  which counts overlapping streams once; a cross-check of the operator table's sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprof.analysis.trace import STEP_MARKER, iter_events, op_name
from trainprof.layout import TRACES_HOW


# below this share of a step (or phase) kept busy by its kernels, the GPU waited for its host: host-bound
HOST_BOUND_BUSY = 0.8
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")  # Kineto's device-side activity categories
HOST_OPS = ("cpu_op", "user_annotation")  # what launches device work (the runtime calls share their External id)
METHOD = ("busy = device self time of the traced step's operators in the phase (profile.json ops, torch.profiler/"
          "Kineto kernel + memcpy + memset time, per traced step) / the phase's median ms over the untraced "
          "measured steps (summary.phases_ms, CUDA events); idle = 1 - busy: the GPU waiting for its host. "
          "Capped at 1 where kernels on several streams overlap; the traced step itself is slower and is not "
          "the denominator.")


@dataclass(slots=True, kw_only=True)
class PhaseBusy:
    phase: str  # a profile phase, or "step" for the whole step
    wall_ms: float  # median ms of the phase per step
    device_ms: float  # device self time of its operators per traced step
    busy_frac: float | None  # device_ms / wall_ms, capped at 1; None when wall_ms is 0
    capped: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"wall_ms": self.wall_ms, "device_ms": self.device_ms, "busy_frac": self.busy_frac,
                "idle_frac": None if self.busy_frac is None else 1.0 - self.busy_frac, "capped": self.capped}


def _busy(phase: str, wall_ms: float, device_ms: float) -> PhaseBusy:
    if wall_ms <= 0:
        return PhaseBusy(phase=phase, wall_ms=wall_ms, device_ms=device_ms, busy_frac=None)
    frac = device_ms / wall_ms
    return PhaseBusy(phase=phase, wall_ms=wall_ms, device_ms=device_ms, busy_frac=min(frac, 1.0), capped=frac > 1.0)


def device_ms_by_phase(profile: dict[str, Any]) -> dict[str, float]:
    """Device self ms per phase per traced step, from the operator table of a CUDA profile."""
    traced = len((profile.get("ops_info") or {}).get("steps") or []) or 1
    out: dict[str, float] = {}
    for row in profile.get("ops") or []:
        phase = row.get("phase") or "other"
        out[phase] = out.get(phase, 0.0) + float(row.get("self_ms") or 0.0) / traced
    return out


def phase_busy(profile: dict[str, Any]) -> tuple[list[PhaseBusy] | None, str | None]:
    """Busy share of the step and of each phase, or (None, why it cannot be given).

    Args:
        profile: a profile.json document (merged or one rank's).
    Returns:
        ([the step first, then each phase that took time or ran kernels], None), or (None, reason).
    """
    env, s = profile.get("env") or {}, profile.get("summary") or {}
    if env.get("device_type") != "cuda":
        return None, (f"the device is {env.get('device_type') or 'not recorded'}: the operator table's self time is "
                      "host time there, not kernel time, so the GPU's busy share is not defined")
    info = profile.get("ops_info") or {}
    if not profile.get("ops") or not info.get("steps"):
        return None, ("no operator trace (tracing off, or no traced step): the GPU's kernel time per phase comes "
                      f"from the traced step; trace one with {TRACES_HOW}")
    step_ms = (s.get("step_ms") or {}).get("median")
    phases = s.get("phases_ms") or {}
    if not step_ms or not phases:
        return None, "the profile has no median step or phase times (profiler off?)"
    device = device_ms_by_phase(profile)
    rows = [_busy("step", float(step_ms), sum(device.values()))]
    for phase in [*phases, *(p for p in device if p not in phases)]:
        wall, dev = float(phases.get(phase) or 0.0), device.get(phase, 0.0)
        if wall > 0 or dev > 0:
            rows.append(_busy(phase, wall, dev))
    return rows, None


def gpu_busy_fields(profile: dict[str, Any]) -> dict[str, Any]:
    """profile.json `gpu_busy` (and `gpu_busy_reason`): the step's and each phase's busy share."""
    rows, reason = phase_busy(profile)
    if rows is None:
        return {"gpu_busy": None, "gpu_busy_reason": reason}
    return {"gpu_busy": {"method": METHOD, "traced_steps": list((profile.get("ops_info") or {}).get("steps") or []),
                         "step": rows[0].as_dict(), "phases": {r.phase: r.as_dict() for r in rows[1:]}},
            "gpu_busy_reason": None}


@dataclass(slots=True, kw_only=True)
class TraceDeviceTime:
    """Device activity in one Kineto trace file (all its ProfilerStep ranges)."""

    steps: list[int]  # ProfilerStep#N numbers in the file
    device_ms: float  # sum of the kernel / memcpy / memset durations
    union_ms: float  # their union: the time at least one ran (overlapping streams counted once)
    by_category: dict[str, float]  # category -> summed ms
    step_ms: float  # summed duration of the ProfilerStep ranges (host side)
    outside_ops_ms: float  # device time launched by no operator (a library calling the driver itself)
    op_kernels: frozenset[str] = frozenset()  # names of the device events an operator launched


def trace_device_time(path: str | Path) -> TraceDeviceTime:
    """Sum and union of the device activity in a trace, streamed (the file is never loaded whole)."""
    intervals: list[tuple[float, float]] = []
    by_cat: dict[str, float] = {}
    steps: list[int] = []
    step_us = 0.0
    origin: float | None = None
    launched_by: dict[Any, str] = {}  # External id -> the host event's name
    device_by_launcher: dict[Any, float] = {}
    names_by_launcher: dict[Any, set[str]] = {}
    for ev in iter_events(path):
        if ev.get("ph") != "X":
            continue
        cat, ts, dur = ev.get("cat") or "", float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
        if cat in DEVICE_CATEGORIES:
            # from the first device event on: an epoch-scale ts (~5e12 us) plus dur rounds in the last bits
            origin = ts if origin is None else origin
            intervals.append((ts - origin, ts - origin + dur))
            by_cat[cat] = by_cat.get(cat, 0.0) + dur / 1e3
            ext = (ev.get("args") or {}).get("External id")
            device_by_launcher[ext] = device_by_launcher.get(ext, 0.0) + dur / 1e3
            names_by_launcher.setdefault(ext, set()).add(ev.get("name", ""))
        elif cat != "gpu_user_annotation":  # Kineto mirrors each step marker on the GPU's timeline
            if cat in HOST_OPS and "External id" in (ev.get("args") or {}):
                launched_by[ev["args"]["External id"]] = ev.get("name", "")
            m = STEP_MARKER.match(ev.get("name", ""))
            if m:
                steps.append(int(m.group(1)))
                step_us += dur
    by_op = {ext for ext in device_by_launcher if op_name(launched_by.get(ext, "")) is not None}
    outside = sum(ms for ext, ms in device_by_launcher.items() if ext not in by_op)
    op_kernels = frozenset(name for ext in by_op for name in names_by_launcher[ext])
    return TraceDeviceTime(steps=steps, device_ms=sum(by_cat.values()), union_ms=union_us(intervals) / 1e3,
                           by_category=by_cat, step_ms=step_us / 1e3, outside_ops_ms=outside, op_kernels=op_kernels)


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The time covered by at least one of the intervals (us), overlaps counted once."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total
