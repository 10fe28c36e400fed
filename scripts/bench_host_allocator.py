"""What `train.cpu_allocator` changes on this machine: the same recipe run with `cache` and with `system`,
interleaved (cache, system, cache, system, ...) so that a slow spell hits both, and per allocator the
median over the repeats of each run's median step, its phases and its peak RSS.

    python scripts/bench_host_allocator.py                             # the quickstart on 2 ranks, 3 repeats
    python scripts/bench_host_allocator.py --nproc 1 --repeats 5 data.seq_len=128   # recipe overrides last
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("cache", "system")


def run(recipe: str, overrides: list[str], nproc: int, out: Path) -> dict:
    from trainprof.sweep.launch import launch_command

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = launch_command(recipe, [*overrides, "profile.ops=false", "profile.calibrate=false", f"output.dir={out}"],
                         nproc=nproc)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    found = sorted(out.glob("*/profile.json"))
    if proc.returncode != 0 or not found:
        raise SystemExit(f"bench_host_allocator: the run {overrides} failed: {proc.stderr.strip()[-500:]}")
    return json.loads(found[-1].read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="recipes/quickstart_cpu.yaml")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("overrides", nargs="*", help="recipe key=value")
    args = parser.parse_args()
    common = [f"train.steps={args.steps}", "train.warmup_steps=3", *args.overrides]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="trainprof-alloc-") as tmp:
        for i in range(args.repeats):
            for mode in MODES:
                profile = run(args.recipe, [*common, f"train.cpu_allocator={mode}"], args.nproc,
                              Path(tmp) / f"{mode}{i}")
                assert profile["env"]["host_allocator"]["mode"] == mode, profile["env"]["host_allocator"]
                runs[mode].append(profile)
                print(f"  {mode:6s} run {i}: {profile['summary']['step_ms']['median']:.1f} ms", flush=True)
    print(f"\n{args.recipe} {' '.join(args.overrides)} on {args.nproc} rank(s), {args.repeats} runs each of "
          f"{args.steps} measured steps, interleaved")
    print(f"{'allocator':10s} {'step ms':>8s} {'forward':>8s} {'backward':>9s} {'optimizer':>10s} {'comm':>6s} "
          f"{'peak MiB':>9s}")
    medians = {}
    for mode in MODES:
        s = [p["summary"] for p in runs[mode]]
        step = statistics.median(x["step_ms"]["median"] for x in s)
        ph = {k: statistics.median(x["phases_ms"].get(k, 0.0) for x in s)
              for k in ("forward", "backward", "optimizer", "comm_exposed")}
        peak = statistics.median(max(x["peak_memory_bytes"].values()) for x in s) / 2**20  # the fullest phase
        medians[mode] = step
        print(f"{mode:10s} {step:8.1f} {ph['forward']:8.1f} {ph['backward']:9.1f} {ph['optimizer']:10.1f} "
              f"{ph['comm_exposed']:6.1f} {peak:9.0f}")
    print(f"\ncache / system step time: {medians['cache'] / medians['system']:.3f}")
    print("timer: host monotonic clock; step = slowest rank's median over the measured steps, median over the runs; "
          "peak = peak process RSS (CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
