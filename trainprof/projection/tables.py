"""The research's tables, predicted for hardware one does not have (`trainprof project RUN --table
zhang2023 --to a800-80g,rtx4090,rtx3090`): Zhang et al. (arXiv 2311.03687) measured, on three 8-GPU
platforms, pretraining throughput and memory per method and model size (their Table III), the
largest micro batch each method fits and the throughput there (Table IV), and LoRA/QLoRA finetuning
(Table IX). Each cell here is one prediction from one measured run, with its confidence.

The rows (methods) are given by the caller, e.g. from recipes/sweeps/pretrain_methods_gpu.yaml.
"""

from __future__ import annotations

from typing import Any, Callable

from trainprof.projection.best import HEADROOM, MAX_MICRO_BATCH

MODEL_SIZES = ("llama2-7b", "llama2-13b", "llama2-70b")
# the research's pretraining methods (Table III's rows), as recipes/sweeps/pretrain_methods_gpu.yaml measures
# them (tests/test_projection_tables.py keeps the two in step); baseline: eager attention, no recompute
METHODS_BASE = ["model.attention=eager", "model.recompute=false", "engine.offload=none"]
METHODS: list[tuple[str, list[str]]] = [
    ("naive DP", ["engine.zero_stage=0"]),
    ("ZeRO-2", ["engine.zero_stage=2"]),
    ("ZeRO-3", ["engine.zero_stage=3"]),
    ("ZeRO-2 + offload", ["engine.zero_stage=2", "engine.offload=optimizer"]),
    ("ZeRO-3 + offload", ["engine.zero_stage=3", "engine.offload=optimizer+params"]),
    ("ZeRO-2 + recompute", ["engine.zero_stage=2", "model.recompute=true"]),
    ("ZeRO-3 + recompute", ["engine.zero_stage=3", "model.recompute=true"]),
    ("ZeRO-2 + flash", ["engine.zero_stage=2", "model.attention=flash2"]),
    ("ZeRO-3 + flash", ["engine.zero_stage=3", "model.attention=flash2"]),
    ("ZeRO-2 + recompute + flash", ["engine.zero_stage=2", "model.recompute=true", "model.attention=flash2"]),
    ("ZeRO-3 + recompute + flash", ["engine.zero_stage=3", "model.recompute=true", "model.attention=flash2"]),
    ("ZeRO-3 + offload + recompute + flash",
     ["engine.zero_stage=3", "engine.offload=optimizer+params", "model.recompute=true", "model.attention=flash2"]),
    ("ZeRO-2 + 4-bit", ["engine.zero_stage=2", "optimizer.state_bits=4"]),
    ("ZeRO-3 + 4-bit", ["engine.zero_stage=3", "optimizer.state_bits=4"]),
    ("ZeRO-3 + recompute + flash + 4-bit",
     ["engine.zero_stage=3", "model.recompute=true", "model.attention=flash2", "optimizer.state_bits=4"]),
]
# Table IV's rows: recipes/sweeps/pretrain_maxbatch_gpu.yaml's cells
MAXBATCH_METHODS: list[tuple[str, list[str]]] = [
    ("naive DP", ["engine.zero_stage=0"]),
    ("ZeRO-2", ["engine.zero_stage=2"]),
    ("ZeRO-3", ["engine.zero_stage=3"]),
    ("ZeRO-3 + offload", ["engine.zero_stage=3", "engine.offload=optimizer+params"]),
    ("ZeRO-3 + recompute", ["engine.zero_stage=3", "model.recompute=true"]),
    ("ZeRO-3 + flash", ["engine.zero_stage=3", "model.attention=flash2"]),
    ("ZeRO-3 + recompute + flash", ["engine.zero_stage=3", "model.recompute=true", "model.attention=flash2"]),
    ("ZeRO-3 + 4-bit", ["engine.zero_stage=3", "optimizer.state_bits=4"]),
]
# Table IX: recipes/sweeps/finetune_gpu.yaml's settings
FINETUNE_BASE = ["engine.zero_stage=2", "model.recompute=true"]
Predict = Callable[[list[str], str], dict[str, Any] | None]  # (overrides, target) -> prediction or None (refused)


