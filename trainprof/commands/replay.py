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
                        "taken as one of its GPUs): the kernels re-timed by the datasheet ratios (GEMM and attention by "
                        "bf16 peak, the rest by memory bandwidth), the host as fast as the source's; needs the run's "
                        "profile.json beside the trace (its GPU and measured step)")
    p.set_defaults(func=run)
    return p


@dataclasses.dataclass(slots=True, kw_only=True)
class CrossTarget:
    """What --to resolved to, checked before any trace is read."""

    name: str  # as given to --to
    gpu: str  # its accelerator key: itself, or a node template's GPU
    gpus_per_node: int | None  # set for a node template
    rates: DeviceRates
    measured_ms: float  # the source run's median untraced step
    capacity_bytes: float | None  # the target GPU's catalog memory_gb
    confidence: ReplayConfidence  # how far replay was found off on this run or this pair of GPUs


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
    from trainprof.analysis.replay import replay
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
    print(f"{trace}: host gaps x {args.host_scale:g}, device work x {args.device_scale:g} "
          "(replay of the launch timeline against the kernels; see trainprof/analysis/replay.py)")
    faster_host, faster_gpu = f"host x{args.host_scale:g} ms", f"GPU x{args.device_scale:g} ms"
    width = max(12, len(faster_host), len(faster_gpu))
    print(f"{'step':>5} {'traced ms':>10} {'replayed ms':>11} {'GPU busy':>9} {faster_host:>{width}} {faster_gpu:>{width}}"
          "  bound by")
    floored = []  # (step, its GPU what-if) where that stopped at the host
    for s in steps:
        same = replay(s)
        host = replay(s, host_scale=args.host_scale)
        gpu = replay(s, device_scale=lambda op: args.device_scale)
        busy = same.device_busy_ms / same.step_ms
        print(f"{s.step:>5} {s.measured_ms:>10.1f} {same.step_ms:>11.1f} {busy:>9.0%} "
              f"{host.step_ms:>{width}.1f} {gpu.step_ms:>{width}.1f}  {bound_by(busy)}")
        if args.device_scale < 1 and gpu.step_ms <= gpu.host_ms:
            floored.append((s.step, gpu))
    print(f"traced ms: the trace's ProfilerStep span; bound by: GPU where the replayed step keeps it busy "
          f"{HOST_BOUND_BUSY:.0%} or more, else host (the what-if columns do not decide it)")
    if doc is not None and (line := traced_against_untraced(doc)):
        print(line)
    if floored:
        print(host_floor(floored, faster_gpu.removesuffix(" ms"), untraced_median(doc)))
    if target is not None:
        _print_cross_device(steps, target, doc)
    return 0


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
    return CrossTarget(name=to, gpu=gpu, gpus_per_node=resolved.gpus_per_node,
                       rates=rates, measured_ms=doc["summary"]["step_ms"]["median"],
                       capacity_bytes=resolved.memory_bytes(), confidence=confidence)


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


def _print_cross_device(steps: list, target: CrossTarget, doc: dict[str, Any]) -> None:
    """The --to prediction: the measured step carried by the ratio of the replays on the two GPUs, and whether
    the run's measured peak memory fits the target GPU."""
    from trainprof.analysis.replay import cross_device

    rates = target.rates
    pred = cross_device(steps[0], target.measured_ms, rates)
    where = target.gpu if target.gpu == target.name else (
        f"{target.name}, taken as its GPU {target.gpu} (a node template of {target.gpus_per_node}; the replay re-times "
        "one GPU's kernels, not the node's links)")
    misfit = does_not_fit(doc, target)
    print(f"on {where}: {pred.step_ms:.1f} ms a step{', ' + misfit[0] if misfit else ''}; "
          f"{target.confidence.text}; measured here {target.measured_ms:.1f} ms x replay {pred.target.step_ms:.1f} / "
          f"{pred.source.step_ms:.1f} ms (GPU busy {pred.target.device_busy_ms / pred.target.step_ms:.0%}); kernels "
          f"x{rates.compute:.3f} (GEMM, attention) and x{rates.memory:.3f} (the rest) from {rates.source}; the host as "
          "fast as this one's")
    if misfit:
        print(misfit[1])


def does_not_fit(doc: dict[str, Any], target: CrossTarget) -> tuple[str, str] | None:
    """(the note beside the step, how it was compared) when the source run's measured peak memory exceeds the
    target GPU's catalog capacity; None when it does not or either figure is missing. The measured peak is
    compared as it is: no memory model moves it to the target."""
    from trainprof.report.rundir import run_peak_memory

    summary = doc.get("summary") or {}
    peak = run_peak_memory(summary)
    if not peak or not target.capacity_bytes or peak <= target.capacity_bytes:
        return None
    meter = summary.get("memory_meter") if summary.get("peak_memory_bytes_max") else summary.get("peak_memory_method")
    return (f"does not fit: measured peak {peak / GIB:.1f} GiB > {target.capacity_bytes / GIB:.1f} GiB",
            f"memory: the run as traced would not fit {target.gpu}: its measured peak per rank "
            f"({meter or 'meter not recorded'}) against {target.gpu}'s {target.capacity_bytes / GIB:g} GiB "
            "(catalog memory_gb, binary); the peak is compared as measured, not re-planned for the target")
