"""`trainprof sweep SWEEP.yaml`: run every cell of a sweep file as its own torchrun process and tabulate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainprof.commands.run import positive_int


def _sweep(args: argparse.Namespace) -> int:
    from trainprof.io import atomic_write_text
    from trainprof.sweep.launch import check_launchable
    from trainprof.sweep.report import write_sweep_report
    from trainprof.sweep.runner import interrupt_on_sigterm, run_cells
    from trainprof.sweep.spec import load_sweep
    from trainprof.sweep.state import SweepState
    from trainprof.report.plots import require_matplotlib

    # every cell validated before any runs
    sweep = load_sweep(args.sweep, check_machine=not args.dry_run, extra_overrides=args.overrides)
    timeout = float(args.timeout or sweep.timeout_s)
    out = Path(args.out) if args.out else Path("runs") / "sweeps" / sweep.name
    if args.dry_run:
        print(f"{len(sweep.cells)} cells (base recipe {sweep.recipe_path}), output would go to {out}/")
        for c in sweep.cells:
            print(f"  {c.id:<60} n={c.world_size:<3} {' '.join(c.overrides)}")
        return 0
    check_launchable(sweep.cells)
    require_matplotlib()
    state = SweepState(out / "sweep.json", kind="sweep", name=sweep.name,
                       meta={"sweep_file": sweep.path, "recipe": sweep.recipe_path, "timeout_s": timeout,
                             "cell_ids": [c.id for c in sweep.cells]})
    atomic_write_text(out / "sweep.yaml", Path(sweep.path).read_text())
    interrupt_on_sigterm()
    interrupted = False
    try:
        run_cells(sweep.cells, out, state, timeout_s=timeout, retry_failed=args.retry_failed, desc=sweep.name)
    except KeyboardInterrupt:
        interrupted = True
    records = [state.get(c.key) for c in sweep.cells]
    paths = write_sweep_report(out, sweep, records)
    done = sum(bool(r) and r["status"] == "done" for r in records)
    failed = sum(bool(r) and r["status"] == "failed" for r in records)
    print(f"sweep {sweep.name}: {done} done, {failed} failed, {len(records) - done - failed} not finished "
          f"of {len(records)} cells", file=sys.stderr)
    for p in paths:
        print(f"  {p}", file=sys.stderr)
    if interrupted:
        print("trainprof: sweep interrupted; finished cells are kept in "
              f"{state.path}; run the same command again to resume", file=sys.stderr)
        return 130
    # a cell out of memory is a finding of the table (it does not fit); any other failure is the sweep's
    broken = [c.label for c, r in zip(sweep.cells, records)
              if r and r["status"] == "failed" and (r.get("failure") or {}).get("kind") != "oom"]
    if broken:
        print(f"trainprof: exit status 1: {len(broken)} cell(s) failed other than out of memory "
              f"({', '.join(broken)}); see their failure in results.md, --retry-failed runs them again",
              file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("sweep", help="run a grid of recipe variants, one torchrun process per cell",
                       description="Run every cell of a sweep file (a base recipe plus a list and/or matrix of "
                       "overrides, see recipes/sweeps/ and docs/sweeps.md) as its own torchrun process and write "
                       "results.{md,csv,html,png}. Resumable: finished cells (done or failed) are not run again; "
                       "re-run the same command after an interruption. Exit status 0 when every cell finished or ran out of "
                       "memory (a result: it does not fit), 1 when a cell failed otherwise (error, killed, timeout), "
                       "130 when interrupted.")
    p.add_argument("sweep", help="sweep YAML file")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every cell last, e.g. train.steps=2 "
                   "for a quick pass (they change the cells' keys: such cells are separate from the full ones)")
    p.add_argument("--out", help="output dir (default runs/sweeps/<sweep name>); holds sweep.json, the state")
    p.add_argument("--timeout", type=positive_int, help="seconds per cell (default: the sweep file's timeout_s, "
                   "else 1800); a cell running longer is killed and recorded as timeout")
    p.add_argument("--retry-failed", action="store_true", help="run failed cells again too")
    p.add_argument("--dry-run", action="store_true", help="validate and list the cells, run nothing "
                   "(skips the machine checks, so GPU sweeps can be checked on a laptop)")
    p.set_defaults(func=_sweep)
    return p
