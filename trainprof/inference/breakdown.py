"""Prefill / decode breakdown of one generate call: module level with the profiler's module hooks, operator
level with torch.profiler (the training profiler's OpTracer), both split at the first output token.

Module level: ModuleHooks records every forward call of every module down to `max_depth` with the
training timer (CUDA events on GPU, host clock on CPU). The model's own forward calls are the
generate steps: the first is prefill (the whole prompt, produces token 1), each later one a decode
step (one token per sequence). Each module window is attributed to the model call that encloses it.
Decode figures are per decode step (= per output token after the first). Closure: the request's wall
time = the top-level modules' windows (the model's children: decoder stack and lm_head) +
unattributed (generate's own work: logits processing, argmax, cache bookkeeping, the model's glue).
Decoder layers torch.compile'd (model.compile) are timed around their compiled call; the modules
inside a layer get no hooks (profiler/compiled.py), so their rows say `not_timed` instead of a time.

Operator level: the hooks also open `trainprof::prefill::<module>` / `trainprof::decode::<module>`
record_function ranges (switched when the first token exists), the request runs under torch.profiler,
and each aten op goes to its innermost range, as in training (profiler/ops.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainprof.analysis.records import F_CLOSE, F_OPEN, RANGE_PREFIX, module_label
from trainprof.inference.generate import RequestTiming, run_request
from trainprof.profiler.hooks import ModuleHooks
from trainprof.profiler.log import StepLog
from trainprof.profiler.ops import OpTracer
from trainprof.profiler.timers import make_timer

PHASES = ("prefill", "decode")
CLOSURE_NOTE = ("request_ms (the hooked call, same timer) = the top-level modules' prefill + decode windows + "
                "unattributed_ms, the call's time outside them: generate's own work (logits processing, argmax, cache "
                "and stopping-criteria bookkeeping) and the hooks' own cost around the top-level windows")


def _range_names(modules: list[Any]) -> list[dict[str, str]]:
    return [{phase: f"{RANGE_PREFIX}{phase}::{module_label(m.name)}" for phase in PHASES} for m in modules]


def module_breakdown(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int,
                     max_depth: int) -> dict[str, Any]:
    """Time one generate call per module, prefill and decode apart.

    Args:
        model: the causal LM (eval mode, use_cache on).
        input_ids: (batch, prompt_len) prompt.
        new_tokens: output tokens per request.
        max_depth: deepest module level timed (0 = the model).
    Returns:
        {modules: [{name, type, depth, prefill_ms, decode_ms, decode_calls_per_token, not_timed}], closure: {...},
        timer}; not_timed is None for a module with a window, else why it has none (its 0 ms are no measurement)
    """
    timer = make_timer(input_ids.device)
    log = StepLog(active=True)
    hooks = ModuleHooks(model, max_depth, log, timer.now, recompute_sentinels=False)
    origin = timer.now()
    try:
        run_request(model, input_ids, new_tokens)
        end = timer.now()
    finally:
        log.active = False
        hooks.close()
    times = timer.resolve(origin, [*log.stamps, end])
    timer.release()
    request_ms = times[-1]
    n = len(hooks.modules)
    prefill, decode = [0.0] * n, [0.0] * n
    decode_calls, calls = [0] * n, [0] * n
    open_at: dict[int, list[float]] = {}
    root_calls = -1  # index of the model call in progress: 0 = prefill, >= 1 decode steps
    for code, mi, t in zip(log.codes, log.subjects, times):
        if code == F_OPEN:
            if mi == 0:
                root_calls += 1
            open_at.setdefault(mi, []).append(t)
        elif code == F_CLOSE and open_at.get(mi):
            span = t - open_at[mi].pop()
            calls[mi] += 1
            if root_calls == 0:
                prefill[mi] += span
            else:
                decode[mi] += span
                decode_calls[mi] += 1
    steps = max(root_calls, 1)  # decode steps = model calls after prefill
    rows = [{"name": module_label(m.name), "type": m.type, "depth": m.depth, "prefill_ms": prefill[m.index],
             "decode_ms": decode[m.index] / steps, "decode_calls_per_token": decode_calls[m.index] / steps,
             "not_timed": _not_timed(m.name, calls[m.index], hooks)}
            for m in hooks.modules]
    top = [m.index for m in hooks.modules if m.depth == 1] or [0]
    top_ms = sum(prefill[i] + decode[i] for i in top)
    return {
        "modules": rows,
        "decode_steps": root_calls,
        "closure": {
            "request_ms": request_ms, "top_level_ms": top_ms, "model_ms": prefill[0] + decode[0],
            "unattributed_ms": request_ms - top_ms,
            "unattributed_frac": (request_ms - top_ms) / request_ms if request_ms else None,
            "top_level_modules": [module_label(hooks.modules[i].name) for i in top],
            "note": CLOSURE_NOTE,
        },
        "timer": timer.kind,
    }


NOT_TIMED_INSIDE_COMPILED = "not timed (inside a compiled layer)"
NOT_TIMED_NOT_CALLED = "not called (a container such as a ModuleList: its children are timed)"


def _not_timed(name: str, calls: int, hooks: ModuleHooks) -> str | None:
    """Why a module has no window in the hooked call, None when it has one: inside a torch.compile'd region
    it gets no hooks (profiler/compiled.py), and a container that is never called has none to fire."""
    if name in hooks.compiled.inside_names:
        return NOT_TIMED_INSIDE_COMPILED
    return None if calls else NOT_TIMED_NOT_CALLED


def operator_breakdown(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int, max_depth: int,
                       trace_dir: Path) -> dict[str, Any]:
    """One generate call under torch.profiler: aten ops by (module, prefill|decode) and a Kineto trace in
    `trace_dir` (TensorBoard plugin layout, as training writes it).

    Returns:
        {rows: [{name, module, phase, calls, self_ms, self_ms_per_token}], trace_files, decode_steps, batch_size,
        traced_e2el_ms, traced_ttft_ms (the traced call's own wall time and first token), self_ms_by_phase}
    """
    cuda = input_ids.device.type == "cuda"
    timer = make_timer(input_ids.device)
    log = StepLog(active=True)
    hooks = ModuleHooks(model, max_depth, log, timer.now, recompute_sentinels=False)
    names = _range_names(hooks.modules)
    tracer = OpTracer(cuda=cuda, trace_dir=trace_dir, rank=0, world_size=1, wait=0, warmup=0, active=1,
                      record_shapes=False, gzip=True)

    def switch_to_decode(token_index: int) -> None:
        if token_index == 0:
            hooks.range_names = [{"forward": n["decode"]} for n in names]

    try:
        tracer.begin_step(0, names, [module_label(m.name) for m in hooks.modules])
        hooks.range_names = [{"forward": n["prefill"]} for n in names]
        timing: RequestTiming = run_request(model, input_ids, new_tokens, on_token=switch_to_decode)
        rows = tracer.end_step(0) or tracer.close() or [[]]
    finally:
        log.active = False
        hooks.close()
        if not tracer.done:
            tracer.close()
    decode_steps = max(timing.output_tokens - 1, 1)
    by_phase: dict[str, float] = {}
    for r in rows[0]:
        by_phase[r["phase"]] = by_phase.get(r["phase"], 0.0) + r["self_ms"]
    out = []
    for r in rows[0]:
        per_token = r["self_ms"] / decode_steps if r["phase"] == "decode" else None
        out.append({"name": r["name"], "module": r["module"], "phase": r["phase"], "calls": r["calls"],
                    "self_ms": r["self_ms"], "self_ms_per_token": per_token})
    return {"rows": out, "trace_files": [p.name for p in tracer.files], "decode_steps": decode_steps,
            "batch_size": int(input_ids.shape[0]),
            # the traced call's own clock (the token stamps, as the measured calls are timed): the total its
            # operators' self times fall inside, prefill's up to the first token
            "traced_e2el_ms": timing.end_ms, "traced_ttft_ms": timing.token_ms[0], "self_ms_by_phase": by_phase,
            "self_time": "device (kernel) self time" if cuda else "host self time (torch.profiler, CPU)"}
