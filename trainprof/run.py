"""`python -m trainprof.run RECIPE [key=value ...]`: train a recipe (under torchrun or alone) and
write its run dir."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from trainprof.recipe import Recipe, RecipeError, check_environment, check_world_size, load_recipe

# how long a rank other than 0 that met a recipe mistake waits for rank 0 to print it (user_error)
RANK0_WAIT_S = 60.0
# on several nodes, how long the first rank of each node waits after printing a recipe mistake: its exit can end
# the rendezvous, and with it another node's ranks before they have printed the same line (user_error)
NODES_GRACE_S = 10.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainprof.run",
        description="Train and profile one recipe; run under torchrun for several ranks, e.g. "
        "`torchrun --nproc_per_node 2 -m trainprof.run recipes/quickstart_cpu.yaml`.",
    )
    parser.add_argument("recipe", help="recipe YAML file (see recipes/)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.micro_batch_size=4")
    return parser.parse_args(argv)


def train_step(engine, batches, grad_accum: int, prof=None) -> float | None:
    """One optimizer step: grad_accum micro batches of forward, backward, step(); the mean loss.
    With a Profiler, backward and the engine's step are marked as phases (so ZeRO's post-backward
    reduction counts as backward and DeepSpeed's optimizer as optimizer) and each micro batch's loss
    and tokens are recorded. A pipeline stage returns None except on the last stage (which computes
    the loss)."""
    import torch

    if hasattr(engine, "train_step"):  # a schedule (pipeline, Megatron) runs all micro batches of the step
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

    from trainprof.distributed import DistContext, init_distributed, shared_run_dir
    from trainprof.io import atomic_write_text

    ctx = DistContext.from_env()
    init_distributed(ctx, engine_kind=recipe.engine.kind)
    run_dir = shared_run_dir(recipe.output.dir, recipe.output.name)
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

    previous = signal.signal(signal.SIGTERM, raise_terminated)  # torchrun stops survivors with SIGTERM
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
            # the cap's own figure: the peak window may have been reset since (profiler phases, write_partial)
            "peak_memory_bytes": getattr(err, "peak_bytes", None) or peak_memory_bytes(ctx.device),
        })
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so record_failure can write the rank's failure file."""


def raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"terminated by SIGTERM ({_who_sent_sigterm()})")


def _who_sent_sigterm() -> str:
    """What likely sent this rank SIGTERM, as far as the rank can know: the signal does not say who sent it."""
    # set by trainprof's cell launcher (trainprof/sweep/runner.py cell_env)
    timeout = os.environ.get("TRAINPROF_CELL_TIMEOUT_S")
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if timeout:
        via = "through torchrun, which also stops the other ranks when one fails" if under_torchrun else "directly"
        return (f"sent by trainprof's cell launcher, {via}: the cell ran past its timeout of {timeout} s or the "
                "sweep was stopped; the sweep's record says which")
    if under_torchrun:
        return "from torchrun: it stops the other ranks when one fails, and passes on a SIGTERM it receives"
    return "sent by another process: a scheduler's preemption, a timeout or `kill`"


def _train(recipe: Recipe, ctx, run_dir: Path) -> Path:
    """Build the engine and the profiler, run the warm-up and measured steps, write the run dir; a rank
    that fails or is stopped keeps what it finished."""
    engine, loader, prof = build_run(recipe, ctx, run_dir)
    steps: list[dict[str, Any]] = []
    try:
        run_steps(recipe, ctx, engine, loader, prof, steps)
    except BaseException as err:
        write_partial(recipe, ctx, prof, steps, err, run_dir)
        raise
    finish_run(recipe, ctx, engine, prof, steps, run_dir)
    return run_dir


def build_run(recipe: Recipe, ctx, run_dir: Path):
    """Seeded engine, this rank's data loader and the recipe's Profiler (watching pipeline stages and
    DDP buckets where the engine has them). Returns (engine, loader, profiler)."""
    import torch

    from trainprof.data import build_loader
    from trainprof.distributed import seed_everything
    from trainprof.engines import build_engine, data_split
    from trainprof.env import apply_host_allocator, apply_memory_cap, check_memory_cap
    from trainprof.models import resolve_shape
    from trainprof.profiler import Profiler

    apply_host_allocator(ctx.device, recipe.train.cpu_allocator)
    seed_everything(recipe.train.seed)
    apply_memory_cap(ctx.device, recipe.train.memory_cap_gb)
    engine = build_engine(recipe, ctx)
    check_memory_cap(ctx.device, recipe.train.memory_cap_gb, before_steps=True)
    pipeline = engine.name == "pipeline"
    data_rank, data_ranks = data_split(engine, ctx)  # pipeline stages and model-parallel ranks share samples
    loader = build_loader(recipe, vocab_size=resolve_shape(recipe.model).vocab_size, rank=data_rank,
                          world_size=data_ranks)
    prof = Profiler.for_recipe(engine.loop_module, engine.optimizer, recipe, run_dir=run_dir, device=ctx.device)
    if pipeline and recipe.profile.enabled:
        prof.watch_pipeline(stage=engine.stage_index, num_stages=engine.num_stages,
                            schedule=recipe.engine.pipeline_schedule, micro_batches=recipe.train.grad_accum,
                            prev_rank=engine.prev_rank, next_rank=engine.next_rank)
        engine.set_action_callback(prof.pipeline_action)
    if isinstance(engine.loop_module, torch.nn.parallel.DistributedDataParallel) and recipe.profile.enabled:
        prof.watch_ddp(engine.loop_module)
    return engine, loader, prof


