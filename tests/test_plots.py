"""The chart helpers the sweep, scaling, max-batch and projection charts share (report/plots.py): long
x tick labels are wrapped, not cut, and the figure grows around long labels, so matplotlib never gives up
on the layout ("Tight layout not applied") and every panel keeps its size."""

from __future__ import annotations

import warnings

import pytest

from trainprof.report import plots

OVERRIDES = ["model.name=llama2-13b", "train.micro_batch_size=4", "data.seq_len=512", "model.recompute=true",
             "engine.zero_stage=2", "train.grad_accum=2", "engine.offload=optimizer", "data.dataset=synthetic"]


def _prediction(hardware: str, tokens_per_s: float) -> dict:
    return {"hardware": hardware, "world_size": 8, "overrides": OVERRIDES, "tokens_per_s": tokens_per_s,
            "expected_error_pct": None, "confidence": "unvalidated: CPU run -> GPU",
            "phases_ms": {"forward": 100.0, "backward": 200.0, "optimizer": 20.0}}


def test_a_projection_with_many_overrides_lays_out_without_a_warning(tmp_path):
    """`trainprof project RUN <8 overrides> --to h100-sxm,a100-80g-sxm,rtx4090`: each bar's label is the
    hardware and every override; before, tight_layout gave up on it with a UserWarning on stderr."""
    from trainprof.projection.report import plot_projection

    result = {"predictions": [_prediction(h, t) for h, t in (("h100-sxm", 24522.0), ("a100-80g-sxm", 12108.0),
                                                               ("rtx4090", 4170.0))],
              "source": {"run_dir": str(tmp_path / "run")}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any layout warning fails the test
        path = plot_projection(result, tmp_path / "projection.png")
    assert path.stat().st_size > 10_000


@pytest.mark.parametrize("n_overrides", [1, 8, 30])
def test_long_tick_labels_are_wrapped_whole_and_the_panels_keep_their_height(tmp_path, n_overrides):
    plt = plots.pyplot()
    labels = [f"h100-sxm\nx8 {' '.join(OVERRIDES * 4)[:40 * n_overrides]}", "short"]
    fig, (ax,), rect = plots.figure(plt, 1, width_in=6, plot_height_in=3, notes=["how measured: a test"])
    ax.bar([0, 1], [1.0, 2.0])
    ax.set_xticks([0, 1], labels, fontsize=7, rotation=30, ha="right")
    plots.wrap_tick_labels(fig)
    shown = [t.get_text() for t in ax.get_xticklabels()]
    assert [s.replace("\n", " ") for s in shown] == [s.replace("\n", " ") for s in labels]  # same words
    assert all(len(line) <= plots.TICK_LABEL_CHARS for s in shown for line in s.split("\n"))
    assert all(t.get_rotation() == 30 and t.get_fontsize() == 7 for t in ax.get_xticklabels())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig.tight_layout(rect=plots.fit_size(fig, rect), pad=plots.LAYOUT_PAD)
    assert ax.get_position().height * fig.get_size_inches()[1] >= plots.MIN_PANEL_IN - 0.05
    plt.close(fig)


def test_long_row_labels_stay_whole_and_the_figure_widens_for_them(tmp_path):
    """A sweep's cells are bar rows named on the y axis: a long name keeps its one line (more would run
    into the next row), and the figure grows wider instead of squeezing the panels."""
    plt = plots.pyplot()
    labels = [" ".join(OVERRIDES * 2) + f" (n={n})" for n in (1, 2)]
    fig, axes, rect = plots.figure(plt, 2, width_in=6, plot_height_in=2, notes=["how measured: a test"], sharey=True)
    for ax in axes:
        ax.barh([0, 1], [1.0, 2.0])
    axes[0].set_yticks([0, 1], labels, fontsize=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plots.save_figure(fig, tmp_path / "rows.png", rect)
    assert [t.get_text() for t in axes[0].get_yticklabels()] == labels
    assert fig.get_size_inches()[0] > 6 and path.stat().st_size > 0
    assert all(ax.get_position().width * fig.get_size_inches()[0] >= plots.MIN_PANEL_IN - 0.05 for ax in axes)
