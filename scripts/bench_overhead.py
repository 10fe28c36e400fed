"""Profiler overhead on the tiny Llama (CPU): profiled and unprofiled training steps alternate in one
run, and the ratio of their median times is printed. Not a timed test.

    python scripts/bench_overhead.py --layers 4             # module hooks every step, a ~100 ms step
    python scripts/bench_overhead.py --batch 16 --pairs 150  # a ~400 ms step, as issue 15 measured (goal <= 1.01)
    python scripts/bench_overhead.py --depth 5 --pairs 40  # deeper module level
    python scripts/bench_overhead.py --device cuda --pairs 20 --json-out OUT.json  # on a GPU (bench_overhead_cuda.py)
    python scripts/bench_overhead.py --breakdown-only      # where the time of one hook goes
    python scripts/bench_overhead.py --in-situ-only        # each piece timed where it runs, inside real steps
    python scripts/bench_overhead.py --clock thread        # CPU time of this thread: on a busy shared machine
    python scripts/bench_overhead.py --compile --layers 2  # torch.compile'd layers: profiled compiled vs compiled

Besides the ratio, it prints the cost per module call in microseconds: (profiled - unprofiled step
time, median over pairs) / the number of module calls the hooks saw in one step (an upper bound: the
step exit and the journal append are in the difference too), and a breakdown of a
hook's pieces, each timed over many invocations in a loop (timer stamp, log append, functools.partial
creation, node pre-hook registration, a whole pre+post hook pair with and without grad). Those loop
figures run with warm caches; `in_situ` times each piece of the profiler where it runs, inside real
training steps (forward pre/post hooks, the node watching inside them, the engine's node callbacks,
the memory meter's syscalls, the step exit, the journal append), where the tensor work in between has evicted
the profiler's code and data from the caches: there each piece costs 2-3x its loop figure.

Each profiled step gets a fresh Profiler (hooks, collective wrappers, memory per phase; FLOP counting
off) that is closed again before the next unprofiled step, so unprofiled steps run with no hooks at
all. The time of a profiled step includes the step exit (stamps resolved, the step kept) and, in the
"as a run" row, the journal append; the module x phase analysis runs when the steps are read (save()
after training, or every 256th step of a longer run) and is printed beside the ratio, not in it. Steps run in
ABBA order; the ratio is the median over pairs of (profiled / unprofiled) of neighbouring steps, with
its interquartile range and a bootstrap 95% interval, which cancels the drift of a shared machine.
An A/A row (unprofiled against unprofiled) shows the noise floor. The runner keeps one Profiler for a
run; the row "one Profiler (as a run)" measures that, "a fresh Profiler a step" adds what a new
Profiler pays on its first step. Operator-level tracing
(torch.profiler) and the FLOP-counting step are measured the same way and reported separately.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainprof.env import quiet_library_noise  # noqa: E402
from trainprof.models import build_model  # noqa: E402
from trainprof.profiler import Profiler  # noqa: E402
from trainprof.profiler.core import ANALYSE_BACKLOG_STEPS  # noqa: E402
from trainprof.recipe import Recipe  # noqa: E402


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=200,
                   help="profiled/unprofiled step pairs (default 200: the median ratio's 95%% CI is then about "
                        "+-1%% on a shared 2-core machine)")
    p.add_argument("--depth", type=int, default=4, help="module_depth of the profiler (default 4, the recipe default)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the tiny Llama (default 4)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the GPU bench of scripts/bench_overhead_cuda.py (llama2-1b and a Llama2-7B LoRA step of "
                        "the runner; pass --pairs, e.g. 20)")
    p.add_argument("--json-out", help="with --device cuda: write the result, every pair's times included, as JSON")
    p.add_argument("--breakdown-only", action="store_true", help="print only the per-piece hook breakdown")
    p.add_argument("--in-situ-only", action="store_true",
                   help="print only the in-situ cost of each profiler piece per step (timed inside real steps)")
    p.add_argument("--in-situ-steps", type=int, default=200, help="steps for the in-situ figures (default 200)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sample (default 256, the CPU quickstart's)")
    p.add_argument("--batch", type=int, default=4, help="micro batch size (default 4, the CPU quickstart's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="model dtype (default bf16)")
    p.add_argument("--ops-pairs", type=int, default=6, help="pairs for the operator-level figure (default 6)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="clock of the step times in the ratio rows (the in-situ pieces stay on perf_counter_ns: "
                        "reading the thread clock is a system call, microseconds on a VM): "
                        "wall (default): time.perf_counter; thread: time.thread_time, this thread's CPU time, which "
                        "other processes on a shared machine do not inflate by preempting it (CPU and --threads 1 "
                        "only: the step's forward, backward and optimizer then all run on this thread)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each decoder layer first (model.compile; the first step compiles, ~30 s)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared 2-core machine more threads make "
                        "step times swing by 10x and the ratio meaningless)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.clock == "thread" and args.threads != 1:
        print("bench_overhead: --clock thread needs --threads 1 (other threads' work would not be counted)",
              file=sys.stderr)
        sys.exit(2)
    if args.compile and args.device == "cuda":
        print("bench_overhead: --compile is not part of --device cuda (its configurations are fixed in "
              "bench_overhead_cuda.py); drop one of them", file=sys.stderr)
        sys.exit(2)
    clock = CLOCKS[args.clock]
    quiet_library_noise()
    if args.device == "cuda":
        from bench_overhead_cuda import main_cuda

        main_cuda(args)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    recipe = Recipe()
    recipe.model.name, recipe.model.dtype = "llama2-tiny", args.dtype
    recipe.model.num_layers = args.layers
    recipe.model.compile = args.compile
    model = build_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq))

    def train_step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    def plain() -> float:
        t0 = clock()
        train_step()
        return clock() - t0

    def profiled(**kwargs: object) -> Callable[[], float]:
        """A fresh Profiler per step, closed after it: its unprofiled neighbours run with no hooks at all."""
        def run() -> float:
            prof = Profiler(model, optimizer=opt, module_depth=args.depth, **kwargs)
            t0 = clock()
            with prof.step():
                train_step()
            elapsed = clock() - t0  # includes the profiler's analysis at step exit
            prof.close()
            return elapsed
        return run

    def in_a_run(prof: Profiler) -> Callable[[], float]:
        """One Profiler for every step, as in `trainprof run`, with its journal (steps appended and
        flushed once a second); between its steps the hooks stay installed and return at once."""
        def run() -> float:
            t0 = clock()
            with prof.step():
                train_step()
            return clock() - t0
        return run

    for _ in range(5):
        train_step()
    print(f"tiny Llama ({args.layers} layers{', each compiled' if args.compile else ''}), batch {args.batch} x "
          f"seq {args.seq}, {args.dtype}, {torch.get_num_threads()} threads, module_depth {args.depth}, clock {args.clock}")
    if not args.in_situ_only:
        hook_breakdown(model, args.depth)
    if args.breakdown_only:
        return
    in_situ(model, opt, train_step, args.depth, args.in_situ_steps)
    if args.in_situ_only:
        return
    prof = Profiler(model, optimizer=opt, module_depth=args.depth, flops=False)
    with prof.step():
        train_step()
    calls = prof.hooks.counter // 2  # the counter advances once in each pre and each post hook
    prof.close()
    print(f"module calls timed per step: {calls} (forward; each also watches its producer nodes for backward)")

    run_dir = tempfile.TemporaryDirectory()  # the runner's journal goes to the run dir: so does this one's
    kept = Profiler(model, optimizer=opt, module_depth=args.depth, flops=False, journal_dir=run_dir.name)
    rows = [
        ("A/A control: unprofiled vs unprofiled", plain, args.pairs),
        ("module hooks, one Profiler (as a run)", in_a_run(kept), args.pairs),
        ("module hooks, a fresh Profiler a step", profiled(flops=False), args.pairs),
        ("+ operator level (torch.profiler)", profiled(flops=False, ops=True, ops_steps=1), args.ops_pairs),
        ("+ FLOP counting (one step per run)", profiled(flops=True), args.ops_pairs),
    ]
    print(f"{'mode':<40} {'unprofiled ms':>14} {'profiled ms':>12} {'ratio':>7}  {'ratio IQR':>13}  {'95% CI of ratio':>15}")
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
        lo, hi = median_ci(ratios)
        print(f"{name:<40} {statistics.median(base) * 1e3:>14.2f} {statistics.median(prof_times) * 1e3:>12.2f} "
              f"{statistics.median(ratios):>7.3f}  {q1:>6.3f}-{q3:<6.3f}  {lo:>7.3f}-{hi:<7.3f}")
        if name.startswith("module hooks, one"):
            extra_us = (statistics.median(ratios) - 1) * statistics.median(base) * 1e6
            print(f"{'':<40} cost per module call: {extra_us / calls:.1f} us "
                  f"((median ratio - 1) x unprofiled step / {calls} calls; includes the step exit and "
                  "the journal append, so an upper bound on the hooks' own cost)")
    backlog = kept.waiting_steps  # the steps since the last 256th: analysed when the steps are read
    t0 = time.perf_counter()
    _ = kept.steps
    print(f"{'':<40} then, as at save(): the module x phase analysis of its last {backlog} steps, "
          f"{(time.perf_counter() - t0) / max(backlog, 1) * 1e6:.0f} us per step (not in the ratio; a run with more than "
          f"{ANALYSE_BACKLOG_STEPS} measured steps pays it every {ANALYSE_BACKLOG_STEPS}th step)")
    kept.close()
    run_dir.cleanup()
    print("ratio: median over ABBA pairs of profiled / unprofiled wall time (time.perf_counter); 95% CI: "
          "bootstrap of that median (2000 resamples). The A/A row times the same unprofiled step on both "
          "sides: its distance from 1 and its CI are this machine's noise floor for the rows below.")


def median_ci(values: list[float], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of `values`."""
    import random

    if len(values) < 2:
        return values[0], values[0]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def _per_call_us(fn: Callable[[], object], n: int = 20000) -> float:
    """Median of 5 loops of n calls, microseconds per call (loop overhead included, ~0.02 us)."""
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def hook_breakdown(model: torch.nn.Module, depth: int) -> None:
    """Time the pieces of one module call's hooks in isolation (a loop of many invocations each)."""
    import functools

    from trainprof.profiler.hooks import NodeWatch
    from trainprof.profiler.log import F_OPEN, StepLog

    prof = Profiler(model, optimizer=None, module_depth=depth, flops=False)
    hooks, timer = prof.hooks, prof.timer
    x = torch.zeros(2, 8, requires_grad=True)
    x_nograd = torch.zeros(2, 8)
    log = StepLog()
    layer = model.model.layers[0].mlp
    mi = next(i.index for i in hooks.modules if i.name.endswith("layers.0.mlp"))
    noop = functools.partial(print)

    def log_append() -> None:  # as the hooks append one point to the log's columns
        log.codes.append(F_OPEN)
        log.subjects.append(3)
        log.stamps.append(0)

    pieces = [
        ("timer stamp (timer.now)", timer.now),
        ("log append (one point: three columns)", log_append),
        ("functools.partial creation", lambda: functools.partial(hooks._on_grad, NodeWatch(0, 1, []))),
        ("node pre-hook registration (grad_fn.register_prehook)", lambda: x.view_as(x).grad_fn.register_prehook(noop)),
        ("  (x.view_as(x) alone, to subtract)", lambda: x.view_as(x)),
    ]

    def pair_with_grad() -> None:
        out = x.view_as(x)  # a fresh producer node per call, as a module's output has
        hooks._pre(mi, layer, (x,), {})
        hooks._post(mi, layer, (x,), {}, out)

    with prof.step():  # hooks act only inside a step
        pieces += [
            ("pre+post hook pair, input needs grad (+ a view)", pair_with_grad),
            ("pre+post hook pair, no grad tensors", lambda: (hooks._pre(mi, layer, (x_nograd,), {}),
                                                             hooks._post(mi, layer, (x_nograd,), {}, x_nograd))),
        ]
        print("hook breakdown (us per invocation, median of 5 loops of 20000):")
        for name, fn in pieces:
            n = 2000 if "hook pair" in name else 20000
            print(f"  {name:<46} {_per_call_us(fn, n):7.2f}")
            log.clear()
            prof.log.clear()
    prof.close()


