"""`trainprof run RECIPE [key=value ...] --nproc N`: validate here, then launch torchrun (one rank: the run
itself, sweep/launch.py's launch_command)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from trainprof.recipe import check_environment, check_world_size, load_recipe
from trainprof.sweep.launch import launch_command


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (world sizes, node counts, batch sizes), sorted, each once."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1 like 1,2,4, got '{text}'")
    return sorted(set(values))


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got '{text}'")
    return value


def _run(args: argparse.Namespace) -> int:
    """Validate in this process (one-line errors, no torchrun noise), then launch the run."""
    import torch

    recipe = load_recipe(args.recipe, args.overrides)
    check_environment(recipe, cuda_available=torch.cuda.is_available())
    nproc = launch_ranks(recipe, args.nproc)
    check_world_size(recipe, nproc)
    cmd = launch_command(args.recipe, args.overrides, nproc=nproc)
    if not torch.cuda.is_available():
        warn_oversubscribed(nproc, torch.get_num_threads())
    print("+ " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd)


def launch_ranks(recipe, nproc: int | None) -> int:
    """--nproc, else what the recipe needs: one rank per pipeline stage, or one."""
    return nproc if nproc is not None else max(1, recipe.engine.pipeline_stages)


def warn_oversubscribed(nproc: int, one_process_threads: int) -> None:
    """One line on stderr where the ranks' threads outnumber the cores this launch may use: the run then
    measures the machine's contention, not the recipe."""
    from trainprof.env import allowed_cores, oversubscription_warning, threads_when_launched

    threads, _ = threads_when_launched(nproc, one_process_threads)
    line = oversubscription_warning(nproc, threads, len(allowed_cores()))
    if line:
        print(line, file=sys.stderr)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="train and profile a recipe under torchrun",
                       description="Validate a recipe, then run it under torchrun with --nproc ranks "
                       "(one rank: python -m trainprof.run, without torchrun).")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. engine.zero_stage=2")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks on this node (default 1; engine.pipeline_stages with pipelines: one stage per rank)")
    p.set_defaults(func=_run)
    return p
