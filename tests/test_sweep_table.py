"""The sweep's results.md notes and results.png chart, from hand-made rows and records (no cells run)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pandas as pd
import pytest

from trainprof.phases import PHASES
from trainprof.sweep import report

STATE_METHOD = "bytes of tensors this rank stores, each storage counted once"


def test_optimizer_states_note_says_what_it_counts_not_a_copy_of_model_states():
    """Both columns come from profile.json model_state_bytes with the same method: the optimizer-states line
    says which part it is instead of repeating the model-states line."""
    rec = {"label": "a", "methods": {"model_states_mib": f"rank 0: {STATE_METHOD}",
                                     "optimizer_states_mib": f"rank 0: {STATE_METHOD}"}}
    notes = {n.split(":", 1)[0]: n for n in report.measurement_notes([rec], report.METRIC_LABELS)}
    model, optim = notes["model_states_mib"], notes["optimizer_states_mib"]
    assert model != optim.replace("optimizer_states_mib", "model_states_mib")
    assert "params, grads, optimizer states and fp32 master copies together" in model and STATE_METHOD in model
    assert "exp_avg and exp_avg_sq" in optim and "not grads, params or fp32 master copies" in optim
    assert STATE_METHOD not in optim and "measured the same way as model_states_mib (above)" in optim


def test_phase_legend_sits_outside_the_bars(tmp_path: Path, monkeypatch):
    """results.png's phase-split legend lies right of its axes (it covered the longest bars inside them), and
    lists only the phases some cell spent time in."""
    boxes = {}
    real_save = report.save_figure

    def keep(fig, path, rect=(0, 0, 1, 1)):
        savefig = fig.savefig

        def measure_then_save(*args, **kwargs):  # after the layout, before the figure is closed
            renderer = fig.canvas.get_renderer()
            legend = fig.axes[2].get_legend()
            boxes.update(labels=[t.get_text() for t in legend.get_texts()], width=fig.bbox.width,
                         legend=legend.get_window_extent(renderer), axes=fig.axes[2].get_window_extent(renderer))
            return savefig(*args, **kwargs)

        fig.savefig = measure_then_save
        return real_save(fig, path, rect)

    monkeypatch.setattr(report, "save_figure", keep)
    rows = [{"cell": f"cell{i}", "world_size": 1, "status": "done", "tokens_per_s": 500.0 + i,
             "peak_memory_mib": 500.0, "forward_ms": 300.0, "backward_ms": 900.0 + 100 * i, "optimizer_ms": 20.0}
            for i in range(4)]
    path = report.write_sweep_chart(tmp_path / "results.png", rows, ["a note"])
    assert path.is_file() and path.stat().st_size > 0
    assert boxes["labels"] == [p for p in PHASES if p in ("forward", "backward", "optimizer")]
    assert boxes["legend"].x0 >= boxes["axes"].x1  # beside the axes, over no bar
    assert boxes["legend"].x1 <= boxes["width"] + 1  # and inside the saved figure


RECORDED = Path(__file__).parent / "data"


def _record(profile: dict, label: str = "a") -> dict:
    """A done cell's state record, as runner.run_cell writes it from the cell's profile.json."""
    from trainprof.sweep.outcome import metrics_row

    values, methods, why = metrics_row(profile)
    return {"label": label, "status": "done", "values": values, "methods": methods, "null_reasons": why}


def _recorded_profile(name: str) -> dict:
    return json.loads((RECORDED / name / "profile.json").read_text())


def test_each_row_says_how_many_steps_its_figures_stand_on(tmp_path: Path):
    """The recorded ZeRO-3 run traced 3 of its 6 measured steps (Kineto warm-up + 2 active): its row says its
    figures are medians of the other 3, not "all steps", and results.md/.csv/.html show steps used and their
    spread; a run whose figures stand on one step shows no spread (n/a), not 0.0%."""
    from trainprof.sweep.spec import Cell, Sweep

    profile = _recorded_profile("zero3_2rank")
    one_step = copy.deepcopy(profile)  # what a 4-step run with 3 traced steps leaves: one untraced step
    one_step["steps"] = [s for s in one_step["steps"] if s["step"] <= 3]
    one_step["summary"].update(steps_used=1, step_ms={"min": 71.7, "median": 71.7, "max": 71.7})
    cells = [Cell(id=f"c{i}-x", label=f"c{i}", overrides=[]) for i in range(2)]
    sweep = Sweep(name="t", path="", recipe_path="r.yaml", cells=cells)
    records = [_record(profile, "c0"), _record(one_step, "c1")]
    rows = report.sweep_rows(sweep, records)
    assert [r["figures"] for r in rows] == ["3 of 6 measured steps (3 traced or FLOP-counted)",
                                            "1 of 4 measured steps (3 traced or FLOP-counted)"]
    step_ms = profile["summary"]["step_ms"]
    assert rows[0]["steps_used"] == 3
    assert rows[0]["step_spread"] == pytest.approx((step_ms["max"] - step_ms["min"]) / step_ms["median"])
    assert rows[1]["steps_used"] == 1 and rows[1]["step_spread"] is None

    report.write_sweep_report(tmp_path, sweep, records)
    df = pd.read_csv(tmp_path / "results.csv")
    assert df["steps_used"].tolist() == [3, 1]
    assert df["step_spread"].iloc[0] == pytest.approx(rows[0]["step_spread"]) and pd.isna(df["step_spread"].iloc[1])
    md = (tmp_path / "results.md").read_text()
    assert "| steps used | step spread |" in md and "| 3 | 151.8% |" in md and "| 1 | n/a |" in md
    assert "step spread n/a (c1): fewer than 2 steps used" in md
    html = (tmp_path / "results.html").read_text()
    assert "steps used" in html and "1 of 4 measured steps (3 traced or FLOP-counted)" in html


@pytest.mark.parametrize("name", ["zero3_2rank", "pre_profiler_run"])
def test_peak_memory_is_the_figure_the_runs_report_gives(name):
    """One definition of peak memory: the sweep row's is the run report's (the runner's peak over the run,
    highest rank), not the step profiler's largest phase peak, which read 0.1-26 MiB apart for the same run."""
    from trainprof.report.sections import _peak_memory_text

    summary = _recorded_profile(name)["summary"]
    rec = _record(_recorded_profile(name))
    mib = rec["values"]["peak_memory_mib"]
    assert _peak_memory_text(summary).startswith(f"{mib:,.1f} MiB")
    assert mib * 2**20 == summary["peak_memory_bytes_max"]
    assert "highest rank" in rec["methods"]["peak_memory_mib"]
    assert summary["memory_meter"] in rec["methods"]["peak_memory_mib"]
