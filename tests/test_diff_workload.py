"""`trainprof diff` on runs that record a workload instead of a recipe (wrap, the callbacks, Profiler), on CPU
runs whose steps vary more than the default noise band, and what the printed diff links and adds up.
Profiles are the kept 2-rank run (tests/data/zero3_2rank) reshaped as such runs would record them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from trainprof.analysis.diff import DEFAULT_BAND, NOISE_SAFETY, diff_profiles, used_steps
from trainprof.report.diff_report import build_diff_document
from trainprof.report.document import render_markdown
from trainprof.report.rundir import RunData
from trainprof.report.sections import CATEGORIES
from trainprof.shapes import DIM_KEYS, SHAPES

DATA = Path(__file__).parent / "data"
PROFILE = json.loads((DATA / "zero3_2rank" / "profile.json").read_text())


def _wrapped(profile: dict, **changes) -> dict:
    """`profile` as `trainprof wrap` records it: no recipe, a workload of the keys it reads from the model and the
    loop (model named custom, its dims spelled out); `changes`: dotted keys set in the workload."""
    out = copy.deepcopy(profile)
    recipe = out.pop("recipe")
    shape = SHAPES[recipe["model"]["name"]]
    model = {"name": "custom", **{k: getattr(shape, k) for k in DIM_KEYS},
             **{k: recipe["model"][k] for k in ("dtype", "attention", "recompute")}, "compile": False}
    out["workload"] = {"engine": {k: recipe["engine"][k] for k in ("kind", "zero_stage", "offload")},
                       "task": {"kind": recipe["task"]["kind"]}, "model": model,
                       "train": {k: recipe["train"][k] for k in ("micro_batch_size", "grad_accum")},
                       "data": {"seq_len": recipe["data"]["seq_len"]}, "unknown": {}}
    for key, value in changes.items():
        group, name = key.split("__")
        out["workload"][group][name] = value
    return out


def _md(a: dict, b: dict, **kw) -> str:
    runs = [RunData.of_profile(p, name) for name, p in (("a", a), ("b", b))]
    return render_markdown(build_diff_document(*runs, diff_profiles(a, b, stat="min", **kw)))


def test_two_wrapped_runs_are_compared_on_their_workloads():
    """Two wrapped runs record no recipe: their workloads are compared, the changed key named, and two alike
    workloads are said to be alike on the keys compared, never "the two recipes are the same"."""
    a, b = _wrapped(PROFILE), _wrapped(PROFILE, model__attention="eager")
    d = diff_profiles(a, b, stat="min")
    assert d.settings_from == {"A": "workload", "B": "workload"}
    assert d.recipe_changes == [("model.attention", "sdpa", "eager")]
    assert {"model.attention", "model.hidden_size", "train.grad_accum", "engine.zero_stage"} <= set(d.settings_compared)
    md = _md(a, b)
    assert "A and B record workloads" in md and "| model.attention | sdpa | eager |" in md
    assert "recipes are the same" not in md and "These keys are the same" not in md
    same = _md(a, _wrapped(PROFILE))
    assert "These keys are the same: differences are noise or the machine." in same


def test_a_recipe_run_against_a_wrapped_run_compares_what_both_record():
    """A recipe names its shape (llama2-tiny, dims unset); a wrapped run spells out the dims and calls it custom:
    the same setup is no change; a grad_accum of 2 is, and since the step then covers twice the tokens, the
    Runs section warns that step times cover different work."""
    same = diff_profiles(PROFILE, _wrapped(PROFILE), stat="min")
    assert same.settings_from == {"A": "recipe", "B": "workload"}
    assert same.recipe_changes == [] and "model.hidden_size" in same.settings_compared
    assert "optimizer.lr" not in same.settings_compared  # a workload does not record it
    assert not same.workload_changes

    b = _wrapped(PROFILE, train__grad_accum=2)
    tokens = PROFILE["summary"]["tokens_per_step"]
    b["summary"]["tokens_per_step"] = 2 * tokens
    d = diff_profiles(PROFILE, b, stat="min")
    assert d.recipe_changes == [("train.grad_accum", 1, 2)]
    assert d.workload_changes == [("tokens_per_step", tokens, 2 * tokens)]
    md = _md(PROFILE, b)
    assert f"Warning: A and B do different work per step (tokens_per_step: {tokens:g} -> {2 * tokens:g})" in md
    assert "A records its recipe, B its workload" in md

    # without tokens per step in the summaries, the keys that set it say so
    for p in (a := copy.deepcopy(PROFILE), b):
        p["summary"].pop("tokens_per_step")
    assert diff_profiles(a, b, stat="min").workload_changes == [("train.grad_accum", 1, 2)]


def test_runs_that_record_neither_are_not_called_the_same_and_a_workload_s_guesses_are_named():
    bare = copy.deepcopy(PROFILE)
    bare.pop("recipe")
    d = diff_profiles(bare, _wrapped(PROFILE), stat="min")
    assert d.settings_from == {"A": "none", "B": "workload"} and not d.settings_compared
    md = _md(bare, _wrapped(PROFILE))
    assert "whether they were set up alike is not known" in md and "the same" not in md

    guessed = _wrapped(PROFILE)
    guessed["workload"]["unknown"] = {"train.grad_accum": "no optimizer step finished while the forward was "
                                                          "watched; 1 assumed"}
    d = diff_profiles(_wrapped(PROFILE), guessed, stat="min")
    assert d.settings_unknown == {"B": guessed["workload"]["unknown"]}
    assert "B's workload could not read, or took a guess at: train.grad_accum (no optimizer step finished" in \
        _md(_wrapped(PROFILE), guessed)


def _steps(profile: dict, walls: list[float]) -> dict:
    """`profile` with one measured step per wall time (each a copy of its first used step: same phases and
    modules), after its warm-up."""
    out = copy.deepcopy(profile)
    template = used_steps(profile)[0]
    out["steps"] = [s for s in out["steps"] if s.get("warmup")] + [
        {**copy.deepcopy(template), "step": i, "wall_ms": w} for i, w in enumerate(walls)]
    return out


def _attention_scaled(profile: dict, factor: float) -> dict:
    out = copy.deepcopy(profile)
    for m in out["modules"]:
        if m["name"].endswith("self_attn"):
            for k in ("forward_ms", "backward_ms", "recompute_ms"):
                m[k] *= factor
    for s in out["steps"]:
        for name, values in (s.get("modules_ms") or {}).items():
            if name.endswith("self_attn"):
                s["modules_ms"][name] = [v * factor for v in values]
    return out


def test_cpu_runs_whose_steps_vary_widen_the_default_band_and_say_why():
    """CPU runs whose steps spread by 100% (interquartile range / median) cannot tell attention made 2x faster
    from noise: the band is 1.5x that spread, not the 15% default, and says so. Steady runs keep the default,
    which says their spreads fit inside it."""
    noisy = _steps(PROFILE, [100, 100, 150, 200, 250, 300, 300, 300])
    d = diff_profiles(noisy, _attention_scaled(noisy, 0.5), stat="min", parts=CATEGORIES)
    wider = max(d.step_spread.values())
    assert d.band_source == "widened" and wider > DEFAULT_BAND["min"] / NOISE_SAFETY
    assert d.band == pytest.approx(NOISE_SAFETY * wider)
    attention = [r for r in d.modules if r.name.endswith("self_attn") and r.phase == "forward"]
    assert attention and {r.verdict for r in attention} == {"within noise"}
    md = _md(noisy, _attention_scaled(noisy, 0.5))
    assert f"{100 * d.band:.0f}%: the 15% default for --stat min widened to 1.5x the wider step-time spread" in md

    # attention 40x the kept run's: halving it saves more ms than the steady steps' noise
    steady = _attention_scaled(_steps(PROFILE, [100, 101, 102, 103, 104, 105]), 40)
    d = diff_profiles(steady, _attention_scaled(steady, 0.5), stat="min")
    assert d.band_source == "default" and d.band == DEFAULT_BAND["min"]
    assert {r.verdict for r in d.modules if r.name.endswith("self_attn") and r.phase == "forward"} == {"faster"}
    assert "x1.5 fit inside it" in _md(steady, _attention_scaled(steady, 0.5))
    # a band given or measured from a repeat is not widened
    assert diff_profiles(noisy, noisy, stat="min", band=0.1).band == 0.1
    assert diff_profiles(noisy, noisy, stat="min", repeat=noisy).band_source == "repeat"


def test_the_printed_diff_links_no_plot_and_says_why_phases_do_not_add_up(tmp_path, cli):
    """Without --out no plot is written, so none is linked; with --out diff.md links the one it wrote. The
    phases table says each row is its own fastest step, with each side's phase sum beside its step."""
    a, b = tmp_path / "a", tmp_path / "b"
    for path, profile in ((a, PROFILE), (b, _attention_scaled(PROFILE, 0.5))):
        path.mkdir()
        (path / "profile.json").write_text(json.dumps(profile))
    printed = cli("diff", a, b)
    assert printed.returncode == 0 and "![" not in printed.stdout and "diff_plots" not in printed.stdout
    d = diff_profiles(PROFILE, _attention_scaled(PROFILE, 0.5), stat="min")
    phases = sum(r.a_ms for r in d.phases)
    assert (f"Each row is its own fastest measured step, not one step split into phases, so the phases need not add "
            f"up to the step (A: phases {phases:,.2f} ms, step {d.steps[0].a_ms:,.2f} ms;") in printed.stdout
    written = cli("diff", a, b, "--out", tmp_path / "d")
    md = (tmp_path / "d" / "diff.md").read_text()
    assert written.returncode == 0 and "](diff_plots/modules.png)" in md
    assert (tmp_path / "d" / "diff_plots" / "modules.png").is_file()


