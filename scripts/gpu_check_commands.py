"""Check the command list `bash scripts/gpu_check.sh --dry-run OUTDIR` wrote (OUTDIR/commands.tsv), on any
machine, before GPU time is spent on it: every trainprof run's recipe loads with its overrides (the
recipe's own rules, for one rank), every test file and script exists, the overhead bench's arguments parse
and its recipes load.

    python scripts/gpu_check_commands.py OUTDIR/commands.tsv

Prints one line per command and exits 1 when any of them would fail at once on the GPU.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def check_run(args: list[str]) -> str:
    """`-m trainprof.run RECIPE KEY=VALUE...`: the recipe loads and passes its one-rank rules."""
    from trainprof.recipe import check_world_size, load_recipe

    recipe_path, overrides = args[0], args[1:]
    recipe = load_recipe(REPO / recipe_path, overrides)
    check_world_size(recipe, 1)
    m, e, t = recipe.model, recipe.engine, recipe.train
    return (f"{recipe_path}: {m.name}, {recipe.task.kind}, {e.kind} ZeRO {e.zero_stage}, "
            f"micro batch {t.micro_batch_size} x seq {recipe.data.seq_len}, {t.steps} steps")


def check_bench(args: list[str]) -> str:
    """scripts/bench_overhead.py's arguments parse, and with --device cuda its configurations' recipes load."""
    import bench_overhead
    from bench_overhead_cuda import CONFIGS

    from trainprof.recipe import load_recipe

    saved, sys.argv = sys.argv, ["bench_overhead.py", *args]
    try:
        parsed = bench_overhead.parse_args()
    finally:
        sys.argv = saved
    if parsed.device == "cuda":
        for _, recipe_path, overrides in CONFIGS:
            load_recipe(REPO / recipe_path, overrides)
    return f"bench_overhead.py --device {parsed.device}, {parsed.pairs} pairs, json to {parsed.json_out}"


def check_files(args: list[str]) -> str:
    missing = [a for a in args if a.endswith(".py") and not (REPO / a).is_file()]
    if missing:
        raise FileNotFoundError(f"not in the repository: {', '.join(missing)}")
    return f"{sum(a.endswith('.py') for a in args)} files exist"


def check(command: str) -> str:
    """What one command would need to start; raises when it would fail at once."""
    words = shlex.split(command)
    for i in range(len(words) - 2):
        if words[i:i + 2] == ["-m", "trainprof.run"]:
            return check_run(words[i + 2:])
    for i, word in enumerate(words):
        if word.endswith("bench_overhead.py"):
            check_files([word])
            return check_bench(words[i + 1:])
    if "pytest" in words:
        return check_files(words)
    return "not checked (no recipe, script or test file in it)"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python scripts/gpu_check_commands.py OUTDIR/commands.tsv", file=sys.stderr)
        return 2
    from trainprof.env import quiet_library_noise

    quiet_library_noise()
    bad = 0
    for line in Path(argv[0]).read_text().splitlines():
        name, _, command = line.partition("\t")
        try:
            print(f"ok   {name}: {check(command)}")
        except Exception as err:  # noqa: BLE001  every failing command is listed, not only the first
            bad += 1
            print(f"FAIL {name}: {type(err).__name__}: {str(err).splitlines()[0]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
