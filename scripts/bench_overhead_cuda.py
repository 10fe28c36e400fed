"""Profiler overhead on a GPU (`python scripts/bench_overhead.py --device cuda [--pairs N] [--json-out FILE]`).

The runner's own step (trainprof.run.train_step on the plain PyTorch engine: AMP bf16, fp32 AdamW, one
GPU) of each configuration below, profiled and unprofiled steps alternating in ABBA order, each step
timed on the host clock between two torch.cuda.synchronize() calls (as the runner times it). The ratio
is the median over pairs of profiled / unprofiled neighbouring steps, with its interquartile range and a
bootstrap 95% interval (bench_overhead.median_ci); an A/A row (unprofiled against unprofiled) gives the
noise floor. Rows:
- one Profiler (as a run): the Profiler `trainprof run` builds (hooks, CUDA-event timer, memory per
  phase, NVML telemetry; no FLOP counting, no operator trace) kept for every step; between its steps the
  hooks stay installed and return at once, so the unprofiled neighbours carry that small cost too;
- a fresh Profiler a step: one built before each profiled step (outside the timing) and closed after it,
  so unprofiled neighbours run with no hook at all; its steps also pay a Profiler's first-step costs.
Cost per module call = (median ratio - 1) x unprofiled step / module calls per step (an upper bound: the
step exit is in the difference too). `gpu_busy_frac`: device time of one unprofiled step traced with
torch.profiler (the union of its kernel, memcpy and memset intervals) over the median unprofiled step; the goal (ratio <= 1.02) is for a GPU-bound step.
The JSON keeps every pair's times, so the figures can be recomputed without a GPU (tests/test_gpu_evidence.py).
"""

from __future__ import annotations

import datetime as dt
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO = Path(__file__).resolve().parents[1]
GOAL_RATIO = 1.02
# (name, recipe, overrides): the GPU-bound llama2-1b step of scripts/gpu_check.sh, and a Llama2-7B LoRA step
CONFIGS = [
    ("llama2-1b pretraining, plain PyTorch AMP bf16, micro batch 16 x seq 1024",
     "recipes/llama1b_zero3_sdpa.yaml",
     ["engine.kind=torch", "engine.zero_stage=0", "train.micro_batch_size=16", "data.seq_len=1024"]),
    ("Llama2-7B LoRA (r 16, q/k/v/o), plain PyTorch AMP bf16, micro batch 4 x seq 1024",
     "recipes/llama13b_lora.yaml",
     ["model.name=llama2-7b", "engine.kind=torch", "engine.zero_stage=0", "train.micro_batch_size=4",
      "data.seq_len=1024"]),
]


def main_cuda(args: Any) -> dict[str, Any]:
    """Run every configuration; print the table; write args.json_out when given. Returns the document."""
    from bench_overhead import median_ci

    if not torch.cuda.is_available():
        print("bench_overhead.py --device cuda: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        sys.exit(2)
    doc: dict[str, Any] = {
        "bench": "profiler overhead on a GPU (scripts/bench_overhead.py --device cuda)",
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", "scripts/bench_overhead.py", *sys.argv[1:]]),
        "method": __doc__.split("\n\n", 1)[1].strip(), "goal_ratio": GOAL_RATIO, "configs": [],
    }
    for name, recipe_path, overrides in CONFIGS:
        try:
            doc["configs"].append(bench_config(name, recipe_path, overrides, args.pairs, median_ci,
                                               torch.device("cuda", torch.cuda.current_device())))
        except Exception as err:  # noqa: BLE001  one configuration failing (e.g. out of memory) keeps the other
            print(f"{name}: failed: {type(err).__name__}: {err}", file=sys.stderr)
            doc["configs"].append({"name": name, "recipe": recipe_path, "overrides": overrides,
                                   "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"})
        gc.collect()
        torch.cuda.empty_cache()
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"written: {args.json_out}")
    return doc


