"""`python -m trainprof.run RECIPE [key=value ...]`: train a recipe (under torchrun or alone) and
write its run dir."""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

from trainprof.recipe import Recipe, RecipeError, check_environment, check_world_size, load_recipe


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
    if recipe.engine.kind in ("deepspeed", "fsdp") and "RANK" not in os.environ:
        # a single process without torchrun: a group of one (both engines need a process group)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if recipe.engine.kind == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    elif ctx.distributed or recipe.engine.kind == "fsdp":
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


def train_step(engine, batches, grad_accum: int, prof=None) -> float | None:
    """One optimizer step: grad_accum micro batches of forward, backward, step(); the mean loss.
    With a Profiler, backward and the engine's step are marked as phases (so ZeRO's post-backward
    reduction counts as backward and DeepSpeed's optimizer as optimizer) and each micro batch's loss
    and tokens are recorded. A pipeline stage returns None except on the last stage (which computes
    the loss)."""
    import torch

    if getattr(engine, "name", None) == "pipeline":  # the schedule runs all micro batches of the step
        return engine.train_step(batches, prof)
    phase = prof.phase if prof is not None else (lambda label: contextlib.nullcontext())
    losses = []
    for _ in range(grad_accum):
        batch = next(batches)
        loss = engine.forward(batch)
        with phase("backward"):
            engine.backward(loss)
        with phase("optimizer"):  # runs the optimizer only at the accumulation boundary
            engine.step()
        losses.append(loss.detach())
        if prof is not None:
            prof.record(loss=loss, tokens=batch["input_ids"].numel())
    return float(torch.stack(losses).float().mean())


def timed_step(engine, batches, grad_accum: int, device, prof=None) -> dict[str, Any]:
    """train_step timed on the host clock between device synchronizations, with its peak memory."""
    import torch

    from trainprof.env import peak_memory_bytes, reset_peak_memory

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    reset_peak_memory(device)
    sync()
    start = time.perf_counter()
    loss = train_step(engine, batches, grad_accum, prof)
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

    previous = signal.signal(signal.SIGTERM, _raise_terminated)  # torchrun stops survivors with SIGTERM
    try:
        yield
    except BaseException as err:
        oom = isinstance(err, MemoryError) or "out of memory" in str(err).lower()
        interrupted = isinstance(err, (KeyboardInterrupt, Terminated))
        atomic_write_json(run_dir / f"failure-rank{ctx.rank}.json", {
            "rank": ctx.rank,
            "kind": "oom" if oom else ("interrupted" if interrupted else "error"),
            "type": type(err).__name__,
            "signal": "SIGTERM" if isinstance(err, Terminated) else ("SIGINT" if isinstance(err, KeyboardInterrupt) else None),
            "message": str(err).strip().splitlines()[0][:500] if str(err).strip() else type(err).__name__,
            "peak_memory_bytes": peak_memory_bytes(ctx.device),
        })
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so record_failure can write the rank's failure file."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated("terminated by SIGTERM (torchrun stops the other ranks when one fails)")