def run_steps(recipe: Recipe, ctx, engine, loader, prof, steps: list[dict[str, Any]]) -> None:
    """The warm-up and measured steps under the profiler, each appended to `steps` as it finishes, with a
    progress bar on rank 0."""
    from tqdm import tqdm

    from trainprof.env import check_memory_cap, progress_interval

    t = recipe.train
    bar = tqdm(total=t.warmup_steps + t.steps, desc=f"{recipe.output.name}", unit="step",
               disable=ctx.rank != 0, file=sys.stderr, mininterval=progress_interval())
    no_loss = "n/a (last stage's)" if recipe.engine.pipeline_stages > 1 else "n/a"  # rank 0 runs the first one
    with prof:
        batches = prof.wrap_loader(loader)
        for step in range(t.warmup_steps + t.steps):
            with prof.step():
                record = timed_step(engine, batches, t.grad_accum, ctx.device, prof)
            record.update(step=step - t.warmup_steps, warmup=step < t.warmup_steps)
            steps.append(record)
            check_memory_cap(ctx.device, t.memory_cap_gb)
            bar.set_postfix(loss=f"{record['loss']:.3f}" if record["loss"] is not None else no_loss,
                            ms=f"{record['wall_ms']:.0f}", refresh=False)  # drawn by update(), at its interval
            bar.update()
        bar.close()


def write_partial(recipe: Recipe, ctx, prof, steps: list[dict[str, Any]], err: BaseException, run_dir: Path) -> None:
    """A rank that failed or was stopped: the steps it finished, marked partial, and the profiler's
    breakdown of them (`trainprof report` merges these files)."""
    from trainprof.io import atomic_write_json

    # already stopping: a second SIGTERM must not cut the partial files short (torchrun SIGKILLs later)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # rank<N>.json is the name of a finished rank
    atomic_write_json(run_dir / f"rank{ctx.rank}.partial.json", {"rank": ctx.rank, "partial": True, "steps": steps})
    # written once, here (an exception or torchrun's SIGTERM), so the finished run pays nothing for it
    prof.close()  # the hooks come off, and the journal writes the steps it holds back (profiler/journal.py)
    if not (recipe.profile.enabled and prof.steps):
        return
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


def finish_run(recipe: Recipe, ctx, engine, prof, steps: list[dict[str, Any]], run_dir: Path) -> None:
    """Every rank: its step log, the merged profile (a collective), its rank file and the calibration;
    rank 0 also writes the run dir's files and prints the summary."""
    import torch

    from trainprof.env import collect_env, cpu_oversubscription, cpu_slots, memory_meter
    from trainprof.io import atomic_write_json
    from trainprof.models import count_params
    from trainprof.report.run_report import write_run_files
    from trainprof.report.summary import terminal_summary

    # the runner's own per-step log (warm-up included), written before the collective merge so a
    # rank that dies there still leaves it
    atomic_write_json(run_dir / f"rank{ctx.rank}.json", {"rank": ctx.rank, "partial": False, "steps": steps})
    measured = [s for s in steps if not s["warmup"]]
    extra = {
        "peak_memory_bytes_max": max(s["peak_memory_bytes"] for s in measured),
        "memory_meter": memory_meter(ctx.device),
        "cpu_slots": cpu_slots(),
        "params": count_params(engine.module),
    }
    rank_extras = gather_to_rank0(extra, ctx)
    env = collect_env(ctx.device, ctx.world_size)
    profile = prof.result(recipe=recipe.to_dict(), env=env,  # a collective: every rank merges
                          engine={"kind": engine.name, "config": engine.config}, params_of=engine.module)
    profile["partial"] = False
    if ctx.rank == 0:
        profile["summary"]["peak_memory_bytes_max"] = max(e["peak_memory_bytes_max"] for e in rank_extras)
        profile["summary"]["memory_meter"] = extra["memory_meter"]
        if ctx.device.type == "cpu":
            profile["env"]["oversubscribed"] = cpu_oversubscription([e["cpu_slots"] for e in rank_extras])
        if engine.name == "pipeline":  # each stage holds its own layers: the model is their sum
            profile["params"] = {k: sum(e["params"][k] for e in rank_extras) for k in ("total", "trainable")}
        write_run_files(profile, run_dir)
        print(terminal_summary(profile, run_dir), file=sys.stderr)
    atomic_write_json(run_dir / f"profile.rank{ctx.rank}.json", prof.rank_result())
    prof.discard_journal()
    if recipe.profile.calibrate:
        write_calibration(recipe, ctx, run_dir)
    if ctx.distributed:
        torch.distributed.barrier()


