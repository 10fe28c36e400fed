"""`trainprof diff`: modules matched by name, one-sided modules listed, verdicts against a noise band
(given, default, or measured from a repeat of run A), md/html/csv output; and two real runs of the
tiny Llama, attention=eager against attention=sdpa, where the attention modules come out faster and
everything else within the noise band measured from a repeat of each run."""

from __future__ import annotations

import copy
import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUIET, run_trainprof
from helpers.checks import NotJudged, retry_on_noise
from trainprof.analysis.diff import DEFAULT_BAND, GPU_MIN_BAND, MIN_BAND, NOISE_SAFETY, diff_profiles
from trainprof.io import read_json
from trainprof.report.diff_report import build_diff_document, run_diff, write_diff
from trainprof.report.document import render_markdown
from trainprof.report.rundir import RunData
from trainprof.report.sections import CATEGORIES

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).parent / "data"
PROFILE = json.loads((DATA / "zero3_2rank" / "profile.json").read_text())


def _scaled(profile: dict, factor: float, match=lambda name: name.endswith("self_attn")) -> dict:
    """A copy of `profile` whose matching modules take `factor` times as long (medians and per step)."""
    out = copy.deepcopy(profile)
    for m in out["modules"]:
        if match(m["name"]):
            for k in ("forward_ms", "backward_ms", "recompute_ms"):
                m[k] *= factor
    for s in out["steps"]:
        for name, values in (s.get("modules_ms") or {}).items():
            if match(name):
                s["modules_ms"][name] = [v * factor for v in values]
    return out


# attention 20x as long as the kept run's (as at a long sequence): halving it then saves more ms than the step's
# noise (band x the step), which a change of the kept run's 1-3 ms attention rows does not
ATTENTION_HEAVY = _scaled(PROFILE, 20)


def _verdicts(d, kind: str = "module") -> dict[tuple[str, str], str]:
    return {(r.name, r.phase): r.verdict for r in d.rows() if r.kind == kind}


@pytest.mark.parametrize("stat", ["min", "median"])
def test_faster_modules_are_named_and_the_rest_is_unchanged(stat):
    b = _scaled(ATTENTION_HEAVY, 0.5)
    b["recipe"]["model"]["attention"] = "eager"
    d = diff_profiles(ATTENTION_HEAVY, b, stat=stat, band=0.1, parts=CATEGORIES)
    verdicts = _verdicts(d)
    for layer in (0, 1):
        for phase in ("forward", "backward"):
            assert verdicts[(f"model.layers.{layer}.self_attn", phase)] == "faster"
    unchanged = {k: v for k, v in verdicts.items() if "self_attn" not in k[0] and k[0] not in
                 ("", "model", "model.layers.0", "model.layers.1")}
    assert unchanged and set(unchanged.values()) <= {"within noise", "too small"}
    attention = {r.phase: r for r in d.parts if r.name == "attention"}
    assert attention["forward"].speedup == pytest.approx(2.0) and attention["forward"].faster_by == pytest.approx(0.5)
    assert d.recipe_changes == [("model.attention", "sdpa", "eager")]


def test_a_part_of_modules_each_too_small_is_not_judged_and_its_table_says_why(tmp_path):
    """The same recipe on an H100 and an H200 (profiles/): the norms' forward sums to 14-17 ms a step over
    modules each under 1 ms, so it is not judged, while the norms' backward, whose largest module is over
    1 ms, is; the parts table's note gives the rule."""
    recipe = "llama1b_zero3_sdpa-torch-gpubound"
    d, doc = run_diff(REPO / "profiles" / f"h100-{recipe}", REPO / "profiles" / f"h200-{recipe}")
    norms = {r.phase: r for r in d.parts if r.name == "norms"}
    assert norms["forward"].a_ms > 10 * d.min_ms and norms["forward"].verdict == "too small"
    assert norms["backward"].verdict != "too small"
    md = write_diff(d, doc, tmp_path, formats=("md",))["md"].read_text()
    assert f"a part whose modules are each under {d.min_ms} ms is too small too" in md