def test_a_row_whose_own_steps_spread_wider_than_its_change_is_within_noise_and_says_so():
    """Steady steps keep the 15% default band, but the optimizer phase of both runs varies 4x from step to step
    (5 or 20 ms, as a ZeRO-2 against ZeRO-3 optimizer can: "+86% slower" beside spreads of 50% and 109%):
    B's optimizer at 1.8x A's is within noise, naming the row's spread, in the table and the CSV, while
    attention made 2x faster on steady modules is still faster, and so is its part."""
    from trainprof.report.diff_report import diff_csv

    walls = [100, 101, 102, 103, 104, 105]
    optimizer = [5.0, 5.0, 20.0, 20.0, 5.0, 20.0]
    a = _attention_scaled(_steps(PROFILE, walls), 40)  # its 2x then saves more ms than the step's noise
    b = _attention_scaled(a, 0.5)
    for run, factor in ((a, 1.0), (b, 1.8)):
        for step, ms in zip(used_steps(run), optimizer):
            step["phases_ms"]["optimizer"] = factor * ms
    d = diff_profiles(a, b, stat="min", parts=CATEGORIES)
    assert d.band_source == "default" and d.band == DEFAULT_BAND["min"]
    opt = next(r for r in d.phases if r.name == "optimizer")
    assert opt.change == pytest.approx(0.8) and opt.change > d.band
    assert opt.spread_a == pytest.approx(opt.spread_b) and NOISE_SAFETY * opt.spread_a > opt.change
    assert opt.verdict == "within noise" and opt.noise_spread == pytest.approx(opt.spread_a)
    md = _md(a, b, parts=CATEGORIES)
    row = next(line for line in md.splitlines() if line.startswith("| optimizer | optimizer |"))
    assert f"| within noise (row spread {100 * opt.spread_a:.0f}%) |" in row
    assert "within 1.5x its wider spread is within noise whatever the band" in md
    csv_row = next(line for line in diff_csv(d).splitlines() if line.startswith("phase,optimizer,"))
    assert ",within noise," in csv_row and csv_row.endswith(f",{opt.noise_spread}")
    # rows whose steps are steady are judged against the band as before
    attention = [r for r in [*d.modules, *d.parts] if r.phase == "forward" and r.name in (
        "model.layers.0.self_attn", "model.layers.1.self_attn", "attention")]
    assert len(attention) == 3 and {(r.verdict, r.noise_spread) for r in attention} == {("faster", None)}
    assert all(r.spread_a is not None for r in d.parts)  # a part's spread: that of its per-step sums


