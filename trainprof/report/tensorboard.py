"""TensorBoard scalars per measured step, written next to the Kineto traces (<run_dir>/tb/<run name>/, see
scalars_logdir) so one `tensorboard --logdir <run_dir>/tb` shows the profiler plugin's views and these
series together, as one run under one name.

Series (x axis = the profile's step number; warm-up steps are left out):
    step/wall_ms, step/tokens_per_s (all ranks, as the summary), step/achieved_tflops (rank 0's), step/loss,
    step/instrumented (1 on a step slowed by FLOP counting or operator tracing)
    phase/<phase>_ms for data_wait, forward, backward, recompute, optimizer, comm_exposed, other,
    unattributed; comm/exposed_ms and comm/exposed_frac (exposed communication over the step)
    memory/peak_<phase>_mib (forward, backward, optimizer; or the step's peak in older run dirs)
    telemetry/<metric>_{mean,max}: NVML telemetry per step on a GPU (report/gpu.py)
    module/<name>/{forward,backward,recompute}_ms for the top modules by self time, when the profile
    has per-step module times (steps[].modules_ms); otherwise their medians as text in the summary

Written with tensorboard's own event writer and protos: no torch or TensorFlow import.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainprof.analysis.records import module_label
from trainprof.analysis.trace import is_trace_file
from trainprof.layout import tb_run_dir
from trainprof.report.gpu import telemetry_series
from trainprof.report.rundir import report_phases, step_peak_memory, step_tflops, step_tokens_per_s, top_modules

SCALARS_SUFFIX = ".trainprof"  # our event files end in this; rewriting replaces only them
TOP_MODULES = 8


def scalar_series(profile: dict[str, Any], top: int = TOP_MODULES) -> dict[str, list[tuple[int, float]]]:
    """The scalar series of a profile: tag -> [(step, value)], measured steps only.

    Args:
        profile: a profile.json document (any version; absent fields give no series).
        top: how many modules get per-step series.
    """
    series: dict[str, list[tuple[int, float]]] = {}

    def add(tag: str, step: int, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            series.setdefault(tag, []).append((step, float(value)))

    modules = [m["name"] for m in top_modules(profile, top)]
    ranks = _all_ranks_factor(profile.get("summary") or {})
    for s in profile.get("steps") or []:
        if s.get("warmup") or s.get("step", 0) < 0:
            continue
        n = int(s["step"])
        add("step/wall_ms", n, s.get("wall_ms"))
        tps = step_tokens_per_s(s)
        add("step/tokens_per_s", n, tps * ranks if tps is not None else None)
        add("step/achieved_tflops", n, step_tflops(profile, s))
        add("step/loss", n, s.get("loss"))
        if "instrumented" in s:
            add("step/instrumented", n, 1.0 if s["instrumented"] else 0.0)
        phases = s.get("phases_ms") or {}
        for phase in report_phases(profile):
            add(f"phase/{phase}_ms", n, phases.get(phase))
        if phases:
            add("phase/unattributed_ms", n, s.get("unattributed_ms"))
            exposed = phases.get("comm_exposed")
            add("comm/exposed_ms", n, exposed)
            if exposed is not None and s.get("wall_ms"):
                add("comm/exposed_frac", n, exposed / s["wall_ms"])
        for phase, nbytes in step_peak_memory(s).items():
            add(f"memory/peak_{phase}_mib", n, None if nbytes is None else nbytes / 2**20)
        per_module = s.get("modules_ms") or {}
        for name in modules:
            times = per_module.get(name)
            if times is None:
                continue
            label = module_label(name)
            for i, phase in enumerate(("forward", "backward", "recompute")):
                add(f"module/{label}/{phase}_ms", n, times[i] if isinstance(times, list) else times.get(phase))
    series.update(telemetry_series(profile))
    return series


def _all_ranks_factor(summary: dict[str, Any]) -> float:
    """All ranks' tokens per step over rank 0's (a step's own record is rank 0's): the scalar is then the
    run's tokens/s, as its summary counts them; 1 for a one-rank run."""
    everyone, own = summary.get("tokens_per_step_all_ranks"), summary.get("tokens_per_step")
    slowest = ((summary.get("across_ranks") or {}).get("step_ms_median") or {}).get("max")
    if everyone is None and summary.get("tokens_per_s") and slowest:  # merged before that field: its inverse
        everyone = summary["tokens_per_s"] * slowest / 1e3
    return everyone / own if everyone and own else 1.0


