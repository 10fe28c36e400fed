"""A pipeline stage that finishes its schedule early waits in the next collective (the optimizer's
grad-norm all-reduce) for the other stages to drain: that wait is bubble, not communication
(analysis/pipeline.py merge_pipeline), and the Communication section says where the point-to-point
waits went (report/sections.py comm_section). Constructed rank profiles, no run."""

from __future__ import annotations

import pytest

from trainprof.analysis import pipeline
from trainprof.report.document import Document, render_markdown
from trainprof.report.rundir import RunData
from trainprof.report.sections import comm_section

WALL_MS = 110.0
# stage 0 (the slow one) runs until 100 ms, then its optimizer; its all-reduce waits 2 ms.
STAGE0 = [["forward", 0, 0.0, 20.0], ["backward", 0, 60.0, 100.0], ["optimizer", None, 101.0, 108.0],
          ["comm_exposed", None, 102.0, 104.0]]
# stage 1 is done at 60 ms (its last gradient send waits 5 ms) and waits 44 ms in the all-reduce,
# 40 of them while stage 0 still runs its schedule.
STAGE1 = [["bubble_forward", None, 0.0, 20.0], ["forward", 0, 20.0, 35.0], ["backward", 0, 35.0, 55.0],
          ["bubble_backward", None, 55.0, 60.0], ["optimizer", None, 60.0, 108.0],
          ["comm_exposed", None, 60.0, 104.0]]


def _rank_profile(stage: int, intervals: list[list], bubble_ms: float, comm_exposed_ms: float) -> dict:
    optimizer_ms = 7.0 - 2.0 if stage == 0 else 48.0 - 44.0
    phases = {"data_wait": 0.0, "optimizer": optimizer_ms, "comm_exposed": comm_exposed_ms,
              "pipeline_bubble": bubble_ms}
    span = WALL_MS - optimizer_ms
    return {
        "rank": stage,
        "steps": [{"step": 0, "wall_ms": WALL_MS, "phases_ms": phases, "warmup": False}],
        "ranks": [{"rank": stage, "phases_ms": dict(phases)}],
        "comm": [{"op": "all_reduce", "phase": "optimizer", "exposed_ms": comm_exposed_ms, "bytes": 4}],
        "modules": [],
        "pipeline": {
            "stage": stage, "num_stages": 2, "schedule": "gpipe", "micro_batches": 1, "prev_rank": None,
            "next_rank": None, "bubble_ms": bubble_ms, "schedule_ms": span, "busy_ms": 60.0 - 25 * stage,
            "bubble_frac_measured": bubble_ms / span, "bubble_frac_analytic": 0.5, "micro_batches_ms": [],
            "p2p_bytes_per_step": {}, "method": {},
            "timelines": [{"step": 0, "origin_unix_ns": 0, "wall_ms": WALL_MS, "intervals": intervals,
                           "transfers": []}],
        },
    }


@pytest.fixture()
def merged_pipeline() -> dict:
    return pipeline.merge_pipeline([_rank_profile(0, STAGE0, 0.0, 2.0), _rank_profile(1, STAGE1, 25.0, 44.0)])


def test_drain_is_the_collective_wait_overlapping_another_stage_schedule():
    stages = [{"stage": 0, "offset_ms": 0.0, "intervals": STAGE0},
              {"stage": 1, "offset_ms": 0.0, "intervals": STAGE1}]
    assert pipeline.drain_ms(stages) == pytest.approx([0.0, 40.0])
    # the same step with stage 1 started 1 ms later on the shared clock: its wait ends 1 ms sooner there
    stages[1]["offset_ms"] = 1.0
    assert pipeline.drain_ms(stages) == pytest.approx([0.0, 39.0])


def test_stage_bubble_counts_its_drain(merged_pipeline):
    stage1 = merged_pipeline["stages"][1]
    span = WALL_MS - 4.0
    assert stage1["drain_ms"] == pytest.approx(40.0)
    assert stage1["bubble_ms"] == pytest.approx(65.0)  # 25 ms waiting for a neighbour + 40 ms drain
    assert stage1["bubble_frac_measured"] == pytest.approx(65.0 / span)
    assert stage1["phases_ms"]["comm_exposed"] == pytest.approx(4.0)
    assert stage1["phases_ms"]["pipeline_bubble"] == pytest.approx(65.0)
    assert "all_reduce (optimizer)" in stage1["drain_in"]
    assert merged_pipeline["stages"][0]["drain_ms"] == pytest.approx(0.0)
    assert merged_pipeline["bubble_frac_measured_mean"] == pytest.approx((0.0 + 65.0 / span) / 2)
    # the diagram draws the drain as a wait for the other stage's backward, the rest as the collective
    waits = [iv[2:] for iv in merged_pipeline["timeline"]["stages"][1]["intervals"]
             if iv[0] in ("bubble_backward", "comm_exposed") and iv[2] >= 60.0]
    assert waits == [[60.0, 100.0], [100.0, 104.0]]


def _comm_markdown(profile: dict) -> str:
    doc = Document("t", plots=False)
    comm_section(doc, RunData.of_profile(profile, "."))
    return render_markdown(doc)


def test_comm_section_says_point_to_point_waits_are_pipeline_bubble(merged_pipeline):
    profile = {
        "summary": {"step_ms": {"median": 1000.0}, "phases_ms": {"comm_exposed": 5.0, "pipeline_bubble": 410.0}},
        "measurement": {},
        "steps_rank": 0,
        "steps": [{"step": 0, "warmup": False}],
        "pipeline": merged_pipeline,
        "comm": [
            {"op": "all_reduce", "phase": "optimizer", "group_size": 2, "calls": 1, "steps": 1, "bytes": 4,
             "total_ms": 5.0, "exposed_ms": 5.0},
            {"op": "irecv", "phase": "backward", "group_size": 2, "calls": 6, "steps": 1, "bytes": 1 << 20,
             "total_ms": 402.0, "exposed_ms": 400.0, "peer": 1},
            {"op": "isend", "phase": "forward", "group_size": 2, "calls": 6, "steps": 1, "bytes": 1 << 20,
             "total_ms": 900.0, "exposed_ms": 10.0, "peer": 1},
        ],
    }
    md = _comm_markdown(profile)
    assert "pipeline_bubble" in md
    assert "410.00 ms" in md  # the point-to-point rows' exposed ms, said to be in the bubble
    assert "stage 1" in md and "40.00 ms" in md  # the other stage's drain, named with its collective


def test_the_merged_ranks_table_books_the_drain_as_bubble():
    """merge_ranks puts each stage's drained phases in its row of `ranks` (the report's Ranks table): stage 1's
    all-reduce wait of 44 ms is 40 ms of drain (bubble 25 -> 65 ms) and 4 ms of communication."""
    from trainprof.analysis.merge import merge_ranks

    profiles = [_rank_profile(0, STAGE0, 0.0, 2.0), _rank_profile(1, STAGE1, 25.0, 44.0)]
    for p in profiles:
        p.update(env={}, summary={"tokens_per_step": 10})
        p["ranks"][0].update(step_ms_median=WALL_MS, busy_ms_median=80.0)
    rows = {r["rank"]: r["phases_ms"] for r in merge_ranks(profiles)["ranks"]}
    assert (rows[0]["comm_exposed"], rows[0]["pipeline_bubble"]) == (2.0, 0.0)
    assert rows[1]["comm_exposed"] == pytest.approx(4.0) and rows[1]["pipeline_bubble"] == pytest.approx(65.0)
