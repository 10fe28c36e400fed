"""Merging per-rank profiles into the run's profile.json (rank 0) and naming a straggler.

The merged document keeps rank 0's steps, operators and collectives (every rank's are in its own
profile.rank<r>.json), sets every module figure to the median over ranks with the min / median / max
and each rank's own figure (`by_rank`, in `ranks` order) kept beside it, and summarises phases per rank
in `ranks` and `summary.across_ranks`.

Straggler: synchronous collectives make every rank's wall time equal to the slowest one's, so ranks
are compared by their busy time, the step minus the time spent blocked in collectives and waiting for
data. A rank whose median busy time exceeds the median of the other ranks by more than 5% is named.

Pipeline stages (profiles with a `pipeline` block) run different modules: their module rows are
concatenated with a `stage` field instead of taken as medians, and `pipeline` holds the per-stage
figures, one step's aligned timeline and the imbalance (analysis/pipeline.py).
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path
from typing import Any

from trainprof.analysis.pipeline import merge_pipeline
from trainprof.io import read_json

STRAGGLER_THRESHOLD = 0.05  # a rank more than 5% slower than the others is named
_MODULE_SPREAD = ("forward_ms", "backward_ms", "recompute_ms", "self_forward_ms", "self_backward_ms",
                  "comm_ms", "comm_exposed_ms")


def _stats(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": float(statistics.median(values)), "max": max(values)}


def find_straggler(ranks: list[dict[str, Any]], threshold: float = STRAGGLER_THRESHOLD) -> dict[str, Any] | None:
    """The slowest rank if it is more than `threshold` slower than the median of the others.

    Args:
        ranks: entries with `rank` and `busy_ms_median` (falls back to `step_ms_median`).
        threshold: fraction, 0.05 = 5%.
    Returns:
        {rank, slower_by_frac, metric} or None.
    """
    if len(ranks) < 2:
        return None
    key = "busy_ms_median" if all(r.get("busy_ms_median") is not None for r in ranks) else "step_ms_median"
    worst = None
    for r in ranks:
        others = [o[key] for o in ranks if o["rank"] != r["rank"]]
        reference = statistics.median(others)
        if reference <= 0:
            continue
        frac = r[key] / reference - 1
        if frac > threshold and (worst is None or frac > worst["slower_by_frac"]):
            worst = {"rank": r["rank"], "slower_by_frac": frac, "metric": key,
                     "description": f"median {key} over the median of the other ranks, minus 1"}
    return worst


def merge_ranks(profiles: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge per-rank profiles (from `Profiler.rank_result`) into one profile.json document.

    Args:
        profiles: one per rank, any order.
    Returns:
        The merged document (kind "merged").
    """
    profiles = sorted(profiles, key=lambda p: p["rank"])
    merged = copy.deepcopy(profiles[0])
    merged["kind"] = "merged"
    merged.pop("rank", None)
    merged["steps_rank"] = profiles[0]["rank"]
    merged["env"]["world_size"] = len(profiles)
    ranks = [p["ranks"][0] for p in profiles]
    merged["ranks"] = ranks
    merged["straggler"] = find_straggler(ranks)

    pipeline = merge_pipeline(profiles)
    if pipeline is not None:
        _merge_pipeline_stages(merged, profiles, pipeline)
        return merged

    by_name = [{m["name"]: m for m in p["modules"]} for p in profiles]
    for module in merged["modules"]:
        spread = {}
        for key in _MODULE_SPREAD:
            values = [rows[module["name"]][key] for rows in by_name if module["name"] in rows]
            spread[key] = _stats(values)
            if len(values) == len(profiles):  # each rank's own figure, in `ranks` order
                spread[key]["by_rank"] = values
            module[key] = spread[key]["median"]
        module["ranks_spread"] = spread

    _merge_summary(merged, profiles, ranks)
    return merged


