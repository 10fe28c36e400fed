"""`trainprof replay TRACE_OR_RUN_DIR`: a traced GPU step rebuilt from its host's launches and its kernels
(trainprof/analysis/replay.py), then again with a faster host and a faster GPU: which side bounds it."""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainprof.analysis.replay import DeviceRates, Replayed, ReplayConfidence, TracedStep

from trainprof.analysis.gpu_busy import HOST_BOUND_BUSY

GIB = 2**30


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("replay", help="what-if on a traced GPU step: a faster host, a faster GPU",
                       description=__doc__)
    p.add_argument("path", help="a Kineto trace (*.pt.trace.json[.gz], replayed whatever its name), a run dir whose "
                                "tb/ holds rank 0's, or a profiles/ folder")
    p.add_argument("--host-scale", type=float, default=0.5,
                   help="the host's own work x this (default 0.5: a host twice as fast)")
    p.add_argument("--device-scale", type=float, default=0.5,
                   help="every kernel, copy and memset x this (default 0.5: a GPU twice as fast)")
    p.add_argument("--to", metavar="HARDWARE",
                   help="also predict the step on this catalog GPU (e.g. h200; a node template such as hgx-h100 is "
                        "taken as one of its GPUs): the kernels re-timed by the catalog's ratios (GEMM and attention by "
                        "MAMF where both GPUs have one, else bf16 dense peak; the rest by memory bandwidth), the host "
                        "as fast as the source's as traced (at its "
                        "untraced pace beside it where profile.json bounds that); needs the run's profile.json beside "
                        "the trace (its GPU and measured step)")
    p.set_defaults(func=run)
    return p


@dataclasses.dataclass(slots=True, kw_only=True)
class CrossTarget:
    """What --to resolved to, checked before any trace is read."""

    name: str  # as given to --to
    gpu: str  # its accelerator key: itself, or a node template's GPU
    source_gpu: str  # the source run's accelerator key
    gpus_per_node: int | None  # set for a node template
    rates: DeviceRates
    measured_ms: float  # the source run's median untraced step
    capacity_bytes: float | None  # the target GPU's catalog memory_gb
    confidence: ReplayConfidence  # how far replay was found off on this run or this pair of GPUs
    project_host: str | None  # the host `trainprof project` assumes for this target, in words


def _trace_of(path: Path) -> Path:
    """The trace to replay: a file as given (whatever its name); in a run dir (tb/<run>/rank0.*) or a profiles/
    folder (rank0.* beside profile.json), rank 0's."""
    from trainprof.errors import UserError
    from trainprof.report.rundir import run_traces

    if not path.exists():
        raise UserError(f"'{path}' does not exist: give a trace file, a run dir or a profiles/ folder")
    if path.is_file():
        return path
    if (path / "inference.json").is_file():
        raise UserError(f"'{path}' is a `trainprof infer` run: replay rebuilds a training step from a GPU training "
                        "run's trace (profile.ops=true); open an inference trace with `trainprof tb`")
    traces = [t for t in run_traces(path) if t.name.startswith("rank0.")]
    if not traces:
        raise UserError(f"'{path}': no rank 0 trace in it or in its tb/; run with profile.ops=true")
    return traces[0]


def _load_steps(trace: Path) -> list[TracedStep]:
    """The trace's steps with GPU work, or a one-line UserError naming the file."""
    from trainprof.analysis.replay import load_steps
    from trainprof.analysis.trace import TraceFormatError
    from trainprof.errors import UserError

    try:
        steps = load_steps(trace)
    except TraceFormatError as e:
        raise UserError(f"{e}: not a readable Kineto trace (*.pt.trace.json[.gz]); give one a run wrote with "
                        "profile.ops=true, or copy it again if it was cut short") from None
    if not steps:
        raise UserError(f"'{trace}': no ProfilerStep# markers, so not a Kineto trace of training steps; give one a "
                        "run wrote with profile.ops=true")
    if not any(s.ops for s in steps):
        raise UserError(f"'{trace}' has no traced step with GPU work (a CPU run's trace cannot be replayed)")
    return steps


