"""`trainprof infer`: the recipe's model served with HF generate over several batch sizes; serving
metrics, KV-cache bytes, peak memory, prefill MFU, decode bandwidth utilization and the prefill/decode
breakdown, written to runs/<recipe>-infer-<UTC timestamp>/inference.json plus a report and TensorBoard."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainprof.env import apply_host_allocator, load_average, peak_memory_bytes, progress_interval, reset_peak_memory
from trainprof.inference.breakdown import module_breakdown, operator_breakdown
from trainprof.inference.checks import serving_recipe
from trainprof.inference.document import inference_document
from trainprof.inference.generate import make_prompt, run_request, serving_metrics
from trainprof.inference.interrupt import StoppedAt, keep_interrupted, sigterm_interrupts
from trainprof.inference.serving import ServingDevice, load_inference_model, model_facts
from trainprof.io import atomic_write_json, atomic_write_text
from trainprof.layout import new_run_dir, tb_run_dir
from trainprof.profiler.compiled import CompiledModules, dynamo_counters
from trainprof.profiler.flops import FlopCounter
from trainprof.recipe import Recipe

NO_DECODE_STEP = ("no decode step: with one new token the only output token comes from prefill, so there is no "
                  "TPOT to read a decode step's bytes over; pass --new-tokens 2 or more")


@dataclass(kw_only=True)
class InferSettings:
    batch_sizes: list[int]
    prompt_len: int = 512  # prompt tokens per request (synthetic ids)
    new_tokens: int = 128  # output tokens per request, fixed (eos disabled)
    requests: int = 5  # measured generate calls per batch size
    warmup: int = 2  # unmeasured generate calls per batch size first (>= 1 with model.compile: they compile)
    ops: bool = True  # operator-level trace of one request (the largest batch size)

    def record(self) -> dict[str, Any]:
        """inference.json's settings (generate's own are added by the document)."""
        return {"batch_sizes": self.batch_sizes, "prompt_len": self.prompt_len, "new_tokens": self.new_tokens,
                "requests": self.requests, "warmup": self.warmup}


def check_settings(recipe: Recipe, settings: InferSettings) -> None:
    """UserError for settings that would measure something else than serving: with model.compile the first
    call of each batch size compiles the decoder layers, which no warm-up call would leave to a measured one."""
    from trainprof.errors import UserError

    if recipe.model.compile and settings.warmup < 1:
        raise UserError(f"--warmup {settings.warmup} with model.compile=true would time torch.compile's compilation "
                        "as latency (the first call of each batch size compiles); pass --warmup 1 or more")


def _prefill_flops(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """FLOPs of one prefill as generate runs it (counted with torch.utils.flop_counter formulas on a
    1-token generate: the prompt forward, logits for the last position only)."""
    counter = FlopCounter(lambda: (-1, "prefill"))
    with counter:
        run_request(model, input_ids, 1)
    return sum(counter.counts.values())


def infer(recipe: Recipe, settings: InferSettings, *, progress: bool = True) -> Path:
    """Run the inference profile and write the run dir: per batch size, warm-up and measured calls, the
    hooked call (module breakdown) and the FLOP-counting call; then one traced call at the largest
    batch size.

    Returns:
        the run directory.
    Raises:
        UserError: settings that would not measure serving (check_settings).
        InferInterrupted: Ctrl-C or SIGTERM; the batch sizes that finished are kept (interrupt.py).
    """
    import yaml
    from tqdm import tqdm

    check_settings(recipe, settings)
    recipe = serving_recipe(recipe)  # what ran: one process, no training engine
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    apply_host_allocator(device, recipe.train.cpu_allocator)
    model = load_inference_model(recipe, device)
    run_dir = new_run_dir(recipe.output.dir, f"{recipe.output.name}-infer")
    # first: a run stopped before its results still says what it ran
    atomic_write_text(run_dir / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    serving = ServingDevice.of(model, device)
    served = model_facts(recipe, model)
    compiled = CompiledModules.find(model)
    total = len(settings.batch_sizes) * (settings.warmup + settings.requests + 2) + int(settings.ops)
    bar = tqdm(total=total, desc=f"{recipe.output.name} infer", unit="call", file=sys.stderr, disable=not progress,
               mininterval=progress_interval())
    results: list[dict[str, Any]] = []
    ops = None
    load_at_start = load_average()  # env.machine_load: was the machine busy while this measured

    def write(partial_reason: str | None = None) -> None:
        doc = inference_document(recipe, settings.record(), serving, compiled, results, ops, model=served,
                                 load_at_start=load_at_start)
        if partial_reason:
            doc.update(partial=True, partial_reason=partial_reason)
        write_run_files(doc, run_dir)

    with sigterm_interrupts():
        try:
            for b in settings.batch_sizes:
                results.append(measure_batch(model, recipe, settings, b, serving, bar.update))
            if settings.ops:
                ops = trace_largest_batch(model, recipe, settings, results, run_dir)
                bar.update()
        except KeyboardInterrupt as err:
            bar.close()
            stopped = StoppedAt.of(err, settings.batch_sizes, len(results))
            raise keep_interrupted(run_dir, stopped, lambda: write(stopped.reason)) from None
    bar.close()
    write()
    return run_dir


def write_run_files(doc: dict[str, Any], run_dir: Path) -> None:
    """inference.json (checked against its schema first) and the reports made from it."""
    from trainprof.inference.report import write_reports
    from trainprof.inference.schema import validate_inference

    validate_inference(doc)
    atomic_write_json(run_dir / "inference.json", doc)
    write_reports(doc, run_dir)


def measure_batch(model: torch.nn.Module, recipe: Recipe, settings: InferSettings, batch_size: int,
                  serving: ServingDevice, tick: Any) -> dict[str, Any]:
    """One batch size: serving metrics over the measured calls, the module breakdown, prefill MFU and
    decode bandwidth; `tick()` after each generate call (the progress bar)."""
    device = serving.device
    ids = make_prompt(batch_size, settings.prompt_len, model.config.vocab_size, recipe.train.seed, device)
    reset_peak_memory(device)
    for _ in range(settings.warmup):
        run_request(model, ids, settings.new_tokens)
        tick()
    before = dynamo_counters()
    timings = []
    for _ in range(settings.requests):
        timings.append(run_request(model, ids, settings.new_tokens))
        tick()
    after = dynamo_counters()
    peak_mem = peak_memory_bytes(device)
    metrics = serving_metrics(timings)
    breakdown = module_breakdown(model, ids, settings.new_tokens, recipe.profile.module_depth)
    tick()
    flops = _prefill_flops(model, ids)
    tick()
    e2el = metrics["e2el_ms"]["p50"]
    return {
        "batch_size": batch_size,
        **metrics,
        # a module with no window has no time: null, with not_timed saying why
        "modules": [{"name": m["name"], "prefill_ms": None if m["not_timed"] else m["prefill_ms"],
                     "decode_ms": None if m["not_timed"] else m["decode_ms"], "not_timed": m["not_timed"]}
                    for m in breakdown["modules"]],
        # the hooked call beside the measured calls it stands for: hooks on, and one call
        "closure": {**breakdown["closure"], "e2el_p50_ms": e2el,
                    "hooked_over_e2el": breakdown["closure"]["request_ms"] / e2el},
        # frames dynamo compiled (or recompiled) during the measured calls: > 0 puts compilation in the
        # latencies; None when dynamo was never loaded in this process
        "compiles_during_measured_calls": (after["frames_converted"] - before["frames_converted"]
                                           if before is not None and after is not None else None),
        "kv_cache_bytes": timings[0].cache_bytes,
        "peak_memory_bytes": peak_mem,
        "prefill": prefill_block(serving, flops, metrics["ttft_ms"]["p50"]),
        "decode": decode_block(serving, timings[0].cache_bytes, (metrics["tpot_ms"] or {}).get("p50")),
    }


def prefill_block(serving: ServingDevice, flops: int, ttft_ms: float) -> dict[str, Any]:
    """Prefill FLOPs over TTFT p50, and MFU against the device's dense peak where one is known."""
    tflops = flops / (ttft_ms / 1e3) / 1e12
    peak = serving.peak
    return {"flops": flops, "achieved_tflops": tflops, "mfu": tflops / peak["tflops"] if peak else None,
            "mfu_reason": None if peak else serving.peak_reason}


