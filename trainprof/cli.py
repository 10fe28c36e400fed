"""`trainprof` command line: run a recipe under torchrun, or plan it without training."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from trainprof.recipe import RecipeError, load_recipe


def _cmd_run(args: argparse.Namespace) -> int:
    """Validate here (one-line errors, no torchrun noise), then launch torchrun."""
    import torch

    from trainprof.recipe import check_environment

    recipe = load_recipe(args.recipe, args.overrides)
    check_environment(recipe, cuda_available=torch.cuda.is_available())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "trainprof.run", args.recipe, *args.overrides]
    print("+ " + " ".join(cmd), file=sys.stderr)
    return subprocess.call(cmd, env=os.environ.copy())


def _cmd_plan(args: argparse.Namespace) -> int:
    from trainprof.plan import estimate_plan, render_plan

    recipe = load_recipe(args.recipe, args.overrides)
    plan = estimate_plan(recipe, world_size=args.nproc)
    print(json.dumps(plan, indent=2) if args.json else render_plan(plan))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainprof",
        description="Training-efficiency profiling for LLMs: run recipes on real engines, see where step time goes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train and profile a recipe under torchrun",
                         description="Validate a recipe, then run it under torchrun with --nproc ranks.")
    run.add_argument("recipe", help="recipe YAML file")
    run.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. engine.zero_stage=2")
    run.add_argument("--nproc", type=int, default=1, help="ranks on this node (default 1)")
    run.set_defaults(func=_cmd_run)

    plan = sub.add_parser("plan", help="what a recipe would take (params, memory, FLOPs), without training",
                          description="Build the model on the meta device and estimate per-rank memory and FLOPs.")
    plan.add_argument("recipe", help="recipe YAML file")
    plan.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    plan.add_argument("--nproc", type=int, default=8, help="data-parallel ranks to plan for (default 8)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "nproc", 1) < 1:
        print("trainprof: --nproc must be >= 1", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except RecipeError as err:
        print(f"trainprof: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
