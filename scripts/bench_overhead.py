"""Profiler overhead on the tiny Llama (CPU): profiled and unprofiled training steps alternate in one
run, and the ratio of their median times is printed. Not a timed test.

    python scripts/bench_overhead.py                       # module hooks every step (goal <= 1.02)
    python scripts/bench_overhead.py --depth 5 --pairs 40  # deeper module level

Each profiled step gets a fresh Profiler (hooks, collective wrappers, memory per phase; FLOP counting
off) that is closed again before the next unprofiled step, so unprofiled steps run with no hooks at
all. The time of a profiled step includes the profiler's per-step analysis after the step. Steps run in
ABBA order; the ratio is the median over pairs of (profiled / unprofiled) of neighbouring steps, with
its interquartile range, which cancels the drift of a shared machine. Operator-level tracing
(torch.profiler) and the FLOP-counting step are measured the same way and reported separately.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainprof.env import quiet_library_noise  # noqa: E402
from trainprof.models import build_model  # noqa: E402
from trainprof.profiler import Profiler  # noqa: E402
from trainprof.recipe import Recipe  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=60, help="profiled/unprofiled step pairs (default 60)")
    p.add_argument("--depth", type=int, default=4, help="module_depth of the profiler (default 4, the recipe default)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sample (default 256, the CPU quickstart's)")
    p.add_argument("--batch", type=int, default=4, help="micro batch size (default 4, the CPU quickstart's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="model dtype (default bf16)")
    p.add_argument("--ops-pairs", type=int, default=6, help="pairs for the operator-level figure (default 6)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine more threads make "
                        "step times swing by 10x and the ratio meaningless)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    quiet_library_noise()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    recipe = Recipe()
    recipe.model.name, recipe.model.dtype = "llama2-tiny", args.dtype
    model = build_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))

    def train_step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    def plain() -> float:
        t0 = time.perf_counter()
        train_step()
        return time.perf_counter() - t0

    def profiled(**kwargs: object) -> Callable[[], float]:
        def run() -> float:
            prof = Profiler(model, optimizer=opt, module_depth=args.depth, **kwargs)
            t0 = time.perf_counter()
            with prof.step():
                train_step()
            elapsed = time.perf_counter() - t0  # includes the profiler's analysis at step exit
            prof.close()
            return elapsed
        return run

    for _ in range(5):
        train_step()
    print(f"tiny Llama, batch {args.batch} x seq {args.seq}, {args.dtype}, {torch.get_num_threads()} threads, "
          f"module_depth {args.depth}")

    rows = [
        ("module hooks, every step", profiled(flops=False), args.pairs),
        ("+ operator level (torch.profiler)", profiled(flops=False, ops=True, ops_steps=1), args.ops_pairs),
        ("+ FLOP counting (one step per run)", profiled(flops=True), args.ops_pairs),
    ]
    print(f"{'mode':<38} {'unprofiled ms':>14} {'profiled ms':>12} {'ratio':>7}  {'ratio IQR':>13}")
    for name, run, pairs in rows:
        base, prof_times, ratios = [], [], []
        for i in range(pairs):
            if i % 2 == 0:  # ABBA
                b, p = plain(), run()
            else:
                p, b = run(), plain()
            base.append(b)
            prof_times.append(p)
            ratios.append(p / b)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0], 0, ratios[0])
        print(f"{name:<38} {statistics.median(base) * 1e3:>14.2f} {statistics.median(prof_times) * 1e3:>12.2f} "
              f"{statistics.median(ratios):>7.3f}  {q1:>6.3f}-{q3:<6.3f}")


if __name__ == "__main__":
    main()
