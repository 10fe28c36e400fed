"""One rank's profile document assembled from a Profiler's recorded steps (the analysis does the
numbers; this module puts them under the profile.json field names and says how each was measured)."""

from __future__ import annotations

import statistics
from typing import Any, Protocol

import torch

from trainprof.analysis.aggregate import (
    SCHEMA_VERSION,
    comm_rows,
    flops_by_module,
    module_rows,
    module_tree_step,
    rank_entry,
    select_steps,
    step_entries,
    summarize,
)
from trainprof.analysis.pipeline import BUBBLE_METHOD, rank_block
from trainprof.env import collect_env, machine_load
from trainprof.profiler.compiled import compile_block
from trainprof.profiler.flops import FLOPS_CONVENTION
from trainprof.profiler.fsdp import param_dtypes as fsdp_param_dtypes
from trainprof.profiler.memory import ACTIVATION_METHOD, model_state_bytes
from trainprof.hardware import dense_peak

class Recorded(Protocol):
    """What this module reads from a Profiler (trainprof.profiler.core implements it): the recorded
    steps and how they were measured. Declared here so that data flows one way, core -> result."""

    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module
    optimizer: Any
    recipe: dict[str, Any] | None
    extra_env: dict[str, Any]
    enabled: bool
    timer: Any  # .kind, .description
    hooks: Any  # ModuleHooks | None: .modules
    memory: Any  # MemoryTracker | None: .method
    steps: list[Any]  # StepRecord
    flops: Any
    count_flops: bool
    ops: bool
    ops_rows: list[dict[str, Any]]
    module_depth: int
    warmup_steps: int
    activation_bytes: int | None
    grads_bytes: int | None
    pipeline: Any  # PipelineInfo | None (a pipeline stage)
    ddp: bool  # DDP's gradient all-reduces watched (watch_ddp)
    dynamo: Any  # DynamoWatch | None (a compiled model)


def compute_dtype(model: torch.nn.Module, autocast: torch.dtype | None = None) -> str:
    """The dtype matmuls ran in, as a peak-table key: the forward's autocast dtype when autocast was on
    (fp32 master weights under AMP run their matmuls in bf16/fp16), else an FSDP2 MixedPrecisionPolicy's
    param_dtype (its groups compute in it over fp32 shards), else the dtype most floating-point parameters
    have (fp32 matmuls -> tf32 when torch allows TF32 on CUDA)."""
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + 1
    policy = fsdp_param_dtypes(model)
    dtype = autocast or (next(iter(policy)) if len(policy) == 1 else None) or \
        (max(counts, key=counts.__getitem__) if counts else torch.float32)
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def recorded_dtype(prof: Any) -> str:
    """compute_dtype of the profiled model, with the autocast dtype its hooks saw on the root forward."""
    return compute_dtype(prof.model, prof.hooks.autocast_dtype if prof.hooks is not None else None)


def profile_env(prof: Recorded) -> dict[str, Any]:
    """The `env` block: library versions, device, world size (trainprof.env.collect_env); the
    runner's fields laid over it; the timer is always the profiler's own."""
    env = collect_env(prof.device, prof.world_size)
    env.update(prof.extra_env)
    env["timer"] = prof.timer.kind
    env["timer_description"] = prof.timer.description
    env["machine_load"] = machine_load(getattr(prof, "load_at_start", None))
    return env


def rank_profile(prof: Recorded) -> dict[str, Any]:
    """This rank's profile: what profile.rank<r>.json holds (no collective)."""
    out = compose_rank_profile(prof, env=profile_env(prof), state=state_bytes(prof),
                               device_type=prof.device.type, dtype=recorded_dtype(prof))
    out["compile"] = compile_block(prof.hooks.compiled if prof.hooks is not None else None, prof.dynamo)
    if out["compile"]["compiled"]:
        out["measurement"]["module_granularity"] = out["compile"]["module_times"]
    return out