def run(args: argparse.Namespace) -> int:
    from trainprof.analysis.replay import untraced_pace
    from trainprof.errors import UserError
    from trainprof.io import profile_file, read_json

    path = Path(args.path)
    trace = _trace_of(path)
    if args.host_scale <= 0 or args.device_scale <= 0:
        raise UserError("--host-scale and --device-scale must be > 0")
    profile = profile_file(path) or profile_file(path.parent)
    doc = read_json(profile) if profile else None
    target = _cross_target(args.to, path, profile, doc) if args.to else None  # a bad --to fails before any output
    steps = _load_steps(trace)
    untraced_ms = untraced_median(doc)
    print(f"{trace}: host gaps x {args.host_scale:g}, device work x {args.device_scale:g} "
          "(replay of the launch timeline against the kernels; see trainprof/analysis/replay.py)")
    faster_host, faster_gpu = f"host x{args.host_scale:g} ms", f"GPU x{args.device_scale:g} ms"
    width = max(12, len(faster_host), len(faster_gpu))
    print(f"{'step':>5} {'traced ms':>10} {'replayed ms':>11} {'GPU busy':>9} {faster_host:>{width}} {faster_gpu:>{width}}"
          "  bound by")
    floored = []  # (step, its GPU what-if) where that stopped at the host
    paced = []  # (step, pace, its what-ifs) at the untraced host's pace, where profile.json bounds it
    for s in steps:
        same, host, gpu = what_ifs(s, args.host_scale, args.device_scale)
        busy = same.device_busy_ms / same.step_ms
        print(f"{s.step:>5} {s.measured_ms:>10.1f} {same.step_ms:>11.1f} {busy:>9.0%} "
              f"{host.step_ms:>{width}.1f} {gpu.step_ms:>{width}.1f}  {bound_by(busy)}")
        if args.device_scale < 1 and gpu.step_ms <= gpu.host_ms:
            floored.append((s.step, gpu))
        if untraced_ms and (pace := untraced_pace(s, untraced_ms)) < 1:
            paced.append((s.step, pace, what_ifs(s, args.host_scale, args.device_scale, pace=pace)))
    print(f"traced ms: the trace's ProfilerStep span; bound by: GPU where the replayed step keeps it busy "
          f"{HOST_BOUND_BUSY:.0%} or more, else host (the what-if columns do not decide it)")
    if doc is not None and (line := traced_against_untraced(doc)):
        print(line)
    if floored:
        print(host_floor(floored, faster_gpu.removesuffix(" ms"), untraced_ms))
    names = (faster_host.removesuffix(" ms"), faster_gpu.removesuffix(" ms"))
    for n, pace, replayed in paced:
        print(at_untraced_pace(n, pace, replayed, names, untraced_ms))
    print(what_if_mark(*names, floor=args.device_scale < 1, paced=bool(paced)))
    if target is not None:
        pace = next((pace for n, pace, _ in paced if n == steps[0].step), 1.0)
        _print_cross_device(steps, target, doc, pace)
    return 0


def what_ifs(step: TracedStep, host_scale: float, device_scale: float, *,
             pace: float = 1.0) -> tuple[Replayed, Replayed, Replayed]:
    """The step replayed as it ran, with the host's own work x host_scale, and with the device work x device_scale;
    the host's own work x `pace` in all three (1.0: the traced host; below: the untraced one's, `untraced_pace`)."""
    from trainprof.analysis.replay import replay

    return (replay(step, host_scale=pace), replay(step, host_scale=pace * host_scale),
            replay(step, host_scale=pace, device_scale=lambda op: device_scale))