def decode_block(serving: ServingDevice, kv_bytes: int, tpot_ms: float | None) -> dict[str, Any]:
    """Bytes a decode step reads over TPOT p50, and its share of the memory bandwidth; with no decode step
    (one new token) that is the reason, whatever the device."""
    bytes_per_step = serving.weight_bytes + kv_bytes
    gbps = bytes_per_step / (tpot_ms / 1e3) / 1e9 if tpot_ms else None
    bandwidth = serving.bandwidth
    reason = NO_DECODE_STEP if gbps is None else None if bandwidth else serving.bandwidth_reason
    return {"bytes_per_step": bytes_per_step, "weight_bytes": serving.weight_bytes, "kv_cache_bytes_read": kv_bytes,
            "achieved_gbps": gbps, "bandwidth_utilization": gbps / bandwidth["gbps"] if bandwidth and gbps else None,
            "bandwidth_reason": reason}


def trace_largest_batch(model: torch.nn.Module, recipe: Recipe, settings: InferSettings,
                        results: list[dict[str, Any]], run_dir: Path) -> dict[str, Any]:
    """The operator breakdown of one call at the largest batch size, tied to the measurement: the traced
    call's own E2EL and TTFT beside that batch size's untraced p50s, and cost_frac (traced E2EL / untraced
    E2EL p50 - 1, as training's ops_info.cost_frac compares traced and untraced steps)."""
    batch = max(settings.batch_sizes)
    ids = make_prompt(batch, settings.prompt_len, model.config.vocab_size, recipe.train.seed, model.device)
    ops = operator_breakdown(model, ids, settings.new_tokens, recipe.profile.module_depth, tb_run_dir(run_dir))
    untraced = next(r for r in results if r["batch_size"] == batch)
    e2el, ttft = untraced["e2el_ms"]["p50"], untraced["ttft_ms"]["p50"]
    return {**ops, "untraced_e2el_p50_ms": e2el, "untraced_ttft_p50_ms": ttft,
            "cost_frac": ops["traced_e2el_ms"] / e2el - 1}
