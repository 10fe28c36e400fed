"""`trainprof wrap SCRIPT [ARGS...]`: `python -m trainprof.wrap` as a subcommand (one process; under
torchrun use `torchrun ... -m trainprof.wrap SCRIPT ARGS`)."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    from trainprof.wrap import add_arguments, description

    p = sub.add_parser("wrap", help="profile an unmodified training script (a plain PyTorch loop, DDP, DeepSpeed, "
                       "HF Trainer, Accelerate, Lightning)", description=description("trainprof wrap"))
    add_arguments(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainprof.wrap import Wrapper, default_output_dir, run_script

    wrapper = Wrapper(Path(args.script).stem, default_output_dir(), args.warmup_steps, args.module_depth, args.ops)
    return run_script(args.script, args.args, wrapper)
