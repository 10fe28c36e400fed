"""The analysis layer on hand-written timelines (no torch work): interval arithmetic, the phase
partition and its closure, recompute bursts, communication carve-out, rank merge and straggler."""

from __future__ import annotations

import pytest

from trainprof.analysis.aggregate import StepRecord, module_tree_step
from trainprof.analysis.bandwidth import bandwidth_gbps, bus_factor
from trainprof.analysis.breakdown import CommEvent, analyze_step, recompute_bursts
from trainprof.analysis.intervals import IntervalSet, label_timeline
from trainprof.analysis.merge import find_straggler, merge_ranks
from trainprof.analysis.records import (
    B_CLOSE, B_OPEN, F_CLOSE, F_OPEN, R_CLOSE, R_OPEN, REGION_CLOSE, REGION_OPEN, Event, ModuleInfo)


def test_interval_set_overlap():
    s = IntervalSet([(5, 7), (0, 2), (1, 3), (10, 10)])
    assert s.total == 5
    assert s.overlap(0, 10) == 5
    assert s.overlap(2.5, 6) == pytest.approx(1.5)
    assert s.overlap(3, 5) == 0
    assert s.overlap(6.5, 100) == pytest.approx(0.5)


def test_label_timeline_priority_and_gaps():
    segs = label_timeline([(0, 10, "forward"), (2, 4, "comm_exposed"), (12, 15, "backward")],
                          {"forward": 2, "backward": 2, "comm_exposed": 6}, 0, 20)
    assert segs == [(0, 2, "forward"), (2, 4, "comm_exposed"), (4, 10, "forward"), (12, 15, "backward")]


def _infos(parents: list[int]) -> list[ModuleInfo]:
    return [ModuleInfo(index=i, name=("" if i == 0 else f"m{i}"), type="T", depth=0 if p < 0 else 1, parent=p,
                       params=0, params_trainable=0, params_local=0) for i, p in enumerate(parents)]


def test_step_partition_closes_and_carves_out_comm_and_recompute():
    # model 0 with children 1 and 2; child 2 is re-run (recompute) inside the backward of the model
    events = [Event(*e) for e in [
        (REGION_OPEN, "data_wait", 0.0), (REGION_CLOSE, "data_wait", 1.0),
        (F_OPEN, 0, 1.0), (F_OPEN, 1, 1.5), (F_CLOSE, 1, 3.5), (F_OPEN, 2, 3.5), (F_CLOSE, 2, 5.0), (F_CLOSE, 0, 5.0),
        (B_OPEN, 0, 5.2), (B_OPEN, 2, 5.2), (R_OPEN, 2, 5.3), (R_CLOSE, 2, 6.3), (B_CLOSE, 2, 7.3),
        (B_OPEN, 1, 7.3), (B_CLOSE, 1, 9.3), (B_CLOSE, 0, 9.5),
        (REGION_OPEN, "optimizer", 9.6), (REGION_CLOSE, "optimizer", 10.6),
    ]]
    comm = CommEvent(op="all_reduce", nbytes=1024, group_size=2, module=1, is_async=False, issue=2.0, ret=3.0,
                     total_ms=1.0)
    step = analyze_step(events, [comm], wall_ms=11.0, parents=[-1, 0, 0])
    p = step.phases_ms
    assert p["data_wait"] == pytest.approx(1.0)
    assert p["comm_exposed"] == pytest.approx(1.0)
    assert p["forward"] == pytest.approx(3.0)  # 4 ms of forward minus the blocking all_reduce
    assert p["recompute"] == pytest.approx(1.0)
    assert p["backward"] == pytest.approx(3.3)
    assert p["optimizer"] == pytest.approx(1.0)
    assert step.unattributed_ms == pytest.approx(11.0 - sum(p.values()))
    assert step.unattributed_ms == pytest.approx(0.7)
    m = step.modules
    assert m[1].forward_ms == pytest.approx(1.0) and m[1].self_comm_ms == pytest.approx(1.0)
    assert m[2].backward_ms == pytest.approx(1.1)  # 2.1 ms window minus 1 ms recompute inside
    assert m[0].backward_ms == pytest.approx(3.3)
    rows = module_tree_step(_infos([-1, 0, 0]), m)
    assert rows[0]["self_forward_ms"] == pytest.approx(3.0 - 1.0 - 1.5)
    assert rows[0]["comm_ms"] == pytest.approx(1.0) and rows[0]["recompute_ms"] == pytest.approx(1.0)
    assert step.comm == [{"op": "all_reduce", "phase": "forward", "calls": 1, "bytes": 1024, "total_ms": 1.0,
                          "exposed_ms": 1.0, "group_size": 2}]


