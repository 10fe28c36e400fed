"""The sweep's results.md notes and results.png chart, from hand-made rows and records (no cells run)."""

from __future__ import annotations

from pathlib import Path

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
    assert STATE_METHOD not in optim and "counted as model_states_mib is" in optim


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