def test_a_run_with_too_few_steps_for_a_spread_leaves_the_other_s_spread_to_widen_the_band():
    """A's steps spread by 100%, B has 2 used steps, too few for a spread: knowing less of B must not tighten the
    band, so it is 1.5x A's spread, not the 15% default, and says the spread is A's and why B has none; either
    way round, and for two GPU runs too (one run's spread alone does not set a GPU band under the default)."""
    noisy = _steps(PROFILE, [100, 100, 150, 200, 250, 300, 300, 300])
    two = _steps(PROFILE, [150, 160])
    for a, b, known, other in ((noisy, two, "A", "B"), (two, noisy, "B", "A")):
        d = diff_profiles(a, b, stat="min")
        assert d.step_spread.keys() == {known} and d.band_source == "widened"
        assert d.band == pytest.approx(NOISE_SAFETY * d.step_spread[known]) and d.band > DEFAULT_BAND["min"]
        md = _md(a, b)
        assert (f"widened to 1.5x {known}'s step-time spread (interquartile range / median), "
                f"{100 * d.step_spread[known]:.0f}% ({other} has 2 used steps, too few for one: under 4)") in md
    gpu = [copy.deepcopy(p) for p in (noisy, two)]
    for p in gpu:
        p["env"]["device_type"] = "cuda"
    d = diff_profiles(*gpu, stat="min")
    assert d.band_source == "widened" and d.band == pytest.approx(NOISE_SAFETY * d.step_spread["A"])
