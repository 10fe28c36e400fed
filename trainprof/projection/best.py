"""The best settings per target (`trainprof project RUN --best`): for each target and world size, every
combination of ZeRO stage, recomputation and offload (and LoRA vs QLoRA for a finetuning task, bf16 for
an fp32 run) at every
micro batch that fits the target's memory with headroom, each predicted by the step model; the setting
with the highest tokens/s and the one with the lowest $/M tokens, with their runners-up. This is the
research's max-batch table (Zhang et al., arXiv 2311.03687, Table IV) for hardware one does not have.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable

HEADROOM = 0.9  # a setting fits when its planned memory is at most this share of the capacity
MAX_MICRO_BATCH = 256
RUNNERS_UP = 3


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """One combination of the searched recipe keys (micro batch apart)."""

    overrides: tuple[str, ...]

    @property
    def text(self) -> str:
        return " ".join(self.overrides)


def settings(recipe: Any, *, same_machine: bool, dtype_given: bool = False) -> list[Setting]:
    """The combinations searched for a recipe: DeepSpeed ZeRO stage 1-3 (and the source's own engine when
    it is not DeepSpeed: DDP or FSDP), recomputation on/off, offload none / optimizer / optimizer+params
    (stage 3 only), for LoRA/QLoRA the two tasks, and for an fp32 recipe bf16 too unless the user gave the
    dtype (`dtype_given`); on the source's machine only recomputation (each engine change is an engine
    probe there, seconds each)."""
    recompute = ("model.recompute=false", "model.recompute=true")
    if same_machine:
        return [Setting(overrides=(r,)) for r in recompute]
    engines = [("engine.kind=deepspeed", f"engine.zero_stage={z}", "engine.offload=none") for z in (1, 2, 3)]
    engines += [("engine.kind=deepspeed", "engine.zero_stage=2", "engine.offload=optimizer"),
                ("engine.kind=deepspeed", "engine.zero_stage=3", "engine.offload=optimizer"),
                ("engine.kind=deepspeed", "engine.zero_stage=3", "engine.offload=optimizer+params")]
    if recipe.engine.kind != "deepspeed":
        engines.insert(0, ())
    tasks = [("task.kind=lora",), ("task.kind=qlora",)] if recipe.task.kind in ("lora", "qlora") else [()]
    dtypes = [(), ("model.dtype=bf16",)] if recipe.model.dtype == "fp32" and not dtype_given else [()]
    return [Setting(overrides=(*e, r, *t, *d)) for e, r, t, d in itertools.product(engines, recompute, tasks, dtypes)]


def search(predict: Callable[[list[str]], dict[str, Any] | None], capacity_bytes: float | None, base: list[str],
           candidates: list[Setting], *, start_micro_batch: int = 1,
           planned: Callable[[list[str]], float | None] | None = None) -> dict[str, Any]:
    """Every candidate at micro batch 1, 2, 4, ... until its planned memory passes HEADROOM x capacity.

    Args:
        predict: overrides -> a prediction dict (None: the recipe rules refuse the combination).
        capacity_bytes: the target's memory per GPU (None: only the starting micro batch is tried).
        base: the user's overrides, applied first.
        planned: overrides -> the memory per GPU alone (None: refused), without predicting the step: where no
            candidate fits at the starting micro batch, the search ends there, before any step is predicted
            (a step on the source's machine may probe for minutes).
    Returns:
        {best_throughput, best_cost, runners_up_throughput, runners_up_cost, tried, refused, not_predicted,
        least_memory_bytes}: rows of {setting, micro_batch, step_ms, tokens_per_s, memory_per_rank_bytes,
        cost_per_million_tokens_usd, time_to_train_s, cost_to_train_usd (null without the tokens to train),
        confidence_text}; `not_predicted` the settings that fit but whose step
        the step model cannot predict ({setting, micro_batch, memory_per_rank_bytes, reason}, at their
        smallest micro batch), `least_memory_bytes` the smallest planned memory of any setting (what
        "nothing fits" missed by).
    """
    rows, refused, not_predicted, least = [], [], [], None
    if planned is not None and capacity_bytes is not None:
        smallest = _smallest(planned, base, candidates, start_micro_batch)
        if smallest is not None and smallest > HEADROOM * capacity_bytes:
            return _found([], [], [], smallest, checked_first=True)
    for cand in candidates:
        mb = start_micro_batch
        while mb <= MAX_MICRO_BATCH:
            overrides = [*base, *cand.overrides, f"train.micro_batch_size={mb}"]
            pred = predict(overrides)
            if pred is None:
                refused.append(cand.text)
                break
            memory = pred.get("memory_per_rank_bytes")
            if memory is not None:
                least = memory if least is None else min(least, memory)
            if capacity_bytes is not None and memory is not None and memory > HEADROOM * capacity_bytes:
                break
            host = pred.get("host_memory_per_rank_bytes") or None  # offload's: the node must hold it
            if not pred.get("tokens_per_s"):  # its reason does not change with the micro batch
                reasons = pred.get("reasons") or {}
                not_predicted.append({"setting": cand.text, "micro_batch": mb, "memory_per_rank_bytes": memory,
                                      "host_memory_per_rank_bytes": host,
                                      "reason": reasons.get("step_ms") or reasons.get("tokens_per_s")})
                break
            rows.append({"setting": cand.text, "micro_batch": mb, "step_ms": pred["step_ms"],
                         "tokens_per_s": pred["tokens_per_s"], "memory_per_rank_bytes": memory,
                         "host_memory_per_rank_bytes": host,
                         "cost_per_million_tokens_usd": pred.get("cost_per_million_tokens_usd"),
                         "time_to_train_s": pred.get("time_to_train_s"),
                         "cost_to_train_usd": pred.get("cost_to_train_usd"),
                         "confidence_text": pred.get("confidence_text"), "host_pace": pred.get("host_pace"),
                         "bound_by": pred.get("bound_by")})
            if capacity_bytes is None:
                break
            mb *= 2
    return _found(rows, refused, not_predicted, least)


def _smallest(planned: Callable[[list[str]], float | None], base: list[str], candidates: list[Setting],
              micro_batch: int) -> float | None:
    """The least memory per GPU of any candidate at `micro_batch` (None: the rules refuse every one)."""
    sizes = [planned([*base, *c.overrides, f"train.micro_batch_size={micro_batch}"]) for c in candidates]
    return min((x for x in sizes if x is not None), default=None)


def _found(rows: list[dict[str, Any]], refused: list[str], not_predicted: list[dict[str, Any]], least: float | None,
           *, checked_first: bool = False) -> dict[str, Any]:
    """search's result from its rows (see there)."""
    by_tps = _each_setting_once(sorted(rows, key=lambda r: -r["tokens_per_s"]))
    priced = [r for r in rows if r["cost_per_million_tokens_usd"] is not None]
    by_cost = _each_setting_once(sorted(priced, key=lambda r: r["cost_per_million_tokens_usd"]))
    return {"best_throughput": by_tps[0] if by_tps else None, "runners_up_throughput": by_tps[1:1 + RUNNERS_UP],
            "best_cost": by_cost[0] if by_cost else None, "runners_up_cost": by_cost[1:1 + RUNNERS_UP],
            "tried": len(rows), "refused": sorted(set(refused)), "not_predicted": not_predicted,
            "least_memory_bytes": least, "headroom": HEADROOM, "checked_before_predicting": checked_first}


def _each_setting_once(ranked: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each setting at its best micro batch, in rank order: the runners-up are other settings, not the
    winner again at smaller micro batches."""
    out: dict[str, dict[str, Any]] = {}
    for row in ranked:
        out.setdefault(row["setting"], row)
    return list(out.values())
