"""Benchmark: trainprof's training loop vs a minimal hand-written DeepSpeed loop on the same engine.

    torchrun --nproc_per_node 2 scripts/bench_loop.py [RECIPE] [key=value ...] [--rounds 30 --steps 3]

Both loops drive one DeepSpeed engine (so model, data and config are identical), alternating in
blocks of --steps optimizer steps, the first loop of each round alternating too. Prints, per round
and as the median, throughput(trainprof) / throughput(minimal); the goal is >= 0.98. The profiler is
off here (profile.enabled=false): its cost is scripts/bench_overhead.py's business.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from trainprof.data import build_loader
from trainprof.engines import DistContext, build_engine
from trainprof.models import resolve_shape
from trainprof.recipe import load_recipe
from trainprof.env import quiet_library_noise
from trainprof.distributed import init_distributed, seed_everything
from trainprof.run import timed_step

DEFAULT_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "quickstart_cpu.yaml"


def minimal_loop(ds_engine, batches, grad_accum: int, n_steps: int) -> None:
    """What a user writes by hand for DeepSpeed (deepspeed.ai getting-started), nothing more."""
    for _ in range(n_steps * grad_accum):
        batch = {k: v.to(ds_engine.device) for k, v in next(batches).items()}
        loss = ds_engine(**batch).loss
        ds_engine.backward(loss)
        ds_engine.step()
    loss.item()  # the hand loop also looks at its loss once per block


def trainprof_loop(engine, batches, grad_accum: int, n_steps: int, device) -> None:
    for _ in range(n_steps):
        timed_step(engine, batches, grad_accum, device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default=str(DEFAULT_RECIPE))
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per loop per round")
    args = parser.parse_args()
    quiet_library_noise()
    recipe = load_recipe(args.recipe, [*args.overrides, "profile.enabled=false"])
    if recipe.engine.kind != "deepspeed":
        sys.exit("bench_loop.py compares against a hand-written DeepSpeed loop: use engine.kind=deepspeed")
    ctx = DistContext.from_env()
    init_distributed(ctx, engine_kind=recipe.engine.kind)
    seed_everything(recipe.train.seed)
    engine = build_engine(recipe, ctx)
    batches = iter(build_loader(recipe, vocab_size=resolve_shape(recipe.model).vocab_size, rank=ctx.rank,
                                world_size=ctx.world_size))
    ga = recipe.train.grad_accum
    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        dist.barrier()
        sync()
        start = time.perf_counter()
        fn()
        sync()
        dist.barrier()
        return time.perf_counter() - start

    run_trainprof = lambda: trainprof_loop(engine, batches, ga, args.steps, ctx.device)  # noqa: E731
    run_minimal = lambda: minimal_loop(engine.engine, batches, ga, args.steps)  # noqa: E731
    timed(run_minimal)  # warm-up, both paths
    timed(run_trainprof)
    ratios = []
    for r in range(args.rounds):
        if r % 2 == 0:
            t_min, t_tp = timed(run_minimal), timed(run_trainprof)
        else:
            t_tp, t_min = timed(run_trainprof), timed(run_minimal)
        ratios.append(t_min / t_tp)  # same tokens in both blocks: throughput ratio = inverse time ratio
        if ctx.rank == 0:
            print(f"round {r}: minimal {t_min * 1e3 / args.steps:.1f} ms/step, trainprof {t_tp * 1e3 / args.steps:.1f}"
                  f" ms/step, throughput ratio {ratios[-1]:.3f}")
    if ctx.rank == 0:
        q1, _, q3 = statistics.quantiles(ratios, n=4)
        print(f"throughput(trainprof loop) / throughput(minimal DeepSpeed loop): median {statistics.median(ratios):.3f} "
              f"(IQR {q1:.3f}-{q3:.3f}) over {args.rounds} rounds x {args.steps} steps (host clock; world size {ctx.world_size}; "
              f"recipe {Path(args.recipe).name}; goal >= 0.98)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
