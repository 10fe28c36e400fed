"""`trainprof scale RECIPE --nproc 1,2,4,8 [--nnodes 1,2]` or `trainprof scale --runs DIR ...`:
throughput and scaling efficiency per world size, and where the lost efficiency went."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainprof.commands.run import positive_int, positive_ints


def _launch_points(args: argparse.Namespace) -> tuple[list[dict], str, Path, bool]:
    """Run the recipe at every world size (as cells of a sweep); returns (points, mode, out dir, interrupted)."""
    import json

    import torch

    from trainprof.errors import UserError
    from trainprof.recipe import check_environment
    from trainprof.sweep.launch import check_launchable
    from trainprof.report.plots import require_matplotlib
    from trainprof.sweep.runner import interrupt_on_sigterm, run_cells
    from trainprof.sweep.scaling import strong_overrides
    from trainprof.sweep.spec import make_cell
    from trainprof.sweep.state import SweepState

    mode = "strong" if args.strong else "weak"
    worlds = sorted({(nn * np_, nn, np_) for nn in args.nnodes for np_ in args.nproc})
    if len({w for w, _, _ in worlds}) < 2:  # before launching anything: one size has nothing to scale against
        raise UserError(f"scaling needs at least two world sizes; --nproc {','.join(map(str, args.nproc))} --nnodes "
                        f"{','.join(map(str, args.nnodes))} give only N={worlds[0][0]}; pass e.g. --nproc 1,2")
    _, base = make_cell(args.recipe, args.overrides, label="base")
    check_environment(base, cuda_available=torch.cuda.is_available())
    n_ref = worlds[0][0]
    cells = []
    for world, nnodes, nproc in worlds:
        extra = strong_overrides(base.train.micro_batch_size, base.train.grad_accum, n_ref, world) if args.strong else []
        label = f"N={world}" + (f" ({nnodes} nodes x {nproc})" if nnodes > 1 else "")
        cell, _ = make_cell(args.recipe, [*args.overrides, *extra], label=label, nproc=nproc, nnodes=nnodes)
        cells.append(cell)
    check_launchable(cells)
    require_matplotlib()
    out = Path(args.out) if args.out else Path("runs") / "scale" / f"{base.output.name}-{mode}"
    state = SweepState(out / "scale.json", kind="scale", name=f"{base.output.name}-{mode}",
                       meta={"recipe": args.recipe, "overrides": args.overrides, "mode": mode,
                             "cell_ids": [c.id for c in cells]})
    interrupt_on_sigterm()
    interrupted = False
    try:
        run_cells(cells, out, state, timeout_s=float(args.timeout), retry_failed=args.retry_failed,
                  desc=f"scale {mode}")
    except KeyboardInterrupt:
        interrupted = True
    points = []
    for c in cells:
        rec = state.get(c.key) or {}
        if rec.get("status") == "done":
            profile = json.loads((Path(rec["run_dir"]) / "profile.json").read_text())
            points.append({"label": c.label, "world_size": c.world_size, "run_dir": rec["run_dir"], "profile": profile})
        elif rec.get("status") == "failed":
            f = rec["failure"]
            print(f"trainprof: {c.label} failed ({f['kind']}: {f['message'][:200]}); left out of the report",
                  file=sys.stderr)
    return points, mode, out, interrupted


def _scale(args: argparse.Namespace) -> int:
    from trainprof.errors import UserError
    from trainprof.sweep.scaling import (analyze, collect_runs, comm_rows, measurement_notes, setting_differences,
                                         write_scale_report)

    differences = []
    if args.runs:
        if args.recipe:
            raise UserError("give either a RECIPE to run or --runs DIR ... to read, not both")
        points = collect_runs(args.runs)
        sizes = [p["world_size"] for p in points]
        dup = sorted({n for n in sizes if sizes.count(n) > 1})
        if dup:
            raise UserError(f"several runs with world size {dup[0]}: "
                            f"{', '.join(p['run_dir'] for p in points if p['world_size'] == dup[0])}; pass one each")
        differences = setting_differences(points)
        if differences and not args.allow_different_settings:
            raise UserError("the runs differ in settings other than the world size: "
                            + "; ".join(d.text() for d in differences)
                            + "; their efficiency would mix those changes with scaling: pass runs of one recipe, or "
                            "--allow-different-settings to compare them anyway")
        for d in differences:
            print(f"trainprof: warning: the runs differ in {d.text()}; compared anyway (--allow-different-settings)",
                  file=sys.stderr)
        for p in points:
            p["label"] = Path(p["run_dir"]).name
        mode = args.mode_label or "as collected (per-rank batch as each run's recipe says)"
        name = (points[0]["profile"].get("recipe") or {}).get("output", {}).get("name") or "runs"
        out = Path(args.out) if args.out else Path("runs") / "scale" / f"{name}-collected"
        interrupted = False
    else:
        if not args.recipe:
            raise UserError("give a RECIPE to run at each --nproc, or --runs DIR ... with existing run dirs")
        points, mode, out, interrupted = _launch_points(args)
        mode = f"{mode} (" + ("global batch fixed at the smallest N's" if mode == "strong"
                              else "per-rank batch fixed") + ")"
    if len(points) < 2:
        print(f"trainprof: scaling needs at least two world sizes that finished; have {len(points)}", file=sys.stderr)
        return 130 if interrupted else 1
    rows, null_notes = analyze(points)
    comms = comm_rows(points)
    notes = measurement_notes(points, mode, differences) + null_notes
    paths = write_scale_report(out, rows, comms, notes, title=f"trainprof scale: {out.name}")
    if not args.no_project:
        paths += _projected(out, points, args.project_to)
    for i, r in enumerate(rows):
        eff = "n/a" if r.get("efficiency") is None else f"{100 * r['efficiency']:.1f}%"
        tput = "n/a" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}"
        baseline = " (the baseline: 100% by definition)" if i == 0 and r.get("efficiency") is not None else ""
        print(f"  N={r['world_size']}: {tput} tokens/s, efficiency {eff}{baseline}", file=sys.stderr)
    for p in paths:
        print(f"  {p}", file=sys.stderr)
    if interrupted:
        print("trainprof: scale interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def _projected(out: Path, points: list[dict], extra: list[int]) -> list[Path]:
    """The "projected" table beside the measured one: from the smallest N's run, every size."""
    import time

    from trainprof.projection.views import project_scaling, write_scaling_projection

    base = min(p["world_size"] for p in points)
    sizes = sorted({p["world_size"] for p in points} | set(extra))
    print(f"trainprof: projecting N={', '.join(map(str, sizes))} from the N={base} run (it calibrates this machine "
          "where the run has no calibration.json, then probes and models each size: minutes, on a busy machine "
          "longer than the runs; --no-project skips it)", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        rows, notes = project_scaling(points, extra, progress=True)
    except Exception as err:  # a projection problem must not lose the measured report
        print(f"trainprof: projected section not written ({type(err).__name__}: {err})", file=sys.stderr)
        return []
    print(f"trainprof: projected in {time.monotonic() - start:.0f} s", file=sys.stderr)
    for r in rows:
        got = "n/a" if r.get("predicted_tokens_per_s") is None else f"{r['predicted_tokens_per_s']:,.0f}"
        err = f", error {r['step_error_pct']:+.1f}%" if r.get("step_error_pct") is not None else ""
        baseline = " (the baseline, projected from itself)" if r["world_size"] == base else ""
        print(f"  N={r['world_size']}: projected {got} tokens/s{err}{baseline}", file=sys.stderr)
    return write_scaling_projection(out, rows, notes, title=f"trainprof scale: {out.name}")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("scale", help="scaling efficiency over world sizes, and where the lost part went",
                       description="Run a recipe at each world size (--nproc per node x --nnodes), or read run dirs "
                       "collected from a cluster (--runs), and report tokens/s, scaling efficiency = tput(N) / "
                       "(N/N0 x tput(N0)), N0 the smallest world size measured, and the lost efficiency split into exposed communication growth, idle, rank "
                       "imbalance, compute slowdown and other, with per-collective bandwidth at each N. Weak scaling "
                       "(fixed per-rank batch) by default. Resumable like `trainprof sweep`.")
    p.add_argument("recipe", nargs="?", help="recipe YAML (omit with --runs)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--nproc", type=positive_ints, default=[1, 2], help="ranks per node, comma-separated (default 1,2)")
    p.add_argument("--nnodes", type=positive_ints, default=[1], help="nodes, comma-separated (default 1; > 1 runs the "
                   "nodes with srun inside a SLURM allocation, see scripts/slurm_scale.sh)")
    p.add_argument("--strong", action="store_true", help="strong scaling: keep the global batch of the smallest N")
    p.add_argument("--runs", nargs="+", metavar="DIR", help="existing run dirs (or dirs holding them), one per "
                   "world size, instead of running the recipe")
    p.add_argument("--mode-label", help="with --runs: how the runs were scaled, for the report (e.g. weak)")
    p.add_argument("--allow-different-settings", action="store_true", help="with --runs: compare runs whose recipes "
                   "differ in more than the world size (and, for strong scaling, the per-rank batch); the report "
                   "lists the differences. Without it such runs are refused")
    p.add_argument("--timeout", type=positive_int, default=1800, help="seconds per world size (default 1800)")
    p.add_argument("--retry-failed", action="store_true", help="run failed world sizes again")
    p.add_argument("--out", help="output dir (default runs/scale/<recipe>-<weak|strong>)")
    p.add_argument("--project-to", type=positive_ints, default=[], help="also project these world sizes from the "
                   "smallest run, e.g. 4,8 (the projected section, scaling_projected.*, is written by default for "
                   "the measured sizes)")
    p.add_argument("--no-project", action="store_true", help="skip the projected section (on by default: it calibrates "
                   "and probes this machine for each size, minutes, on a busy machine longer than the runs)")
    p.set_defaults(func=_scale)
    return p
