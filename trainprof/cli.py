"""`trainprof` command line. Each subcommand lives in its own module with `add_parser(subparsers)`;
COMMANDS lists them (explicitly, no import-time registration)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from trainprof.errors import UserError
from trainprof.recipe import RecipeError
from trainprof.report.rundir import RunDirError

# subcommand modules, in --help order; each defines add_parser(subparsers) -> ArgumentParser whose
# defaults include func(args) -> exit code
COMMANDS = ["trainprof.commands.run", "trainprof.commands.plan", "trainprof.commands.sweep",
            "trainprof.commands.maxbatch", "trainprof.commands.scale", "trainprof.commands.report",
            "trainprof.commands.diff", "trainprof.commands.tb", "trainprof.commands.project",
            "trainprof.commands.infer", "trainprof.commands.wrap", "trainprof.commands.replay"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trainprof",
        description="Training-efficiency profiling for LLMs: run recipes on real engines, see where step time goes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).add_parser(sub)
    parser.set_defaults(command_parsers=sub.choices)  # name -> its parser, for errors with its own usage
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse cannot take positionals after an option (`run R.yaml --nproc 2 k=v`): collect them here, where
    # the recipe's checks say what is wrong with one (`train.steps` without a value) in trainprof's own line
    options = [e for e in extra if e.startswith("-")]
    if extra and hasattr(args, "overrides") and not options:
        args.overrides = [*args.overrides, *extra]
    elif extra:  # with the command's usage line, not trainprof's
        args.command_parsers[args.command].error(f"unrecognized arguments: {' '.join(options or extra)}")
    from trainprof.env import quiet_library_noise

    quiet_library_noise()
    try:
        return args.func(args)
    except (RecipeError, RunDirError, UserError) as err:
        print(f"trainprof: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout left (`trainprof hardware | head`): no traceback, and none at exit's flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # a shell's status for a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
