"""`trainprof project` on a real 2-rank DeepSpeed ZeRO-3 run, for what its probes' and runs' clocks decide
(so on a machine of its own): the step model closes on the source, and what-ifs (settings, model size,
task) land near real runs of the change. The rest of the command: test_projection_targets."""

from __future__ import annotations

import os
from typing import Callable, TypeVar

import pytest

from conftest import NO_CALIBRATION, QUICKSTART_2RANK, QUIET, ZERO2_2RANK, run_trainprof
from helpers.checks import NotJudged, retry_on_noise
from helpers.projection import MEMORY_TOLERANCE, STEPS, kinds, project

# the validation goal is 5% mean / 10% max on a quiet machine (scripts/bench_projection.py); a test on a
# shared 2-core CI machine gets a margin for the noise between two separate runs
STEP_TOLERANCE = 0.35
# the same settings run before and after a test's real runs, further apart than this: the machine's pace changed
# (their run-to-run spread in a steady hour: 87-102 ms, 2026-11-29)
SPELL = 0.3
# probes, and predicted steps against real runs; one pytest-xdist worker copies the module's source run
pytestmark = [pytest.mark.timed, pytest.mark.xdist_group("projection")]
T = TypeVar("T")


def measured(path, *args, **kwargs):
    """run_trainprof's run, as `trainprof project` reads a run (medians of the measured steps)."""
    from trainprof.projection.measured import measured_from_profile

    return measured_from_profile(run_trainprof(path, *args, **kwargs)[1])


def bracketed(tmp_path, source: dict, real: Callable[[], T]) -> tuple[T, float]:
    """Make the real runs (`real`) between two runs of the source's settings (2 ranks, 16 steps, untraced);
    return what `real` returned and the machine's drift since the source (profile.json) was measured: the two
    runs' mean step over the source's. This machine has spells of 1.5-2x that last minutes (docs/suite.md): a
    prediction from a source measured in one, checked against a real run made in another, misses by as much
    whatever the model, and the factor takes that out. Where the two runs of the source's settings disagree by
    more than SPELL, the pace changed while the real runs ran: NotJudged."""
    from trainprof.projection.measured import measured_from_profile

    before = measured(tmp_path / "before", 2, STEPS, *QUIET).step_ms
    out = real()
    after = measured(tmp_path / "after", 2, STEPS, *QUIET).step_ms
    if abs(after - before) > SPELL * min(after, before):
        raise NotJudged(f"the source's settings read {before:.1f} ms before the real runs and {after:.1f} ms after")
    print(f"the source's settings: {before:.1f} ms before the real runs, {after:.1f} ms after")
    return out, (before + after) / 2 / measured_from_profile(source).step_ms


def lands_near(what: str, predicted_ms: float, drift: float, real_ms: float) -> None:
    """A what-if's predicted step, rescaled by the machine's drift, within STEP_TOLERANCE of the real run's."""
    said = f"{what}: predicted {predicted_ms:.1f} ms x drift {drift:.2f} against a real run's {real_ms:.1f} ms"
    print(said)  # pytest -rP shows what passed
    assert abs(predicted_ms * drift - real_ms) / real_ms < STEP_TOLERANCE, said


@pytest.fixture(scope="module")
def source(shared_runs, tmp_path_factory):
    """The quickstart on 2 ranks (test_report and test_engines share the run), copied: projections write into it."""
    return shared_runs.copy(tmp_path_factory.mktemp("source"), *QUICKSTART_2RANK)


