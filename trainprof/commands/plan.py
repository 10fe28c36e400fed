"""`trainprof plan RECIPE`: params, per-rank memory and FLOPs, estimated without training."""

from __future__ import annotations

import argparse
import json
import sys

from trainprof.commands.run import positive_int
from trainprof.recipe import check_world_size, load_recipe


def _plan(args: argparse.Namespace) -> int:
    from trainprof.plan import estimate_plan, render_plan

    recipe = load_recipe(args.recipe, args.overrides)
    stages = recipe.engine.pipeline_stages
    nproc = args.nproc if args.nproc is not None else (stages if stages > 1 else 8)
    check_world_size(recipe, nproc)
    # building the model imports transformers (and peft, bitsandbytes for QLoRA): seconds of silence otherwise
    print(f"trainprof plan: building {recipe.model.name} on the meta device to count its parameters ...",
          file=sys.stderr, flush=True)
    plan = estimate_plan(recipe, world_size=nproc, device=args.device or _run_device())
    print(json.dumps(plan, indent=2) if args.json else render_plan(plan))
    return 0


def _run_device() -> str:
    """The device `trainprof run` would take on this machine (trainprof/distributed.py)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="what a recipe would take (params, memory, FLOPs), without training",
                       description="Build the model on the meta device and estimate per-rank memory and FLOPs. "
                       "Every figure is an estimate and names its formula.")
    p.add_argument("recipe", help="recipe YAML file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="ranks to plan for (default 8 data-parallel ranks; engine.pipeline_stages with pipelines)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="the device the run would take (default: what `trainprof run` takes here, cuda when "
                   "available): cpu shows the resident set to compare with a CPU run's peak RSS, not GPU totals")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)
    return p