def at_untraced_pace(step: int, pace: float, replayed: tuple[Replayed, Replayed, Replayed], names: tuple[str, str],
                     untraced_ms: float) -> str:
    """One line: a step's what-ifs with its host at the untraced pace, the answer for the run as it runs untraced."""
    same, host, gpu = replayed
    return (f"at the untraced host's pace (step {step}), the answer for this run untraced: replayed {same.step_ms:.1f} "
            f"ms, '{names[0]}' {host.step_ms:.1f} ms, '{names[1]}' {gpu.step_ms:.1f} ms, each at most this: the host's "
            f"own work x{pace:.3f}, the slowest pace that issues the step within the untraced median step, "
            f"{untraced_ms:.1f} ms (profile.json); the table is the traced host's")


def what_if_mark(faster_host: str, faster_gpu: str, *, floor: bool, paced: bool) -> str:
    """One line under the table: how far its what-if columns were checked (never), and what floors the GPU's."""
    line = (f"'{faster_host}' and '{faster_gpu}' are unvalidated: no run on a host or a GPU that much faster was "
            "measured against them (only --to's GPU pairs were: validation_gpu.json replay_cases)")
    if not floor:
        return line
    host = ("the host's at the untraced pace (the line above), the table's at the traced host's, which tracing slows"
            if paced else "the traced host's (tracing slows the host; profile.json does not bound by how much here)")
    return line + f"; '{faster_gpu}' goes no lower than the time its host takes to issue the step: {host}"


def _cross_target(to: str, path: Path, profile: Path | None, doc: dict[str, Any] | None) -> CrossTarget:
    """--to resolved against the catalog and the run's profile.json, or a one-line UserError."""
    from trainprof.analysis.replay import device_rates, replay_confidence
    from trainprof.errors import UserError
    from trainprof.hardware import CatalogError, find_accelerator, load_catalog
    from trainprof.projection.validation import gpu_validation

    catalog = load_catalog()
    if to not in catalog.accelerators and to not in catalog.nodes:
        raise UserError(f"--to {to}: hardware '{to}' is not in the catalog; `trainprof hardware` lists the keys "
                        "(GPUs such as h200, h100-sxm)")
    if doc is None:
        raise UserError(f"'{path}': --to needs the run's profile.json beside the trace (its GPU and measured step)")
    device = (doc.get("env") or {}).get("device") or ""
    source = find_accelerator(catalog, device)
    if source is None:
        raise UserError(f"{profile}: its GPU '{device}' is not in the hardware catalog (trainprof/hardware.yaml); "
                        "add it there to re-time its kernels")
    try:
        # a node template is priced and projected per GPU elsewhere (projection/prices.py); a replay re-times one GPU
        resolved = catalog.resolve(to)
        gpu = catalog.accelerator_key(resolved) or to
        rates = device_rates(catalog.resolve(source), catalog.resolve(gpu))
    except (CatalogError, ValueError) as e:
        raise UserError(f"--to {to}: {e}") from None
    # the replay cases name their sources by their profiles/ folder, the one holding profile.json
    confidence = replay_confidence(gpu_validation().get("replay_cases") or [], profile.parent.name, source, gpu)
    return CrossTarget(name=to, gpu=gpu, source_gpu=source, gpus_per_node=resolved.gpus_per_node,
                       rates=rates, measured_ms=doc["summary"]["step_ms"]["median"],
                       capacity_bytes=resolved.memory_bytes(), confidence=confidence,
                       project_host=project_host(doc, catalog, source, gpu))


def project_host(doc: dict[str, Any], catalog: Any, source_gpu: str, target_gpu: str) -> str | None:
    """The host `trainprof project` assumes for the source run on `target_gpu`, per forward operator call, as its
    projector's _gpu_host picks it (same engine): the run's own where its forward was host-bound; on its own GPU
    kind at most what its device-bound forward left; else the catalog's reference host. None without an operator
    trace or a reference."""
    from trainprof.projection.hostref import host_us_and_ceiling
    from trainprof.projection.machines import gpu_host

    own, ceiling = host_us_and_ceiling(doc)
    if "forward" in own:
        return f"this run's own host, {own['forward']:.1f} µs per forward operator call (its forward was host-bound)"
    engine = (doc.get("recipe") or {}).get("engine") or {}
    reference = gpu_host(catalog, engine.get("kind") or "", engine.get("zero_stage") or 0)[0].get("forward")
    if source_gpu == target_gpu and "forward" in ceiling and (reference is None or ceiling["forward"] < reference):
        return f"this run's host, at most {ceiling['forward']:.1f} µs per forward operator call (its device-bound forward)"
    if reference is None:
        return None
    return (f"the target's catalog reference host, {reference:.1f} µs per forward operator call (gpu_host_us_per_op), "
            "not this one")