@pytest.mark.slow
def test_same_settings_reproduce_the_measurement_and_a_change_lands_near_a_real_run(source, tmp_path):
    run_dir, profile = source
    same = project(str(run_dir))
    (p,) = same["predictions"]
    src = same["source"]
    for key in ("hardware", "nodes", "gpus_per_node", "world_size", "overrides", "step_ms", "tokens_per_s", "mfu",
                "scaling_efficiency", "memory_per_rank_bytes", "fits", "time_to_train_s",
                "cost_per_million_tokens_usd", "expected_error_pct", "confidence", "assumptions"):
        assert key in p, key
    assert p["step_ms"] == pytest.approx(src["step_ms"], rel=1e-9)  # the decomposition closes
    assert p["confidence"] == "measured" and p["change_kinds"] == ["none"]
    assert p["memory_per_rank_bytes"] == src["peak_memory_bytes"]
    assert p["mfu"] is None and "CPU" in p["reasons"]["mfu"]
    assert p["cost_per_million_tokens_usd"] is None and "--price" in p["reasons"]["cost_per_million_tokens_usd"]

    # the advisor's changes, projected: ZeRO-3's exposed comm fires with engine.zero_stage=2, which re-probes
    # both engines (ZeRO-2 drops ZeRO-3's parameter fetch and release around every module, so the forward
    # must get faster) and re-derives the collectives: ZeRO-2's gradient all_reduce and one all-gather after
    # the step, in place of ZeRO-3's gathers at every module; the report's advice table shows the gain
    advice = project(str(run_dir), "--advice")["advice"]
    zero2 = next(r for r in advice if r["rule"] == "comm_exposed")
    assert zero2["overrides"] == ["engine.zero_stage=2"] and zero2["predicted_gain"] is not None, zero2
    notes = {a["kind"]: a["values"] for a in zero2["assumptions"]}
    assert notes["engine_change"]["forward"] < 1.0, notes["engine_change"]
    assert "optimizer_probed_step" in notes and notes["comm_zero_derived"]["stage"] == 2
    assert 0 < zero2["phases_ms"]["comm_exposed"] < p["phases_ms"]["comm_exposed"]
    assert zero2["predicted_gain"] == pytest.approx(src["step_ms"] / zero2["predicted_step_ms"] - 1)
    assert f"{100 * zero2['predicted_gain']:+.1f}% tokens/s (trainprof project --advice" in (
        run_dir / "report.html").read_text()
    from trainprof.commands.project import advice_lines

    printed = next(line for line in advice_lines(advice) if line.startswith("comm_exposed"))
    assert f"{100 * zero2['predicted_gain']:+.1f}% tokens/s (validated step error ±" in printed, printed

    # changes the model was tuned on, against real runs of them: micro batch 2 -> 4 with 2 ranks -> 1, and
    # ZeRO-3 -> ZeRO-2 (the advice above)
    attempt = iter(range(3))

    def check() -> None:  # a slow spell of a shared machine during either run is retried, a wrong model is not
        i = next(attempt)
        src_dir, src = source if i == 0 else run_trainprof(tmp_path / f"source{i}", *QUICKSTART_2RANK)
        what_if = project(str(src_dir), "train.micro_batch_size=4", "--nproc", "1")["predictions"][0]
        assert what_if["phases_ms"]["comm_exposed"] == 0.0 and what_if["world_size"] == 1
        assert what_if["change_kinds"] == ["micro_batch", "world_size"]
        if i == 0:  # the first call's scaling-efficiency column probed the source's engine; this one reads it
            assert kinds(what_if)["probe_kept"]["what"] == "source engine", kinds(what_if).keys()
        zero2_ms = zero2["predicted_step_ms"] if i == 0 else \
            project(str(src_dir), "engine.zero_stage=2")["predictions"][0]["step_ms"]
        # the real runs are only measured: no calibration (their traced steps stay, as in the source). The source's
        # step is its slowest rank's, and one core of this machine can run 1.7x slower than the other for minutes
        # (a 1-rank run read 40.9 and 70.8 ms in two attempts, the source's settings steady beside both): the
        # 1-rank run is made on each core, and the slower is checked, as the source's slowest rank
        base = tmp_path / f"attempt{i}"

        def real():
            one_rank = [measured(base / f"mb4-cpu{c}", 1, STEPS, "train.micro_batch_size=4", NO_CALIBRATION, cpu=c)
                        for c in sorted(os.sched_getaffinity(0))[:2]]
            return max(one_rank, key=lambda m: m.step_ms), measured(base / "zero2", *ZERO2_2RANK)

        (m, m2), drift = bracketed(base, src, real)
        lands_near("micro batch 4 on 1 rank", what_if["step_ms"], drift, m.step_ms)
        mem_err = abs(what_if["memory_per_rank_bytes"] - m.peak_memory_bytes) / m.peak_memory_bytes
        assert mem_err < MEMORY_TOLERANCE, (what_if["memory_per_rank_bytes"], m.peak_memory_bytes)
        lands_near("ZeRO-2", zero2_ms, drift, m2.step_ms)

    retry_on_noise(check)


