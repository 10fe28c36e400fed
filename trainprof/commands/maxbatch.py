"""`trainprof maxbatch RECIPE|SWEEP.yaml`: the largest micro batch that fits, per configuration."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainprof.commands.run import non_negative_int, positive_int


def _maxbatch(args: argparse.Namespace) -> int:
    import torch

    from trainprof.errors import UserError
    from trainprof.recipe import check_environment
    from trainprof.sweep.launch import check_launchable
    from trainprof.report.plots import require_matplotlib
    from trainprof.sweep.maxbatch import SearchInterrupted, run_search, write_maxbatch_report
    from trainprof.sweep.runner import interrupt_on_sigterm
    from trainprof.sweep.spec import is_sweep_file, load_sweep, make_cell
    from trainprof.sweep.state import SweepState

    if args.start > args.max:
        raise UserError(f"--start {args.start} is larger than --max {args.max}; lower --start or raise --max")
    # configurations: (label, recipe path, overrides, nproc, nnodes), all validated before anything runs
    if is_sweep_file(args.target):
        if args.overrides:
            raise UserError("overrides go into the sweep file's `overrides:` list, not on the command line")
        if args.nproc is not None:
            raise UserError(f"--nproc {args.nproc} applies to a recipe; a sweep file sets its ranks per try with "
                            "`nproc:` (top level, or per cell), not on the command line")
        sweep = load_sweep(args.target)
        configs = [(c.label, c.recipe_path, c.overrides, c.nproc, c.nnodes) for c in sweep.cells]
        name, timeout = sweep.name, float(args.timeout or sweep.timeout_s)
    else:
        nproc = args.nproc or 1
        _, recipe = make_cell(args.target, args.overrides, label="check", nproc=nproc)
        check_environment(recipe, cuda_available=torch.cuda.is_available())
        label = " ".join(args.overrides) or Path(args.target).stem
        configs = [(label, args.target, list(args.overrides), nproc, 1)]
        name, timeout = recipe.output.name, float(args.timeout or 1800)
    cuda = torch.cuda.is_available()
    for label, path, overrides, nproc, nnodes in configs:  # the largest try validates and launches too
        cell, recipe = make_cell(path, [*overrides, f"train.micro_batch_size={args.max}"], label=label, nproc=nproc,
                                 nnodes=nnodes)
        check_launchable([cell])
        if not cuda and recipe.train.memory_cap_gb is None and not args.no_cap:
            raise UserError(_no_cap_message(label if len(configs) > 1 else None, nproc * nnodes, args.max))
    require_matplotlib()
    out = Path(args.out) if args.out else Path("runs") / "maxbatch" / name
    state = SweepState(out / "maxbatch.json", kind="maxbatch", name=name,
                       meta={"target": args.target, "start": args.start, "max": args.max, "steps": args.steps})
    interrupt_on_sigterm()
    rows, interrupted = [], False
    from tqdm import tqdm

    from trainprof.env import progress_interval

    try:
        for label, path, overrides, nproc, nnodes in tqdm(configs, desc=f"maxbatch {name}", unit="config",
                                                          file=sys.stderr, disable=len(configs) == 1,
                                                          mininterval=progress_interval()):
            print(f"trainprof: max batch of '{label}' on {nproc * nnodes} rank(s)", file=sys.stderr)
            rows.append(run_search(path, overrides, label=label, nproc=nproc, nnodes=nnodes, out_dir=out, state=state,
                                   timeout_s=timeout, start=args.start, limit=args.max, steps=args.steps))
    except SearchInterrupted as stopped:  # the tries that finished still say something: best so far, marked partial
        rows.append(stopped.row)
        interrupted = True
    except KeyboardInterrupt:
        interrupted = True
    notes = [
        "a try is a fresh process (torchrun for several ranks) with train.micro_batch_size set, profile.ops=false "
        "(an operator-traced step runs slower)"
        + (f", train.steps={args.steps} and train.warmup_steps=1" if args.steps else "")
        + "; it fits when it finishes all its steps",
        "does not fit: failure kind oom (CUDA out of memory, or on CPU peak RSS over train.memory_cap_gb, checked "
        "after each step) or a rank killed by SIGKILL (the kernel OOM killer's signal)",
        f"search: doubling from {args.start} until a failure (or --max {args.max}), then bisection between the "
        "last fit and the first failure",
        "tokens/s, step ms and peak memory are those of the try at the max; memory meter as in its profile.json",
        "a try's tokens/s is the median of its few measured steps (maxbatch_tries: how many, and how far apart, "
        "(max - min) / median, n/a for one step): "
        "it finds what fits, not which size is fastest; differences within the spread are noise, and "
        "`trainprof sweep` over the sizes that fit, with more steps, compares their speed",
    ]
    paths = write_maxbatch_report(out, rows, state, title=f"trainprof maxbatch: {name}", notes=notes)
    for r in rows:
        print(f"  {r['config']}: max micro batch {r.get('max_micro_batch')} ({r['status']})", file=sys.stderr)
    for p in paths:
        print(f"  {p}", file=sys.stderr)
    if interrupted:
        print(f"trainprof: maxbatch interrupted; tries so far are kept in {state.path}; run the same command again "
              "to resume", file=sys.stderr)
        return 130
    # a configuration where not even micro batch 1 fits has no answer: a failure, as a launch error is
    return 1 if any(r["status"] in ("error", "none fits") for r in rows) else 0


def _no_cap_message(config: str | None, ranks: int, limit: int) -> str:
    """Why a CPU search without train.memory_cap_gb is refused, with the machine's available memory."""
    import psutil

    available_gib = psutil.virtual_memory().available / 2**30
    where = f"config '{config}': " if config else ""
    return (f"{where}maxbatch on a CPU needs train.memory_cap_gb (GiB per rank): without it the tries grow up to "
            f"--max {limit} until the kernel's OOM killer stops one, which can kill other processes; this machine has "
            f"{available_gib:.1f} GiB available for {ranks} rank(s): add train.memory_cap_gb=N, or pass --no-cap to "
            "search without one")


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("maxbatch", help="find the largest micro batch that fits (doubling, then bisection)",
                       description="Find the largest train.micro_batch_size that runs without running out of memory: "
                       "double from --start until a try fails, then bisect. Each try is a fresh process. "
                       "Give a recipe (with overrides) or a sweep file (one search per cell, one table, like the "
                       "Zhang et al.'s (arXiv 2311.03687) max-batch table). Resumable: tries already made are not run again.")
    p.add_argument("target", help="recipe YAML, or a sweep YAML (recipes/sweeps/)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides (recipe only)")
    p.add_argument("--nproc", type=positive_int, help="ranks per try (recipe only, a sweep file sets its own; "
                   "default 1)")
    p.add_argument("--start", type=positive_int, default=1, help="first micro batch tried (default 1)")
    p.add_argument("--max", type=positive_int, default=1024, help="largest micro batch tried (default 1024)")
    p.add_argument("--steps", type=non_negative_int, default=2, help="measured steps per try, after 1 warm-up step "
                   "(default 2; 0 keeps the recipe's steps)")
    p.add_argument("--timeout", type=positive_int, help="seconds per try (default: sweep file's, else 1800)")
    p.add_argument("--out", help="output dir (default runs/maxbatch/<name>); holds maxbatch.json, the state")
    p.add_argument("--no-cap", action="store_true", help="on a CPU, search without train.memory_cap_gb: the first "
                   "failure is then the kernel's OOM killer (SIGKILL), which can hit other processes too")
    p.set_defaults(func=_maxbatch)
    return p
