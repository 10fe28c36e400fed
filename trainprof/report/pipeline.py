"""The pipeline section of the reports and summary.md: one step's per-stage timeline (the classic
pipeline diagram, from measured intervals; as text without plots), bubble measured beside analytic,
point-to-point volume, stage imbalance and which stage to rebalance. Figures come from profile.json `pipeline` (trainprof/analysis/pipeline.py)."""

from __future__ import annotations

from typing import Any

from trainprof.report import plots
from trainprof.report.document import Document, Figure, Para, Pre, Table, fmt
from trainprof.report.rundir import RunData

def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def timeline_text(stages: list[dict[str, Any]], width: int = 72) -> str:
    """The timeline as text, one line per stage: F / B for a micro batch's forward / backward (its
    index after the letter where there is room), '.' waiting for a neighbour, 'o' optimizer, 'c'
    blocked in a collective, ' ' anything else (for summary.md and terminals)."""
    end = max((st["offset_ms"] + iv[3] for st in stages for iv in st["intervals"]), default=0.0)
    if end <= 0:
        return ""
    scale = width / end
    lines = []
    for st in stages:
        row = [" "] * width
        for kind, mb, t0, t1 in st["intervals"]:
            a = int((st["offset_ms"] + t0) * scale)
            b = max(a + 1, int((st["offset_ms"] + t1) * scale))
            char = {"forward": "F", "backward": "B", "optimizer": "o", "comm_exposed": "c"}.get(kind, ".")
            for i in range(a, min(b, width)):
                row[i] = char
            if kind in ("forward", "backward") and mb is not None and b - a >= 2:
                row[min(a + 1, width - 1)] = str(mb % 10)
        lines.append(f"stage {st['stage']} |{''.join(row)}|")
    lines.append(f"{'':8}0{'':{width - len(f'{end:.1f} ms')}}{end:.1f} ms")
    return "\n".join(lines)


def pipeline_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    pl = p.get("pipeline")
    if not pl or "stages" not in pl:
        return
    sec = doc.section("Pipeline stages", id="pipeline")
    m, n = pl["micro_batches"], pl["num_stages"]
    sec.blocks.append(Para(f"{n} stages, {pl['schedule']} schedule, {m} micro batches per step. Bubble: "
                           f"{bubble_text(pl)}. {pl.get('bubble_frac_measured_method', '')}."))
    tl = pl.get("timeline")
    if tl and not doc.plots:
        sec.blocks.append(Para(f"Step {tl['step']}, measured (F/B: a micro batch's forward/backward, '.': waiting for "
                               "a neighbour, 'c': blocked in a collective, 'o': optimizer):"))
        sec.blocks.append(Pre(timeline_text(tl["stages"])))
    elif tl:
        sec.blocks.append(Figure(plots.pipeline_timeline(tl["stages"]),
                                 f"Step {tl['step']} per stage, from measured intervals (F<i>/B<i>: micro batch i's "
                                 f"forward/backward; hatched: waiting for a neighbour). {tl['alignment']}",
                                 f"{plots.PLOTS_DIR}/pipeline_timeline.png", id="fig-pipeline-timeline"))
    method = (pl["stages"][0].get("method") or {}) if pl["stages"] else {}
    rows = []
    for st in pl["stages"]:
        b = st.get("p2p_bytes_per_step") or {}
        rows.append([st["stage"], st.get("rank"), st.get("busy_ms"), st.get("bubble_ms"), st.get("drain_ms"),
                     st.get("schedule_ms"),
                     _pct(st.get("bubble_frac_measured")), _pct(st.get("bubble_frac_analytic")),
                     (b.get("activations_sent_bytes", 0) + b.get("gradients_sent_bytes", 0)) / 2**20,
                     (b.get("activations_received_bytes", 0) + b.get("gradients_received_bytes", 0)) / 2**20])
    sec.blocks.append(Table(
        ["stage", "rank", "busy ms", "bubble ms", "of which drain ms", "schedule ms", "bubble measured",
         "bubble analytic (GPipe)", "p2p sent MiB", "p2p received MiB"], rows, id="pipeline-stages-table",
        method=f"busy: {method.get('busy_ms', '')}; bubble: {method.get('bubble', '')}; plus the "
               f"{method.get('drain', 'drain: not measured (older run dir)')}; measured fraction: "
               f"{method.get('bubble_frac_measured', '')}; analytic: {method.get('bubble_frac_analytic', '')}; "
               "p2p: bytes of the point-to-point ops with the neighbouring stages per step (median)"))
    transfers = pl.get("transfers") or []
    if transfers:
        sec.blocks.append(Table(
            ["from stage", "to stage", "carries", "KiB per transfer", "transfer ms (median)", "GB/s", "pairs timed"],
            [[t["from_stage"], t["to_stage"], t["carries"], (t["bytes"] or 0) / 1024, t["transfer_ms"], t["gbps"],
              t["samples"]] for t in transfers], id="pipeline-transfers-table", method=pl.get("transfers_method")))
    mb_rows = [[st["stage"], r["micro_batch"], r.get("forward_ms"), r.get("backward_ms")]
               for st in pl["stages"] for r in st.get("micro_batches_ms") or []]
    if mb_rows:
        sec.blocks.append(Table(["stage", "micro batch", "forward ms", "backward ms"], mb_rows,
                                id="pipeline-microbatch-table", method=method.get("micro_batches_ms")))
    bal = pl.get("balance") or {}
    text = (f"Stage imbalance: {_pct(bal.get('imbalance'))} (slowest stage {bal.get('slowest_stage')}, busy ms per "
            f"stage {', '.join(fmt(x) for x in bal.get('busy_ms') or [])}). ")
    if bal.get("suggestion"):
        text += "To rebalance: " + bal["suggestion"]["text"] + "."
    elif bal.get("suggestion_none"):
        text += bal["suggestion_none"] + "."
    sec.blocks.append(Para(text + f" ({bal.get('method', '')})"))


def bubble_text(pl: dict[str, Any]) -> str:
    """Measured bubble beside the analytic one, labelled, in one line."""
    return (f"measured {_pct(pl.get('bubble_frac_measured'))} of the schedule on stage "
            f"{pl.get('bubble_frac_measured_stage')}, which sets the pace (mean over {pl['num_stages']} stages "
            f"{_pct(pl.get('bubble_frac_measured_mean'))}; time blocked on transfers with a neighbour, and in a "
            "collective while another stage drains) vs analytic "
            f"GPipe {_pct(pl['bubble_frac_analytic'])} ((p-1)/(m+p-1), p={pl['num_stages']}, m={pl['micro_batches']}; "
            "equal stages, free transfers)")