def state_bytes(prof: Recorded) -> dict[str, Any]:
    """Model state bytes (params, grads, optimizer states), with the grads read on the FLOP-counting step."""
    return with_grads(model_state_bytes(prof.model, prof.optimizer), prof.grads_bytes)


def with_grads(state: dict[str, Any], grads_bytes: int | None) -> dict[str, Any]:
    """`state` with the grads read when the optimizer began on the FLOP-counting step folded in (the
    live grads may be freed by then)."""
    if grads_bytes is None:
        return state
    state = {**state, "grads": max(state["grads"], grads_bytes)}
    state["total"] = state["params"] + state["grads"] + state["optimizer_states"] + state["master_params"]
    return state


def compose_rank_profile(prof: Any, *, env: dict[str, Any], state: dict[str, Any], device_type: str,
                         dtype: str) -> dict[str, Any]:
    """The rank document from what was recorded (prof: the Recorded fields other than model, optimizer,
    device and extra_env) and the facts read from the live process (env, model state bytes, device
    type, compute dtype); trainprof.profiler.journal replays a killed rank through it."""
    steps_used, used_desc = select_steps(prof.steps)
    infos = prof.hooks.modules if prof.hooks is not None else []
    flops = prof.flops
    peak, reason = dense_peak(env["device"], device_type, dtype)
    summary = summarize(steps_used, prof.steps, flops=flops, flops_convention=FLOPS_CONVENTION,
                        memory_method=prof.memory.method if prof.memory is not None else None,
                        peak=peak, peak_reason=reason)
    summary["steps_used_description"] = used_desc
    summary["warmup_steps"] = prof.warmup_steps  # leading step()s not measured (the profile keeps the last)
    summary["activation_bytes"] = prof.activation_bytes
    if prof.activation_bytes is not None:
        summary["activation_bytes_method"] = ACTIVATION_METHOD
    else:
        summary["activation_bytes_reason"] = ("FLOP counting is off (flops=False), and activations are counted on "
                                              "the FLOP-counting step" if not prof.count_flops else
                                              "no tensor was saved for backward on the FLOP-counting step")
    op_steps = [s for s in prof.steps if "ops" in s.instrumented]
    ops_cost = None
    if op_steps and summary["step_ms"]["median"]:
        ops_cost = statistics.median(s.breakdown.wall_ms for s in op_steps) / summary["step_ms"]["median"] - 1
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "rank",
        "rank": prof.rank,
        "recipe": prof.recipe,
        "env": env,
        "measurement": measurement(prof, used_desc),
        "steps": step_entries_with_modules(prof.steps, infos),
        "summary": summary,
        "modules": module_rows(infos, steps_used, flops_by_module(infos, flops["counts"]) if flops else None),
        "ops": mean_ops(prof.ops_rows),
        "ops_info": {"enabled": prof.ops, "steps": [s.step for s in op_steps], "cost_frac": ops_cost,
                     "mechanism": "torch.profiler (Kineto) with trainprof record_function ranges per module and "
                                  "phase; see trainprof/profiler/ops.py"},
        "comm": comm_rows(steps_used),
        "model_state_bytes": state,
        "ranks": [rank_entry(prof.rank, steps_used)],
        "straggler": None,
        **({"pipeline": rank_block(prof.pipeline, steps_used)} if prof.pipeline is not None else {}),
    }


def step_entries_with_modules(steps: list[Any], infos: list[Any]) -> list[dict[str, Any]]:
    """Each step's entry; beyond the medians, each carries its own module times (`modules_ms`: name ->
    [forward, backward, recompute] ms, modules that ran), for per-step series (TensorBoard) and the
    run-to-run diff's noise."""
    out = step_entries(steps)
    if infos:
        for entry, record in zip(out, steps):
            rows = module_tree_step(infos, record.breakdown.modules)
            entry["modules_ms"] = {infos[i].name: [r["forward_ms"], r["backward_ms"], r["recompute_ms"]]
                                   for i, r in rows.items()}
    return out