def _cell(pred: dict[str, Any] | None) -> dict[str, Any]:
    if pred is None:
        return {"tokens_per_s": None, "memory_gib": None, "fits": None, "confidence": None,
                "reason": "the recipe rules refuse this combination"}
    return {"tokens_per_s": pred["tokens_per_s"], "memory_gib": (pred["memory_per_rank_bytes"] or 0) / 2**30 or None,
            "fits": pred["fits"], "confidence": pred.get("confidence_text"), "host_pace": pred.get("host_pace"),
            "bound_by": pred.get("bound_by"), "reason": (pred.get("reasons") or {}).get("step_ms")}


def methods_table(predict: Predict, methods: list[tuple[str, list[str]]], targets: list[str],
                  models: tuple[str, ...] = MODEL_SIZES) -> list[dict[str, Any]]:
    """Table III: per method and model size, per target, tokens/s and memory per GPU."""
    rows = []
    for model in models:
        for name, overrides in methods:
            row: dict[str, Any] = {"model": model, "method": name}
            for target in targets:
                row[target] = _cell(predict([f"model.name={model}", *overrides], target))
            rows.append(row)
    return rows


def maxbatch_table(predict: Predict, methods: list[tuple[str, list[str]]], targets: list[str],
                   capacity_gb: dict[str, float | None], models: tuple[str, ...] = MODEL_SIZES) -> list[dict[str, Any]]:
    """Table IV: per method and model size, per target, the largest micro batch that fits with headroom
    (doubling) and the predicted tokens/s there."""
    rows = []
    for model in models:
        for name, overrides in methods:
            row: dict[str, Any] = {"model": model, "method": name}
            for target in targets:
                row[target] = _largest(predict, [f"model.name={model}", *overrides], target, capacity_gb.get(target))
            rows.append(row)
    return rows


def _largest(predict: Predict, overrides: list[str], target: str, capacity_gb: float | None) -> dict[str, Any]:
    if capacity_gb is None:
        return {"micro_batch": None, "tokens_per_s": None, "reason": f"{target} has no memory capacity in the catalog"}
    best: dict[str, Any] = {"micro_batch": None, "tokens_per_s": None, "reason": "micro batch 1 does not fit"}
    mb = 1
    while mb <= MAX_MICRO_BATCH:
        pred = predict([*overrides, f"train.micro_batch_size={mb}"], target)
        if pred is None or pred["memory_per_rank_bytes"] is None or pred["memory_per_rank_bytes"] > HEADROOM * capacity_gb * 2**30:
            break
        best = {"micro_batch": mb, "tokens_per_s": pred["tokens_per_s"], "confidence": pred.get("confidence_text"),
                "host_pace": pred.get("host_pace"), "bound_by": pred.get("bound_by"),
                "memory_gib": pred["memory_per_rank_bytes"] / 2**30,
                "reason": (pred.get("reasons") or {}).get("step_ms") if pred["tokens_per_s"] is None else None}
        mb *= 2
    best["capped"] = best["micro_batch"] == MAX_MICRO_BATCH  # fits the search's largest: the true largest may be more
    return best


def finetune_table(predict: Predict, targets: list[str], models: tuple[str, ...] = MODEL_SIZES,
                   tasks: tuple[str, ...] = ("lora", "qlora"), extra: list[str] | None = None) -> list[dict[str, Any]]:
    """Table IX: per model size and task (LoRA on a 16-bit base, QLoRA on a 4-bit one), per target,
    tokens/s and memory per GPU."""
    rows = []
    for model in models:
        for task in tasks:
            row: dict[str, Any] = {"model": model, "method": task}
            for target in targets:
                row[target] = _cell(predict([f"model.name={model}", f"task.kind={task}", *(extra or [])], target))
            rows.append(row)
    return rows
