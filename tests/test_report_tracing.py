"""How a report words what operator tracing did: the trace-cost verdict of the Operators section, the
steps the medians use (with or without a trace warm-up step), the headline phases line, and where
`trainprof report` writes TensorBoard scalars in a run dir renamed after its traces were written."""

from __future__ import annotations

import copy
import json
import shutil
import statistics
from pathlib import Path

import pytest

from trainprof.analysis.aggregate import StepRecord, select_steps
from trainprof.report.document import Document, render_markdown
from trainprof.report.rundir import RunData
from trainprof.report.sections import headline_facts, ops_section, tracing_cost

DATA = Path(__file__).parent / "data"
RUN = DATA / "zero3_2rank"
PROFILE = json.loads((RUN / "profile.json").read_text())
BUSY = {"start": 3.17, "end": 4.21, "cores": 2, "busy": True, "how": "os.getloadavg"}


def _profile(traced: list[float], untraced: list[float], *, load: dict | None = None,
             oversubscribed: dict | None = None) -> dict:
    """zero3_2rank's profile with these traced ("ops") and untraced step times, after a trace warm-up step."""
    p = copy.deepcopy(PROFILE)
    steps = [{"step": -1, "wall_ms": 5000.0, "warmup": True, "instrumented": ["flops"]},
             {"step": 0, "wall_ms": 4000.0, "warmup": False, "instrumented": ["trace_warmup"]}]
    steps += [{"step": 1 + i, "wall_ms": ms, "warmup": False, "instrumented": ["ops"]} for i, ms in enumerate(traced)]
    steps += [{"step": 1 + len(traced) + i, "wall_ms": ms, "warmup": False, "instrumented": []}
              for i, ms in enumerate(untraced)]
    p["steps"] = steps
    p["summary"]["step_ms"] = {"min": min(untraced), "median": statistics.median(untraced), "max": max(untraced)}
    p["ops_info"]["steps"] = [s["step"] for s in steps if s["instrumented"] == ["ops"]]
    p["ops_info"]["cost_frac"] = statistics.median(traced) / p["summary"]["step_ms"]["median"] - 1
    p["env"]["machine_load"] = load
    p["env"]["oversubscribed"] = oversubscribed
    return p


def _operators_text(profile: dict, tmp_path: Path) -> str:
    doc = Document("t", plots=False)
    ops_section(doc, RunData.of_profile(profile, tmp_path))
    return render_markdown(doc)


def test_two_traced_steps_on_a_busy_machine_are_not_called_the_cost_of_tracing(tmp_path):
    """A recorded CPU run: 2 traced steps 19% slower than 3 untraced ones, on a machine it recorded as busy."""
    p = _profile([3167.136734, 3939.579446], [2977.327396, 3056.34511, 2955.250485], load=BUSY)
    assert tracing_cost(p).verdict == "few steps"
    text = _operators_text(p, tmp_path)
    assert "19% slower" in text and "cost of tracing" not in text
    assert "cannot be told from noise (profile.ops_steps 3 on a quiet machine would let it be judged)" in text
    assert "busy machine" in text
    assert "3,167.1, 3,939.6 ms" in text and "2,977.3, 3,056.3, 2,955.3 ms" in text  # the figures judged from


def test_faster_traced_steps_are_judged_by_the_rule_slower_ones_are(tmp_path):
    """Slower and faster beyond the untraced range read alike: a real difference only with enough steps a
    side on a quiet machine; with 2 traced steps a 25% speed-up is noise that cannot be told, not a verdict."""
    few = _profile([70.0, 80.0], [100.0, 102.0, 104.0])
    assert tracing_cost(few).verdict == "few steps"
    assert "cannot be told from noise (profile.ops_steps 3 would let it be judged)" in _operators_text(few, tmp_path)
    few_untraced = _profile([120.0, 125.0, 130.0], [100.0])
    assert "cannot be told from noise (2 more train.steps would let it be judged)" in _operators_text(few_untraced,
                                                                                                     tmp_path)
    faster = _profile([70.0, 75.0, 80.0], [100.0, 102.0, 104.0])
    assert tracing_cost(faster).verdict == "faster"
    assert "every traced step was faster than every untraced step" in _operators_text(faster, tmp_path)
    slower = _profile([120.0, 125.0, 130.0], [100.0, 102.0, 104.0])
    assert tracing_cost(slower).verdict == "slower"
    assert "every traced step was slower than every untraced step, the cost of tracing" in \
        _operators_text(slower, tmp_path)
    overlap = _profile([101.0, 125.0, 130.0], [100.0, 102.0, 104.0])
    assert tracing_cost(overlap).verdict == "overlap"
    assert "cost of tracing shows" in _operators_text(overlap, tmp_path)


@pytest.mark.parametrize("busy", [dict(load=BUSY), dict(oversubscribed={"threads": 8, "cores": 2, "ranks": 2})])
def test_a_machine_recorded_busy_leaves_the_difference_untold(tmp_path, busy):
    p = _profile([120.0, 125.0, 130.0], [100.0, 102.0, 104.0], **busy)
    assert tracing_cost(p).verdict == "busy machine"
    text = _operators_text(p, tmp_path)
    assert "cost of tracing" not in text and "cannot be told from noise" in text


