"""inference.json as `trainprof infer` writes it: settings, the model served, the environment (machine load
included), how every figure was measured, and the results."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainprof.env import collect_env, machine_load
from trainprof.inference.generate import METRICS_METHOD, TIMER_DESCRIPTION
from trainprof.inference.serving import ServingDevice
from trainprof.profiler.compiled import CompiledModules, compile_block
from trainprof.recipe import Recipe

if TYPE_CHECKING:
    import torch

SCHEMA_VERSION = 1

LOAD_HOW = ("the host's 1-minute load average (os.getloadavg) when the measurement started (before the first "
            "warm-up call) and when inference.json was written, against the cores this process may use; this "
            "process's own threads count in it")


def generate_text(compiled: CompiledModules) -> str:
    """How generate ran, for settings.generate: HF's own compile of the whole forward is always off; the
    recipe's model.compile compiles the decoder layers (models.compile_decoder_layers)."""
    model = (f"decoder layers torch.compile'd by model.compile=true ({len(compiled.regions)} compiled region(s), "
             "inductor; compiled by each batch size's first warm-up call)" if compiled.compiled
             else "model eager (model.compile=false)")
    return ("HF generate: cache_implementation='static', greedy (do_sample=False, num_beams=1), min_new_tokens = "
            "max_new_tokens, eos disabled, generate's own torch.compile of the forward off (disable_compile=True), "
            f"{model}, synthetic prompt ids without padding; one generate call = batch_size requests")


def memory_meter_text(device: torch.device) -> str:
    """What an infer run's peak_memory_bytes measures (env.memory_meter): the meter, before its window."""
    if device.type == "cuda":
        return ("cuda_allocator_peak: torch.cuda.max_memory_allocated of the infer process, reset at the start of "
                "each batch size's warm-up and read after its measured calls")
    return ("cpu_process_peak_rss: the infer process's peak resident set (VmHWM, /proc/self/status): Python, the "
            "libraries, the model and every generate call so far, read after a batch size's measured calls")


def peak_memory_window(device: torch.device) -> str:
    """What one batch size's peak_memory_bytes covers: reset_peak_memory starts a window on GPU only."""
    if device.type == "cuda":
        return "window: warm-up and measured calls of the batch size"
    return ("window: the process lifetime so far, not the batch size (nothing resets the high-water mark): a "
            "batch size's figure includes the model load and every earlier batch size's calls, so it only rises "
            "from one batch size to the next and does not compare them")


def serving_load(at_start: float | None) -> dict[str, Any] | None:
    """env.machine_load of an infer run (env.machine_load as training records it, worded for infer)."""
    load = machine_load(at_start)
    return None if load is None else {**load, "how": LOAD_HOW}


def _modules_method(cuda: bool, compiled: CompiledModules) -> str:
    text = ("one extra generate call per batch size with the profiler's module hooks "
            f"({'CUDA events' if cuda else 'host clock'}); prefill = the model's first forward, decode_ms = mean "
            "per decode step (per output token after the first); windows inclusive of children; the hooks slow "
            "that call, and it is one call: request_ms is shown beside the measured calls' E2EL p50")
    if compiled.compiled:
        text += ("; compiled decoder layers are timed around their compiled call, and the modules inside them "
                 "have no window (not_timed: no hooks run inside compiled code, profiler/compiled.py)")
    return text


def _method(serving: ServingDevice, compiled: CompiledModules) -> dict[str, str]:
    device, peak, bandwidth = serving.device, serving.peak, serving.bandwidth
    return {
        "metrics": METRICS_METHOD,
        "timer": TIMER_DESCRIPTION[device.type],
        "modules": _modules_method(device.type == "cuda", compiled),
        "kv_cache_bytes": "bytes of the key/value tensors of the StaticCache generate allocated (all layers, "
                          "max_cache_len = prompt + new tokens - 1, whole batch)",
        "peak_memory_bytes": f"{memory_meter_text(device)}; {peak_memory_window(device)}",
        "prefill_mfu": "prefill FLOPs (torch.utils.flop_counter formulas on one prompt forward as generate runs "
                       "it, lm_head on the last position only) / TTFT p50 / the device's dense peak "
                       + (f"({peak['key']}: {peak['source']})" if peak else "(none known)"),
        "decode_bandwidth": "bytes read per decode step = weights (all parameters but the input embedding) + "
                            "the whole static KV cache (attention reads all max_cache_len slots, masked) / TPOT p50; "
                            "utilization = that / the device's memory bandwidth "
                            + (f"({bandwidth['source']})" if bandwidth else "(none known)"),
        "samples": "results[].samples: the measured calls' own values, one per call (ITL: every token gap of "
                   "every call); the percentiles weight each call by its batch_size requests",
        "ops": "one generate call at the largest batch size under torch.profiler: its own wall time and TTFT "
               "(traced_*) beside that batch size's untraced p50s; cost_frac = traced E2EL / untraced E2EL p50 - 1",
    }


def inference_document(recipe: Recipe, settings: dict[str, Any], serving: ServingDevice, compiled: CompiledModules,
                       results: list[dict[str, Any]], ops: dict[str, Any] | None, *, model: dict[str, Any],
                       load_at_start: float | None) -> dict[str, Any]:
    """inference.json: settings (InferSettings.record()), the model served, environment, how each figure was
    measured, the results; env.machine_load from `load_at_start` to now."""
    device = serving.device
    env = collect_env(device, world_size=1)
    env["timer"] = "host_after_cuda_synchronize" if device.type == "cuda" else "host"
    env["memory_meter"] = memory_meter_text(device)
    env["machine_load"] = serving_load(load_at_start)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "inference",
        "recipe": recipe.to_dict(),
        "model": model,
        "settings": {**settings, "generate": generate_text(compiled)},
        "compile": compile_block(compiled, None),
        "env": env,
        "method": _method(serving, compiled),
        "peak": serving.peak, "peak_reason": serving.peak_reason or None,
        "memory_bandwidth": serving.bandwidth, "memory_bandwidth_reason": serving.bandwidth_reason or None,
        "results": results,
        "ops": ops,
    }