def test_the_runs_name_each_side_s_device_and_speed_and_warn_when_the_machines_differ(tmp_path, cli):
    """The same QLoRA recipe on an H100 and an H200 (profiles/): each side's device, tokens/s and median step
    are the profile's own (env, summary), in the terminal with --out and in diff.md / diff.html, with a
    warning that the machines differ; against itself there is no warning."""
    a, b = REPO / "profiles" / "h100-llama7b_qlora", REPO / "profiles" / "h200-llama7b_qlora"
    out = cli("diff", a, b, "--out", tmp_path / "d")
    assert out.returncode == 0, out.stderr
    md, html = (tmp_path / "d" / "diff.md").read_text(), (tmp_path / "d" / "diff.html").read_text()
    for side, run in (("A", a), ("B", b)):
        profile = read_json(run / "profile.json.gz")
        env, s = profile["env"], profile["summary"]
        said = (f"**{side} ran on**: {env['device']} ({env['device_type']}) x {env['world_size']} rank; "
                f"{s['tokens_per_s']:,.0f} tokens/s ({s['tokens_per_s_scope']}); median step "
                f"{s['step_ms']['median']:,.2f} ms, wall time of an optimizer step over {s['steps_used']} measured steps")
        assert said in out.stdout and said in md, out.stdout
        assert env["device"] in html and f"{s['tokens_per_s']:,.0f} tokens/s" in html
    assert ("A and B ran on different machines (NVIDIA H100 80GB HBM3 vs NVIDIA H200)" in md
            and "differences are what the warning above names" in md)
    # the figures sit above the first table
    assert md.index("**B ran on**") < md.index("| figure |")
    same = cli("diff", a, a)
    assert "different machines" not in same.stdout and "differences are noise or the machine" in same.stdout


def test_a_cpu_side_names_its_host_and_the_slowest_rank():
    """A CPU run's device is its architecture, so the host CPU's model is named; on 2 ranks the median step
    is the slowest rank's (the one tokens/s divides by), rank 0's beside it; a rank count that differs is
    warned about."""
    one_rank = copy.deepcopy(PROFILE)
    one_rank["env"].update(world_size=1, device_type="cpu", device="x86_64", host_cpu="AMD EPYC")
    two = copy.deepcopy(one_rank)
    two["env"]["world_size"] = 2
    two["summary"]["across_ranks"]["step_ms_median"] = {"min": 10.0, "median": 11.0, "max": 12.5}
    two["summary"]["step_ms"]["median"] = 10.0
    two["steps_rank"] = 0
    runs = [RunData.of_profile(p, name) for name, p in (("one", one_rank), ("two", two))]
    md = render_markdown(build_diff_document(*runs, diff_profiles(one_rank, two, stat="min")))
    assert "**A ran on**: x86_64 (cpu, AMD EPYC) x 1 rank;" in md
    assert "median step 12.50 ms on the slowest rank (10.00 ms on rank 0)" in md
    assert "A and B ran on different rank counts (1 vs 2)" in md and "different machines" not in md


def test_a_side_with_too_few_measured_steps_is_warned_about():
    """Three measured steps (the kept profile) give the band something to stand on; one does not (a 4-step
    run's single measured step judged sdpa's optimizer 1.35x faster): the Runs section says so, unless a
    repeat measured the band on these runs."""
    one = copy.deepcopy(PROFILE)
    one["steps"] = [s for s in one["steps"] if s.get("warmup") or not s.get("instrumented")][:2]  # warm-up + 1

    def runs_md(a, b, **kw) -> str:
        runs = [RunData.of_profile(p, name) for name, p in (("a", a), ("b", b))]
        return render_markdown(build_diff_document(*runs, diff_profiles(a, b, stat="min", **kw)))

    assert "Warning: B 1 measured step: each verdict stands on so few samples" in runs_md(PROFILE, one)
    assert "each verdict stands on so few samples" not in runs_md(PROFILE, PROFILE)
    assert "each verdict stands on so few samples" not in runs_md(PROFILE, one, repeat=PROFILE)


