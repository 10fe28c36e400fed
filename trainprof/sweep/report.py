"""The sweep table (one row per cell: throughput, step time, memory, FLOP/s, MFU, phase split, or how
the cell failed, with the figures of the steps it measured before, marked partial) and its bar chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.phases import PHASES
from trainprof.sweep.spec import Sweep
from trainprof.report.plots import figure, pyplot, save_figure
from trainprof.report.tables import Column, fmt_num, fmt_pct, fmt_text, write_tables

# what a column counts, where its measurement note (the profile's method) is shared with another column
METRIC_COUNTS = {
    "model_states_mib": "params, grads, optimizer states and fp32 master copies together",
    "optimizer_states_mib": ("the optimizer's state tensors alone (AdamW's exp_avg and exp_avg_sq; quantized states "
                             "as their codes, scales and code books): a part of model states, not grads, params or "
                             "fp32 master copies"),
}
METRIC_LABELS = {"tokens_per_s": "tokens/s", "step_ms": "step ms", "step_spread": "step spread",
                 "peak_memory_mib": "peak memory",
                 "achieved_tflops": "achieved TFLOP/s", "mfu": "MFU", "phases_ms": "phase split"}

COLUMNS = [
    Column("cell", "cell"),
    Column("world_size", "ranks", fmt_text),
    Column("status", "status"),
    Column("figures", "figures from", fmt_text),
    Column("tokens_per_s", "tokens/s", fmt_num(0)),
    Column("step_ms", "step ms", fmt_num(1)),
    Column("steps_used", "steps used", fmt_text),
    Column("step_spread", "step spread", fmt_pct),
    Column("peak_memory_mib", "peak memory MiB", fmt_num(0)),
    Column("peak_forward_mib", "peak forward MiB", fmt_num(0)),
    Column("peak_backward_mib", "peak backward MiB", fmt_num(0)),
    Column("peak_optimizer_mib", "peak optimizer MiB", fmt_num(0)),
    Column("activation_mib", "activations MiB", fmt_num(1)),
    Column("model_states_mib", "model states MiB", fmt_num(1)),
    Column("optimizer_states_mib", "optimizer states MiB", fmt_num(1)),
    Column("optimizer_states_quantized_frac", "states quantized", fmt_pct),
    Column("achieved_tflops", "achieved TFLOP/s", fmt_num(4, thousands=False)),
    Column("mfu", "MFU", fmt_pct),
    *[Column(f"{p}_ms", f"{p} ms", fmt_num(1)) for p in PHASES],
    Column("failure_kind", "failure", fmt_text),
    Column("failed_rank", "failed rank", fmt_text),
    Column("signal", "signal", fmt_text),
    Column("failure_memory_mib", "memory at failure MiB", fmt_num(0)),
    Column("failure_message", "failure message", fmt_text),
    Column("note", "note", fmt_text),
    Column("cell_id", "cell id", fmt_text),
    Column("overrides", "overrides", fmt_text),
    Column("run_dir", "run dir", fmt_text),
]


def sweep_rows(sweep: Sweep, records: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """One row per cell, in the sweep's order; cells not run yet have status `pending`."""
    rows = []
    for cell, rec in zip(sweep.cells, records):
        rec = rec or {}
        row: dict[str, Any] = {"cell": cell.label, "cell_id": cell.id, "world_size": cell.world_size,
                               "status": rec.get("status", "pending"), "overrides": " ".join(cell.overrides),
                               "run_dir": rec.get("run_dir")}
        row.update(rec.get("values") or {})
        partial = rec.get("partial")
        if rec.get("status") == "done":
            row["figures"] = figures_from(rec.get("values") or {})
        elif partial:  # what a failed or stopped cell measured, never its status
            row.update(partial.get("values") or {})
            how = "was interrupted" if rec.get("status") == "interrupted" else "failed"
            row["figures"] = f"partial: {figures_from(partial.get('values') or {})} before it {how}"
        row["note"] = rec.get("note")
        row["world_size"] = cell.world_size
        f = rec.get("failure")
        if f:
            mem = f.get("peak_memory_bytes")
            row.update(failure_kind=f.get("kind"), failed_rank=f.get("rank"), signal=f.get("signal"),
                       failure_message=f.get("message"), failure_memory_mib=None if mem is None else mem / 2**20)
        rows.append(row)
    return rows


def figures_from(values: dict[str, Any]) -> str:
    """Which steps a row's figures stand on, e.g. "1 of 4 measured steps (3 traced or FLOP-counted)": the
    steps used are the measured ones no operator trace or FLOP count slowed, or all where every one was."""
    used, measured, slowed = values.get("steps_used"), values.get("steps_measured"), values.get("steps_instrumented")
    if used is None:
        return "steps not recorded"
    if measured is None:
        return f"{used} measured step{'s' if used != 1 else ''}"
    if used == measured:
        every = ", every one traced or FLOP-counted" if slowed == measured and slowed else ""
        return f"all {measured} measured step{'s' if measured != 1 else ''}{every}"
    return f"{used} of {measured} measured steps ({slowed} traced or FLOP-counted)"