def _train(recipe: Recipe, ctx, run_dir: Path) -> Path:
    import torch
    from tqdm import tqdm

    from trainprof.data import build_loader
    from trainprof.engines import build_engine
    from trainprof.env import apply_memory_cap, check_memory_cap, collect_env, memory_meter
    from trainprof.io import atomic_write_json
    from trainprof.models import count_params, resolve_shape
    from trainprof.profiler import Profiler

    seed_everything(recipe.train.seed)
    apply_memory_cap(ctx.device, recipe.train.memory_cap_gb)
    engine = build_engine(recipe, ctx)
    check_memory_cap(ctx.device, recipe.train.memory_cap_gb)

    pipeline = engine.name == "pipeline"  # every stage reads the same samples (no data parallelism)
    loader = build_loader(recipe, vocab_size=resolve_shape(recipe.model).vocab_size,
                          rank=0 if pipeline else ctx.rank, world_size=1 if pipeline else ctx.world_size)
    prof = Profiler.for_recipe(engine.loop_module, engine.optimizer, recipe, run_dir=run_dir, device=ctx.device)
    if pipeline and recipe.profile.enabled:
        prof.watch_pipeline(stage=engine.stage_index, num_stages=engine.num_stages,
                            schedule=recipe.engine.pipeline_schedule, micro_batches=recipe.train.grad_accum,
                            prev_rank=engine.prev_rank, next_rank=engine.next_rank)
        engine.set_action_callback(prof.pipeline_action)
    if isinstance(engine.loop_module, torch.nn.parallel.DistributedDataParallel) and recipe.profile.enabled:
        prof.watch_ddp(engine.loop_module)
    t = recipe.train
    steps: list[dict[str, Any]] = []
    bar = tqdm(total=t.warmup_steps + t.steps, desc=f"{recipe.output.name}", unit="step",
               disable=ctx.rank != 0, file=sys.stderr)
    try:
        with prof:
            batches = prof.wrap_loader(loader)
            for step in range(t.warmup_steps + t.steps):
                with prof.step():
                    record = timed_step(engine, batches, t.grad_accum, ctx.device, prof)
                record.update(step=step - t.warmup_steps, warmup=step < t.warmup_steps)
                steps.append(record)
                check_memory_cap(ctx.device, t.memory_cap_gb)
                bar.set_postfix(loss=f"{record['loss']:.3f}" if record["loss"] is not None else "n/a",
                                ms=f"{record['wall_ms']:.0f}")
                bar.update()
            bar.close()
    except BaseException as err:
        # already stopping: a second SIGTERM must not cut the partial files short (torchrun SIGKILLs later)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # keep the steps that finished, marked partial (rank<N>.json is the name of a finished rank)
        atomic_write_json(run_dir / f"rank{ctx.rank}.partial.json", {"rank": ctx.rank, "partial": True, "steps": steps})
        # and the profiler's breakdown of them: written once, here (an exception or torchrun's SIGTERM),
        # so the finished run pays nothing for it; `trainprof report` merges these files
        prof.close()  # the hooks come off, and the journal writes the steps it holds back (profiler/journal.py)
        if recipe.profile.enabled and prof.steps:
            reason = f"rank {ctx.rank} stopped after {len(prof.steps)} profiled steps: {type(err).__name__}: {err}"
            try:
                rank_doc = prof.rank_result()
            except Exception as why:  # noqa: BLE001  the original error matters more than its partial profile
                print(f"trainprof: rank {ctx.rank}: partial profile not written ({type(why).__name__}: {why}); "
                      "its journal keeps the finished steps and `trainprof report` rebuilds them", file=sys.stderr)
                raise err from None
            rank_doc.update(partial=True, partial_reason=reason.strip().splitlines()[0][:300])
            atomic_write_json(run_dir / f"profile.rank{ctx.rank}.partial.json", rank_doc)
            prof.discard_journal()
        raise
    # the runner's own per-step log (warm-up included), written before the collective merge so a
    # rank that dies there still leaves it
    atomic_write_json(run_dir / f"rank{ctx.rank}.json", {"rank": ctx.rank, "partial": False, "steps": steps})
    measured = [s for s in steps if not s["warmup"]]
    extra = {
        "peak_memory_bytes_max": max(s["peak_memory_bytes"] for s in measured),
        "memory_meter": memory_meter(ctx.device),
    }
    rank_extras = gather_to_rank0(extra, ctx)
    env = collect_env(ctx.device, ctx.world_size)
    profile = prof.result(recipe=recipe.to_dict(), env=env)  # a collective: every rank merges
    profile.update(partial=False, engine={"kind": engine.name, "config": engine.config},
                   params=count_params(engine.module))
    if ctx.rank == 0:
        profile["summary"]["peak_memory_bytes_max"] = max(e["peak_memory_bytes_max"] for e in rank_extras)
        profile["summary"]["memory_meter"] = extra["memory_meter"]
        write_run_files(profile, run_dir)
        print(render_summary(profile, run_dir), file=sys.stderr)
    atomic_write_json(run_dir / f"profile.rank{ctx.rank}.json", prof.rank_result())
    prof.discard_journal()
    if recipe.profile.calibrate:
        write_calibration(recipe, ctx, run_dir)
    if ctx.distributed:
        torch.distributed.barrier()
    return run_dir


def write_calibration(recipe: Recipe, ctx, run_dir: Path) -> None:
    """calibration.json for `trainprof project` (a collective: every rank measures the collectives)."""
    from trainprof.io import atomic_write_json
    from trainprof.projection.calibrate import calibrate_in_run

    cal = calibrate_in_run(ctx, recipe.model.dtype)
    if cal is not None:
        atomic_write_json(run_dir / "calibration.json", cal)