def test_a_row_new_in_b_has_no_speedup_as_it_has_no_change(tmp_path):
    """Recompute off in A, on in B (a recompute pair): A's recompute is 0 ms, so change, faster by and
    speedup are all n/a, in the table and the CSV, not a speedup of 0.00x; a row gone in B likewise."""
    b = copy.deepcopy(PROFILE)
    for step in b["steps"]:
        step["phases_ms"]["recompute"] = 50.0
    b["summary"]["phases_ms"]["recompute"] = 50.0
    d = diff_profiles(PROFILE, b, stat="min")
    row = next(r for r in d.phases if r.name == "recompute")
    assert (row.a_ms, row.b_ms, row.verdict) == (0.0, 50.0, "new in B")
    assert row.change is None and row.faster_by is None and row.speedup is None
    gone = next(r for r in diff_profiles(b, PROFILE, stat="min").phases if r.name == "recompute")
    assert gone.verdict == "gone in B" and gone.speedup is None
    runs = [RunData.of_profile(p, name) for name, p in (("a", PROFILE), ("b", b))]
    written = write_diff(d, build_diff_document(*runs, d), tmp_path, formats=("md", "csv"))
    assert "| recompute | recompute | 0.00 | 50.00 | n/a | n/a | n/a | new in B |" in written["md"].read_text()
    csv_row = next(r for r in csv.DictReader(io.StringIO(written["csv"].read_text())) if r["name"] == "recompute")
    assert csv_row["speedup"] == "" and csv_row["verdict"] == "new in B"


def test_a_row_that_changed_by_fewer_ms_than_the_step_s_noise_is_within_noise(tmp_path):
    """Recompute on against off (--stat median, 3 steps each) read data_wait 5.08 -> 0.47 ms 10.7x faster and
    comm_exposed 32 -> 114 ms 0.28x slower while the 2,660 ms step was within noise. A row that changed by fewer
    ms than the step's noise (here, with no repeat or step spread, the band x the faster step) is within noise,
    naming it, in the table, its method line and the CSV; a phase new in B, and a change of more ms than that,
    are still judged. A band measured from repeats holds each row's own noise: the rows are left to it."""
    from trainprof.report.diff_report import diff_csv

    b = copy.deepcopy(PROFILE)
    b["summary"]["phases_ms"].update(data_wait=5.0, comm_exposed=45.0, recompute=30.0, forward=40.0)
    d = diff_profiles(PROFILE, b, stat="median")
    step, rows = d.steps[0], {r.name: r for r in d.phases}
    assert d.band_source == "default" and not d.step_spread
    assert d.step_noise_ms == pytest.approx(DEFAULT_BAND["median"] * min(step.a_ms, step.b_ms))
    for name in ("data_wait", "comm_exposed"):  # beyond the band as a ratio, a few ms as a change
        r = rows[name]
        assert r.change > d.band and abs(r.b_ms - r.a_ms) < d.step_noise_ms
        assert (r.verdict, r.step_noise_ms) == ("within noise", d.step_noise_ms)
    assert rows["recompute"].verdict == "new in B" and rows["forward"].verdict == "slower"
    assert rows["forward"].b_ms - rows["forward"].a_ms > d.step_noise_ms
    runs = [RunData.of_profile(p, name) for name, p in (("a", PROFILE), ("b", b))]
    md = render_markdown(build_diff_document(*runs, d))
    noise = f"{d.step_noise_ms:,.2f}"
    assert "| data_wait | data_wait | 0.21 | 5.00 |" in md and f"| within noise (the step's noise: {noise} ms) |" in md
    assert (f"a row that changed by fewer ms than the step's noise ({noise} ms: the faster step x the noise band "
            "(neither a repeat nor a step spread measured the step's own)) is within noise whatever its ratio") in md
    csv_row = next(r for r in csv.DictReader(io.StringIO(diff_csv(d))) if r["name"] == "data_wait")
    assert float(csv_row["step_noise_ms"]) == pytest.approx(d.step_noise_ms) and csv_row["noise_spread"] == ""
    repeated = diff_profiles(PROFILE, b, stat="median", repeat=PROFILE)
    assert repeated.band_source == "repeat" and repeated.step_noise_ms is None
    assert {r.name: r.verdict for r in repeated.phases}["data_wait"] == "slower"