def bound_by(busy: float | None) -> str:
    """Which side a step waits on, by the share of it its GPU was busy (the bar the projection uses too)."""
    if busy is None:
        return "n/a"
    return "GPU" if busy >= HOST_BOUND_BUSY else "host"


def untraced_median(doc: dict[str, Any] | None) -> float | None:
    """The run's median untraced step (profile.json summary), None without one."""
    return (((doc or {}).get("summary") or {}).get("step_ms") or {}).get("median")


def host_floor(floored: list[tuple[int, Replayed]], what_if: str, untraced_ms: float | None) -> str:
    """One line: the GPU what-if stopped at the traced host's time, and how much tracing inflated that host where
    profile.json says (the untraced step holds all of the untraced host's issuing, so it bounds that host)."""
    hosts = ", ".join(f"{r.host_ms:.1f} ms (step {n})" for n, r in floored)
    line = (f"'{what_if}' stops at the traced host: it took {hosts} to issue the step's work, a floor no faster GPU "
            "goes under in this replay")
    host_ms = max(r.host_ms for _, r in floored)
    if untraced_ms is None:
        return line + "; how much tracing inflated that host is not known (no profile.json beside the trace)"
    if host_ms <= untraced_ms:
        return (line + f"; how much tracing inflated that host is not known: the untraced median step, "
                f"{untraced_ms:.1f} ms (profile.json), is longer than it, so does not bound it")
    return (line + f"; tracing inflated that host by at least {host_ms / untraced_ms - 1:+.0%}: the untraced median "
            f"step, {untraced_ms:.1f} ms (profile.json), holds all of the untraced host's issuing, so untraced the "
            "floor is lower")


def traced_against_untraced(doc: dict[str, Any]) -> str | None:
    """One line: the traced step against the untraced median, both from profile.json, and the untraced GPU busy
    share; None when the profile lacks either step figure."""
    traced_ids = set((doc.get("ops_info") or {}).get("steps") or [])
    traced = [s["wall_ms"] for s in doc.get("steps") or [] if s.get("step") in traced_ids and s.get("wall_ms")]
    summary = doc.get("summary") or {}
    untraced = (summary.get("step_ms") or {}).get("median")
    if not traced or not untraced:
        return None
    traced_ms = statistics.median(traced)
    busy = ((doc.get("gpu_busy") or {}).get("step") or {}).get("busy_frac")
    busy_text = (f"; untraced, the GPU is busy {busy:.1%} (gpu_busy.step): {bound_by(busy)}-bound"
                 if busy is not None else "")
    return (f"'bound by' is the traced step's: profile.json's timer gives it {traced_ms:.1f} ms, "
            f"{traced_ms / untraced - 1:+.0%} on the untraced median {untraced:.1f} ms of "
            f"{summary.get('steps_used', '?')} measured steps (tracing slows the host){busy_text}")