def mean_ops(per_step: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Operator rows averaged over the traced steps (per-step values)."""
    if not per_step:
        return []
    n = len(per_step)
    acc: dict[tuple[str, Any, str], dict[str, Any]] = {}
    for rows in per_step:
        for r in rows:
            a = acc.setdefault((r["name"], r["module"], r["phase"]), {
                "name": r["name"], "module": r["module"], "phase": r["phase"], "calls": 0.0, "self_ms": 0.0,
                "self_cpu_ms": 0.0, "flops": None})
            a["calls"] += r["calls"] / n
            a["self_ms"] += r["self_ms"] / n
            a["self_cpu_ms"] += r["self_cpu_ms"] / n
            if r["flops"] is not None:
                a["flops"] = (a["flops"] or 0) + r["flops"] / n
    out = sorted(acc.values(), key=lambda r: r["self_ms"], reverse=True)
    for r in out:
        r["calls"] = round(r["calls"], 3)
        if r["flops"] is not None:
            r["flops"] = int(r["flops"])
    return out


DDP_WAIT = ("DDP waits for its gradient all-reduces in C++ at the end of backward, where no Python hook sees "
            "the wait: that wait is counted in backward, not comm_exposed; the all-reduces' issue-to-completion time "
            "bounds it")


def measurement(prof: Recorded, used_desc: str) -> dict[str, str]:
    """How every figure was measured, in words, for the output."""
    return {
        "profiler": ("enabled" if prof.enabled else
                     "disabled (profile.enabled false): only step wall time and data wait were recorded"),
        "timer": prof.timer.description,
        "steps_used": used_desc,
        "module_depth": str(prof.module_depth),
        "module_times": ("forward/recompute: forward-hook windows minus exposed communication inside them; "
                         "backward: from the tensor hook on a module's outputs to the first autograd node "
                         "created before the module ran (or the end of the backward pass), minus "
                         "recompute and exposed communication inside; self = minus the children that ran; "
                         "per-module values are medians over steps of per-step sums over calls"),
        "recompute": ("forward hooks firing inside an autograd graph task (activation checkpointing re-runs); "
                      "back-to-back re-runs of children are one re-run of their common ancestor"),
        "phases": ("each instant labeled once, priority pipeline_bubble = comm_exposed > recompute > data_wait > optimizer > "
                   "backward = forward > other; unattributed = wall - sum(phases)"),
        "comm_exposed": ("host timer: time the issuing thread blocked in a synchronous collective or in "
                         "Work.wait(); CUDA events: compute-stream time across the call / wait"),
        "comm_module": ("a collective belongs to the innermost profiled module open when it was issued; FSDP2's to the "
                        "module whose parameter group issued it (all-gather, reduce-scatter; see profiler/fsdp.py)"),
        "comm_bandwidth": ("nccl-tests PERFORMANCE.md: algbw = S/t, busbw = algbw*2(n-1)/n for all_reduce, "
                           "*(n-1)/n for all_gather/reduce_scatter/all_to_all, *1 for broadcast/reduce; "
                           "t = issue-to-completion, which includes waiting for slower ranks"),
        "memory": prof.memory.method if prof.memory is not None else "not measured",
        "pipeline_bubble": (BUBBLE_METHOD if prof.pipeline is not None else
                            "0: not a pipeline stage (no engine.pipeline_stages > 1)"),
        **({"comm_exposed_ddp": DDP_WAIT} if prof.ddp else {}),
        **({"p2p": ("point-to-point rows: phase = what they carry (forward activations, backward gradients); "
                    "total = issue to the end of this rank's last wait on it, so it includes waiting for the "
                    "neighbour and the bandwidth is a lower bound; the link time per transfer is "
                    "pipeline.transfers of the merged profile")} if prof.pipeline is not None else {}),
    }
