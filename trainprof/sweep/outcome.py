"""What a finished cell left behind: a metrics row read from its profile.json, or a failure record
(which rank failed, how, with what memory, by which signal).

profile.json is read defensively: a field another part of trainprof has not written yet (phases,
FLOPs, MFU, collectives) becomes null with a reason, never an error.

Failure evidence, most specific first:
  1. the launcher's own timeout                                   -> kind timeout
  2. torchrun's "Root Cause" block naming a rank killed by a signal, with no failure file of its own
                                                                  -> kind killed, that rank and signal
  3. failure-rank<N>.json files written by the ranks (trainprof.run record_failure): oom first, then
     error, then interrupted; the earliest written within a kind (the others usually fail because of it)
  4. torchrun's Root Cause block with an exit code, or the last line of the log
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

from trainprof.phases import PHASES
from trainprof.io import dig
from trainprof.report.rundir import run_peak_memory
from trainprof.sweep.launch import GRACE_S, Launch

_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
_ANY_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*exitcode\s*:\s*(-?\d+)")
_KIND_ORDER = {"oom": 0, "error": 1, "interrupted": 2}


def find_run_dir(cell_dir: Path) -> Path | None:
    """The run dir trainprof.run made under the cell's output dir (the newest if several)."""
    dirs = [p for p in cell_dir.iterdir() if p.is_dir() and (p / "recipe.yaml").is_file()] if cell_dir.is_dir() else []
    return max(dirs, key=lambda p: p.stat().st_mtime) if dirs else None


def _peak_memory(summary: dict[str, Any], env: dict[str, Any]) -> tuple[int | None, str | None]:
    """(bytes, method): the run's peak memory as its report states it (report/rundir.py run_peak_memory: the
    runner's lifetime peak, highest rank, else the largest per-phase peak), so a sweep row and the run's
    report.md give one figure."""
    peak = run_peak_memory(summary)
    if peak is None:
        return None, None
    if summary.get("peak_memory_bytes_max"):
        meter = summary.get("memory_meter") or env.get("memory_meter") or "meter not recorded"
        return peak, f"peak over the run, highest rank (the run report's peak memory): {meter}"
    method = summary.get("peak_memory_method") or env.get("memory_meter") or "method not recorded"
    return peak, f"largest phase peak (the run report's peak memory): {method}"


def step_counts(profile: dict[str, Any]) -> tuple[int | None, int | None]:
    """(measured, traced): how many measured steps the profile lists, and how many of those an operator
    trace (or its Kineto warm-up) or FLOP counting slowed; (None, None) where it lists no steps."""
    steps = [s for s in profile.get("steps") or [] if isinstance(s, dict) and not s.get("warmup")]
    if not steps:
        return None, None
    return len(steps), sum(bool(s.get("instrumented")) for s in steps)