def bench_config(name: str, recipe_path: str, overrides: list[str], pairs: int,
                 median_ci: Callable[[list[float]], tuple[float, float]], device: torch.device) -> dict[str, Any]:
    """One configuration's rows (the CPU test runs it on a tiny model, so the GPU gets a bench that ran)."""
    from trainprof.engines import DistContext
    from trainprof.engines.torch_engine import TorchEngine
    from trainprof.profiler import Profiler
    from trainprof.recipe import load_recipe
    from trainprof.distributed import seed_everything
    from trainprof.run import train_step

    recipe = load_recipe(REPO / recipe_path, overrides)
    seed_everything(recipe.train.seed)
    engine = TorchEngine(recipe, DistContext(device=device))
    vocab = engine.module.config.vocab_size
    ids = torch.randint(0, vocab, (recipe.train.micro_batch_size, recipe.data.seq_len), device=device)
    batches = itertools.repeat({"input_ids": ids, "labels": ids})
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(prof: Profiler | None = None) -> float:
        sync()
        t0 = time.perf_counter()
        train_step(engine, batches, 1, prof)
        sync()
        return (time.perf_counter() - t0) * 1e3

    def as_profiled(prof: Profiler) -> float:
        with prof.step():
            return timed(prof)

    def make() -> Profiler:
        return Profiler.for_recipe(engine.loop_module, engine.optimizer, recipe, flops=False, ops=False,
                                   warmup_steps=0, active_steps=None)

    def fresh() -> float:
        prof = make()
        try:
            return as_profiled(prof)
        finally:
            prof.close()

    for _ in range(3):
        timed()
    probe = make()
    as_profiled(probe)
    calls = probe.hooks.counter // 2  # the counter advances in each pre and each post hook
    telemetry = f"on: NVML every {probe.telemetry.period_ms:g} ms" if probe.telemetry else probe.telemetry_reason
    probe.close()
    rows = [alternate("A/A control: unprofiled vs unprofiled", timed, timed, pairs, median_ci)]
    print_row(name, rows[-1])
    kept = make()  # built after the A/A row: its installed hooks must not slow that row's steps
    try:
        rows.append(alternate("one Profiler (as a run)", lambda: as_profiled(kept), timed, pairs, median_ci))
    finally:
        kept.close()
    print_row("", rows[-1])
    rows.append(alternate("a fresh Profiler a step", fresh, timed, pairs, median_ci))
    print_row("", rows[-1])
    base_ms = statistics.median(rows[1]["unprofiled_ms"])
    out = {"name": name, "recipe": recipe_path, "overrides": overrides, "module_depth": kept.module_depth,
           "module_calls_per_step": calls, "telemetry": telemetry, "rows": rows,
           "us_per_module_call": (rows[1]["ratio_median"] - 1) * base_ms * 1e3 / calls if calls else None,
           "gpu_busy_frac": traced_busy(lambda: timed()) / base_ms if cuda else None,
           "gpu_busy_frac_reason": None if cuda else "no GPU: the step ran on the CPU",
           "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None}
    busy = "n/a" if out["gpu_busy_frac"] is None else f"{out['gpu_busy_frac']:.0%}"
    print(f"{'':<4}cost per module call (as a run): {out['us_per_module_call']:.2f} us over {calls} calls; "
          f"GPU busy {busy} of an unprofiled step (the goal {GOAL_RATIO} is for >= 80%)")
    del engine, kept, probe
    return out


def alternate(mode: str, run: Callable[[], float], plain: Callable[[], float], pairs: int,
              median_ci: Callable[[list[float]], tuple[float, float]]) -> dict[str, Any]:
    """`pairs` ABBA pairs of (plain, run): their times and the ratio's median, IQR and 95% CI."""
    base, prof = [], []
    for i in range(pairs):
        if i % 2 == 0:
            b, p = plain(), run()
        else:
            p, b = run(), plain()
        base.append(b)
        prof.append(p)
    ratios = [p / b for p, b in zip(prof, base)]
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    return {"mode": mode, "pairs": pairs, "unprofiled_ms": base, "profiled_ms": prof,
            "ratio_median": statistics.median(ratios), "ratio_iqr": [q1, q3], "ratio_ci95": list(median_ci(ratios))}


def traced_busy(step: Callable[[], float]) -> float:
    """Device ms of one step under torch.profiler: the union of its kernel, memcpy and memset intervals in
    the exported trace. (The sum of key_averages' self device time counts device time more than once: it
    gave 5.1 and 1.9 times the step on an H200.)"""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from trainprof.analysis.gpu_busy import trace_device_time

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.pt.trace.json"
        p.export_chrome_trace(str(path))
        return trace_device_time(path).union_ms


def print_row(name: str, row: dict[str, Any]) -> None:
    if name:
        print(f"{name}\n{'':<4}{'mode':<40} {'unprofiled ms':>14} {'profiled ms':>12} {'ratio':>7}  "
              f"{'ratio IQR':>13}  {'95% CI of ratio':>15}")
    q1, q3 = row["ratio_iqr"]
    lo, hi = row["ratio_ci95"]
    print(f"{'':<4}{row['mode']:<40} {statistics.median(row['unprofiled_ms']):>14.2f} "
          f"{statistics.median(row['profiled_ms']):>12.2f} {row['ratio_median']:>7.3f}  {q1:>6.3f}-{q3:<6.3f}  "
          f"{lo:>7.3f}-{hi:<7.3f}")