@pytest.mark.slow
def test_a_model_size_change_probes_its_parts_and_lands_near_a_real_run(source, tmp_path):
    """Twice the decoder layers and a wider MLP, on the source's machine: one layer and the rest of the
    model are probed at both shapes (never the whole target model), the layers scale with their count, and
    the prediction lands near a real run of the target (its collectives re-derived from the census)."""
    # an MLP three times as wide: at 512 (from 352) the probed layer read 10% slower, and once, in a spell, the
    # wrong way (1.90 against 2.04 ms)
    overrides = ["model.num_layers=4", "model.intermediate_size=1024"]
    attempt = iter(range(3))

    def check() -> None:
        i = next(attempt)
        src_dir, src = source if i == 0 else run_trainprof(tmp_path / f"source{i}", *QUICKSTART_2RANK)
        pred = project(str(src_dir), *overrides)["predictions"][0]
        assert pred["change_kinds"] == ["model_size"], pred.get("reasons")
        parts = kinds(pred)["parts_probed"]
        assert (parts["source_layers"], parts["target_layers"]) == (2, 4)
        assert parts["layer_target_ms"] > parts["layer_source_ms"] > 0  # the wider MLP costs more per layer
        assert "comm_zero3_derived" in kinds(pred)
        base = tmp_path / f"attempt{i}"
        m, drift = bracketed(base, src, lambda: measured(base / "real", 2, STEPS, *overrides, NO_CALIBRATION))
        lands_near("4 layers, MLP 1024", pred["step_ms"], drift, m.step_ms)

    retry_on_noise(check)


@pytest.mark.slow
def test_a_task_or_dtype_change_is_probed_with_its_engine_and_unmodelled_keys_are_refused(source, tmp_path):
    """pretrain -> LoRA at ZeRO-2 builds both engines with their models and probes them: the frozen base
    skips its weight-gradient GEMMs, so the backward must get faster; the step updates the adapters only;
    the collectives carry the adapters' bytes. Under ZeRO-3 the collectives follow the census (the adapters
    are persistent parameters: 27 gathered after the step). A dtype change is probed the same way (both
    engines at their dtype), its collectives carry 4 bytes an element, and it lands near a real fp32 run
    (on these shapes fp32 runs about 10% faster than bf16 here, inside the tolerance: its accuracy is
    scripts/bench_projection.py's). A key the model does not re-derive makes the step null with the
    reason (and no probe runs)."""
    run_dir, profile = source
    result = project(str(run_dir), "task.kind=lora", "engine.zero_stage=2")
    lora = result["predictions"][0]
    assert lora["change_kinds"] == ["zero_stage", "task"] and lora["step_ms"] > 0, lora.get("reasons")
    notes = kinds(lora)
    assert notes["engine_change"]["backward"] < 0.95, notes["engine_change"]
    adapters = 2 * 2 * (8 * 128 + 128 * 8)  # layers x (q_proj, v_proj) x (A: r x hidden, B: hidden x r)
    assert notes["optimizer_probed_step"]["state_elements"] == adapters
    assert notes["comm_zero_derived"]["mbytes"] == pytest.approx(adapters * 2 / 1e6)
    assert lora["phases_ms"]["optimizer"] < 0.5 * result["source"]["phases_ms"]["optimizer"]
    zero3 = project(str(run_dir), "task.kind=lora")["predictions"][0]
    assert zero3["step_ms"] > 0 and kinds(zero3)["comm_zero3_derived"]["persistent"] == 27
    refused = project(str(run_dir), "optimizer.state_bits=8", "optimizer.lr=0.1")["predictions"][0]
    assert refused["step_ms"] is None and refused["tokens_per_s"] is None
    assert "does not re-derive a change of optimizer.state_bits:" in refused["reasons"]["step_ms"]
    assert refused["memory_per_rank_bytes"] > 0  # the plan's formulas still give the memory

    attempt = iter(range(3))

    def check() -> None:
        i = next(attempt)
        src_dir, src = source if i == 0 else run_trainprof(tmp_path / f"source{i}", *QUICKSTART_2RANK)
        fp32 = project(str(src_dir), "model.dtype=fp32")["predictions"][0]
        assert fp32["change_kinds"] == ["dtype"] and fp32["step_ms"] > 0, fp32.get("reasons")
        notes = kinds(fp32)
        assert "engine_change" in notes and "optimizer_engine_ratio" in notes
        assert notes["comm_zero3_derived"]["mbytes"] == pytest.approx(4 * profile["params"]["total"] / 1e6)
        base = tmp_path / f"attempt{i}"
        m, drift = bracketed(base, src, lambda: measured(base / "real", 2, STEPS, "model.dtype=fp32", NO_CALIBRATION))
        lands_near("fp32", fp32["step_ms"], drift, m.step_ms)
        assert abs(fp32["memory_per_rank_bytes"] - m.peak_memory_bytes) / m.peak_memory_bytes < MEMORY_TOLERANCE

    retry_on_noise(check)
