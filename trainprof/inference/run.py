"""`trainprof infer`: the recipe's model served with HF generate over several batch sizes; serving
metrics, KV-cache bytes, peak memory, prefill MFU, decode bandwidth utilization and the prefill/decode
breakdown, written to runs/<recipe>-infer-<UTC timestamp>/inference.json plus a report and TensorBoard."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainprof.env import (apply_host_allocator, collect_env, device_name, memory_meter, peak_memory_bytes,
                           progress_interval, reset_peak_memory)
from trainprof.inference.breakdown import module_breakdown, operator_breakdown
from trainprof.inference.generate import METRICS_METHOD, TIMER_DESCRIPTION, make_prompt, run_request, serving_metrics
from trainprof.inference.interrupt import StoppedAt, keep_interrupted, sigterm_interrupts
from trainprof.io import atomic_write_json, atomic_write_text
from trainprof.layout import new_run_dir, tb_run_dir
from trainprof.profiler.compiled import CompiledModules, compile_block, dynamo_counters
from trainprof.profiler.flops import FlopCounter
from trainprof.hardware import dense_peak, memory_bandwidth
from trainprof.recipe import Recipe

SCHEMA_VERSION = 1


@dataclass(kw_only=True)
class InferSettings:
    batch_sizes: list[int]
    prompt_len: int = 512  # prompt tokens per request (synthetic ids)
    new_tokens: int = 128  # output tokens per request, fixed (eos disabled)
    requests: int = 5  # measured generate calls per batch size
    warmup: int = 2  # unmeasured generate calls per batch size first (>= 1 with model.compile: they compile)
    ops: bool = True  # operator-level trace of one request (the largest batch size)


def check_settings(recipe: Recipe, settings: InferSettings) -> None:
    """UserError for settings that would measure something else than serving: with model.compile the first
    call of each batch size compiles the decoder layers, which no warm-up call would leave to a measured one."""
    from trainprof.errors import UserError

    if recipe.model.compile and settings.warmup < 1:
        raise UserError(f"--warmup {settings.warmup} with model.compile=true would time torch.compile's compilation "
                        "as latency (the first call of each batch size compiles); pass --warmup 1 or more")


def load_inference_model(recipe: Recipe, device: torch.device) -> torch.nn.Module:
    """The recipe's model for serving: built as for training, LoRA adapters merged into the base weights
    (peft merge_and_unload), eval mode, KV cache on."""
    from trainprof.models import build_model

    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe, device=device)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.eval()
    model.config.use_cache = True
    model.generation_config.use_cache = True
    return model


def _prefill_flops(model: torch.nn.Module, input_ids: torch.Tensor) -> int:
    """FLOPs of one prefill as generate runs it (counted with torch.utils.flop_counter formulas on a
    1-token generate: the prompt forward, logits for the last position only)."""
    counter = FlopCounter(lambda: (-1, "prefill"))
    with counter:
        run_request(model, input_ids, 1)
    return sum(counter.counts.values())


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter except the input embedding, of which a
    step gathers only one row per sequence."""
    emb = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in emb)


def _dtype_key(model: torch.nn.Module) -> str:
    dt_ = next(model.parameters()).dtype
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt_, "tf32" if torch.backends.cuda.matmul.allow_tf32
                                                               else "fp32")


