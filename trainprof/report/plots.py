"""The reports' charts, drawn with matplotlib's Agg backend: the run report's plots as PNG bytes
(embedded in report.html, written beside report.md), and the figure helpers the sweep, scaling,
max-batch and projection charts share (panels above a how-measured caption, saved atomically)."""

from __future__ import annotations

import io
import textwrap
from pathlib import Path
from typing import Any

PHASE_COLORS = {
    "data_wait": "#9e9e9e", "forward": "#4c78a8", "backward": "#f58518", "recompute": "#b279a2",
    "optimizer": "#54a24b", "comm_exposed": "#e45756", "pipeline_bubble": "#ff9da6", "other": "#bab0ac",
    "unattributed": "#eeeeee",
    "step": "#4c78a8",
}
DPI = 110
PLOTS_DIR = "report_plots"  # the run report's PNGs, beside report.md
INSTALL_HINT = "pip install matplotlib (a dependency of trainprof: `pip install -e .` installs it)"


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib() -> None:
    """Fail before any cell runs, not after, when the charts cannot be drawn."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        from trainprof.errors import UserError

        raise UserError(f"charts need matplotlib, which is not installed; {INSTALL_HINT}")


CAPTION_LINE_IN = 0.13  # inches per caption line at fontsize 7


def wrap_caption(lines: list[str], width: int = 160) -> list[str]:
    """The how-measured lines of a figure, wrapped to fit its width."""
    return [w for line in lines for w in textwrap.wrap(line, width)]


def figure(plt, ncols: int, *, width_in: float, plot_height_in: float, notes: list[str], **kwargs):
    """A figure with ncols panels above room for the how-measured caption.

    Returns:
        (fig, axes list, rect): pass rect to save_figure, which lays the panels out inside it.
    """
    wrapped = wrap_caption(notes, int(width_in * 13))
    cap_in = CAPTION_LINE_IN * len(wrapped) + 0.15
    fig, axes = plt.subplots(1, ncols, figsize=(width_in, plot_height_in + cap_in), squeeze=False, **kwargs)
    fig.text(0.01, 0.01, "\n".join(wrapped), fontsize=7, va="bottom", ha="left", family="monospace")
    return fig, list(axes[0]), (0, (cap_in + 0.1) / (plot_height_in + cap_in), 1, 1)


TICK_LABEL_CHARS = 40  # longer x tick labels (a projection's overrides) are wrapped onto lines this long
MIN_PANEL_IN = 1.5  # a panel keeps at least this height and width: the figure grows around long labels instead
LAYOUT_PAD = 1.08  # tight_layout's padding around and between the panels, in font sizes (matplotlib's default)


def wrap_tick_labels(fig) -> None:
    """Wrap each x tick label longer than TICK_LABEL_CHARS at its spaces: same text, on shorter lines. Y tick
    labels stay whole: they name bar rows, and extra lines would run into the next row."""
    for ax in fig.axes:
        texts = [label.get_text() for label in ax.xaxis.get_ticklabels()]
        if all(len(line) <= TICK_LABEL_CHARS for text in texts for line in text.split("\n")):
            continue
        wrapped = ["\n".join(textwrap.fill(line, TICK_LABEL_CHARS, break_long_words=False) or line
                             for line in text.split("\n")) for text in texts]
        ax.xaxis.set_ticks(ax.xaxis.get_ticklocs(), wrapped)


def fit_size(fig, rect: tuple[float, float, float, float]) -> tuple[float, float, float, float]:
    """Grow the figure so that each panel (side by side, as `figure` makes them) keeps MIN_PANEL_IN inches
    each way beside its labels: tight_layout alone would shrink the panels, and gives up with a warning
    ("Tight layout not applied") when they would vanish. The caption below rect keeps its height.
    Returns rect for the new size."""
    import matplotlib

    renderer = fig.canvas.get_renderer()
    width, height = fig.get_size_inches()
    pad_in = LAYOUT_PAD * matplotlib.rcParams["font.size"] / 72
    panels = [(ax.get_tightbbox(renderer), ax.get_window_extent(renderer)) for ax in fig.axes if ax.get_visible()]
    need_h = max(((tight.height - own.height) / fig.dpi for tight, own in panels), default=0.0)
    need_h += 2 * pad_in + MIN_PANEL_IN
    need_w = sum((tight.width - own.width) / fig.dpi + MIN_PANEL_IN for tight, own in panels)
    need_w += (len(panels) + 1) * pad_in
    room_h = (rect[3] - rect[1]) * height
    grown_w, grown_h = max(width, need_w), height + max(0.0, need_h - room_h)
    if (grown_w, grown_h) == (width, height):
        return rect
    fig.set_size_inches(grown_w, grown_h)
    return (rect[0], rect[1] * height / grown_h, rect[2], 1 - (1 - rect[3]) * height / grown_h)


def save_figure(fig, path: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> Path:
    """Lay out the panels inside rect, save the figure atomically (trainprof.io.atomic_write_text) and close it."""
    from trainprof.io import atomic_write_text

    wrap_tick_labels(fig)
    fig.tight_layout(rect=fit_size(fig, rect), pad=LAYOUT_PAD)
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format=path.suffix.lstrip(".") or None, dpi=DPI)
    finally:
        pyplot().close(fig)
    atomic_write_text(path, buf.getvalue())
    return path


def legend_if_labelled(ax, **kwargs) -> None:
    """A legend only where the axes hold labelled artists (else matplotlib warns "No artists with labels
    found" on the user's terminal, e.g. a chart whose every try failed)."""
    handles, _ = ax.get_legend_handles_labels()
    if handles:
        ax.legend(**kwargs)


def png_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    pyplot().close(fig)
    return buf.getvalue()


def phase_bars(steps: list[dict[str, Any]], phases: tuple[str, ...]) -> bytes:
    """A stacked bar per step: each phase's ms, then what no phase covered (unattributed).

    Args:
        steps: profile.json steps (with phases_ms and unattributed_ms).
        phases: the phases in stacking order.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = list(range(len(steps)))
    bottom = [0.0] * len(steps)
    for phase in (*phases, "unattributed"):
        values = [(s.get("unattributed_ms") if phase == "unattributed" else s["phases_ms"].get(phase)) or 0.0
                  for s in steps]
        if not any(values):
            continue
        ax.bar(x, values, bottom=bottom, label=phase, color=PHASE_COLORS.get(phase), edgecolor="white", linewidth=0.3)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(x, [str(s["step"]) + ("*" if s.get("instrumented") else "") for s in steps], fontsize=8)
    ax.set_xlabel("step (* = instrumented: FLOP counting or operator tracing)")
    ax.set_ylabel("ms")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return png_bytes(fig)


def step_bars(steps: list[dict[str, Any]]) -> bytes:
    """Wall time per step, for run dirs without a phase breakdown."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 3.0))
    ax.bar([str(s["step"]) for s in steps], [s.get("wall_ms") or 0.0 for s in steps], color=PHASE_COLORS["step"])
    ax.set_xlabel("step")
    ax.set_ylabel("wall ms")
    ax.spines[["top", "right"]].set_visible(False)
    return png_bytes(fig)


def module_bars(labels: list[str], parts: dict[str, list[float]], xlabel: str) -> bytes:
    """Horizontal stacked bars, one per module (largest on top), parts e.g. forward/backward/recompute."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.32 * len(labels)))
    y = list(range(len(labels)))[::-1]
    left = [0.0] * len(labels)
    for part, values in parts.items():
        if not any(values):
            continue
        ax.barh(y, values, left=left, label=part, color=PHASE_COLORS.get(part), edgecolor="white", linewidth=0.3)
        left = [a + b for a, b in zip(left, values)]
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel(xlabel)
    ax.legend(fontsize=8, frameon=False, loc="lower right")
    ax.spines[["top", "right"]].set_visible(False)
    return png_bytes(fig)


def memory_bars(peaks: dict[str, float], ylabel: str) -> bytes:
    """Peak memory per phase (MiB)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.0))
    names = list(peaks)
    ax.bar(names, [peaks[n] for n in names], color=[PHASE_COLORS.get(n, "#4c78a8") for n in names])
    for i, n in enumerate(names):
        ax.annotate(f"{peaks[n]:,.0f}", (i, peaks[n]), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.spines[["top", "right"]].set_visible(False)
    return png_bytes(fig)


def speedup_bars(labels: list[str], changes: list[float], noise: float | None) -> bytes:
    """Time change B vs A per row (negative = B faster), with the noise band shaded."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.9 + 0.3 * len(labels)))
    y = list(range(len(labels)))[::-1]
    colors = ["#54a24b" if c < 0 else "#e45756" for c in changes]
    ax.barh(y, [100 * c for c in changes], color=colors)
    if noise:  # the band is symmetric in ratio: B within A/(1+noise) .. A*(1+noise)
        ax.axvspan(100 * (1 / (1 + noise) - 1), 100 * noise, color="#dddddd", alpha=0.6,
                   label=f"noise band (ratio within {1 + noise:.2f}x)")
        ax.legend(fontsize=8, frameon=False, loc="lower right")
    ax.axvline(0, color="black", linewidth=0.6)
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("time change B vs A, % (negative = B faster)")
    ax.spines[["top", "right"]].set_visible(False)
    return png_bytes(fig)


TIMELINE_COLORS = {"forward": PHASE_COLORS["forward"], "backward": PHASE_COLORS["backward"],
                   "bubble_forward": PHASE_COLORS["pipeline_bubble"], "bubble_backward": PHASE_COLORS["pipeline_bubble"],
                   "optimizer": PHASE_COLORS["optimizer"], "comm_exposed": PHASE_COLORS["comm_exposed"]}


def pipeline_timeline(stages: list[dict[str, Any]]) -> bytes:
    """The classic pipeline diagram of one step: a row per stage, its micro batches' forwards (F<i>)
    and backwards (B<i>), the waits for a neighbour and the optimizer, placed on a shared time axis.

    Args:
        stages: merged profile `pipeline.timeline.stages` (offset_ms, intervals [kind, mb, t0, t1]).
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.8 + 0.7 * len(stages)))
    seen = set()
    for row, st in enumerate(stages):
        y = len(stages) - 1 - row
        for kind, mb, t0, t1 in st["intervals"]:
            x0 = st["offset_ms"] + t0
            label = None
            legend = ("waiting for a neighbour" if kind.startswith("bubble") else
                      "blocked in a collective" if kind == "comm_exposed" else kind)
            if legend not in seen:
                seen.add(legend)
                label = legend
            ax.broken_barh([(x0, t1 - t0)], (y - 0.35, 0.7), facecolors=TIMELINE_COLORS.get(kind, "#cccccc"),
                           edgecolor="white", linewidth=0.4, label=label, hatch="//" if kind.startswith("bubble") else None)
            if kind in ("forward", "backward") and mb is not None:
                ax.text(x0 + (t1 - t0) / 2, y, f"{kind[0].upper()}{mb}", ha="center", va="center", fontsize=7,
                        color="white", clip_on=True)
    ax.set_yticks(range(len(stages)), [f"stage {st['stage']}" for st in reversed(stages)], fontsize=8)
    ax.set_xlabel("ms since the first stage's step start")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    return png_bytes(fig)


def telemetry_lines(steps: list[int], panels: dict[str, dict[str, list[float | None]]], units: dict[str, str]) -> bytes:
    """One small panel per telemetry metric: the per-step mean as a line, the per-step max as dots.

    Args:
        steps: the step numbers (x axis).
        panels: metric -> {"mean": [...], "max": [...]} aligned with `steps` (None where no sample).
        units: metric -> unit (y labels).
    """
    plt = pyplot()
    names = list(panels)
    cols = 2
    rows = max(1, (len(names) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(9, 1.9 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        series = panels[name]
        for key, style in (("mean", dict(color=PHASE_COLORS["forward"], linewidth=1.2, marker=".")),
                           ("max", dict(color=PHASE_COLORS["backward"], linestyle="none", marker="^", markersize=3))):
            pts = [(x, y) for x, y in zip(steps, series.get(key) or []) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=key, **style)
        ax.set_title(f"{name} ({units.get(name, '')})", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.spines[["top", "right"]].set_visible(False)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=7, frameon=False)
    fig.supxlabel("step", fontsize=8)
    fig.tight_layout()
    return png_bytes(fig)