def test_the_collectives_of_each_side_are_beside_each_other():
    """ZeRO-3 against ZeRO-2 showed one comm_exposed row: the Communication section puts each run's collectives
    (profile.json comm, by op and phase) side by side: calls, MiB, exposed and issue-to-completion ms a step,
    those one side issued marked so, and says how they were measured; a side without a comm block is named."""
    zero2 = copy.deepcopy(PROFILE)
    rs = next(c for c in zero2["comm"] if c["op"] == "reduce_scatter_tensor")
    zero2["comm"] = [c for c in zero2["comm"] if c["phase"] != "forward" and c is not rs]
    zero2["comm"].append({**rs, "op": "all_reduce", "calls": 2, "exposed_ms": 3.5, "total_ms": 4.0})

    def comm_md(a, b) -> str:
        runs = [RunData.of_profile(p, name) for name, p in (("a", a), ("b", b))]
        md = render_markdown(build_diff_document(*runs, diff_profiles(a, b, stat="min")))
        return md.split("## Communication")[1].split("\n## ")[0]

    section = comm_md(PROFILE, zero2)
    gather = next(c for c in PROFILE["comm"] if c["op"] == "all_gather_into_tensor" and c["phase"] == "optimizer")
    assert (f"| all_gather_into_tensor | optimizer | {gather['calls']} | {gather['calls']} | "
            f"{gather['bytes'] / 2**20:.2f} | {gather['bytes'] / 2**20:.2f} | {gather['exposed_ms']:.2f} | "
            f"{gather['exposed_ms']:.2f} | {gather['total_ms']:.2f} | {gather['total_ms']:.2f} | both |") in section
    assert "| all_gather_into_tensor | forward | 1 | n/a |" in section and "| only in A |" in section
    assert (f"| all_reduce | backward | n/a | 2 | n/a | {rs['bytes'] / 2**20:.2f} | n/a | 3.50 | n/a | 4.00 | "
            "only in B |") in section
    assert PROFILE["measurement"]["comm_exposed"] in section and "issue-to-completion: from the call" in section
    old = copy.deepcopy(PROFILE)
    old.pop("comm")
    assert "| A (B has no comm block) |" in comm_md(PROFILE, old)
    assert "neither profile.json has a comm block" in comm_md(old, old)


def test_the_memory_each_side_holds_is_beside_its_time():
    """Recompute, offload or ZeRO trade time for memory: a diff that showed only time read recompute as 14%
    slower with its saving out of sight. The Memory section puts each side's peak, activations and model
    states side by side, and says when the two peaks were metered alike."""
    a, b = copy.deepcopy(PROFILE), copy.deepcopy(PROFILE)  # the kept run predates activation bytes: given here
    a["summary"]["activation_bytes"], b["summary"]["activation_bytes"] = 16 * 2**20, 4 * 2**20
    runs = [RunData.of_profile(p, name) for name, p in (("a", a), ("b", b))]
    md = render_markdown(build_diff_document(*runs, diff_profiles(a, b, stat="min")))
    memory = md.split("## Memory")[1].split("\n## ")[0]
    act = 16.0
    assert f"| activations saved for backward per micro batch | {act:.2f} | {act / 4:.2f} | -75.0% |" in memory
    states = PROFILE["model_state_bytes"]["total"] / 2**20
    assert f"| model states | {states:.2f} | {states:.2f} | +0.0% |" in memory and "| peak memory per rank |" in memory
    assert "(not alike)" not in memory
    b["summary"]["peak_memory_method"] = "cpu_process_peak_rss"
    md = render_markdown(build_diff_document(runs[0], RunData.of_profile(b, "b"), diff_profiles(a, b, stat="min")))
    assert "B cpu_process_peak_rss (not alike)" in md.split("## Memory")[1]


def test_modules_on_one_side_only_are_listed():
    b = copy.deepcopy(PROFILE)
    b["modules"] = [m for m in b["modules"] if m["name"] != "lm_head"]
    b["modules"].append({**b["modules"][-1], "name": "model.layers.2"})
    d = diff_profiles(PROFILE, b, stat="median")
    assert d.only_a == ["lm_head"] and d.only_b == ["model.layers.2"]
    assert not any(r.name in ("lm_head", "model.layers.2") for r in d.modules)


def test_noise_band_from_a_repeat_of_run_a():
    repeat = _scaled(PROFILE, 1.04, match=lambda name: True)  # every module 4% slower: the "noise"
    b = _scaled(PROFILE, 0.5)
    d = diff_profiles(PROFILE, b, stat="min", repeat=repeat, parts=CATEGORIES)
    assert d.band_source == "repeat" and d.repeat_noise == {"A": pytest.approx(0.04, abs=0.005)}
    assert d.band == pytest.approx(max(MIN_BAND, NOISE_SAFETY * d.repeat_noise["A"]))
    assert _verdicts(d)[("model.layers.0.self_attn", "forward")] == "faster"