def test_recompute_burst_is_credited_to_the_rerun_parent():
    # transformers re-runs a layer's forward(), not its __call__: only the children (2, 3) fire
    events = [Event(*e) for e in [(B_OPEN, 1, 0.0), (R_OPEN, 2, 1.0), (R_CLOSE, 2, 2.0), (R_OPEN, 3, 2.2),
                                  (R_CLOSE, 3, 3.0), (B_OPEN, 3, 3.1), (B_CLOSE, 3, 4.0), (B_CLOSE, 1, 5.0)]]
    assert recompute_bursts(events) == [(1.0, 3.0, [2, 3])]
    step = analyze_step(events, [], wall_ms=5.0, parents=[-1, 0, 1, 1])
    assert step.phases_ms["recompute"] == pytest.approx(2.0)  # the glue between the children included
    assert step.modules[1].recompute_burst_ms == pytest.approx(2.0)
    rows = module_tree_step(_infos([-1, 0, 1, 1]), step.modules)
    assert rows[1]["recompute_ms"] == pytest.approx(2.0) and rows[1]["recompute_calls"] == 1
    assert rows[1]["backward_ms"] == pytest.approx(3.0)


def test_async_comm_exposed_is_the_wait_only():
    comm = CommEvent(op="all_gather_into_tensor", nbytes=4096, group_size=4, module=-1, is_async=True, issue=1.0,
                     ret=1.1, waits=[(3.0, 3.5)], total_ms=2.5)
    step = analyze_step([Event(F_OPEN, 0, 0.0), Event(F_CLOSE, 0, 4.0)], [comm], wall_ms=4.0)
    assert step.phases_ms["comm_exposed"] == pytest.approx(0.5)
    assert step.phases_ms["forward"] == pytest.approx(3.5)
    assert step.comm[0]["total_ms"] == 2.5 and step.comm[0]["exposed_ms"] == pytest.approx(0.5)


def test_nccl_tests_bus_bandwidth():
    # nccl-tests PERFORMANCE.md: all_reduce busbw = algbw * 2(n-1)/n, all_gather (n-1)/n, broadcast 1
    assert bus_factor("all_reduce", 8) == pytest.approx(1.75)
    assert bus_factor("all_gather_into_tensor", 8) == pytest.approx(0.875)
    assert bus_factor("reduce_scatter_tensor", 4) == pytest.approx(0.75)
    assert bus_factor("broadcast", 8) == 1.0
    assert bus_factor("barrier", 8) is None
    algbw, busbw = bandwidth_gbps("all_reduce", 2e9, 1.0, 2)
    assert algbw == pytest.approx(2.0) and busbw == pytest.approx(2.0)


def _rank(rank: int, busy: float, step: float = 100.0) -> dict:
    phases = {p: 0.0 for p in ("data_wait", "forward", "backward", "recompute", "optimizer", "comm_exposed", "other")}
    phases["comm_exposed"] = step - busy
    return {"rank": rank, "step_ms_median": step, "busy_ms_median": busy, "phases_ms": phases}


def test_straggler_named_only_above_five_percent():
    assert find_straggler([_rank(0, 80), _rank(1, 83), _rank(2, 81)]) is None
    straggler = find_straggler([_rank(0, 80), _rank(1, 90), _rank(2, 81)])
    assert straggler["rank"] == 1 and straggler["slower_by_frac"] == pytest.approx(90 / 80.5 - 1)
    assert find_straggler([_rank(0, 80)]) is None


def test_merge_keeps_rank0_steps_and_spreads_modules():
    def profile(rank: int, fwd: float, busy: float) -> dict:
        return {"rank": rank, "kind": "rank", "env": {"world_size": 1}, "steps": [{"step": rank}],
                "summary": {"tokens_per_step": 100, "flops_per_step": 10**9},
                "modules": [{"name": "", "forward_ms": fwd, "backward_ms": 2 * fwd, "recompute_ms": 0.0,
                             "self_forward_ms": 0.0, "self_backward_ms": 0.0, "comm_ms": 0.0,
                             "comm_exposed_ms": 0.0}],
                "ranks": [_rank(rank, busy)]}

    merged = merge_ranks([profile(1, 12.0, 90.0), profile(0, 10.0, 80.0)])
    assert merged["kind"] == "merged" and merged["steps"] == [{"step": 0}] and merged["env"]["world_size"] == 2
    module = merged["modules"][0]
    assert module["forward_ms"] == pytest.approx(11.0)
    assert module["ranks_spread"]["forward_ms"] == {"min": 10.0, "median": 11.0, "max": 12.0, "by_rank": [10.0, 12.0]}
    assert merged["straggler"]["rank"] == 1
    assert merged["summary"]["tokens_per_s"] == pytest.approx(200 / 0.1)
    assert merged["summary"]["across_ranks"]["busy_ms_median"]["max"] == 90.0


def test_step_record_defaults():
    assert StepRecord(step=0, breakdown=None).instrumented == []  # type: ignore[arg-type]