def metrics_row(profile: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """The sweep-table figures of one profile.json.

    Returns:
        (values, methods, null_reasons): values by column; how each figure was measured (copied from
        the profile); why a value is null.
    """
    s = profile.get("summary") or {}
    env = profile.get("env") or {}
    meas = profile.get("measurement") or {}
    values: dict[str, Any] = {}
    methods: dict[str, str] = {}
    why: dict[str, str] = {}

    values["world_size"] = env.get("world_size")
    values["tokens_per_s"] = s.get("tokens_per_s")
    methods["tokens_per_s"] = s.get("tokens_per_s_method") or s.get("tokens_per_s_scope") or \
        "global tokens per optimizer step / median step wall time"
    values["step_ms"] = dig(s, "step_ms", "median")
    # how many steps the figures stand on, and how far apart they were: a few steps' median is no firmer
    values["steps_used"] = s.get("steps_used")
    values["steps_measured"], values["steps_instrumented"] = step_counts(profile)
    lo, hi = dig(s, "step_ms", "min"), dig(s, "step_ms", "max")
    one_step = values["steps_used"] is not None and values["steps_used"] < 2  # min = max: no spread, not 0%
    values["step_spread"] = None if one_step or None in (lo, hi) or not values["step_ms"] else \
        (hi - lo) / values["step_ms"]
    if values["step_spread"] is None:
        why["step_spread"] = "fewer than 2 steps used: no spread to read" if one_step else \
            "profile.json has no step time range"
    methods["step_ms"] = (f"median measured step wall time, {env.get('timer', '?')} timer"
                          + (f" ({meas['timer']})" if meas.get("timer") else ""))
    mem, mem_method = _peak_memory(s, env)
    values["peak_memory_mib"] = None if mem is None else mem / 2**20
    if mem is None:
        why["peak_memory_mib"] = "profile.json has no peak memory"
    else:
        methods["peak_memory_mib"] = mem_method or "unknown meter"
    per_phase = s.get("peak_memory_bytes") if isinstance(s.get("peak_memory_bytes"), dict) else {}
    for phase in ("forward", "backward", "optimizer"):
        v = per_phase.get(phase)
        values[f"peak_{phase}_mib"] = None if v is None else v / 2**20
    if not per_phase:
        why["peak memory by phase"] = "profile.json has no summary.peak_memory_bytes per phase (step profiler off)"
    act = s.get("activation_bytes")
    values["activation_mib"] = None if act is None else act / 2**20
    if act is None:
        why["activation_mib"] = s.get("activation_bytes_reason") or "profile.json has no summary.activation_bytes"
    else:
        methods["activation_mib"] = s.get("activation_bytes_method") or "saved-tensor bytes"
    state = profile.get("model_state_bytes") or {}
    for key, field in (("model_states_mib", "total"), ("optimizer_states_mib", "optimizer_states")):
        values[key] = None if state.get(field) is None else state[field] / 2**20
        if values[key] is None:
            why[key] = "profile.json has no model_state_bytes (older profiler)"
        else:
            methods[key] = f"rank {profile.get('steps_rank', profile.get('rank', 0))}: {state.get('method', 'tensor bytes')}"
    elements = state.get("optimizer_state_elements")
    values["optimizer_states_quantized_frac"] = (
        state["optimizer_state_quantized_elements"] / elements if elements else None)
    if values["optimizer_states_quantized_frac"] is None:
        why["optimizer_states_quantized_frac"] = "profile.json does not count optimizer state elements"
    values["achieved_tflops"] = s.get("achieved_tflops")
    if values["achieved_tflops"] is None:
        why["achieved_tflops"] = s.get("mfu_reason") if "achieved_tflops" in s else \
            "profile.json has no summary.achieved_tflops (FLOPs not counted by this build's profiler)"
    else:
        methods["achieved_tflops"] = "; ".join(t for t in (s.get("flops_convention") or "FLOP convention not stated",
                                                           s.get("achieved_tflops_scope")) if t)
    values["mfu"] = s.get("mfu")
    if values["mfu"] is None:
        why["mfu"] = s.get("mfu_reason") or "profile.json has no summary.mfu"
    else:
        peak = s.get("peak") or {}
        methods["mfu"] = f"model FLOPs / step time / dense peak ({peak.get('source', 'peak source not stated')})"
    phases = s.get("phases_ms")
    for p in PHASES:
        values[f"{p}_ms"] = phases.get(p) if isinstance(phases, dict) else None
    if isinstance(phases, dict):
        methods["phases_ms"] = meas.get("phases") or "per-step phase split, medians over measured steps"
    else:
        why["phases_ms"] = "profile.json has no summary.phases_ms (the step profiler's phases are not in this build)"
    steps = profile.get("steps") or []
    values["loss_last"] = s.get("loss_last", steps[-1].get("loss") if steps and isinstance(steps[-1], dict) else None)
    return values, methods, why


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _log_tail(log: str, lines: int = 60) -> list[str]:
    try:
        return Path(log).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def _last_error_line(tail: list[str]) -> str:
    for line in reversed(tail):
        text = line.strip()
        if re.match(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b", text) and "ChildFailedError" not in text:
            return text[:500]
    return next((t.strip()[:500] for t in reversed(tail) if t.strip()), "")


def _killed(base: dict[str, Any], rank: int, signum: int, aftermath: str = "") -> dict[str, Any]:
    """The record of a rank that a signal ended before it could write a failure file."""
    sig = _signal_name(signum)
    hint = " (the kernel OOM killer sends SIGKILL; check dmesg)" if signum == signal.SIGKILL else ""
    return {**base, "kind": "killed", "rank": rank, "signal": sig, "type": sig, "peak_memory_bytes": None,
            "message": f"rank {rank} was killed by {sig}{hint}{aftermath}"}


def failure_record(launch: Launch, run_dir: Path | None, world_size: int) -> dict[str, Any]:
    """Why a cell failed: {kind, rank, signal, type, message, peak_memory_bytes, exit_code, ranks_*}.

    kind is oom | error | interrupted | killed | timeout; rank and signal are null when unknown.
    """
    files = sorted(run_dir.glob("failure-rank*.json")) if run_dir else []
    failures = []
    for f in files:
        try:
            rec = json.loads(f.read_text())
            rec["_mtime"] = f.stat().st_mtime
            failures.append(rec)
        except (OSError, ValueError):
            continue
    finished = sorted(int(m.group(1)) for f in (run_dir.glob("rank*.json") if run_dir else [])
                      if (m := re.fullmatch(r"rank(\d+)\.json", f.name)))
    failed_ranks = sorted({int(r["rank"]) for r in failures if "rank" in r})
    silent = [r for r in range(world_size) if r not in finished and r not in failed_ranks]
    tail = _log_tail(launch.log)
    text = "\n".join(tail)
    base = {"exit_code": launch.returncode, "ranks_finished": finished, "ranks_with_failure_file": failed_ranks,
            "ranks_silent": silent, "log": launch.log, "elapsed_s": round(launch.elapsed_s, 1)}

    if launch.timed_out:
        limit = f"its timeout of {launch.timeout_s:g} s" if launch.timeout_s is not None else "its timeout"
        peaks = [r["peak_memory_bytes"] for r in failures if r.get("peak_memory_bytes") is not None]
        return {**base, "kind": "timeout", "rank": silent[0] if len(silent) == 1 else None, "signal": None,
                "type": "Timeout", "peak_memory_bytes": max(peaks) if peaks else None,
                "message": f"cell ran past {limit} and was stopped (SIGTERM, SIGKILL after {GRACE_S:g} s); "
                           f"{launch.elapsed_s:.0f} s elapsed from its start until its processes were gone"}
    root = _ROOT_CAUSE.search(text)
    if root:
        rank, code = int(root.group(1)), int(root.group(2))
        if code < 0 and rank not in failed_ranks:
            return _killed(base, rank, -code, "; the other ranks were stopped by torchrun")
    if failures:
        first = min(failures, key=lambda r: (_KIND_ORDER.get(r.get("kind"), 9), r["_mtime"]))
        return {**base, "kind": first.get("kind", "error"), "rank": first.get("rank"), "signal": None,
                "type": first.get("type"), "message": first.get("message", ""),
                "peak_memory_bytes": first.get("peak_memory_bytes")}
    if root or _ANY_FAILURE.search(text):
        m = root or _ANY_FAILURE.search(text)
        rank, code = int(m.group(1)), int(m.group(2))
        sig = _signal_name(-code) if code < 0 else None
        return {**base, "kind": "killed" if sig else "error", "rank": rank, "signal": sig, "type": sig or "Error",
                "peak_memory_bytes": None,
                "message": _last_error_line(tail) or f"rank {rank} exited with code {code}"}
    code = launch.returncode
    sig = _signal_name(-code) if code is not None and code < 0 else None
    if sig and world_size == 1:  # a single rank runs without torchrun: the launcher was the rank
        return _killed(base, 0, -code)
    return {**base, "kind": "killed" if sig else "error", "rank": None, "signal": sig, "type": sig or "Error",
            "peak_memory_bytes": None,
            "message": _last_error_line(tail) or f"the launcher exited with code {code} and no failure record"}
