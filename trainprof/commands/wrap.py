"""`trainprof wrap SCRIPT [ARGS...]`: `python -m trainprof.wrap` as a subcommand (one process; under
torchrun use `torchrun ... -m trainprof.wrap SCRIPT ARGS`)."""

from __future__ import annotations

import argparse

from trainprof.integrations.session import DEFAULT_MODULE_DEPTH, DEFAULT_WARMUP_STEPS


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("wrap", help="profile an unmodified training script (DeepSpeed, HF Trainer, Lightning)",
                       description="Run SCRIPT as __main__ with trainprof attached to the DeepSpeed engines, HF "
                       "Trainer and Lightning Trainer it builds; the run dir goes to $TRAINPROF_OUTPUT_DIR "
                       "(default runs/). Its output and exit code pass through. Several ranks: "
                       "`torchrun --nproc_per_node N -m trainprof.wrap SCRIPT ARGS`.")
    p.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS,
                   help=f"optimizer steps not measured (default {DEFAULT_WARMUP_STEPS})")
    p.add_argument("--module-depth", type=int, default=DEFAULT_MODULE_DEPTH,
                   help=f"deepest module level timed (default {DEFAULT_MODULE_DEPTH})")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from trainprof.wrap import Wrapper, default_output_dir, run_script

    wrapper = Wrapper(Path(args.script).stem, default_output_dir(), args.warmup_steps, args.module_depth)
    return run_script(args.script, args.args, wrapper)
