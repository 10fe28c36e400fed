"""Projected next to measured: the rows `trainprof scale` and the run report add beside their measured
figures (the same step model as `trainprof project`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.report.tables import Column, fmt_num, fmt_pct, fmt_text, write_tables

SCALE_PROJECTED_COLUMNS = [
    Column("world_size", "N", fmt_text),
    Column("measured_step_ms", "measured step ms", fmt_num(1)),
    Column("predicted_step_ms", "projected step ms", fmt_num(1)),
    Column("step_error_pct", "error %", fmt_num(1)),
    Column("measured_tokens_per_s", "measured tokens/s", fmt_num(0)),
    Column("predicted_tokens_per_s", "projected tokens/s", fmt_num(0)),
    Column("predicted_efficiency", "projected efficiency", fmt_pct),
    Column("expected_error_pct", "expected error %", fmt_num(1)),
    Column("marks", "confidence marks", fmt_text),
]


def project_scaling(points: list[dict[str, Any]], extra_sizes: list[int] | None = None, *,
                    progress: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """From the smallest world size's run, the projected step and throughput at every measured size
    (measured beside it, with the error) and at `extra_sizes` (projected only); `progress`: a tqdm bar
    over the sizes.

    Returns:
        (rows, notes); rows are empty with a note saying why when the projection cannot be made.
    """
    from tqdm import tqdm

    from trainprof.env import progress_interval
    from trainprof.hardware import load_catalog
    from trainprof.projection.measured import measured_from_profile
    from trainprof.projection.project import above_linear
    from trainprof.projection.projector import Projector
    from trainprof.projection.source import load_source
    from trainprof.projection.validation import load_validation

    pts = sorted(points, key=lambda p: p["world_size"])
    ref = pts[0]
    source, recipe = load_source(ref["run_dir"])
    sizes = sorted({p["world_size"] for p in pts} | set(extra_sizes or []))
    measured = {p["world_size"]: p for p in pts}
    rows: list[dict[str, Any]] = []
    one = None
    with Projector(source, load_catalog(), validation=load_validation()) as projector:
        for n in tqdm(sizes, desc="project", unit="size", disable=not progress, mininterval=progress_interval()):
            pred = projector.predict(recipe, world=n)
            if n == 1 or one is None and n == sizes[0]:
                one = (n, pred)
            row: dict[str, Any] = {"world_size": n, "predicted_step_ms": pred["step_ms"],
                                   "predicted_tokens_per_s": pred["tokens_per_s"],
                                   # the source projected onto itself claims no expected error
                                   "expected_error_pct": None if n == ref["world_size"] else pred["expected_error_pct"],
                                   "marks": "; ".join(pred.get("confidence_marks") or []) or None,
                                   "reason": (pred.get("reasons") or {}).get("step_ms")}
            if one and one[1]["tokens_per_s"] and pred["tokens_per_s"]:
                row["predicted_efficiency"] = pred["tokens_per_s"] * one[0] / (n * one[1]["tokens_per_s"])
                if row["predicted_efficiency"] > 1:
                    row["above_linear"] = above_linear(pred, one[1])
            if n in measured:
                prof = measured[n]["profile"]
                m = measured_from_profile(prof)
                row["measured_step_ms"] = m.step_ms
                row["measured_tokens_per_s"] = (prof.get("summary") or {}).get("tokens_per_s")
                if pred["step_ms"]:
                    row["step_error_pct"] = 100 * (pred["step_ms"] - m.step_ms) / m.step_ms
            rows.append(row)
    notes = [f"projected from {ref['run_dir']} (N={ref['world_size']}) by trainprof's step model; collectives "
             "re-timed with the α-β fit measured on this machine; error % = (projected - measured) / measured"]
    notes.append(f"N={ref['world_size']}: the baseline, the run the others are projected from; its projected "
                 "efficiency is 100% by definition and it claims no expected error (its error % shows how well the "
                 "step model reproduces its own source)")
    notes += [f"N={r['world_size']}: not projected: {r['reason']}" for r in rows if r.get("reason")]
    notes += [f"N={r['world_size']}: projected efficiency above 100%: per rank {r['above_linear']}"
              for r in rows if r.get("above_linear")]
    return rows, notes


def write_scaling_projection(out_dir: Path, rows: list[dict[str, Any]], notes: list[str], *, title: str) -> list[Path]:
    return write_tables(out_dir / "scaling_projected", rows, SCALE_PROJECTED_COLUMNS, title=f"{title}: projected",
                        notes=notes)