def measurement_notes(records: list[dict[str, Any] | None], labels: dict[str, str]) -> list[str]:
    """How each figure was measured (copied from the profiles) and why some are n/a, deduplicated."""
    methods: dict[str, list[str]] = {}
    reasons: dict[tuple[str, str], list[str]] = {}
    for rec in records:
        if not rec:
            continue
        for key, text in (rec.get("methods") or {}).items():
            methods.setdefault(key, [])
            if text not in methods[key]:
                methods[key].append(text)
        for key, text in (rec.get("null_reasons") or {}).items():
            reasons.setdefault((key, text), []).append(rec.get("label", rec.get("id", "?")))
    notes = []
    for key, texts in methods.items():
        for text in texts:
            counts = METRIC_COUNTS.get(key)
            if counts and key != "model_states_mib" and text in methods.get("model_states_mib", []):
                text = f"{counts}; measured the same way as model_states_mib (above)"
            elif counts:
                text = f"{counts}; {text}"
            notes.append(f"{labels.get(key, key)}: {text}")
    for (key, text), cells in reasons.items():
        which = ", ".join(cells[:3]) + (f" and {len(cells) - 3} more" if len(cells) > 3 else "")
        notes.append(f"{labels.get(key, key)} n/a ({which}): {text}")
    notes.append("figures from: the measured steps the figures are medians over: those without operator tracing "
                 "(or its warm-up) and FLOP counting, which slow a step, unless every measured step had them; "
                 "steps used counts them, and step spread is their (max - min) / median, n/a under 2 steps")
    notes.append("memory at failure: the failing rank's peak memory as it recorded it in failure-rank<N>.json "
                 "(peak memory's meter, over the window since the step profiler last reset it; for a timeout, the "
                 "highest any rank recorded when it was stopped); n/a for a rank killed by a signal, which records "
                 "nothing")
    if any(rec and rec.get("status") != "done" and rec.get("partial") for rec in records):
        notes.append("figures from `partial`: a cell that failed or was stopped, measured over the steps it finished "
                     "(its ranks' profile.rank<N>.partial.json, or their journals, as `trainprof report` reads a "
                     "partial run); not a finished cell's figures")
    return notes


def write_sweep_report(out_dir: Path, sweep: Sweep, records: list[dict[str, Any] | None]) -> list[Path]:
    """results.{md,csv,html} and results.png in out_dir; returns the paths written."""
    rows = sweep_rows(sweep, records)
    notes = measurement_notes(records, METRIC_LABELS)
    done = sum(r["status"] == "done" for r in rows)
    failed = sum(r["status"] == "failed" for r in rows)
    intro = [f"Sweep {sweep.path or sweep.name}: base recipe {sweep.recipe_path}; {len(rows)} cells, {done} done, "
             f"{failed} failed, {len(rows) - done - failed} not finished."]
    if sweep.description:
        intro.append(sweep.description)
    chart = write_sweep_chart(out_dir / "results.png", rows, notes)
    paths = write_tables(out_dir / "results", rows, COLUMNS, title=f"trainprof sweep: {sweep.name}", intro=intro,
                         notes=notes, image=chart.name if chart else None)
    return [*paths, *([chart] if chart else [])]


def write_sweep_chart(path: Path, rows: list[dict[str, Any]], notes: list[str]) -> Path | None:
    """Horizontal bars per cell: tokens/s, peak memory and (when profiled) the phase split of a step;
    failed cells show their failure instead of a bar."""
    if not rows:
        return None
    plt = pyplot()
    has_phases = any(r.get(f"{p}_ms") is not None for r in rows for p in PHASES)
    panels = 3 if has_phases else 2
    labels = [f"{r['cell']} (n={r['world_size']})" for r in rows]
    fig, axes, rect = figure(plt, panels, width_in=5 * panels + 4, plot_height_in=1.4 + 0.32 * len(rows), notes=notes,
                             sharey=True)
    y = list(range(len(rows)))
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s (global)"),
                           (axes[1], "peak_memory_mib", "peak memory, highest rank, MiB (hatched: at failure)")):
        values = [r.get(key) or 0 for r in rows]
        ax.barh(y, values, color="#4c72b0")
        if key == "peak_memory_mib":  # a failed cell's memory when it failed, where its rank recorded it
            failed = [(r.get("failure_memory_mib") or 0) if r["status"] != "done" else 0 for r in rows]
            ax.barh(y, failed, color="none", edgecolor="#b00000", hatch="//")
            values = [max(a, b) for a, b in zip(values, failed)]
        top = max(values) if any(values) else 1
        for yi, r, v in zip(y, rows, values):
            if r["status"] != "done":
                text = r.get("failure_kind") or r["status"]
                if r.get("failed_rank") is not None:
                    text += f" (rank {r['failed_rank']}{', ' + r['signal'] if r.get('signal') else ''})"
                if r.get("figures"):
                    text += ", partial"
                ax.text(v + top * 0.02, yi, text, va="center", fontsize=8, color="#b00000")
            elif v:
                ax.text(v, yi, f" {v:,.0f}", va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, top * 1.3)
    if has_phases:
        ax = axes[2]
        left = [0.0] * len(rows)
        colors = plt.get_cmap("tab10")
        for i, p in enumerate(PHASES):
            vals = [r.get(f"{p}_ms") or 0 for r in rows]
            if not any(vals):  # a phase no cell spent time in would only lengthen the legend
                continue
            ax.barh(y, vals, left=left, color=colors(i), label=p)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_title("phase split of a step, ms (median)", fontsize=9)
        # beside the axes, not over the longest bars; the layout (save_figure) makes room for it
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, frameon=False)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(labels, fontsize=8)
    axes[0].invert_yaxis()
    return save_figure(fig, path, rect)