def write_calibration(recipe: Recipe, ctx, run_dir: Path) -> None:
    """calibration.json for `trainprof project` (a collective: every rank measures the collectives)."""
    from trainprof.io import atomic_write_json
    from trainprof.projection.calibrate import calibrate_in_run

    cal = calibrate_in_run(ctx, recipe.model.dtype)
    if cal is not None:
        atomic_write_json(run_dir / "calibration.json", cal)


def gather_to_rank0(obj: Any, ctx) -> list[Any]:
    import torch.distributed as dist

    if not ctx.distributed:
        return [obj]
    out = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


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
        return user_error(err)
    from trainprof.env import MemoryCapExceeded

    try:
        train(recipe)
    except MemoryCapExceeded as err:  # the user's own cap: its line says all (record_failure wrote the file)
        line = f"trainprof: rank {os.environ.get('RANK', 0)}: {err}"
        say_line(line)
        write_error_file(err, line)
        if err.every_rank:  # no rank exits, and so has torchrun stop the others, before each has said its line
            import torch.distributed as dist

            dist.barrier()
        return 1
    return 0


def say_line(line: str) -> None:
    """`line` and its newline on stderr in one write: the ranks under torchrun share the stream, and print()'s
    two writes (text, then newline; two system calls when stderr is unbuffered, PYTHONUNBUFFERED) let two ranks
    that print at once join their lines into one."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def write_error_file(err: Exception, line: str) -> None:
    """Under torchrun, this rank's TORCHELASTIC_ERROR_FILE (the format torch.distributed.elastic's @record
    writes), so torchrun's failure report names `line` as the root cause instead of a link to its docs."""
    import json

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        with open(error_file, "w") as f:
            json.dump({"message": {"message": f"{type(err).__name__}: {err}",
                                   "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}, f)


def user_error(err: Exception) -> int:
    """A recipe mistake: one line on rank 0's stderr, exit code 2. Under torchrun each rank also writes
    it to its TORCHELASTIC_ERROR_FILE (the format torch.distributed.elastic's @record writes), so
    torchrun's failure report names this line as the root cause instead of a link to its docs; torchrun
    itself still prints that report and exits 1 (README, "Use"). Every rank reads the same recipe, so rank 0
    meets the same mistake: the other ranks wait for it (up to RANK0_WAIT_S), as torchrun stops the others when
    the first rank exits, and a rank 0 still importing when a faster rank exited never printed its line. On
    several nodes the first rank of every other node prints the line too, and each node's first rank exits
    NODES_GRACE_S after printing: a node's log is all its user sees there, and its ranks would otherwise wait out
    RANK0_WAIT_S for a rank 0 whose exit their torchrun need not see (it did not where the other node held the
    rendezvous store). A waiting rank writes its error file when it exits, stopped by torchrun or at the end of
    its wait: torchrun names the failure with the earliest timestamp (whole seconds) its root cause, and one written
    before rank 0's named a rank torchrun had stopped (exit code -15)."""
    line = f"trainprof: {err}"
    rank = int(os.environ.get("RANK", 0))
    first_of_another_node = int(os.environ.get("GROUP_RANK", 0)) > 0 and int(os.environ.get("LOCAL_RANK", 0)) == 0
    says_it = rank == 0 or first_of_another_node
    if says_it:
        say_line(line)
    if not says_it:
        def stopped(*_: Any) -> None:
            write_error_file(err, line)
            os._exit(2)

        signal.signal(signal.SIGTERM, stopped)
        time.sleep(RANK0_WAIT_S)
        write_error_file(err, line)
        return 2
    write_error_file(err, line)
    if int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1:
        time.sleep(NODES_GRACE_S)
    return 2


if __name__ == "__main__":
    sys.exit(main())
