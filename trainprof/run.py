"""`python -m trainprof.run RECIPE [key=value ...]`: train a recipe (under torchrun or alone) and
write its run dir."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from trainprof.recipe import Recipe, RecipeError, check_environment, load_recipe


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainprof.run",
        description="Train and profile one recipe; run under torchrun for several ranks, e.g. "
        "`torchrun --nproc_per_node 2 -m trainprof.run recipes/quickstart_cpu.yaml`.",
    )
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.micro_batch_size=4")
    return parser.parse_args(argv)


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def init_distributed(recipe: Recipe, ctx) -> None:
    """Join the process group torchrun set up (gloo on CPU, NCCL on GPU)."""
    import torch

    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    if recipe.engine.kind == "deepspeed":
        import deepspeed

        if "RANK" not in os.environ:  # a single process without torchrun: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))

        deepspeed.init_distributed(dist_backend=backend)
    elif ctx.distributed:
        torch.distributed.init_process_group(backend=backend)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_run_dir(recipe: Recipe, ctx) -> Path:
    """runs/<name>-<UTC timestamp>/, chosen on rank 0 and shared with every rank."""
    import torch.distributed as dist

    name = [None]
    if ctx.rank == 0:
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        base = Path(recipe.output.dir) / f"{recipe.output.name}-{stamp}"
        path, n = base, 1
        while path.exists():
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        path.mkdir(parents=True)
        name[0] = str(path)
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def train_step(engine, batches, grad_accum: int) -> float:
    """One optimizer step: grad_accum micro batches of forward, backward, step(); the mean loss."""
    import torch

    losses = []
    for _ in range(grad_accum):
        loss = engine.forward(next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return float(torch.stack(losses).float().mean())


def timed_step(engine, batches, grad_accum: int, device) -> dict[str, Any]:
    """train_step timed on the host clock between device synchronizations, with its peak memory."""
    import torch

    from trainprof.env import peak_memory_bytes, reset_peak_memory

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reset_peak_memory(device)
    sync()
    start = time.perf_counter()
    loss = train_step(engine, batches, grad_accum)
    sync()
    wall_ms = (time.perf_counter() - start) * 1e3
    return {"wall_ms": wall_ms, "loss": loss, "peak_memory_bytes": peak_memory_bytes(device)}


def train(recipe: Recipe) -> Path:
    """Run warm-up and measured steps; write the run dir; return its path."""
    import yaml

    from trainprof.engines import DistContext
    from trainprof.io import atomic_write_text

    ctx = DistContext.from_env()
    init_distributed(recipe, ctx)
    run_dir = make_run_dir(recipe, ctx)
    if ctx.rank == 0:
        atomic_write_text(run_dir / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    with record_failure(run_dir, ctx):
        return _train(recipe, ctx, run_dir)


@contextlib.contextmanager
def record_failure(run_dir: Path, ctx):
    """On an exception, write failure-rank<N>.json (kind oom|error, message, memory) and re-raise, so
    a sweep can say which rank failed how even when the process dies right after."""
    from trainprof.env import peak_memory_bytes
    from trainprof.io import atomic_write_json

    try:
        yield
    except BaseException as err:
        oom = isinstance(err, MemoryError) or "out of memory" in str(err).lower()
        atomic_write_json(run_dir / f"failure-rank{ctx.rank}.json", {
            "rank": ctx.rank,
            "kind": "oom" if oom else ("interrupted" if isinstance(err, KeyboardInterrupt) else "error"),
            "type": type(err).__name__,
            "message": str(err).strip().splitlines()[0][:500] if str(err).strip() else type(err).__name__,
            "peak_memory_bytes": peak_memory_bytes(ctx.device),
        })
        raise


def _train(recipe: Recipe, ctx, run_dir: Path) -> Path:
    import torch
    from tqdm import tqdm

    from trainprof.data import build_loader
    from trainprof.engines import build_engine
    from trainprof.env import apply_memory_cap, check_memory_cap, collect_env, memory_meter
    from trainprof.io import atomic_write_json
    from trainprof.models import count_params, resolve_shape

    seed_everything(recipe.train.seed)
    apply_memory_cap(ctx.device, recipe.train.memory_cap_gb)
    engine = build_engine(recipe, ctx)
    check_memory_cap(ctx.device, recipe.train.memory_cap_gb)

    loader = build_loader(recipe, vocab_size=resolve_shape(recipe.model).vocab_size, rank=ctx.rank,
                          world_size=ctx.world_size)
    batches = iter(loader)
    t = recipe.train
    tokens_per_step = t.micro_batch_size * t.grad_accum * recipe.data.seq_len * ctx.world_size
    total = t.warmup_steps + t.steps
    steps: list[dict[str, Any]] = []
    bar = tqdm(total=total, desc=f"{recipe.output.name}", unit="step", disable=ctx.rank != 0, file=sys.stderr)
    for step in range(total):
        record = timed_step(engine, batches, t.grad_accum, ctx.device)
        record.update(step=step - t.warmup_steps, warmup=step < t.warmup_steps, tokens=tokens_per_step,
                      tokens_per_s=tokens_per_step / (record["wall_ms"] / 1e3))
        steps.append(record)
        check_memory_cap(ctx.device, t.memory_cap_gb)
        bar.set_postfix(loss=f"{record['loss']:.3f}", ms=f"{record['wall_ms']:.0f}")
        bar.update()
    bar.close()

    rank_file = {"rank": ctx.rank, "steps": steps}
    atomic_write_json(run_dir / f"rank{ctx.rank}.json", rank_file)
    all_ranks = gather_to_rank0(rank_file, ctx)
    if ctx.rank == 0:
        profile = build_profile(recipe, collect_env(ctx.device, ctx.world_size), all_ranks,
                                params=count_params(engine.module), engine_name=engine.name,
                                engine_config=engine.config, memory_kind=memory_meter(ctx.device))
        atomic_write_json(run_dir / "profile.json", profile)
        print(render_summary(profile, run_dir), file=sys.stderr)
    if ctx.distributed:
        torch.distributed.barrier()
    return run_dir


def gather_to_rank0(obj: Any, ctx) -> list[Any]:
    import torch.distributed as dist

    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def build_profile(recipe: Recipe, env: dict[str, Any], ranks: list[dict[str, Any]], *, params: dict[str, int],
                  engine_name: str, engine_config: dict[str, Any], memory_kind: str) -> dict[str, Any]:
    """Merge per-rank step records into the profile.json document (rank 0)."""
    measured = [[s for s in r["steps"] if not s["warmup"]] for r in sorted(ranks, key=lambda r: r["rank"])]
    steps = []
    for i, rank0_step in enumerate(measured[0]):
        per_rank = [r[i] for r in measured]
        steps.append({
            "step": rank0_step["step"],
            # a step ends when its slowest rank ends: the collectives make every rank wait for it
            "wall_ms": max(s["wall_ms"] for s in per_rank),
            "loss": statistics.fmean(s["loss"] for s in per_rank),
            "tokens": rank0_step["tokens"],
            "peak_memory_bytes": max(s["peak_memory_bytes"] for s in per_rank),
        })
    walls = [s["wall_ms"] for s in steps]
    median_ms = statistics.median(walls)
    return {
        "schema_version": 1,
        "partial": False,
        "recipe": recipe.to_dict(),
        "env": env,
        "engine": {"kind": engine_name, "config": engine_config},
        "params": params,
        "steps": steps,
        "summary": {
            "step_ms": {"min": min(walls), "median": median_ms, "max": max(walls)},
            "tokens_per_s": steps[0]["tokens"] / (median_ms / 1e3),
            "tokens_per_s_method": "global tokens per optimizer step / median measured step wall time",
            "peak_memory_bytes_max": max(s["peak_memory_bytes"] for s in steps),
            "memory_meter": memory_kind,
            "loss_first": steps[0]["loss"],
            "loss_last": steps[-1]["loss"],
        },
        "ranks": [
            {"rank": r["rank"], "step_ms_median": statistics.median(s["wall_ms"] for s in m)}
            for r, m in zip(sorted(ranks, key=lambda r: r["rank"]), measured)
        ],
    }


def render_summary(profile: dict[str, Any], run_dir: Path) -> str:
    s, env = profile["summary"], profile["env"]
    rows = [
        ("run dir", str(run_dir)),
        ("device", f"{env['device']} x {env['world_size']} ({env['timer']} timer)"),
        ("step ms (min/median/max)", f"{s['step_ms']['min']:.1f} / {s['step_ms']['median']:.1f} / {s['step_ms']['max']:.1f}"),
        ("tokens/s (global)", f"{s['tokens_per_s']:,.0f}"),
        ("loss first -> last", f"{s['loss_first']:.4f} -> {s['loss_last']:.4f}"),
        ("peak memory", f"{s['peak_memory_bytes_max'] / 2**20:,.0f} MiB ({s['memory_meter'].split(':')[0]})"),
        ("params total / trainable", f"{profile['params']['total']:,} / {profile['params']['trainable']:,}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["", "trainprof run summary", *(f"  {k:<{width}}  {v}" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from trainprof.env import quiet_library_noise

    quiet_library_noise()
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        import torch

        check_environment(recipe, cuda_available=torch.cuda.is_available())
    except RecipeError as err:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"trainprof: {err}", file=sys.stderr)
        return 2
    train(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
