"""`trainprof report`: report.md and a self-contained report.html from recorded run dirs (a 2-rank
ZeRO-3 run with traces, a run dir from before the profiler, one with no profile at all), rendered in
headless Chromium; and the report of a fresh real run with operator tracing."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import QUICKSTART_2RANK
from trainprof.report.run_report import write_reports

DATA = Path(__file__).parent / "data"
REPO = Path(__file__).resolve().parents[1]
TABLES = ("methods-table", "phases-table", "steps-table", "categories-table", "top-modules-table",
          "module-phase-table", "ops-table", "comm-table", "memory-table", "flops-table", "ranks-table",
          "traces-table")
FIGURES = ("fig-phases", "fig-modules", "fig-memory")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars"]


def _copy(name: str, tmp_path: Path) -> Path:
    dest = tmp_path / name
    shutil.copytree(DATA / name, dest)
    return dest


def _no_external_references(html: str) -> None:
    """Self-contained: every src/href is inline data or an in-page anchor; no scripts, no stylesheets."""
    refs = re.findall(r'\b(?:src|href)="([^"]*)"', html)
    outside = [r[:40] for r in refs if not r.startswith(("data:", "#"))]
    assert refs and not outside, outside
    assert "<script" not in html and "<link" not in html and "@import" not in html


def test_report_of_a_profiled_two_rank_run(tmp_path):
    run = _copy("zero3_2rank", tmp_path)
    written = write_reports(run)
    html = written["html"].read_text()
    md = written["md"].read_text()
    _no_external_references(html)
    for table in TABLES:
        assert f'<table id="{table}">' in html, table
    for fig in FIGURES:
        assert re.search(rf'<figure id="{fig}"><img alt="[^"]+" src="data:image/png;base64,', html), fig
        assert (run / "report_plots" / f"{fig[4:]}.png").stat().st_size > 5000
    assert "not available" not in html  # nothing is missing from this run dir
    assert md.splitlines()[2].startswith(f"{run.name}; llama2-tiny pretrain; ")  # what ran, whatever its name
    profile = json.loads((run / "profile.json").read_text())
    # every module of the profile is in the module x phase table, and the method strings are copied
    for m in profile["modules"]:
        assert (m["name"] or "&lt;whole model&gt;") in html  # the root module's one name (analysis/records.py)
    assert profile["measurement"]["module_times"] in md
    assert profile["summary"]["flops_convention"] in md
    # the trace size per step is stated (file size / traced steps)
    per_step = profile["ops_info"]["trace_bytes_per_step"] / 2**20
    assert f"{per_step:.2f}" in md
    assert (run / "tb").glob("events.out.tfevents.*.trainprof")
    # the phase table's medians need not add up to the median step: it shows their sum and says why
    s = profile["summary"]
    total = sum(s["phases_ms"].values()) + s["unattributed_ms"]
    row = next(line for line in md.splitlines() if line.startswith("| sum of the rows above |"))
    assert f"{total:.3g}" in row.replace(",", "") or f"{total:.2f}" in row, (row, total)
    assert "so they need not add up to 100%" in md


@pytest.mark.parametrize("cost, said", [
    (-0.04, "ran 4% faster than the median untraced step"),
    (0.04, "ran 4% slower than the median untraced step"),
    (0.001, "ran as fast as the median untraced step"),
    (0.5, "ran 50% slower than the median untraced step"),
    (1.5, "ran 150% slower than the median untraced step"),
    (-0.5, "ran 50% faster than the median untraced step"),
])
def test_the_operators_section_says_what_tracing_did_either_way(cost, said):
    """ops_info.cost_frac below zero is traced steps that ran faster, not a negative slowdown. zero3_2rank
    traced 2 steps: too few to tell either direction from noise (tests/test_report_tracing.py has the rule)."""
    from trainprof.report.document import Document, render_markdown
    from trainprof.report.rundir import RunData
    from trainprof.report.sections import ops_section

    profile = json.loads((DATA / "zero3_2rank" / "profile.json").read_text())
    profile["ops_info"]["cost_frac"] = cost
    doc = Document("t")
    ops_section(doc, RunData.of_profile(profile, DATA / "zero3_2rank"))
    md = render_markdown(doc)
    assert said in md and "with 2 traced and 3 untraced steps" in md and "cannot be told from noise" in md, md
    assert "cost of tracing" not in md and "-4%" not in md and "Tracing made" not in md


def test_report_does_not_import_torch_and_is_fast(tmp_path):
    run = _copy("zero3_2rank", tmp_path)
    code = ("import sys, time; t = time.perf_counter(); from trainprof.report.run_report import write_reports; "
            f"write_reports({str(run)!r}); assert 'torch' not in sys.modules and 'deepspeed' not in sys.modules, "
            "'imported torch'; print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 30  # seconds; about 2 s on the 2-core CI machine


def test_run_dir_from_before_the_profiler_reports_what_it_has(tmp_path):
    run = _copy("pre_profiler_run", tmp_path)
    html = write_reports(run)["html"].read_text()
    _no_external_references(html)
    for missing in ("phase breakdown", "module times", "operator table", "communication table",
                    "memory per phase", "FLOPs / MFU", "Kineto traces"):
        assert f"not available: {missing}</strong>" in html, missing
    assert '<table id="steps-table">' in html and 'id="fig-steps"' in html and 'id="memory-table"' in html


def test_run_dir_with_only_a_failure_and_cli_errors(tmp_path):
    run = tmp_path / "failed"
    run.mkdir()
    (run / "failure-rank0.json").write_text(json.dumps({"rank": 0, "kind": "oom", "message": "CUDA out of memory"}))
    md = write_reports(run)["md"].read_text()
    assert "not available: profile" in md and "oom: CUDA out of memory" in md
    out = subprocess.run([sys.executable, "-m", "trainprof", "report", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "does not exist" in out.stderr


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_dir_that_holds_no_run_is_refused_in_one_line_and_nothing_is_written(tmp_path, cli):
    """An empty dir, some other program's JSON, a profile cut short mid-write (plain or gzipped) and a file
    are refused: one line naming the path, exit 2, nothing written into the dir. What a training run leaves
    without a profile (a failure record, the runner's recipe.yaml) still reports; an inference run dir
    (inference.json, or an interrupted one's inference.interrupted.json) is refused in one line saying
    where its report is, as `trainprof diff` refuses mixed kinds."""
    text = (DATA / "zero3_2rank" / "profile.json").read_text()
    cases = {"empty": ({}, "is not a run dir"),
             "foreign": ({"profile.json": '{"foo": 1}'}, "is not a trainprof profile"),
             "a_list": ({"profile.json": "[1, 2]"}, "is not a trainprof profile"),
             "cut": ({"profile.json": text[:len(text) // 2]}, "not valid JSON (line "),
             "cut_gz": ({"profile.json.gz": gzip.compress(text.encode())[:200]}, "gzip stream is cut short")}
    for name, (files, said) in cases.items():
        run = tmp_path / name
        run.mkdir()
        for file, content in files.items():
            (run / file).write_bytes(content if isinstance(content, bytes) else content.encode())
        proc = cli("report", run)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (name, proc.stderr)
        assert proc.stderr.startswith("trainprof: ") and str(run) in proc.stderr and said in proc.stderr, name
        assert _tree(run) == sorted(files), name
    proc = cli("report", tmp_path / "cut" / "profile.json")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is a file" in proc.stderr
    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / "recipe.yaml").write_text("{}\n")
    assert cli("report", killed).returncode == 0
    assert "(the run failed before writing one)" in (killed / "report.md").read_text()
    cases = {"infer": ({"inference.json": "{}", "recipe.yaml": "{}"},
                       "is an inference run dir: its report is inference.md / inference.html, written by "
                       "`trainprof infer`"),
             "infer_stopped": ({"inference.interrupted.json": '{"stopped_during": "batch size 1 (1 of 2)"}',
                                "recipe.yaml": "{}"},
                               "interrupted before any batch size finished (batch size 1 (1 of 2))")}
    for name, (files, said) in cases.items():
        run = tmp_path / name
        run.mkdir()
        for file, content in files.items():
            (run / file).write_text(content)
        proc = cli("report", run)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (name, proc.stderr)
        assert proc.stderr.startswith(f"trainprof: '{run}' ") and said in proc.stderr, (name, proc.stderr)
        assert _tree(run) == sorted(files), name  # no hollow report.md / report.html


def test_traces_beside_profile_json_are_found_where_replay_finds_them(tmp_path):
    """A folder kept in profiles/ stores rank 0's trace beside profile.json.gz, not under tb/: the report lists
    and reads it (`trainprof replay` takes it from there too); with no trace anywhere it says where it looked."""
    from trainprof.report.document import render_html
    from trainprof.report.run_report import build_run_report
    from trainprof.report.rundir import load_run

    kept = REPO / "profiles" / "h200-llama1b_zero3_sdpa-torch-gpubound"
    run = tmp_path / kept.name
    shutil.copytree(kept, run)
    (trace,) = run.glob("rank0.*.pt.trace.json.gz")

    def report() -> str:  # the report's text without its plots (the traces section has none)
        return render_html(build_run_report(load_run(run), plots=False))

    html = report()
    assert "not available: Kineto traces" not in html
    table = html[html.index('<table id="traces-table">'):]
    table = table[:table.index("</table>")]
    assert f"<td>{trace.name}</td>" in table and "<td>rank0</td>" in table
    trace.unlink()
    assert f"not available: Kineto traces</strong> — no *.pt.trace.json[.gz] in {run} or its tb/" in report()


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("chromium is not installed (apt-get install -y chromium)")


def test_report_html_renders_in_headless_chromium(tmp_path):
    browser = _chromium()
    run = _copy("zero3_2rank", tmp_path)
    html = write_reports(run, scalars=False)["html"]
    url = html.resolve().as_uri()
    common = [browser, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}"]
    env = {**os.environ, "HOME": str(tmp_path)}
    shot = tmp_path / "shot.png"
    # one browser start for both: the DOM as rendered on stdout and a screenshot of the page
    dom = subprocess.run([*common, "--dump-dom", f"--screenshot={shot}", "--window-size=1200,2400", url],
                         capture_output=True, text=True, timeout=120, env=env)
    assert dom.returncode == 0 and shot.exists(), dom.stderr[-2000:]
    for table in TABLES:
        assert f'<table id="{table}">' in dom.stdout, table
    assert dom.stdout.count('src="data:image/png;base64,') == len(FIGURES)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    dark = (pixels.mean(axis=2) < 0.5).mean()  # text, table rules and plot bars
    colored = (pixels.std(axis=2) > 0.15).mean()  # the phase plot's colors
    assert pixels.std() > 0.05 and 0.005 < dark < 0.5 and colored > 0.001, (pixels.std(), dark, colored)


@pytest.mark.slow
@pytest.mark.timed  # its run is test_projection's source (conftest.MEASURED)
def test_real_run_with_operator_tracing_writes_traces_that_report(shared_run):
    from trainprof.analysis.trace import summarize_trace

    # 2 traced steps (profile.ops, ops_steps 2), 16 measured; test_engines and test_projection share this run
    run_dir, profile = shared_run(*QUICKSTART_2RANK)
    traces = sorted((run_dir / "tb" / run_dir.name).glob("rank*.pt.trace.json.gz"))  # tb/<run name>/
    assert [t.name.split(".")[0] for t in traces] == ["rank0", "rank1"]
    info = profile["ops_info"]
    assert info["trace_steps"] == [1, 2] and info["trace_bytes_per_step"] > 0
    assert [s["instrumented"] for s in profile["steps"] if not s["warmup"]][:3] == [["trace_warmup"], ["ops"], ["ops"]]
    for rank, path in enumerate(traces):
        s = summarize_trace(path)
        assert (s.rank, s.world_size, sorted(s.steps)) == (rank, 2, [1, 2])
        assert "trainprof::forward::model.layers.0.self_attn" in s.ranges_ms
    written = write_reports(run_dir)
    assert "not available" not in written["html"].read_text()
    # the machine's load while it ran, against its cores, in the run's facts
    load = profile["env"]["machine_load"]
    assert load["busy"] == (max(load["start"], load["end"]) > load["cores"]) and load["cores"] >= 1, load
    assert f"1-minute load average {load['start']:g} at start" in written["md"].read_text()