def _print_cross_device(steps: list, target: CrossTarget, doc: dict[str, Any], pace: float) -> None:
    """The --to prediction: the measured step carried by the ratio of the replays on the two GPUs with the host
    as traced (what the replay cases validate); where profile.json bounds the untraced host (`pace` < 1), the
    same at the untraced pace beside it; and whether the run's measured peak memory fits the target GPU."""
    from trainprof.analysis.replay import cross_device

    rates = target.rates
    pred = cross_device(steps[0], target.measured_ms, rates)
    where = target.gpu if target.gpu == target.name else (
        f"{target.name}, taken as its GPU {target.gpu} (a node template of {target.gpus_per_node}; the replay re-times "
        "one GPU's kernels, not the node's links)")
    misfit = does_not_fit(doc, target)
    paced = ""
    if pace < 1:
        # on the replay cases the untraced pace was further off where the source was GPU-bound (docs/projection.md)
        at = cross_device(steps[0], target.measured_ms, rates, pace=pace)
        paced = (f"; at the untraced host's pace (its own work x{pace:.3f}, the slowest that fits the untraced median "
                 f"step) {at.step_ms:.1f} ms, unvalidated and not the answer: the replay cases, measured, came out "
                 "further off at that pace from GPU-bound sources (docs/projection.md)")
    print(f"on {where}: {pred.step_ms:.1f} ms a step{', ' + misfit[0] if misfit else ''}; "
          f"{target.confidence.text}{paced}; measured here {target.measured_ms:.1f} ms x replay "
          f"{pred.target.step_ms:.1f} / {pred.source.step_ms:.1f} ms (GPU busy "
          f"{pred.target.device_busy_ms / pred.target.step_ms:.0%}); kernels x{rates.compute:.3f} (GEMM, attention) and "
          f"x{rates.memory:.3f} (the rest) from {rates.source}; {host_assumed(pred.target.host_ms, pace, target, doc)}")
    if misfit:
        print(misfit[1])


def host_assumed(host_ms: float, pace: float, target: CrossTarget, doc: dict[str, Any]) -> str:
    """The --to line's host: this one's as traced, per operator call, beside the host `trainprof project` assumes,
    so that the two commands' steps can be set side by side."""
    from trainprof.projection.measured import measured_from_profile

    bound = (f"tracing inflated it: untraced, its own work is at most x{pace:.3f} of this" if pace < 1 else
             f"its untraced pace not known: the untraced median step, {target.measured_ms:.1f} ms, does not bound it")
    text = f"the host as fast as this one's as traced ({bound}): {host_ms:.1f} ms to issue the step's work on {target.gpu}"
    calls = sum(o.calls for o in (measured_from_profile(doc).ops or {}).values())
    if calls:
        text += f", {host_ms / calls * 1e3:.1f} µs per operator call ({calls:,.0f} calls a step, profile.json)"
    if target.project_host:
        text += f"; `trainprof project` assumes {target.project_host}"
    return text


def does_not_fit(doc: dict[str, Any], target: CrossTarget) -> tuple[str, str] | None:
    """(the note beside the step, how it was compared) when the source run's measured peak memory exceeds the
    target GPU's catalog capacity, or the share of it `trainprof project --best` leaves a setting (HEADROOM: CUDA
    gets less than the datasheet's memory); None when it stays within that or either figure is missing. The
    measured peak is compared as it is: no memory model moves it to the target."""
    from trainprof.projection.best import HEADROOM
    from trainprof.report.rundir import run_peak_memory

    summary = doc.get("summary") or {}
    peak, capacity = run_peak_memory(summary), target.capacity_bytes
    if not peak or not capacity or peak <= HEADROOM * capacity:
        return None
    meter = summary.get("memory_meter") if summary.get("peak_memory_bytes_max") else summary.get("peak_memory_method")
    compared = (f"its measured peak per rank ({meter or 'meter not recorded'}) against {target.gpu}'s "
                f"{capacity / GIB:g} GiB (catalog memory_gb, binary); the peak is compared as measured, not re-planned "
                "for the target")
    if peak > capacity:
        return (f"does not fit: measured peak {peak / GIB:.1f} GiB > {capacity / GIB:.1f} GiB",
                f"memory: the run as traced would not fit {target.gpu}: {compared}")
    return (f"may not fit: measured peak {peak / GIB:.1f} GiB > {HEADROOM:.0%} of {capacity / GIB:.1f} GiB",
            f"memory: the run as traced leaves under {1 - HEADROOM:.0%} of {target.gpu}'s memory free: {compared}; "
            f"CUDA gets less than the datasheet's figure (an H200's 141 GiB offered about 139: hardware.py "
            f"memory_bytes), so `trainprof project --best` counts a setting as fitting within {HEADROOM:.0%} "
            "of it")