def write_run_files(profile: dict[str, Any], run_dir: Path) -> None:
    """profile.json and what is derived from it (csv tables, summary.md)."""
    from trainprof.io import atomic_write_json
    from trainprof.report.summary import write_report

    from trainprof.report.run_report import write_reports

    atomic_write_json(run_dir / "profile.json", profile)
    write_report(profile, run_dir)
    try:
        write_reports(run_dir)  # report.md, report.html, TensorBoard scalars under tb/
    except Exception as err:  # a report problem must not fail a finished run; `trainprof report` retries
        print(f"trainprof: report not written ({type(err).__name__}: {err}); run `trainprof report {run_dir}`",
              file=sys.stderr)


def gather_to_rank0(obj: Any, ctx) -> list[Any]:
    import torch.distributed as dist

    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


def render_summary(profile: dict[str, Any], run_dir: Path) -> str:
    """The short table rank 0 prints at the end of a run."""
    from trainprof.report.rundir import trace_size_text
    from trainprof.report.summary import model_states_text

    s, env = profile["summary"], profile["env"]
    steps = [st for st in profile["steps"] if not st.get("warmup")]
    phases = s.get("phases_ms") or {}
    phase_text = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if v) or "profiler off"
    tflops = s.get("achieved_tflops")
    mfu = s.get("mfu")
    rows = [
        ("run dir", str(run_dir)),
        ("device", f"{env['device']} x {env['world_size']} ({env['timer']} timer)"),
        ("step ms (min/median/max)",
         f"{s['step_ms']['min']:.1f} / {s['step_ms']['median']:.1f} / {s['step_ms']['max']:.1f}"),
        ("phases, median ms", phase_text),
        ("unattributed", f"{100 * s['unattributed_frac']:.2f}% of the step"
         if s.get("unattributed_frac") is not None else "n/a"),
        ("tokens/s (all ranks)", f"{s['tokens_per_s']:,.0f}" if s.get("tokens_per_s") else "n/a"),
        ("achieved TFLOP/s", f"{tflops:.4f}" if tflops is not None else "n/a"),
        ("MFU", f"{100 * mfu:.1f}%" if mfu is not None else f"n/a ({s.get('mfu_reason', 'no known peak')})"),
        ("loss first -> last", f"{steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}"
         if steps and steps[0].get("loss") is not None else "n/a"),
        ("peak memory", f"{s['peak_memory_bytes_max'] / 2**20:,.0f} MiB ({s['memory_meter'].split(':')[0]})"),
        ("activations (rank 0)", f"{s['activation_bytes'] / 2**20:,.1f} MiB saved for backward per micro batch"
         if s.get("activation_bytes") is not None else "n/a"),
        ("model states (rank 0)", model_states_text(profile["model_state_bytes"])
         if profile.get("model_state_bytes") else "n/a"),
        ("params total / trainable", f"{profile['params']['total']:,} / {profile['params']['trainable']:,}"),
        ("trace per step", trace_size_text(profile)),
    ]
    if (profile.get("compile") or {}).get("compiled"):
        from trainprof.report.summary import compile_text

        rows.append(("compiled", compile_text(profile)))
    pl = profile.get("pipeline")
    timeline: list[str] = []
    if pl and "stages" in pl:
        from trainprof.report.pipeline import bubble_text, timeline_text

        bal = pl.get("balance") or {}
        rows.append(("pipeline bubble", bubble_text(pl)))
        rows.append(("stage imbalance", f"{100 * bal['imbalance']:.1f}% (slowest stage {bal['slowest_stage']})"
                     if bal.get("imbalance") is not None else "n/a"))
        if pl.get("timeline"):
            timeline = [f"  stage timeline, step {pl['timeline']['step']} (F/B forward/backward, . waiting for a "
                        "neighbour, c collective, o optimizer):",
                        *("    " + line for line in timeline_text(pl["timeline"]["stages"], width=60).splitlines())]
    width = max(len(k) for k, _ in rows)
    from trainprof.report.advisor import advise

    advice = advise(profile)["advice"]
    changes = [f"  - {a['title']}: {a['trigger']['text']}; gain: {a['gain']['text']}" for a in advice] \
        or ["  nothing triggered (checks listed in summary.md)"]
    return "\n".join(["", "trainprof run summary", "what to change:", *changes,
                      *(f"  {k:<{width}}  {v}" for k, v in rows), *timeline])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from trainprof.env import quiet_library_noise

    quiet_library_noise()
    try:
        recipe = load_recipe(args.recipe, args.overrides)
        import torch

        check_environment(recipe, cuda_available=torch.cuda.is_available())
        check_world_size(recipe, int(os.environ.get("WORLD_SIZE", 1)))
    except RecipeError as err:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"trainprof: {err}", file=sys.stderr)
        return 2
    train(recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
