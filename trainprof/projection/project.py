"""Projection: one measured run -> predictions for other hardware, world sizes, model sizes and recipe
settings.

    result = project(run_dir, targets=["h100-sxm", "rtx4090"], nodes=[1, 2], gpus_per_node=8,
                     overrides=["model.name=llama2-7b"], tokens=2e10)

`result` is the projection.json dict: `source` (what was measured) and `predictions`, one per target
and size, each with step_ms, tokens_per_s, mfu, scaling_efficiency, memory_per_rank_bytes, fits,
time_to_train_s, cost_per_million_tokens_usd, its confidence (validated with an expected error, or
why not) and its assumptions as records. A figure the inputs cannot support is null with a reason.
Each prediction is the Projector's (projector.py); this module runs it over targets and sizes, and over the
settings of `best` (--best), `research_tables` (--table) and `project_advice` (--advice).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from trainprof.env import progress_interval
from trainprof.hardware import Catalog, CatalogError, find_accelerator, load_catalog
from trainprof.projection.changes import THIS, counts_ranks, recipe_kinds
from trainprof.phases import MODULE_PHASES
from trainprof.projection.measured import PHASES
from trainprof.projection.projector import PROJECTION_VERSION, Projector, with_overrides
from trainprof.projection.source import ProjectionError, Source, load_source, same_machine_as_source
from trainprof.projection.validation import load_validation


def project(run_dir: str | Path, *, targets: list[str] | None = None, nodes: list[int] | None = None,
            gpus_per_node: int = 8, nproc: list[int] | None = None, overrides: list[str] | None = None,
            tokens: float | None = None, catalog_file: str | None = None, prices: dict[str, Any] | None = None,
            threads: int | None = None, probe: bool = True, progress: bool = False) -> dict[str, Any]:
    """Predictions for every target and size (see the module docstring).

    Args:
        run_dir: the measured run.
        targets: catalog keys, or "this" (the source's machine; default).
        nodes, gpus_per_node: sizes for catalog targets (world = nodes * gpus_per_node).
        nproc: world sizes for "this" (default: the source's).
        overrides: recipe key=value changes, as everywhere else.
        tokens: tokens to train, for time and cost.
        catalog_file: a user catalog merged over the package's.
        prices: from prices.load_prices.
        threads: for "this", intra-op threads of the target (a different CPU, calibrated here).
        probe: time the recipe's parts on this machine for same-machine changes.
        progress: a tqdm bar over predictions.
    """
    from tqdm import tqdm

    source, target_recipe = load_source(run_dir, overrides)
    catalog = load_catalog(catalog_file)
    targets = given_targets(targets)
    jobs = _jobs(catalog, source, targets, nodes, gpus_per_node, nproc)
    if probe and any(machine == THIS for machine, _ in jobs) and same_machine_as_source(source):
        from trainprof.projection.probes import warm_up

        with contextlib.suppress(ValueError):  # a probe that needs it says why in its prediction
            warm_up()  # its imports run beside the predictions' first steps, before a probe needs it
    with Projector(source, catalog, prices=prices, validation=load_validation(), probe=probe) as projector:
        predictions = [projector.predict(target_recipe, machine=machine, world=world, gpus_per_node=gpus_per_node,
                                         threads=threads if machine == THIS else None, tokens=tokens,
                                         overrides=overrides)
                       for machine, world in tqdm(jobs, desc="project", unit="prediction", disable=not progress,
                                                  mininterval=progress_interval())]
        scaling_efficiency(projector, target_recipe, predictions, gpus_per_node, threads)
    order_by_value(predictions)
    return {"projection_version": PROJECTION_VERSION, "source": source_block(source), "tokens": tokens,
            "warnings": node_size_warnings(catalog, targets, gpus_per_node), "catalog": catalog.files, "validation": _validation_block(projector.validation),
            "method": __import__("trainprof.projection.stepmodel", fromlist=["x"]).__doc__.strip(),
            "predictions": predictions}


def node_size_warnings(catalog: Catalog, targets: list[str], gpus_per_node: int) -> list[str]:
    """One line per GPU target given more GPUs a node than any of the catalog's node templates for it holds (the
    links assumed are then a node the catalog does not describe)."""
    out = []
    for t in targets:
        if t == THIS or catalog.resolve(t).gpus_per_node:
            continue
        gpu = catalog.accelerator_key(catalog.resolve(t))
        templates = {k: int(v["gpus_per_node"]) for k, v in catalog.nodes.items() if v["accelerator"] == gpu}
        if templates and gpus_per_node > max(templates.values()):
            out.append(f"warning: --gpus-per-node {gpus_per_node} on {t}: the catalog's node templates for it hold "
                       f"at most {max(templates.values())} ({', '.join(f'{k}: {n}' for k, n in templates.items())}); "
                       f"its rows assume one node of {gpus_per_node} on its intra-node link")
    return out


def given_targets(targets: list[str] | None) -> list[str]:
    """--to as given, each once (a target named twice is one set of rows); the run's own machine by default."""
    return list(dict.fromkeys(targets or [THIS]))


def _jobs(catalog: Catalog, source: Source, targets: list[str], nodes: list[int] | None, gpus_per_node: int,
          nproc: list[int] | None) -> list[tuple[str, int]]:
    jobs: list[tuple[str, int]] = []
    for t in targets:
        if t == THIS:
            jobs.extend((t, n) for n in (nproc or [source.measured.world_size]))
        else:
            per_node = catalog.resolve(t).gpus_per_node or gpus_per_node  # unknown names fail before any work
            jobs.extend((t, n * per_node) for n in (nodes or [1]))
    return jobs


def source_block(source: Source) -> dict[str, Any]:
    m = source.measured
    return {"run_dir": str(source.run_dir), "device": source.profile["env"]["device"], "world_size": m.world_size,
            "device_type": m.device_type, "timer": source.profile["env"]["timer"], "step_ms": m.step_ms, "phases_ms": m.phases_ms,
            "unattributed_ms": m.unattributed_ms, "tokens_per_s": source.profile["summary"].get("tokens_per_s"),
            "peak_memory_bytes": m.peak_memory_bytes, "calibration": source.calibration is not None,
            "mfu": source.profile["summary"].get("mfu"),
            "measured_over_analytic": source.profile["summary"].get("measured_over_analytic"),
            "busy_frac": m.busy_frac(), "recipe": source.recipe.to_dict(), "recipe_origin": source.recipe_origin,
            "unknown": source.unknown}


def _validation_block(validation: dict[str, Any] | None) -> dict[str, Any] | None:
    return {k: validation.get(k) for k in ("measured_on", "command", "by_kind", "by_kind_gpu")} if validation else None


def project_advice(run_dir: str | Path, *, probe: bool = True, progress: bool = False) -> list[dict[str, Any]]:
    """The advisor's advice for a run (trainprof.report.advisor), each with its recipe overrides projected
    on the run's own machine: predicted step and tokens/s, and the gain over the same-settings
    prediction (which reproduces the measured step), or null with the reason."""
    from tqdm import tqdm

    from trainprof.projection.changes import modelled_key
    from trainprof.report.advisor import advise, override_args

    source, recipe = load_source(run_dir)
    with Projector(source, load_catalog(), validation=load_validation(), probe=probe) as projector:
        base = projector.predict(recipe)
        out = []
        for a in tqdm(advise(source.profile)["advice"], desc="advice", unit="advice", disable=not progress,
                      mininterval=progress_interval()):
            overrides = override_args(a["overrides"])
            row: dict[str, Any] = {"rule": a["rule"], "overrides": overrides, "predicted_step_ms": None,
                                   "predicted_tokens_per_s": None, "predicted_gain": None, "expected_error_pct": None}
            unmodelled = [k for k in a["overrides"] if not modelled_key(k)]
            if not overrides:
                row["reason"] = "the advice changes no recipe key"
            elif unmodelled:
                row["reason"] = f"the step model does not model {', '.join(unmodelled)}"
            else:
                try:
                    target = with_overrides(source, overrides)
                except Exception as err:  # noqa: BLE001  a recipe rule refusing the combination is the answer
                    row["reason"] = f"the recipe refuses {' '.join(overrides)}: {str(err).splitlines()[0]}"
                else:
                    pred = projector.predict(target, overrides=overrides)
                    row.update(predicted_step_ms=pred["step_ms"], predicted_tokens_per_s=pred["tokens_per_s"],
                               expected_error_pct=pred["expected_error_pct"],
                               expected_error_text=pred["expected_error_text"],
                               expected_error_source=pred["expected_error_source"], phases_ms=pred["phases_ms"],
                               assumptions=pred["assumptions"])
                    if pred["tokens_per_s"] and base["tokens_per_s"]:
                        row["predicted_gain"] = pred["tokens_per_s"] / base["tokens_per_s"] - 1
                        row["predicted_gain_convention"] = ("predicted tokens/s over the same-settings prediction, "
                                                            "minus 1")
                    else:
                        row["reason"] = (pred.get("reasons") or {}).get("step_ms", "no step time predicted")
            out.append(row)
        return out


def scaling_efficiency(projector: Projector, recipe: Any, predictions: list[dict[str, Any]], gpus_per_node: int,
                       threads: int | None) -> None:
    """tput(N) x N0 / (N x tput(N0)) per hardware and settings (as `trainprof scale` computes it), N0 the
    fewest GPUs of the same kind, one or a power of two below N, that the same settings fit (a model that
    needs 8 GPUs scales from 8, not from a one-GPU figure for a configuration that cannot run, which would
    read as superlinear); `scaling_base_gpus` says which. Where they fit no fewer GPUs than N: null, with
    the reason."""

    def where(p: dict[str, Any]) -> tuple[str, str]:
        return (THIS if p["hardware"].startswith(THIS) else p["hardware"]), " ".join(p["overrides"])

    known = {(*where(p), p["world_size"]): p for p in predictions}

    def at(machine: str, settings: str, world: int) -> dict[str, Any]:
        if (machine, settings, world) not in known:
            known[(machine, settings, world)] = projector.predict(
                recipe, machine=machine, world=world, gpus_per_node=gpus_per_node,
                threads=threads if machine == THIS else None)
        return known[(machine, settings, world)]

    def unit(machine: str) -> str:
        return "rank" if counts_ranks(machine, projector.source.measured.device_type) else "GPU"

    for p in predictions:
        if p["tokens_per_s"] is None:
            continue
        (machine, settings), n = where(p), p["world_size"]
        if n == 1:  # itself against itself would read 100%
            p.setdefault("reasons", {})["scaling_efficiency"] = (
                f"one {unit(machine)}: the baseline larger world sizes are scaled against")
            continue
        fewer = [1 << k for k in range(n.bit_length()) if 1 << k < n]
        base = next((b for b in fewer if at(machine, settings, b)["fits"] is not False), None)
        if base is None:
            one = at(machine, settings, 1)
            gib = (one["memory_per_rank_bytes"] or 0) / 2**30
            nor = f" nor {', '.join(map(str, fewer[1:]))}" if n > 2 else ""
            p.setdefault("reasons", {})["scaling_efficiency"] = (
                f"the same settings do not fit one {unit(machine)} of {machine} (trainprof plan: {gib:.1f} GiB){nor}: "
                f"no throughput on fewer {unit(machine)}s to scale from")
        elif at(machine, settings, base)["tokens_per_s"]:
            p["scaling_efficiency"] = p["tokens_per_s"] * base / (n * at(machine, settings, base)["tokens_per_s"])
            p["scaling_base_gpus"] = base
            if p["scaling_efficiency"] > 1:
                p["above_linear"] = above_linear(p, at(machine, settings, base))


def above_linear(p: dict[str, Any], base: dict[str, Any]) -> str:
    """Why a prediction scales past 100% of its baseline: the phases a rank spends less time in at its world
    size, each with what shortens it (ZeRO's share of the optimizer step; for compute, the thread count a
    rank gets here and the probe that timed it, whose own marks say how far to trust it)."""
    ours, theirs = p["phases_ms"] or {}, base["phases_ms"] or {}
    parts = []
    for ph in PHASES:
        now, was = ours.get(ph) or 0.0, theirs.get(ph) or 0.0
        if now < 0.99 * was:
            why = ("each rank steps its ZeRO share of the states" if ph == "optimizer" else
                   "a rank's compute predicted faster: the probe timed it so at the threads a rank gets"
                   if ph in MODULE_PHASES else "as predicted")
            parts.append(f"{ph} {was:.1f} -> {now:.1f} ms ({why})")
    marks = [m for m in p.get("confidence_marks") or [] if m not in (base.get("confidence_marks") or [])]
    return "; ".join(parts or ["no phase shorter per rank"]) + (f"; {', '.join(marks)}" if marks else "")


def order_by_value(predictions: list[dict[str, Any]]) -> None:
    """`order` 1 = best: cheapest per million tokens when every fitting prediction has a price, else the
    highest tokens/s; predictions that do not fit or cannot be predicted come last (order null)."""
    usable = [p for p in predictions if p["tokens_per_s"] and p["fits"] is not False]
    priced = bool(usable) and all(p["cost_per_million_tokens_usd"] is not None for p in usable)
    key = (lambda p: p["cost_per_million_tokens_usd"]) if priced else (lambda p: -p["tokens_per_s"])
    for i, p in enumerate(sorted(usable, key=key), 1):
        p["order"] = i
        p["ordered_by"] = "cost_per_million_tokens_usd" if priced else "tokens_per_s"
    for p in predictions:
        p.setdefault("order", None)


__all__ = ["project", "Projector", "load_source", "ProjectionError", "CatalogError", "PHASES", "find_accelerator",
           "recipe_kinds"]


def best(run_dir: str | Path, *, targets: list[str] | None = None, nodes: list[int] | None = None,
         gpus_per_node: int = 8, nproc: list[int] | None = None, overrides: list[str] | None = None,
         catalog_file: str | None = None, prices: dict[str, Any] | None = None, probe: bool = True,
         tokens: float | None = None, progress: bool = False) -> dict[str, Any]:
    """The best settings per target and world size (projection/best.py), from one measured run; with
    `tokens`, the time (fastest setting) and cost (cheapest) to train that many.

    Raises:
        ProjectionError: `--to this` without train.memory_cap_gb (the search needs a capacity).
    """
    from tqdm import tqdm

    from trainprof.projection import best as search
    from trainprof.recipe import override_key

    source, target_recipe = load_source(run_dir, overrides)
    catalog = load_catalog(catalog_file)
    # over predictions, naming the one under way: on the source's machine one can probe for a minute
    bar = tqdm(desc="best", unit="prediction", disable=not progress, mininterval=progress_interval())
    with Projector(source, catalog, prices=prices, validation=load_validation(), probe=probe) as projector, bar:
        results = []
        for machine, world in _jobs(catalog, source, given_targets(targets), nodes, gpus_per_node, nproc):
            same = machine == THIS
            if same and target_recipe.train.memory_cap_gb is None:
                raise ProjectionError("--best on this machine needs a memory capacity: set train.memory_cap_gb=GB")
            capacity = (target_recipe.train.memory_cap_gb if same else catalog.resolve(machine).figure("memory_gb"))

            def predict(extra: list[str], machine: str = machine, world: int = world) -> dict[str, Any] | None:
                bar.set_postfix_str(f"{machine} x {world}: {' '.join(extra)}", refresh=False)  # drawn by update()
                try:
                    recipe = with_overrides(source, [*(overrides or []), *extra])
                except Exception:  # noqa: BLE001  a combination the recipe rules refuse is skipped, and listed
                    recipe = None
                pred = None if recipe is None else projector.predict(
                    recipe, machine=machine, world=world, gpus_per_node=gpus_per_node, tokens=tokens,
                    overrides=[*(overrides or []), *extra])
                bar.update()
                return pred

            def planned(extra: list[str], machine: str = machine, world: int = world) -> int | None:
                try:
                    recipe = with_overrides(source, [*(overrides or []), *extra])
                except Exception:  # noqa: BLE001  refused: predict() lists it
                    return None
                return projector.memory_per_rank(recipe, machine=machine, world=world)

            capacity_bytes = capacity * 2**30 if capacity else None  # a cap's GB and a GPU's are binary
            dtype_given = any(override_key(o) == "model.dtype" for o in overrides or [])
            found = search.search(predict, capacity_bytes, [], search.settings(target_recipe, same_machine=same,
                                                                                dtype_given=dtype_given),
                                  planned=planned)
            per_node = world if same else (catalog.resolve(machine).gpus_per_node or gpus_per_node)
            results.append({"hardware": machine, "world_size": world, "gpus_per_node": min(per_node, world),
                            "unit": "rank" if counts_ranks(machine, source.measured.device_type) else "GPU",
                            "capacity_gb": capacity, "capacity_bytes": capacity_bytes, **found})
        return {"projection_version": PROJECTION_VERSION, "source": source_block(source), "best": results,
                "tokens": tokens, "searched": "micro batch x recomputation" + ("" if targets == [THIS] else
                                                              " x ZeRO stage x offload (x LoRA/QLoRA for finetuning, "
                                                              "x bf16 for an fp32 run)")}


# the research's engine (its methods are DeepSpeed's ZeRO stages, whatever the source ran) and sequence
# length; micro batch 1
TABLE_DEFAULTS = ["engine.kind=deepspeed", "data.seq_len=350", "train.micro_batch_size=1"]


def research_tables(run_dir: str | Path, *, targets: list[str], nodes: int = 1, gpus_per_node: int = 8,
                    overrides: list[str] | None = None, catalog_file: str | None = None,
                    prices: dict[str, Any] | None = None, progress: bool = False) -> dict[str, Any]:
    """Zhang et al.'s (arXiv 2311.03687) Tables III, IV and IX predicted for `targets` from one run
    (projection/tables.py), at seq_len 350 and micro batch 1 unless `overrides` say otherwise."""
    from tqdm import tqdm

    from trainprof.projection import tables

    source, _ = load_source(run_dir)
    catalog = load_catalog(catalog_file)
    with Projector(source, catalog, prices=prices, validation=load_validation(), probe=False) as projector:
        worlds = {t: nodes * (catalog.resolve(t).gpus_per_node or gpus_per_node) for t in targets}
        bar = tqdm(desc="tables", unit="prediction", disable=not progress, mininterval=progress_interval())

        def predict(extra: list[str], target: str) -> dict[str, Any] | None:
            bar.update()
            try:
                recipe = with_overrides(source, [*TABLE_DEFAULTS, *(overrides or []), *extra])
            except Exception:  # noqa: BLE001  a combination the recipe rules refuse is a cell saying so
                return None
            return projector.predict(recipe, machine=target, world=worlds[target], gpus_per_node=gpus_per_node,
                                     overrides=extra)

        methods = [(name, [*tables.METHODS_BASE, *o]) for name, o in tables.METHODS]
        maxbatch = [(name, [*tables.METHODS_BASE, *o]) for name, o in tables.MAXBATCH_METHODS]
        out = {"projection_version": PROJECTION_VERSION, "source": source_block(source), "targets": targets,
               "world_size": worlds, "defaults": [*TABLE_DEFAULTS, *(overrides or [])],
               "table_iii": tables.methods_table(predict, methods, targets),
               "table_iv": tables.maxbatch_table(predict, maxbatch, targets,
                                                 {t: catalog.resolve(t).figure("memory_gb") for t in targets}),
               "table_ix": tables.finetune_table(predict, targets, extra=tables.FINETUNE_BASE)}
        bar.close()
        return out