def in_situ(model: torch.nn.Module, opt: torch.optim.Optimizer, train_step: Callable[[], None], depth: int,
            steps: int) -> None:
    """Each piece of one Profiler (as in a run) timed where it runs, over `steps` real training steps:
    the hooks and the analysis are wrapped in a perf_counter_ns accumulator (about 0.1 us per call,
    included) and re-registered, so nothing else about the step changes."""
    from trainprof.profiler.hooks import attach_forward_hooks, describe_modules

    journal_dir = tempfile.TemporaryDirectory()
    prof = Profiler(model, optimizer=opt, module_depth=depth, flops=False, journal_dir=journal_dir.name)
    hooks, acc = prof.hooks, {}

    def timed(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        acc[name] = [0, 0]
        now = time.perf_counter_ns

        def wrapper(*a: object, **k: object) -> object:
            t0 = now()
            out = fn(*a, **k)
            cell = acc[name]
            cell[0] += 1
            cell[1] += now() - t0
            return out
        return wrapper

    for handle in hooks._handles:  # the module hooks hold the original methods: register timed ones instead
        handle.remove()
    hooks._handles.clear()
    pre, post = timed("forward pre-hooks", hooks._pre), timed("forward post-hooks", hooks._post)
    hooks._watch = timed("  of which: watching producer nodes", hooks._watch)
    hooks.flush = timed("  of which: node pre-hooks registered", hooks.flush)
    hooks._on_grad = timed("engine callbacks on watched nodes", hooks._on_grad)
    hooks._on_grad_now = timed("engine callbacks settled at once (root)", hooks._on_grad_now)
    hooks.settle = timed("backward stack, settled from the queue", hooks.settle)
    if prof.memory is not None:
        prof.memory.begin = timed("memory meter: phase begin", prof.memory.begin)
        prof.memory.end = timed("memory meter: phase end", prof.memory.end)
    prof._finish_step = timed("step exit: stamps resolved, step kept", prof._finish_step)
    prof.journal.step_ended = timed("journal: steps kept, written each second", prof.journal.step_ended)
    hooks._handles.extend(attach_forward_hooks(describe_modules(model, depth), pre, post))
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        with prof.step():
            train_step()
        walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter_ns()
    _ = prof.steps  # the module x phase analysis of every step, deferred to here (as to save() in a run)
    analysis_ns = time.perf_counter_ns() - t0
    prof.close()
    journal_dir.cleanup()
    step_us = statistics.median(walls) * 1e6
    print(f"in situ, per step (median profiled step {step_us / 1e3:.1f} ms; {steps} steps, one Profiler as in a run):")
    print(f"  {'piece':<40} {'calls':>6} {'us/call':>8} {'us/step':>8} {'% of step':>9}")
    total = 0.0
    for name, (calls, ns) in acc.items():
        per_step = ns / steps / 1e3
        if not name.startswith("  "):
            total += per_step
        print(f"  {name:<40} {calls / steps:6.1f} {ns / max(calls, 1) / 1e3:8.2f} {per_step:8.1f} {per_step / step_us:9.2%}")
    print(f"  {'sum (the module slow path of nn.Module.__call__ and the step context are not in it)':<40} "
          f"{total:.0f} us = {total / step_us:.2%} of the step")
    print(f"  after training, when the steps are read (save): the analysis, {analysis_ns / steps / 1e3:.0f} us per step "
          f"(in a run longer than {ANALYSE_BACKLOG_STEPS} measured steps, paid by every {ANALYSE_BACKLOG_STEPS}th step)")


if __name__ == "__main__":
    main()
