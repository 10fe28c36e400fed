"""projection.json / .md / .csv / .html with a chart, and the short table `trainprof project` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.io import atomic_write_json
from trainprof.phases import PHASES
from trainprof.report.plots import figure, pyplot, save_figure
from trainprof.report.tables import Column, fmt_num, fmt_pct, fmt_text, write_tables

GIB = 2**30


def _fmt_bytes(x: Any) -> str:
    return "n/a" if x is None else f"{x / GIB:,.2f}"


def _fmt_bool(x: Any) -> str:
    return "n/a" if x is None else ("yes" if x else "no")


def _fmt_err(x: Any) -> str:
    return "n/a" if x is None else f"±{x:.1f}%"


def _fmt_hours(x: Any) -> str:
    return "n/a" if x is None else f"{x / 3600:,.1f}"


COLUMNS = [
    Column("rank", "rank", fmt_text),
    Column("hardware", "hardware", fmt_text),
    Column("world_size", "GPUs", fmt_text),
    Column("overrides_text", "changes", fmt_text),
    Column("step_ms", "step ms", fmt_num(1)),
    Column("expected_error_pct", "expected error", _fmt_err),
    Column("tokens_per_s", "tokens/s", fmt_num(0)),
    Column("mfu", "MFU", fmt_pct),
    Column("scaling_efficiency", "scaling eff.", fmt_pct),
    Column("memory_per_rank_bytes", "memory/rank GiB", _fmt_bytes),
    Column("fits", "fits", _fmt_bool),
    Column("time_to_train_s", "hours to train", _fmt_hours),
    Column("cost_per_million_tokens_usd", "$ / M tokens", fmt_num(3)),
]


def _rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for p in result["predictions"]:
        row = dict(p)
        row["overrides_text"] = " ".join(p["overrides"]) or "none"
        rows.append(row)
    return rows


def notes(result: dict[str, Any]) -> list[str]:
    src = result["source"]
    out = [
        f"source: {src['run_dir']} measured on {src['device']} x {src['world_size']} ({src['timer']} timer), "
        f"step {src['step_ms']:.1f} ms (slowest rank's median), peak memory "
        + (f"{src['peak_memory_bytes'] / GIB:.2f} GiB" if src.get("peak_memory_bytes") else "n/a"),
        "step ms: the step model (trainprof/projection/stepmodel.py) re-derives every measured phase for the "
        "target; each prediction's assumptions are listed in projection.json",
        "expected error: the step-time MAPE that scripts/bench_projection.py measured for that kind of change "
        "(validation.json); n/a means that kind of change was not validated",
        "MFU: PaLM model FLOPs (6N + 12LHQT per token, trainprof plan) over the catalog's datasheet dense peak",
        "scaling eff.: predicted tokens/s at N GPUs over N x the predicted tokens/s on one GPU of the same kind",
        "memory/rank: trainprof plan's formulas for the target (plus what the source measured beyond them on the "
        "same machine); fits: under the catalog's memory capacity",
        "cost: price x GPUs / tokens/s, only from --price or a price file with source and date (never invented)",
    ]
    for p in result["predictions"]:
        if p.get("fit_suggestion"):
            out.append(f"{p['hardware']} x {p['world_size']}: does not fit; would fit with "
                       f"{' '.join(p['fit_suggestion'])} (plan)")
        for key, why in (p.get("reasons") or {}).items():
            if key == "step_ms":
                out.append(f"{p['hardware']} x {p['world_size']}: step not predicted: {why}")
    return out


def write_projection(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """projection.json, projection.{md,csv,html} and projection.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out_dir / "projection.json", result)
    image = None
    if any(p["tokens_per_s"] for p in result["predictions"]):
        image = plot_projection(result, out_dir / "projection.png").name
    paths = write_tables(out_dir / "projection", _rows(result), COLUMNS, title="trainprof projection",
                         intro=["Predicted from one measured run; every figure is a prediction with its "
                                "expected error, not a measurement."], notes=notes(result), image=image)
    return [out_dir / "projection.json", *paths]


def plot_projection(result: dict[str, Any], path: Path) -> Path:
    """Tokens/s per prediction (bars), and the predicted phase split of each step (stacked bars)."""
    plt = pyplot()
    preds = [p for p in result["predictions"] if p["tokens_per_s"]]
    labels = [f"{p['hardware']}\nx{p['world_size']} {' '.join(p['overrides'])}".strip() for p in preds]
    fig, (ax1, ax2), rect = figure(plt, 2, width_in=12, plot_height_in=4.2, notes=[
        "Predicted by trainprof project from one measured run; error bars: the validated expected error "
        "(none when not validated).", f"source: {result['source']['run_dir']}"])
    errs = [p["tokens_per_s"] * (p["expected_error_pct"] or 0) / 100 for p in preds]
    ax1.bar(range(len(preds)), [p["tokens_per_s"] for p in preds], yerr=errs, color="#4c72b0", capsize=3)
    ax1.set_xticks(range(len(preds)), labels, fontsize=7, rotation=30, ha="right")
    ax1.set_ylabel("predicted tokens/s (all GPUs)")
    bottom = [0.0] * len(preds)
    for phase in PHASES:
        vals = [(p["phases_ms"] or {}).get(phase, 0.0) for p in preds]
        if any(vals):
            ax2.bar(range(len(preds)), vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xticks(range(len(preds)), labels, fontsize=7, rotation=30, ha="right")
    ax2.set_ylabel("predicted ms per step, per rank")
    ax2.legend(fontsize=7)
    return save_figure(fig, path, rect)


def render_short(result: dict[str, Any]) -> str:
    """The table printed on stdout."""
    cols = [c for c in COLUMNS if c.key not in ("time_to_train_s",)]
    rows = _rows(result)
    table = [[c.header for c in cols]] + [[c.fmt(r.get(c.key)) for c in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in table]
    src = result["source"]
    head = (f"trainprof project: from {src['run_dir']} ({src['device']} x {src['world_size']}, "
            f"measured step {src['step_ms']:.1f} ms)")
    tail = [f"  {n}" for n in notes(result)[1:] if ": step not predicted:" in n or "does not fit" in n]
    return "\n".join([head, *lines, *tail])
