"""Pipeline parallelism on CPU (gloo, 2 ranks, torch.distributed.pipelining), real runs under torchrun:

* transfers: each stage's activation sends and gradient receives (and the mirror on the other stage)
  carry exactly boundary bytes (micro_batch_size x seq_len x hidden x 4 B) x micro batches per step;
* the bubble: measured beside the analytic (p-1)/(m+p-1); on the stage that sets the pace it is a
  smaller share of the step with 6 micro batches than with 2 (fill and drain do not grow with m);
* losses equal the unsplit model's (torch engine, 1 rank, same seed, same micro batches), and GPipe's
  equal 1F1B's (same gradients, another order);
* the timeline: on the aligned clock the second stage's forward of a micro batch starts after the
  first stage's forward of it ends (it needs its activations), 1F1B interleaves on the last stage;
* closure on every rank, schema, report, plan and project of a pipeline, and one-line refusals.

Four runs are shared by the assertions (module scope): GPipe with 2 and 6 micro batches, 1F1B with 2,
and the unsplit model. The model has 4 decoder layers split [3, 1] (engine.pipeline_layers), so the
first stage is the busier one in forward and in backward alike, about twice the other (the head and the
loss are about half a layer here): it sets the pace even when one core runs 1.7x slower than the other
for minutes, as this machine's do, and only fills and drains (the other stage also waits for it on
every micro batch).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_trainprof
from helpers.checks import check_closure, logged_by, retry_on_noise
from trainprof.profiler.schema import validate_profile
from trainprof.recipe import RecipeError, check_world_size, load_recipe

QUICK = REPO / "recipes" / "quickstart_cpu.yaml"
# seq_len 256 (not conftest.FAST's 64): a micro batch takes tens of ms, so that a shared 2-core machine's
# scheduling delays at each hand-over between the stages (a few ms) stay small beside fill and drain
SEQ = 256
# fp32: the split and the unsplit model then agree to ~1e-5 (bf16 autocast rounds differently enough
# that they drift apart by ~1e-3 within a few steps at this learning rate; docs/pipeline.md)
# 9 measured steps (conftest.FAST has 5): a stage's busy time is a median over them, which a slow spell of
# the machine over a few steps of one stage must not move enough to make the lighter stage the slower one
MODEL = ["model.num_layers=4", "model.dtype=fp32", f"data.seq_len={SEQ}", "engine.kind=torch", "engine.zero_stage=0",
         "train.steps=10", "profile.ops=false", "profile.calibrate=false"]
PIPE = [*MODEL, "engine.pipeline_stages=2", "engine.pipeline_layers=[3,1]"]
MICRO, HIDDEN = 2, 128  # conftest.FAST's micro batch; llama2-tiny's hidden size
BOUNDARY = MICRO * SEQ * HIDDEN * 4  # fp32 residual stream between the stages
# bubbles, transfer times and projected steps; one pytest-xdist worker makes the module's runs
pytestmark = [pytest.mark.timed, pytest.mark.xdist_group("pipeline")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def run(name: str, nproc: int, *overrides: str) -> tuple[Path, dict]:
        return run_trainprof(tmp_path_factory.mktemp(name), nproc, *overrides)

    return {
        "gpipe2": run("gpipe2", 2, *PIPE, "train.grad_accum=2"),
        "gpipe6": run("gpipe6", 2, *PIPE, "train.grad_accum=6"),
        "1f1b2": run("onef1b2", 2, *PIPE, "train.grad_accum=2", "engine.pipeline_schedule=1f1b"),
        "unsplit2": run("unsplit2", 1, *MODEL, "train.grad_accum=2"),
    }


def rank_file(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / f"profile.rank{rank}.json").read_text())


def p2p(profile: dict, op: str, phase: str) -> dict:
    (row,) = [c for c in profile["comm"] if c["op"] == op and c["phase"] == phase]
    return row


def losses(profile: dict) -> list[float]:
    return [s["loss"] for s in profile["steps"] if not s["warmup"]]


@pytest.mark.slow
@pytest.mark.parametrize("name, m", [("gpipe2", 2), ("gpipe6", 6), ("1f1b2", 2)])
def test_p2p_bytes_are_boundary_activations_times_micro_batches(runs, name, m):
    run_dir, _ = runs[name]
    first, last = rank_file(run_dir, 0), rank_file(run_dir, 1)
    expected = BOUNDARY * m
    for profile, sends, receives in ((first, "forward", "backward"), (last, "backward", "forward")):
        sent, received = p2p(profile, "isend", sends), p2p(profile, "irecv", receives)
        assert sent["bytes"] == received["bytes"] == expected, (sent, received, expected)
        assert sent["calls"] == received["calls"] == m
        assert sent["peer"] == 1 - profile["rank"] and sent["total_ms"] > 0 and sent["algbw_gbps"] > 0
    assert first["pipeline"]["p2p_bytes_per_step"] == {
        "activations_sent_bytes": expected, "activations_received_bytes": 0,
        "gradients_sent_bytes": 0, "gradients_received_bytes": expected}
    transfers = runs[name][1]["pipeline"]["transfers"]  # timed across both ranks on the aligned clock
    assert [(t["from_stage"], t["to_stage"], t["carries"], t["bytes"]) for t in transfers] == [
        (0, 1, "activations", BOUNDARY), (1, 0, "gradients", BOUNDARY)]
    timed = [t for t in transfers if t["samples"]]
    assert timed and all(0 < t["transfer_ms"] < 50 and t["gbps"] > 0 for t in timed), transfers


@pytest.mark.slow
def test_bubble_measured_beside_analytic_and_shrinks_with_micro_batches(runs):
    two, six = runs["gpipe2"][1]["pipeline"], runs["gpipe6"][1]["pipeline"]
    assert two["bubble_frac_analytic"] == pytest.approx(1 / 3) and six["bubble_frac_analytic"] == pytest.approx(1 / 7)
    for pl in (two, six):
        for stage in pl["stages"]:
            assert 0 < stage["bubble_frac_measured"] < 1 and stage["bubble_ms"] > 0
        assert pl["bubble_frac_measured_stage"] == pl["balance"]["slowest_stage"] == 0  # three layers + embedding
    assert six["bubble_frac_measured"] < two["bubble_frac_measured"], (two["stages"], six["stages"])
    summary = (runs["gpipe2"][0] / "summary.md").read_text()
    assert "vs analytic GPipe 33.3%" in summary and "which sets the pace" in summary
    # rank 0's FLOPs are stage 0's layers only (three of four): said where the FLOPs are printed
    merged, first = runs["gpipe2"][1]["summary"], rank_file(runs["gpipe2"][0], 0)["summary"]
    assert merged["flops_per_step"] == first["flops_per_step"] and merged["analytic"]["layers"] == 3
    assert "FLOPs per step as executed by pipeline stage 0 of 2" in summary
    from trainprof.report.advisor import advise

    fired = {a["rule"]: a for a in advise(runs["gpipe2"][1])["advice"]}  # 33% analytic at m=2: it fires
    assert fired["pipeline_bubble"]["overrides"] == {"train.micro_batch_size": 1, "train.grad_accum": 4}


@pytest.mark.slow
def test_losses_match_the_unsplit_model_and_across_schedules(runs):
    split, one_f_one_b, unsplit = (losses(runs[k][1]) for k in ("gpipe2", "1f1b2", "unsplit2"))
    assert len(split) == len(unsplit) and all(x is not None for x in split)
    assert split == pytest.approx(unsplit, rel=1e-4), (split, unsplit)
    assert split == pytest.approx(one_f_one_b, rel=1e-5), (split, one_f_one_b)
    assert split[-1] < split[0]  # it trains


@pytest.mark.slow
def test_timeline_is_causal_and_shows_the_schedule(runs):
    for name, m in (("gpipe6", 6), ("1f1b2", 2)):
        stages = runs[name][1]["pipeline"]["timeline"]["stages"]
        spans = [{(k, mb): (st["offset_ms"] + a, st["offset_ms"] + b) for k, mb, a, b in st["intervals"]
                  if k in ("forward", "backward")} for st in stages]
        for s in spans:
            assert sorted(s) == sorted([("forward", i) for i in range(m)] + [("backward", i) for i in range(m)])
        for i in range(m):  # stage 1 needs stage 0's activations of micro batch i, stage 0 stage 1's gradients
            assert spans[1][("forward", i)][0] >= spans[0][("forward", i)][1] - 0.5, (name, i)
            assert spans[0][("backward", i)][0] >= spans[1][("backward", i)][1] - 0.5, (name, i)
    gpipe_last, one_last = (runs[k][1]["pipeline"]["timeline"]["stages"][1]["intervals"] for k in ("gpipe6", "1f1b2"))
    order = lambda intervals: [(k, mb) for k, mb, _, _ in intervals if k in ("forward", "backward")]  # noqa: E731
    assert order(gpipe_last)[:6] == [("forward", i) for i in range(6)]  # fill-drain: all forwards first
    assert order(one_last) == [("forward", 0), ("backward", 0), ("forward", 1), ("backward", 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpipe2", "gpipe6", "1f1b2"])
def test_every_rank_closes_and_validates(runs, name):
    run_dir, merged = runs[name]
    validate_profile(merged)
    assert merged["straggler"] is None and merged["steps_loss_rank"] == 1
    assert {m["stage"] for m in merged["modules"]} == {0, 1}
    assert {m["name"] for m in merged["modules"] if m["stage"] == 0} >= {"model.embed_tokens", "model.layers.2"}
    assert {m["name"] for m in merged["modules"] if m["stage"] == 1} >= {"lm_head", "loss", "model.layers.3"}
    for rank in (0, 1):
        profile = rank_file(run_dir, rank)
        validate_profile(profile)
        check_closure(profile)
        assert profile["summary"]["phases_ms"]["pipeline_bubble"] > 0
    stages = merged["pipeline"]["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert merged["pipeline"]["balance"]["imbalance"] >= 0


@pytest.mark.slow
def test_report_has_the_pipeline_section(runs):
    run_dir, _ = runs["gpipe2"]
    report = (run_dir / "report.md").read_text()
    assert "## Pipeline stages" in report and "Stage imbalance" in report
    assert (run_dir / "report_plots" / "pipeline_timeline.png").stat().st_size > 1000


@pytest.mark.slow
def test_project_swaps_the_bubble_and_scales_p2p(runs, tmp_path):
    from trainprof.projection.project import project

    attempt = iter(range(3))

    def check() -> None:  # a slow spell over one of the two runs is retried with both made again, back to back
        i = next(attempt)
        (run_dir, source), (_, real_six) = (runs["gpipe2"], runs["gpipe6"]) if i == 0 else (
            run_trainprof(tmp_path / f"gpipe2-{i}", 2, *PIPE, "train.grad_accum=2"),
            run_trainprof(tmp_path / f"gpipe6-{i}", 2, *PIPE, "train.grad_accum=6"))
        same = project(run_dir, probe=False)["predictions"][0]  # nothing changed: the pace stage's step back
        pace_rank = source["pipeline"]["stages"][source["pipeline"]["balance"]["slowest_stage"]]["rank"]
        measured_two = next(r["step_ms_median"] for r in source["ranks"] if r["rank"] == pace_rank)
        assert same["step_ms"] == pytest.approx(measured_two, rel=1e-6)
        assert same["pipeline"]["bubble_ms"] == pytest.approx(same["pipeline"]["bubble_ms_measured"])
        assert same["pipeline"]["bubble_ms"] > 0
        six = project(run_dir, overrides=["train.grad_accum=6"], probe=False)["predictions"][0]
        assert six["pipeline"]["p2p_bytes_per_step_per_boundary"]["activations"] == 6 * BOUNDARY
        assert six["tokens_per_step"] == 6 * MICRO * SEQ  # one pipeline: the stages share their tokens
        assert any(a["kind"].startswith("pipeline") for a in six["assumptions"])
        assert 1.2 * measured_two < six["step_ms"] < 3 * measured_two  # 3x the micro batches, fill/drain unchanged
        measured_six = max(r["step_ms_median"] for r in real_six["ranks"])
        said = f"6 micro batches: predicted {six['step_ms']:.1f} ms against a real run's {measured_six:.1f} ms"
        print(said)
        assert six["step_ms"] == pytest.approx(measured_six, rel=0.4), said  # another run

    retry_on_noise(check)
    from trainprof.projection.pipeline import check_world

    source = runs["gpipe2"][1]
    assert check_world(source, 2) is None and "project it with --nproc 2" in check_world(source, 4)


# -- no training: rebalance, plan and validation ---------------------------------------------------

def test_rebalance_moves_the_layers_that_even_the_stages():
    from trainprof.analysis.pipeline import rebalance

    stages = [{"stage": 0, "busy_ms": 30.0}, {"stage": 1, "busy_ms": 10.0}]
    out = rebalance(stages, [{0: 10.0, 1: 10.0, 2: 9.0}, {3: 9.0}])
    assert out["imbalance"] == pytest.approx(0.5) and out["slowest_stage"] == 0
    s = out["suggestion"]
    assert (s["from_stage"], s["to_stage"], s["layers"]) == (0, 1, 1) and s["busy_ms_after"] == [21.0, 19.0]
    assert rebalance(stages, [{0: 25.0}, {1: 9.0}])["suggestion"] is None  # the last layer stays



def test_plan_splits_params_memory_and_p2p_per_stage():
    from trainprof.plan import estimate_plan

    recipe = load_recipe(QUICK, [*PIPE, "engine.pipeline_layers=null", "train.grad_accum=4",
                                 f"data.seq_len={SEQ}", f"train.micro_batch_size={MICRO}", "engine.pipeline_schedule=1f1b"])
    plan = estimate_plan(recipe, world_size=2)
    pp = plan["pipeline"]
    assert sum(s["params"] for s in pp["stages"]) == plan["params"]["total"]["value"]
    assert [s["layers"] for s in pp["stages"]] == [[0, 2], [2, 4]]
    assert [s["in_flight_micro_batches"] for s in pp["stages"]] == [2, 1]  # 1F1B: min(p - s, m)
    assert pp["bubble_frac_analytic"] == pytest.approx(1 / 5)
    assert pp["p2p_bytes_per_step_per_boundary"] == {"activations": 4 * BOUNDARY, "gradients": 4 * BOUNDARY}
    assert plan["tokens_per_step"]["value"] == 4 * MICRO * SEQ
    gpipe = estimate_plan(load_recipe(QUICK, [*PIPE, "train.grad_accum=4"]), world_size=2)["pipeline"]  # [3, 1]
    assert [s["in_flight_micro_batches"] for s in gpipe["stages"]] == [4, 4]
    assert [s["layers"] for s in gpipe["stages"]] == [[0, 3], [3, 4]]


@pytest.mark.parametrize("overrides, key", [
    (["engine.pipeline_stages=2"], "engine.pipeline_stages"),  # DeepSpeed ZeRO-3 in the quickstart
    ([*PIPE, "engine.pipeline_layers=null", "engine.pipeline_stages=5"], "engine.pipeline_stages"),  # 4 layers
    ([*PIPE, "task.kind=lora"], "task.kind"),
    ([*PIPE, "engine.pipeline_schedule=1f1b", "train.grad_accum=1"], "train.grad_accum"),
    ([*PIPE, "engine.pipeline_layers=[2,1]"], "engine.pipeline_layers"),
    ([*PIPE, "engine.pipeline_stages=0"], "engine.pipeline_stages"),
])
def test_refused_combinations_name_the_key(overrides, key):
    with pytest.raises(RecipeError, match=f"recipe key '{key}'") as err:
        load_recipe(QUICK, overrides)
    assert "\n" not in str(err.value)


def test_ranks_must_equal_stages_one_line_exit_2():
    with pytest.raises(RecipeError, match="need exactly 2 ranks"):
        check_world_size(load_recipe(QUICK, PIPE), 4)
    check_world_size(load_recipe(QUICK, PIPE), 2)
    env = {**os.environ, "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-m", "trainprof.run", str(QUICK), *PIPE], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("trainprof:")]
    assert len(lines) == 1 and "engine.pipeline_stages" in lines[0] and "--nproc_per_node 2" in lines[0]


def test_trainprof_run_launches_one_rank_per_stage_by_default():
    from trainprof.commands.run import launch_ranks

    assert launch_ranks(load_recipe(QUICK, PIPE), None) == 2
    assert launch_ranks(load_recipe(QUICK, PIPE), 4) == 4  # then refused by check_world_size, naming the key
    assert launch_ranks(load_recipe(QUICK), None) == 1


def test_a_stage_runs_on_transformers_current_api_without_deprecation_warnings(recwarn):
    """A stage's forward on both stages of the tiny model matches the unsplit model's logits, and calls
    transformers by the names it takes now (`past_key_values` warned, and goes in transformers 5.40)."""
    import torch

    from trainprof.engines.stages import LlamaStage
    from trainprof.models import build_model

    torch.manual_seed(0)
    model = build_model(load_recipe(QUICK, ["data.seq_len=16"])).eval()
    first, last = (LlamaStage(model, s, 2) for s in (0, 1))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with logged_by("transformers") as logged, torch.no_grad():
        split, whole = last(first(ids)), model(ids).logits
    assert torch.allclose(split, whole, atol=1e-5)
    said = [str(w.message) for w in recwarn] + logged
    assert not [m for m in said if "deprecated" in m], said