def test_noise_band_takes_the_wider_side_when_both_runs_are_repeated(tmp_path):
    # B's repeat has a spell on the MLPs alone (+30%): A's repeat cannot see it, B's sets the band
    b = _scaled(PROFILE, 0.5)
    b_spell = _scaled(b, 1.3, match=lambda name: name.endswith("mlp"))
    a_repeat = _scaled(PROFILE, 1.04, match=lambda name: True)
    d = diff_profiles(PROFILE, b, stat="min", repeat=a_repeat, repeat_b=b_spell, parts=CATEGORIES)
    assert d.repeat_noise == {"A": pytest.approx(0.04, abs=0.005), "B": pytest.approx(0.3, abs=0.005)}
    assert d.band == pytest.approx(NOISE_SAFETY * d.repeat_noise["B"])
    only_b = diff_profiles(PROFILE, b, stat="min", repeat_b=b_spell, parts=CATEGORIES)
    assert only_b.repeat_noise.keys() == {"B"} and only_b.band == d.band
    assert _verdicts(d)[("model.layers.0.self_attn", "forward")] == "faster"
    # the CLI names both repeats and both sides' noise
    dirs = {}
    for name, profile in (("a", PROFILE), ("b", b), ("a2", a_repeat), ("b2", b_spell)):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "profile.json").write_text(json.dumps(profile))
    out = subprocess.run([sys.executable, "-m", "trainprof", "diff", str(dirs["a"]), str(dirs["b"]), "--repeat",
                          str(dirs["a2"]), "--repeat-b", str(dirs["b2"])], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert f"**repeat of B**: {dirs['b2']}" in out.stdout, out.stdout[:2000]
    assert "45%: 1.5x the wider of each run's largest difference from its repeat (A 4%, B 30%)" in out.stdout
    assert not d.repeat_changes and "warning" not in out.stderr
    # a "repeat" of another recipe is named, in the report and on stderr: its band holds that change
    b_spell["recipe"]["model"]["attention"] = "eager"
    (dirs["b2"] / "profile.json").write_text(json.dumps(b_spell))
    out = subprocess.run([sys.executable, "-m", "trainprof", "diff", str(dirs["a"]), str(dirs["b"]), "--repeat-b",
                          str(dirs["b2"])], capture_output=True, text=True, timeout=120, cwd=REPO)
    said = "The repeat of B is not B's recipe (model.attention: sdpa -> eager)"
    assert out.returncode == 0 and said in out.stdout and f"warning: {said}" in out.stderr, out.stderr


def test_run_dirs_without_phases_or_modules_still_diff(tmp_path):
    d, doc = run_diff(DATA / "pre_profiler_run", DATA / "zero3_2rank")
    assert [r.name for r in d.steps] == ["step"] and not d.phases and not d.modules
    assert any(n.startswith("phases:") for n in d.notes) and any(n.startswith("modules:") for n in d.notes)
    written = write_diff(d, doc, tmp_path)
    assert "not available: modules" in written["html"].read_text()


def test_cli_writes_md_html_csv(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for path, profile in ((a, ATTENTION_HEAVY), (b, _scaled(ATTENTION_HEAVY, 0.5))):
        path.mkdir()
        (path / "profile.json").write_text(json.dumps(profile))
    out = subprocess.run([sys.executable, "-m", "trainprof", "diff", str(a), str(b), "--out", str(tmp_path / "d"),
                          "--noise", "10%"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    rows = list(csv.DictReader(io.StringIO((tmp_path / "d" / "diff.csv").read_text())))
    attn = next(r for r in rows if r["name"] == "model.layers.0.self_attn" and r["phase"] == "forward")
    assert attn["verdict"] == "faster" and float(attn["speedup"]) == pytest.approx(2.0)
    assert float(attn["noise_band"]) == pytest.approx(0.1)
    html = (tmp_path / "d" / "diff.html").read_text()
    assert '<table id="module-diff">' in html and 'src="data:image/png;base64,' in html and "<script" not in html
    assert "How measured" in (tmp_path / "d" / "diff.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "trainprof", "diff", str(a), str(tmp_path / "missing")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1


def test_cli_refuses_a_cut_short_or_foreign_profile_and_a_bad_noise_band(tmp_path, cli):
    good, cut, foreign = tmp_path / "good", tmp_path / "cut", tmp_path / "foreign"
    text = json.dumps(PROFILE)
    for path, content in ((good, text), (cut, text[:200]), (foreign, '{"foo": 1}')):
        path.mkdir()
        (path / "profile.json").write_text(content)
    for other, said in ((cut, "profile.json: not valid JSON (line 1 col "), (foreign, "is not a trainprof profile"),
                        (tmp_path / "nope", "does not exist")):
        proc = cli("diff", good, other, "--out", tmp_path / "d")
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert str(other) in proc.stderr and said in proc.stderr
    assert not (tmp_path / "d").exists()
    proc = cli("diff", good, good, "--noise", "abc")
    assert proc.returncode == 2 and "invalid" not in proc.stderr
    assert proc.stderr.splitlines()[-1].endswith("argument --noise: noise band must be a fraction like 0.15 or 15%, "
                                                 "got 'abc'")


def test_two_gpu_runs_are_judged_against_their_own_step_spread_not_the_cpu_default():
    """The 15% default was measured on CPU runs; two GPU runs whose steps spread by 1% are judged against 1.5x
    their wider spread (at least 5%), and the band says so: the H200 is faster on the step, forward and backward
    of the same recipe. A repeat of a GPU-bound run stays within that band on the step and the main phases, and
    a CPU run keeps the default, which says where it was measured."""
    recipe = "llama1b_zero3_sdpa-torch-gpubound"
    d, doc = run_diff(REPO / "profiles" / f"h100-{recipe}", REPO / "profiles" / f"h200-{recipe}")
    step = d.steps[0]
    assert d.band_source == "spread" and d.step_spread == {"A": step.spread_a, "B": step.spread_b}
    assert max(step.spread_a, step.spread_b) < 0.02
    assert d.band == pytest.approx(max(GPU_MIN_BAND, NOISE_SAFETY * max(step.spread_a, step.spread_b)))
    assert {r.name: r.verdict for r in [*d.steps, *d.phases] if r.name in ("step", "forward", "backward")} == \
        {"step": "faster", "forward": "faster", "backward": "faster"}
    md = render_markdown(doc)
    assert f"{100 * d.band:.0f}%: 1.5x the wider step-time spread" in md
    assert "the 15% default was measured on CPU runs" in md

    again, _ = run_diff(REPO / "profiles" / "h100-llama1b_zero3_sdpa-gpubound32",
                        REPO / "profiles" / "h100-llama1b_zero3_sdpa-gpubound32-v2")
    assert again.band_source == "spread" and again.band < DEFAULT_BAND["min"]
    assert {r.verdict for r in [*again.steps, *again.phases]
            if r.name in ("step", "forward", "backward", "recompute", "optimizer")} == {"within noise"}

    cpu = diff_profiles(PROFILE, _scaled(PROFILE, 0.5), stat="min")
    assert cpu.band_source == "default" and cpu.band == DEFAULT_BAND["min"] and not cpu.step_spread
    runs = [RunData.of_profile(p, name) for name, p in (("a", PROFILE), ("b", _scaled(PROFILE, 0.5)))]
    assert "measured on identical runs of a tiny model on a shared 2-core CPU machine" in \
        render_markdown(build_diff_document(*runs, cpu))
    given, _ = run_diff(REPO / "profiles" / f"h100-{recipe}", REPO / "profiles" / f"h200-{recipe}", band=0.2)
    assert given.band_source == "given" and given.band == 0.2


def _inference_run(path: Path, *, prompt_len: int, new_tokens: int, ms: float) -> Path:
    """A `trainprof infer` run dir holding a hand-made inference.json: batch sizes 1 and 4, every p50 `ms`."""
    results = [{"batch_size": bs, **{k: {"p50": ms} for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")},
                "output_tokens_per_s": 1e3 / ms, "modules": [], "peak_memory_bytes": 2**30, "kv_cache_bytes": 2**20}
               for bs in (1, 4)]
    path.mkdir(parents=True)
    (path / "inference.json").write_text(json.dumps({
        "kind": "inference", "recipe": {"model": {"name": "tiny"}}, "env": {"device": "x86_64", "device_type": "cpu"},
        "settings": {"batch_sizes": [1, 4], "prompt_len": prompt_len, "new_tokens": new_tokens, "requests": 5},
        "method": {"timer": "perf_counter"}, "results": results}))
    return path


def test_an_inference_diff_across_settings_warns_and_names_them(tmp_path, cli):
    """Two inference runs of different prompt lengths and token counts: the latencies compare different work,
    so a warning names the settings, in the terminal and in diff.md; the same settings give none. --stat, which
    does not apply to inference runs, is warned about; a training run given as --repeat of one is named so."""
    a = _inference_run(tmp_path / "a", prompt_len=512, new_tokens=128, ms=100.0)
    b = _inference_run(tmp_path / "b", prompt_len=32, new_tokens=8, ms=2.0)
    same = _inference_run(tmp_path / "same", prompt_len=512, new_tokens=128, ms=90.0)
    out = cli("diff", a, b, "--out", tmp_path / "d", "--stat", "median")
    assert out.returncode == 0, out.stderr
    said = "Warning: A and B measured different workloads (prompt_len: 512 -> 32; new_tokens: 128 -> 8)"
    assert said in out.stdout and said in (tmp_path / "d" / "diff.md").read_text()
    assert "--stat median does not apply to inference run dirs" in out.stderr
    plain = cli("diff", a, same)
    assert plain.returncode == 0 and "different workloads" not in plain.stdout and "warning" not in plain.stderr
    d, _ = run_diff(a, b)
    assert d.workload_changes == [("prompt_len", 512, 32), ("new_tokens", 128, 8)]
    cpu_run = REPO / "profiles" / "cpu-x86_64-quickstart_cpu"
    mixed = cli("diff", cpu_run, cpu_run, "--repeat", a)
    assert mixed.returncode == 2 and len(mixed.stderr.strip().splitlines()) == 1
    assert f"'{a}' (--repeat) an inference one" in mixed.stderr and "diff two of a kind" in mixed.stderr


def test_cli_refuses_an_out_file_an_empty_format_and_a_negative_min_ms(tmp_path, cli):
    """Each is one line on stderr, exit 2, before any output or file is written."""
    a = tmp_path / "a"
    a.mkdir()
    (a / "profile.json").write_text(json.dumps(PROFILE))
    (tmp_path / "f").write_text("")
    out_file = cli("diff", a, a, "--out", tmp_path / "f")
    assert out_file.returncode == 2 and out_file.stdout == "" and len(out_file.stderr.splitlines()) == 1
    assert f"--out {tmp_path / 'f'}: a file is there, not a directory" in out_file.stderr
    empty = cli("diff", a, a, "--out", tmp_path / "d", "--format", "")
    assert empty.returncode == 2 and "--format '': choose one or more of md,html,csv" in empty.stderr
    assert not (tmp_path / "d").exists()
    negative = cli("diff", a, a, "--min-ms", "-5")
    assert negative.returncode == 2 and "argument --min-ms: must be a number of ms, 0 or more" in negative.stderr


# -- two real runs ---------------------------------------------------------------------------------
# seq 2048 (the tiny model's RoPE table raised to cover it): eager attention materializes 4 heads x
# 2048^2 scores per layer; SDPA's CPU flash kernel does not, which makes attention several times faster
# (7.5x forward, 4x backward measured here on a quiet day) while MLP, norms and head do the same work in
# both runs.
REAL = ["engine.kind=torch", "engine.zero_stage=0", "data.seq_len=2048", "model.max_position_embeddings=2048",
        "train.micro_batch_size=1", "train.steps=8", "train.warmup_steps=1", "profile.module_depth=4",
        *QUIET]


UNRESOLVED_BAND = 0.5
SHARE = 0.2  # of attention's change (ms, per phase): what a leak of attention's time elsewhere would exceed


def _run(out: Path, attention: str) -> Path:
    """One real single-process run of the CPU quickstart recipe (`python -m trainprof.run`), on core 0: the
    cores of this machine can differ by 1.7x for minutes, and a run on the other core reads as a change."""
    run_dir, _ = run_trainprof(out, 1, *REAL, f"model.attention={attention}", f"output.name={attention}", timeout=300,
                               cpu=0)
    return run_dir


def _contains_attention(name: str) -> bool:
    return name in ("", "model", "model.layers") or name.startswith("model.layers.") and name.count(".") == 2 \
        or "self_attn" in name


@pytest.mark.slow
@pytest.mark.timed
@pytest.mark.timeout(900)  # up to 3 attempts of 4 runs (about 55 s in all on a quiet machine; a loaded CI took > 300 s)
def test_sdpa_against_eager_speeds_up_attention_and_nothing_else(tmp_path):
    attempt = iter(range(3))

    def check() -> None:
        base = tmp_path / f"attempt{next(attempt)}"
        # A, B, A's repeat, B's repeat: the band is the wider of the two sides'. A spell of this machine during
        # one run slows all of it, which A's band alone misses when the run is B's: the MLP's backward then
        # reads slower beside SDPA (+61% once, with A's band at 0.48)
        eager = _run(base / "a", "eager")
        sdpa = _run(base / "b", "sdpa")
        eager2 = _run(base / "a2", "eager")
        sdpa2 = _run(base / "b2", "sdpa")
        d, doc = run_diff(eager, sdpa, stat="min", repeat=eager2, repeat_b=sdpa2)
        write_diff(d, doc, base / "diff")
        # a band of 50% or more cannot tell a 2x speed-up from noise: such an attempt judges nothing (slow
        # hours of this machine measured bands of 0.56-1.21, with attention 1.2-1.7x faster; docs/suite.md)
        if d.band >= UNRESOLVED_BAND:
            noise = ", ".join(f"{side}'s {NOISE_SAFETY * x:.2f}" for side, x in d.repeat_noise.items())
            raise NotJudged(f"noise band {d.band:.2f} ({noise}, each from a repeat) is too wide to judge a 2x "
                            "speed-up")
        # attention rows: faster beyond the noise band measured between the two eager runs; the backward may
        # be within it, never slower: the CPU flash kernel's backward gained 4x on this machine on quiet days
        # and 1.25-1.5x in the slow hours of 2026-11-29, inside bands of 0.39-0.48
        def faster(r) -> bool:
            return r.verdict == "faster" or r.phase == "backward" and r.verdict == "within noise" and r.b_ms < r.a_ms

        for layer in (0, 1):
            for phase in ("forward", "backward"):
                row = next(r for r in d.modules if r.name == f"model.layers.{layer}.self_attn" and r.phase == phase)
                assert faster(row), (row, d.band)
        assert all(faster(r) for r in d.parts if r.name == "attention")
        # the layers' change is attention's, within the band on the rest of the layers or a share of attention's
        # change: a profiler that put a fifth of attention's time in its neighbours would show it here (forward
        # -142.0 against -141.8 ms, backward -52.4 against -53.2; the rest's backward 0.2-4.7 ms slower in four
        # trios, 2026-11-29)
        attention = {r.phase: r for r in d.parts if r.name == "attention"}
        for r in d.parts:
            if r.name == "decoder layers":
                att = attention[r.phase]
                others = r.b_ms - r.a_ms - (att.b_ms - att.a_ms)
                assert abs(others) <= max(SHARE * (att.a_ms - att.b_ms), d.band * (r.a_ms - att.a_ms)), (r, att, d.band)
        # everything that does not contain attention: within that band (or too small to judge), or changed by
        # a small share of attention's change (the MLP's forward read 6-16% faster in three trios, docs/reports.md)
        rest = [r for r in d.modules if not _contains_attention(r.name)]
        rest += [r for r in d.parts if r.name in ("MLP", "norms", "head", "embedding")]

        def judged_alike(r) -> bool:
            att = attention[r.phase]
            return r.verdict in ("within noise", "too small") or abs(r.b_ms - r.a_ms) <= SHARE * (att.a_ms - att.b_ms)

        assert rest and all(judged_alike(r) for r in rest), \
            ([(r.name, r.phase, r.change, r.b_ms - r.a_ms) for r in rest if not judged_alike(r)], d.band, attention)

    retry_on_noise(check)