@dataclass(slots=True, kw_only=True)
class ServingDevice:
    """The device a model is served on and the figures its utilizations are measured against."""

    device: torch.device
    peak: dict[str, Any] | None  # dense peak for the model's dtype (profiles/accelerators.yaml), or None
    peak_reason: str
    bandwidth: dict[str, Any] | None  # memory bandwidth, or None
    bandwidth_reason: str
    weight_bytes: int  # what a decode step reads besides the KV cache

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device) -> ServingDevice:
        name = device_name(device)
        peak, peak_reason = dense_peak(name, device.type, _dtype_key(model))
        bandwidth, bandwidth_reason = memory_bandwidth(name, device.type)
        return cls(device=device, peak=peak, peak_reason=peak_reason, bandwidth=bandwidth,
                   bandwidth_reason=bandwidth_reason, weight_bytes=_weight_bytes(model))


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
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    apply_host_allocator(device, recipe.train.cpu_allocator)
    model = load_inference_model(recipe, device)
    run_dir = new_run_dir(recipe.output.dir, f"{recipe.output.name}-infer")
    # first: a run stopped before its results still says what it ran
    atomic_write_text(run_dir / "recipe.yaml", yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    serving = ServingDevice.of(model, device)
    compiled = CompiledModules.find(model)
    total = len(settings.batch_sizes) * (settings.warmup + settings.requests + 2) + int(settings.ops)
    bar = tqdm(total=total, desc=f"{recipe.output.name} infer", unit="call", file=sys.stderr, disable=not progress,
               mininterval=progress_interval())
    results: list[dict[str, Any]] = []
    ops = None

    def write(partial_reason: str | None = None) -> None:
        doc = inference_document(recipe, settings, serving, compiled, results, ops)
        if partial_reason:
            doc.update(partial=True, partial_reason=partial_reason)
        write_run_files(doc, run_dir)

    with sigterm_interrupts():
        try:
            for b in settings.batch_sizes:
                results.append(measure_batch(model, recipe, settings, b, serving, bar.update))
            if settings.ops:
                ids = make_prompt(max(settings.batch_sizes), settings.prompt_len, model.config.vocab_size,
                                  recipe.train.seed, device)
                ops = operator_breakdown(model, ids, settings.new_tokens, recipe.profile.module_depth,
                                         tb_run_dir(run_dir))
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
    kv_bytes = timings[0].cache_bytes
    tflops = flops / (metrics["ttft_ms"]["p50"] / 1e3) / 1e12
    tpot = metrics["tpot_ms"]["p50"] if metrics["tpot_ms"] else None
    bytes_per_step = serving.weight_bytes + kv_bytes
    gbps = bytes_per_step / (tpot / 1e3) / 1e9 if tpot else None
    peak, bandwidth = serving.peak, serving.bandwidth
    return {
        "batch_size": batch_size,
        **metrics,
        # a module with no window has no time: null, with not_timed saying why
        "modules": [{"name": m["name"], "prefill_ms": None if m["not_timed"] else m["prefill_ms"],
                     "decode_ms": None if m["not_timed"] else m["decode_ms"], "not_timed": m["not_timed"]}
                    for m in breakdown["modules"]],
        "closure": breakdown["closure"],
        # frames dynamo compiled (or recompiled) during the measured calls: > 0 puts compilation in the
        # latencies; None when dynamo was never loaded in this process
        "compiles_during_measured_calls": (after["frames_converted"] - before["frames_converted"]
                                           if before is not None and after is not None else None),
        "kv_cache_bytes": kv_bytes,
        "peak_memory_bytes": peak_mem,
        "prefill": {"flops": flops, "achieved_tflops": tflops,
                    "mfu": tflops / peak["tflops"] if peak else None,
                    "mfu_reason": None if peak else serving.peak_reason},
        "decode": {"bytes_per_step": bytes_per_step, "weight_bytes": serving.weight_bytes,
                   "kv_cache_bytes_read": kv_bytes, "achieved_gbps": gbps,
                   "bandwidth_utilization": gbps / bandwidth["gbps"] if bandwidth and gbps else None,
                   "bandwidth_reason": None if bandwidth else serving.bandwidth_reason},
    }


def generate_text(compiled: CompiledModules) -> str:
    """How generate ran, for settings.generate: HF's own compile of the whole forward is always off; the
    recipe's model.compile compiles the decoder layers (models.compile_decoder_layers)."""
    model = (f"decoder layers torch.compile'd by model.compile=true ({len(compiled.regions)} compiled region(s), "
             "inductor; compiled by each batch size's first warm-up call)" if compiled.compiled
             else "model eager (model.compile=false)")
    return ("HF generate: cache_implementation='static', greedy (do_sample=False, num_beams=1), min_new_tokens = "
            "max_new_tokens, eos disabled, generate's own torch.compile of the forward off (disable_compile=True), "
            f"{model}, synthetic prompt ids without padding; one generate call = batch_size requests")


def peak_memory_window(device: torch.device) -> str:
    """What one batch size's peak_memory_bytes covers: reset_peak_memory starts a window on GPU only."""
    if device.type == "cuda":
        return "window: warm-up and measured calls of the batch size"
    return ("window: the process lifetime so far, not the batch size (nothing resets the high-water mark here): a "
            "batch size's figure includes the model load and every earlier batch size's calls, so it only rises "
            "from one batch size to the next and does not compare them")


def inference_document(recipe: Recipe, settings: InferSettings, serving: ServingDevice, compiled: CompiledModules,
                       results: list[dict[str, Any]], ops: dict[str, Any] | None) -> dict[str, Any]:
    """inference.json: settings, environment, how each figure was measured, the results."""
    device, peak, bandwidth = serving.device, serving.peak, serving.bandwidth
    cuda = device.type == "cuda"
    env = collect_env(device, world_size=1)
    env["timer"] = "host_after_cuda_synchronize" if cuda else "host"
    modules = ("one extra generate call per batch size with the profiler's module hooks "
               f"({'CUDA events' if cuda else 'host clock'}); prefill = the model's first forward, decode_ms = mean "
               "per decode step (per output token after the first); windows inclusive of children")
    if compiled.compiled:
        modules += ("; compiled decoder layers are timed around their compiled call, and the modules inside them "
                    "have no window (not_timed: no hooks run inside compiled code, profiler/compiled.py)")
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "inference",
        "recipe": recipe.to_dict(),
        "settings": {"batch_sizes": settings.batch_sizes, "prompt_len": settings.prompt_len,
                     "new_tokens": settings.new_tokens, "requests": settings.requests, "warmup": settings.warmup,
                     "generate": generate_text(compiled)},
        "compile": compile_block(compiled, None),
        "env": env,
        "method": {
            "metrics": METRICS_METHOD,
            "timer": TIMER_DESCRIPTION[device.type],
            "modules": modules,
            "kv_cache_bytes": "bytes of the key/value tensors of the StaticCache generate allocated (all layers, "
                              "max_cache_len = prompt + new tokens - 1, whole batch)",
            "peak_memory_bytes": f"{memory_meter(device)}; {peak_memory_window(device)}",
            "prefill_mfu": "prefill FLOPs (torch.utils.flop_counter formulas on one prompt forward as generate runs "
                           "it, lm_head on the last position only) / TTFT p50 / the device's dense peak "
                           + (f"({peak['key']}: {peak['source']})" if peak else "(none known)"),
            "decode_bandwidth": "bytes read per decode step = weights (all parameters but the input embedding) + "
                                "the whole static KV cache (attention reads all max_cache_len slots, masked) / TPOT p50; "
                                "utilization = that / the device's memory bandwidth "
                                + (f"({bandwidth['source']})" if bandwidth else "(none known)"),
        },
        "peak": peak, "peak_reason": serving.peak_reason or None,
        "memory_bandwidth": bandwidth, "memory_bandwidth_reason": serving.bandwidth_reason or None,
        "results": results,
        "ops": ops,
    }
