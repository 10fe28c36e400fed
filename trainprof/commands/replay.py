"""`trainprof replay TRACE_OR_RUN_DIR`: a traced GPU step rebuilt from its host's launches and its kernels
(trainprof/analysis/replay.py), then again with a faster host and a faster GPU: which side bounds it."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("replay", help="what-if on a traced GPU step: a faster host, a faster GPU",
                       description=__doc__)
    p.add_argument("path", help="a Kineto trace (*.pt.trace.json[.gz]), a run dir whose tb/ holds rank 0's, or a "
                                "profiles/ folder")
    p.add_argument("--host-scale", type=float, default=0.5,
                   help="the host's own work x this (default 0.5: a host twice as fast)")
    p.add_argument("--device-scale", type=float, default=0.5,
                   help="every kernel, copy and memset x this (default 0.5: a GPU twice as fast)")
    p.add_argument("--to", metavar="HARDWARE",
                   help="also predict the step on this catalog GPU (e.g. h200): the kernels re-timed by the datasheet "
                        "ratios (GEMM and attention by bf16 peak, the rest by memory bandwidth), the host as fast as "
                        "the source's; needs the run's profile.json beside the trace (its GPU and measured step)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from trainprof.analysis.replay import load_steps, replay
    from trainprof.analysis.trace import find_traces
    from trainprof.errors import UserError

    path = Path(args.path)
    if not path.exists():
        raise UserError(f"'{path}' does not exist: give a trace file, a run dir or a profiles/ folder")
    # a file; a run dir (tb/<run>/rank0.*); a profiles/ folder (rank0.* beside profile.json)
    found = [path] if path.is_file() else [*sorted(path.glob("rank0.*.pt.trace.json*")), *find_traces(path)]
    traces = [t for t in found if t.name.startswith("rank0.")]
    if not traces:
        raise UserError(f"'{path}': no rank 0 trace in it or in its tb/; run with profile.ops=true")
    if args.host_scale <= 0 or args.device_scale <= 0:
        raise UserError("--host-scale and --device-scale must be > 0")
    steps = load_steps(traces[0])
    if not steps or not any(s.ops for s in steps):
        raise UserError(f"'{traces[0]}' has no traced step with GPU work (a CPU run's trace cannot be replayed)")
    print(f"{traces[0]}: host gaps x {args.host_scale:g}, device work x {args.device_scale:g} "
          "(replay of the launch timeline against the kernels; see trainprof/analysis/replay.py)")
    faster_host, faster_gpu = f"host x{args.host_scale:g} ms", f"GPU x{args.device_scale:g} ms"
    width = max(12, len(faster_host), len(faster_gpu))
    print(f"{'step':>5} {'traced ms':>10} {'replayed ms':>11} {'GPU busy':>9} {faster_host:>{width}} {faster_gpu:>{width}}"
          "  bound by")
    for s in steps:
        same = replay(s)
        host = replay(s, host_scale=args.host_scale)
        gpu = replay(s, device_scale=lambda op: args.device_scale)
        bound = "host" if host.step_ms < gpu.step_ms else "GPU" if gpu.step_ms < host.step_ms else "both"
        print(f"{s.step:>5} {s.measured_ms:>10.1f} {same.step_ms:>11.1f} {same.device_busy_ms / same.step_ms:>9.0%} "
              f"{host.step_ms:>{width}.1f} {gpu.step_ms:>{width}.1f}  {bound}")
    if args.to:
        _print_cross_device(path, steps, args.to)
    return 0


def _print_cross_device(path: Path, steps: list, to: str) -> None:
    """The --to prediction: the measured step carried by the ratio of the replays on the two GPUs."""
    from trainprof.analysis.replay import cross_device, device_rates
    from trainprof.errors import UserError
    from trainprof.hardware import CatalogError, find_accelerator, load_catalog
    from trainprof.io import profile_file, read_json

    profile = profile_file(path) or profile_file(path.parent)
    if profile is None:
        raise UserError(f"'{path}': --to needs the run's profile.json beside the trace (its GPU and measured step)")
    doc = read_json(profile)
    catalog = load_catalog()
    device = (doc.get("env") or {}).get("device") or ""
    key = find_accelerator(catalog, device)
    if key is None:
        raise UserError(f"{profile}: its GPU '{device}' is not in the hardware catalog; add it (--catalog) to re-time "
                        "its kernels")
    try:
        rates = device_rates(catalog.resolve(key), catalog.resolve(to))
    except (CatalogError, ValueError) as e:
        raise UserError(f"--to {to}: {e}") from None
    measured = doc["summary"]["step_ms"]["median"]
    pred = cross_device(steps[0], measured, rates)
    print(f"on {to}: {pred.step_ms:.1f} ms a step (measured here {measured:.1f} ms x replay {pred.target.step_ms:.1f}"
          f" / {pred.source.step_ms:.1f} ms; GPU busy {pred.target.device_busy_ms / pred.target.step_ms:.0%}); "
          f"kernels x{rates.compute:.3f} "
          f"(GEMM, attention) and x{rates.memory:.3f} (the rest) from {rates.source}; the host as fast as this one's. "
          "Measured error: docs/projection.md (replay_cases)")