def _merge_summary(merged: dict[str, Any], profiles: list[dict[str, Any]], ranks: list[dict[str, Any]],
                   pipeline: bool = False) -> None:
    """summary.across_ranks, tokens/s and all-rank TFLOP/s. The stages of a pipeline process the same
    tokens, so its tokens/s counts them once."""
    summary = merged["summary"]
    phases = ranks[0]["phases_ms"].keys()
    summary["across_ranks"] = {
        "step_ms_median": _stats([r["step_ms_median"] for r in ranks]),
        "busy_ms_median": _stats([r["busy_ms_median"] for r in ranks]),
        "phases_ms": {ph: _stats([r["phases_ms"][ph] for r in ranks]) for ph in phases},
    }
    step_s = max(r["step_ms_median"] for r in ranks) / 1e3
    tokens = [p["summary"].get("tokens_per_step") for p in profiles]
    if step_s > 0 and all(t for t in tokens):
        if pipeline:
            summary["tokens_per_step_all_ranks"] = tokens[0]
            summary["tokens_per_s"] = tokens[0] / step_s
            summary["tokens_per_s_scope"] = ("one pipeline: tokens per step (every stage processes the same "
                                             "tokens) / slowest stage's median step")
        else:
            # Megatron's tensor x pipeline parallel ranks of one model replica process the same tokens
            shared = int(profiles[0]["env"].get("model_parallel_size") or 1)
            summary["tokens_per_step_all_ranks"] = sum(tokens) / shared
            summary["tokens_per_s"] = summary["tokens_per_step_all_ranks"] / step_s
            summary["tokens_per_s_scope"] = "all ranks: sum of per-rank tokens per step / slowest rank's median step"
            if shared > 1:
                summary["tokens_per_s_scope"] += (f", / {shared} (the tensor x pipeline parallel ranks of a model "
                                                  "replica process the same tokens)")
    flops = [p["summary"].get("flops_per_step") for p in profiles]
    if step_s > 0 and all(f for f in flops):
        summary["achieved_tflops_all_ranks"] = sum(flops) / step_s / 1e12
    summary["achieved_tflops_scope"] = "per rank (rank 0's FLOPs over its median step)"
    if pipeline:  # rank 0 runs stage 0's layers only: its FLOPs (and their PaLM cross-check) are that stage's
        summary["flops_scope"] = f"by pipeline stage 0 of {len(profiles)} (rank 0; the stages together: see all ranks)"
        summary["achieved_tflops_scope"] = "per rank (pipeline stage 0's FLOPs, rank 0, over its median step)"


def _merge_pipeline_stages(merged: dict[str, Any], profiles: list[dict[str, Any]], pipeline: dict[str, Any]) -> None:
    """A pipeline's ranks run different modules: the merged module table is every stage's rows, each
    with its `stage` (names are the unsplit model's, so a layer appears once); the loss of each step
    is the last stage's (the only one that computes it)."""
    merged["pipeline"] = pipeline
    merged["straggler"] = None  # stages differ by design: their imbalance is pipeline.balance
    modules = []
    for p in profiles:
        stage = p["pipeline"]["stage"]
        for m in p["modules"]:
            modules.append({**m, "stage": stage})
    merged["modules"] = modules
    last = max(profiles, key=lambda p: p["pipeline"]["stage"])
    loss_by_step = {s["step"]: s.get("loss") for s in last["steps"]}
    for step in merged["steps"]:
        if step.get("loss") is None:
            step["loss"] = loss_by_step.get(step["step"])
    merged["steps_loss_rank"] = last["rank"]
    # a stage's drain (its collective's wait for the other stages) is bubble, which only the merge can tell
    drained = {st["rank"]: st["phases_ms"] for st in pipeline["stages"] if st.get("drain_ms") and st.get("phases_ms")}
    merged["ranks"] = [{**r, "phases_ms": {**r["phases_ms"], **drained[r["rank"]]}} if r["rank"] in drained else r
                       for r in merged["ranks"]]
    _merge_summary(merged, profiles, merged["ranks"], pipeline=True)


def merge_rank_files(run_dir: str | Path) -> dict[str, Any]:
    """Merge the profile.rank<r>.json files of a run dir (offline, e.g. after a crash of rank 0).

    Args:
        run_dir: the run directory.
    Returns:
        The merged document.
    """
    files = sorted(Path(run_dir).glob("profile.rank*.json"))
    if not files:
        raise FileNotFoundError(f"no profile.rank*.json in {run_dir}; run with the profiler enabled first")
    return merge_ranks([read_json(f) for f in files])