def _summary_text(profile: dict[str, Any], run_name: str) -> str:
    """Markdown shown in TensorBoard's Text tab: how the scalars were measured."""
    meas = profile.get("measurement") or {}
    s = profile.get("summary") or {}
    lines = [f"**trainprof run {run_name}**", "",
             "- wall time (TensorBoard's relative axis): each step at its end on a clock of the steps' own wall_ms, "
             "warm-up included; the time between steps is not in it, the report's writing time ends the last"]
    for key in ("timer", "phases", "comm_exposed", "memory", "steps_used"):
        if key in meas:
            lines.append(f"- {key}: {meas[key]}")
    if s.get("tokens_per_s_scope") or s.get("tokens_per_s_method"):
        per_step = ("all ranks' tokens of the step (rank 0's x "
                    f"{_all_ranks_factor(s):g}) / rank 0's wall time of it" if _all_ranks_factor(s) != 1 else
                    "tokens of the step / its wall time")
        lines.append(f"- tokens/s: per step, {per_step}; the run's figure: "
                     f"{s.get('tokens_per_s_scope') or s.get('tokens_per_s_method')}")
    if s.get("flops_convention"):
        lines.append(f"- achieved TFLOP/s: FLOPs counted on one step / each step's wall time; {s['flops_convention']}")
    mods = top_modules(profile, TOP_MODULES)
    if mods and not any((st.get("modules_ms") for st in profile.get("steps") or [])):
        lines += ["", "Top modules by self time (median per step, ms; this profile has no per-step module times):", "",
                  "| module | forward | backward | recompute |", "|---|---|---|---|"]
        lines += [f"| {module_label(m['name'])} | {m.get('forward_ms', 0):.3f} | {m.get('backward_ms', 0):.3f} | "
                  f"{m.get('recompute_ms', 0):.3f} |" for m in mods]
    return "\n".join(lines)


def step_end_times(profile: dict[str, Any], last_end: float) -> dict[int, float]:
    """Step -> the wall time its event carries: its end on a clock of the steps' own wall_ms (warm-up
    included), the last ending at `last_end`, so that TensorBoard's relative axis reads the time training took
    (the profile keeps no clock times of its steps; time between them, outside any step, is not in it)."""
    steps = [s for s in profile.get("steps") or [] if isinstance(s.get("wall_ms"), (int, float))]
    total = sum(s["wall_ms"] for s in steps) / 1e3
    out, elapsed = {}, 0.0
    for s in steps:
        elapsed += s["wall_ms"] / 1e3
        out[int(s["step"])] = last_end - total + elapsed
    return out


def _holds_traces(folder: Path) -> bool:
    return folder.is_dir() and any(is_trace_file(p) for p in folder.iterdir())


def scalars_logdir(run_dir: str | Path) -> Path:
    """Where a run's scalars go: beside its traces, so TensorBoard lists traces and scalars as one run. That
    is tb/<run name>/ (layout.tb_run_dir); tb/ itself where the traces sit there (written before the per-run
    folder); or the one tb/<name>/ holding traces under another name, as in a run dir renamed or copied
    after the run (its traces keep the name they were written under)."""
    tb, own = Path(run_dir) / "tb", tb_run_dir(run_dir)
    if not tb.is_dir() or _holds_traces(own):
        return own
    if _holds_traces(tb):
        return tb
    holders = [d for d in sorted(tb.iterdir()) if _holds_traces(d)]
    return holders[0] if len(holders) == 1 else own


def write_tensorboard_scalars(profile: dict[str, Any], run_dir: str | Path) -> Path:
    """Write the scalar series (and a text note on how they were measured) beside the run's traces, in
    `scalars_logdir(run_dir)`.

    Replaces event files this function wrote before (suffix .trainprof), so re-running a report does
    not duplicate points; the Kineto traces are left alone.

    Args:
        profile: the merged profile.json document.
        run_dir: the run directory.
    Returns:
        The event file written.
    """
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.compat.proto.tensor_pb2 import TensorProto
    from tensorboard.compat.proto.tensor_shape_pb2 import TensorShapeProto
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    tb = Path(run_dir) / "tb"
    logdir = scalars_logdir(run_dir)
    logdir.mkdir(parents=True, exist_ok=True)
    for old in [*tb.glob(f"events.out.tfevents.*{SCALARS_SUFFIX}"), *tb.glob(f"*/events.out.tfevents.*{SCALARS_SUFFIX}")]:
        old.unlink()
        if old.parent not in (tb, logdir) and not any(old.parent.iterdir()):
            old.parent.rmdir()  # a folder left empty would stay in the logdir under a name no run has
    writer = EventFileWriter(str(logdir), filename_suffix=SCALARS_SUFFIX)
    wall = time.time()
    ends = step_end_times(profile, wall)
    by_step: dict[int, list[Any]] = {}
    for tag, points in scalar_series(profile).items():
        for step, value in points:
            by_step.setdefault(step, []).append(summary_pb2.Summary.Value(tag=tag, simple_value=value))
    for step in sorted(by_step):
        writer.add_event(event_pb2.Event(wall_time=ends.get(step, wall), step=step,
                                         summary=summary_pb2.Summary(value=by_step[step])))
    text = _summary_text(profile, Path(run_dir).name).encode("utf-8")
    meta = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    tensor = TensorProto(dtype=7, string_val=[text], tensor_shape=TensorShapeProto())  # 7 = DT_STRING
    writer.add_event(event_pb2.Event(wall_time=wall, step=0, summary=summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag="trainprof/how_measured", metadata=meta, tensor=tensor)])))
    writer.close()
    return next(logdir.glob(f"events.out.tfevents.*{SCALARS_SUFFIX}"))