def _step(n: int, *instrumented: str, warmup: bool = False) -> StepRecord:
    return StepRecord(step=n, breakdown=None, instrumented=list(instrumented), warmup=warmup)


def test_steps_used_names_the_trace_warm_up_step_only_where_there_is_one():
    steps, text = select_steps([_step(-1, "flops", warmup=True), _step(0), _step(1)])
    assert [s.step for s in steps] == [0, 1] and "warm-up" not in text  # profile.ops=false: none
    steps, text = select_steps([_step(0, "trace_warmup"), _step(1, "ops"), _step(2, "ops"), _step(3), _step(4)])
    assert [s.step for s in steps] == [3, 4] and "trace warm-up step left out" in text and "included" not in text
    steps, text = select_steps([_step(0, "trace_warmup"), _step(1, "ops")])  # every step instrumented
    assert [s.step for s in steps] == [0, 1] and "trace warm-up step kept" in text


def test_the_phases_line_says_its_medians_need_not_add_up_to_the_step():
    facts = dict(headline_facts(RunData.of_profile(PROFILE, RUN)))
    assert "each its own median" in facts["phases, median ms"]
    assert "need not add up to the median step" in facts["phases, median ms"]


def test_report_on_a_renamed_run_dir_writes_scalars_beside_its_traces(tmp_path):
    """Traces in tb/<name the run was written under>/: the scalars join them (one TensorBoard run),
    and the scalars a report wrote there before are replaced, not moved to tb/<new name>/."""
    from trainprof.cli import main

    first = tmp_path / "first"
    shutil.copytree(RUN, first)
    (first / "tb" / "first").mkdir()
    for trace in (first / "tb").glob("*.pt.trace.json*"):
        trace.rename(first / "tb" / "first" / trace.name)
    assert main(["report", "--no-scalars", str(first)]) == 0  # what a fresh run leaves, scalars written next
    from trainprof.report.tensorboard import write_tensorboard_scalars
    assert write_tensorboard_scalars(PROFILE, first).parent == first / "tb" / "first"  # a fresh run: unchanged

    renamed = tmp_path / "renamed"
    first.rename(renamed)
    assert main(["report", str(renamed)]) == 0
    assert [d.name for d in (renamed / "tb").iterdir()] == ["first"]
    events = list((renamed / "tb").rglob("events.out.tfevents.*"))
    assert [e.parent.name for e in events] == ["first"]
    report = (renamed / "report.md").read_text()
    assert "tb/renamed/" not in report and f"tb/first/{events[0].name}" in report


def test_scalars_of_a_renamed_run_without_traces_leave_no_empty_folder_behind(tmp_path):
    """No traces to stay beside: the scalars go to tb/<new name>/, and tb/<old name>/, emptied, goes too
    (TensorBoard would list the empty folder's name)."""
    from trainprof.report.tensorboard import write_tensorboard_scalars

    old = tmp_path / "old"
    shutil.copytree(DATA / "pre_profiler_run", old)
    profile = json.loads((old / "profile.json").read_text())
    assert write_tensorboard_scalars(profile, old).parent == old / "tb" / "old"
    new = tmp_path / "new"
    old.rename(new)
    assert write_tensorboard_scalars(profile, new).parent == new / "tb" / "new"
    assert [d.name for d in (new / "tb").iterdir()] == ["new"]


def test_the_memory_section_says_per_phase_peaks_barely_differ_under_the_cache_allocator():
    """A CPU run under train.cpu_allocator: cache keeps what it frees, so its per-phase RSS peaks read alike
    (550.87 MiB forward, backward and optimizer on the quickstart): the section says so, and only there."""
    import copy
    import json
    from pathlib import Path

    from trainprof.report.document import Document, Para
    from trainprof.report.rundir import RunData
    from trainprof.report.sections import memory_section

    profile = json.loads((Path(__file__).parent / "data" / "zero3_2rank" / "profile.json").read_text())

    def says(mode: str | None) -> bool:
        p = copy.deepcopy(profile)
        p["env"]["host_allocator"] = {"mode": mode, "detail": "..."} if mode else None
        doc = Document("t")
        memory_section(doc, RunData.of_profile(p, "x"))
        return any(isinstance(b, Para) and "per-phase peaks barely differ" in b.text
                   for sec in doc.sections for b in sec.blocks)

    assert says("cache") and not says("system") and not says(None)


def test_model_states_say_no_separate_master_where_there_is_none():
    """The torch and FSDP2 engines update fp32 params themselves: 'fp32 master 0.0 MiB' beside DeepSpeed's
    'fp32 master 1.3 MiB' read as a missing copy."""
    from trainprof.report.sections import model_states_text

    state = {"params": 2**20, "grads": 2**20, "optimizer_states": 2**21, "master_params": 0}
    assert model_states_text(state).endswith("optimizer states 2.0 MiB, no separate fp32 master")
    assert model_states_text({**state, "master_params": 2**20}).endswith("fp32 master 1.0 MiB")
