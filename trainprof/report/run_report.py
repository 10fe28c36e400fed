"""`trainprof report RUN_DIR`: report.md and a self-contained report.html of one run: the answer and
what to change, projections of the run, run facts and how each figure was measured, phases per step,
modules, module x phase, operators, communication, memory, FLOPs/MFU, ranks and traces. Every number
comes from the run dir (profile.json and the files beside it); what a run dir lacks is named in the
report. The sections it shares with summary.md and the terminal summary live in report/sections.py.
Imports neither torch nor deepspeed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprof.analysis.diff import RunSettings
from trainprof.analysis.records import ROOT_LABEL
from trainprof.analysis.trace import TraceFormatError, summarize_trace
from trainprof.errors import UserError
from trainprof.io import atomic_write_text, dig
from trainprof.layout import TRACES_HOW
from trainprof.report.diff_report import SETTINGS_WHAT
from trainprof.report.document import Details, Document, Facts, Missing, Para, Table
from trainprof.report.document import render_html, render_markdown
from trainprof.report.gpu import gpu_section
from trainprof.report.pipeline import pipeline_section
from trainprof.report.plots import INSTALL_HINT
from trainprof.report.projections import how_to_project, projections_section
from trainprof.report.rundir import WRITERS, RunData, RunDirError, load_run, recipe_of
from trainprof.report.sections import (MiB, advice_section, categories_section, comm_section, compile_text,
                                       hardware_text, headline_facts, machine_load_text, memory_section,
                                       methods_section, module_phase_section, ops_section, phases_section,
                                       ranks_section, top_modules_section)

TRACE_SCAN_BYTES = 32 * MiB  # traces larger than this (on disk) are listed, not read, unless asked


@dataclass(slots=True, kw_only=True)
class NotWritten:
    """A part of the report that could not be made because a package is not installed."""

    part: str
    package: str


class ReportIncomplete(UserError):
    """Some parts of a run's report could not be made; the others were written. One line: which parts,
    which packages, how to install them."""

    def __init__(self, run_dir: Path, missing: list[NotWritten], written: dict[str, Path]) -> None:
        self.missing, self.written = missing, written
        packages = sorted({m.package for m in missing})
        super().__init__(f"{run_dir}: {'; '.join(m.part for m in missing)} not written: {', '.join(packages)} "
                         f"not installed; pip install {' '.join(packages)} (trainprof depends on "
                         f"{'them' if len(packages) > 1 else 'it'}: `pip install -e .` installs "
                         f"{'them' if len(packages) > 1 else 'it'}); the rest of the report was written")


def importable(module: str) -> bool:
    """Whether `module` imports here (an optional part's package is installed and works)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _mib(x: float | None) -> float | None:
    return None if x is None else x / MiB


# -- sections only the full report has -----------------------------------------------------------------

def answer_section(doc: Document, run: RunData) -> None:
    """The answer for a decision maker first: throughput, time of a step, the bottleneck phase and the
    run's other headline figures; what to change and the projections follow, the method details later."""
    doc.section("The answer", id="answer").blocks.append(Facts(headline_facts(run)))


def advice_and_projections(doc: Document, run: RunData) -> None:
    """What to change, then every projection of the run (or one line on how to make one)."""
    advice_section(doc, run)
    advice = doc.sections[-1]
    if not projections_section(doc, run):
        advice.blocks.append(Para(how_to_project(run)))


def run_settings(run: RunData) -> RunSettings:
    """How the run was set up: its recipe (profile.json's, else recipe.yaml), else the workload that `trainprof
    wrap`, the callbacks and trainprof.Profiler record (the recipe keys they read from the model and the loop)."""
    return RunSettings.of({**(run.profile or {}), "recipe": recipe_of(run)})


def _model_text(settings: RunSettings) -> str:
    """The model's name, its dims where a workload names it `custom` (no named shape), and how it ran."""
    k = settings.keys
    dims = ", ".join(f"{label} {k[key]}" for key, label in (("model.hidden_size", "hidden"), ("model.num_layers",
                     "layers"), ("model.num_heads", "heads"), ("model.vocab_size", "vocab")) if k.get(key) is not None)
    how = (f"{k.get('model.dtype', '?')}, attention {k.get('model.attention', '?')}, recompute "
           f"{k.get('model.recompute', '?')}, compile {k.get('model.compile', False)}")
    return f"{k.get('model.name', 'n/a')} ({dims + '; ' if settings.source == 'workload' and dims else ''}{how})"


def _steps_text(run: RunData, settings: RunSettings) -> str:
    """Measured and warm-up steps: the recipe's; else the profile's measured steps and the profiler's warm-up
    count (profiles written before it was recorded do not say it: the profile keeps only the last warm-up
    step, the one that counts FLOPs)."""
    s = (run.profile or {}).get("summary") or {}
    used = (f"{s.get('steps_used', len(run.measured_steps))} used for medians "
            f"({s.get('steps_used_description', 'all measured steps')})")
    if settings.source == "recipe":
        k = settings.keys
        return f"{k.get('train.steps', '?')} measured after {k.get('train.warmup_steps', '?')} warm-up; {used}"
    warmup = s.get("warmup_steps")
    after = f"after {warmup} warm-up" if warmup is not None else "after warm-up (its count is not recorded)"
    return f"{len(run.measured_steps)} measured {after}; {used}"


def facts_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    env = p.get("env") or {}
    settings = run_settings(run)
    k = settings.keys
    sec = doc.section("Run facts", id="facts")
    engine = k.get("engine.kind", "n/a")
    items = [
        ("run dir", str(run.path)),
        ("profile source", run.source),
        ("settings from", SETTINGS_WHAT[settings.source]),
        ("model", _model_text(settings)),
        ("compile", compile_text(p)),
        ("task", str(k.get("task.kind", "n/a"))),
        ("engine", f"{engine}, "
                   + (f"FSDP2 reshard_after_forward {k.get('engine.reshard_after_forward')}" if engine == "fsdp"
                      else f"ZeRO stage {k.get('engine.zero_stage', '?')}") + f", offload {k.get('engine.offload', '?')}"),
        ("batch", f"micro batch {k.get('train.micro_batch_size', '?')} x grad accum {k.get('train.grad_accum', '?')} "
                  f"x seq {k.get('data.seq_len', '?')} per rank"),
        ("steps", _steps_text(run, settings)),
        ("hardware", hardware_text(env)),
        ("machine load", machine_load_text(env.get("machine_load")) or "not recorded"),
        ("versions", ", ".join(f"{pkg} {env[pkg]}" for pkg in ("torch", "deepspeed", "transformers") if env.get(pkg))
         or "not recorded"),
        ("timer", f"{env.get('timer', 'n/a')}: {env.get('timer_description', 'not recorded')}"),
    ]
    if settings.unknown:
        items.insert(3, ("not read from the loop", "; ".join(f"{key} ({why})" for key, why in
                                                              sorted(settings.unknown.items()))))
    for f in run.failures:
        items.append((f"failure on rank {f.get('rank')}", f"{f.get('kind')}: {f.get('message')}"))
    sec.blocks.append(Facts(items))
    import yaml

    recipe = recipe_of(run)
    if run.recipe_text or recipe:
        sec.blocks.append(Details("resolved recipe", run.recipe_text or yaml.safe_dump(recipe, sort_keys=False)))
    elif settings.source == "workload":
        sec.blocks.append(Details("recorded workload (no recipe)", yaml.safe_dump(p["workload"], sort_keys=False)))
    else:
        sec.blocks.append(Missing("recipe", "no recipe.yaml, and neither a recipe nor a workload in profile.json"))


def flops_section(doc: Document, run: RunData) -> None:
    s = (run.profile or {}).get("summary") or {}
    sec = doc.section("FLOPs and MFU", id="flops")
    if s.get("flops_per_step") is None:
        why = s.get("mfu_reason") or "this run dir has no FLOP count (older run dir or profiler off)"
        sec.blocks.append(Missing("FLOPs / MFU", why))
        return
    rows = [["FLOPs per step (executed, this rank)", s["flops_per_step"]],
            ["model FLOPs per step (minus recompute)", s.get("model_flops_per_step")]]
    for phase, n in (s.get("flops_by_phase") or {}).items():
        rows.append([f"  of which {phase}", n])
    rows += [["achieved TFLOP/s (per rank)", s.get("achieved_tflops")],
             ["model TFLOP/s (per rank)", s.get("model_tflops")]]
    if s.get("achieved_tflops_all_ranks") is not None:
        rows.append(["achieved TFLOP/s (all ranks)", s["achieved_tflops_all_ranks"]])
    rows.append(["MFU", "n/a: " + str(s.get("mfu_reason")) if s.get("mfu") is None else f"{100 * s['mfu']:.2f}%"])
    if s.get("peak"):
        rows.append(["peak used for MFU", f"{s['peak'].get('tflops')} TFLOP/s ({s['peak'].get('source')})"])
    if s.get("measured_over_analytic") is not None:
        rows.append(["measured / analytic (6N + 12LHQT)", s["measured_over_analytic"]])
    if s.get("flops_uncounted_ops"):
        rows.append(["ops without a FLOP formula (calls)", ", ".join(f"{k} x{v}" for k, v in
                                                                     s["flops_uncounted_ops"].items())])
    sec.blocks.append(Table(["figure", "value"], rows, method=s.get("flops_convention"), id="flops-table",
                            numeric=[False, True]))


def traces_section(doc: Document, run: RunData, scan_bytes: int = TRACE_SCAN_BYTES) -> None:
    p = run.profile or {}
    info = p.get("ops_info") or {}
    sec = doc.section("Traces and TensorBoard", id="traces")
    if not run.traces:
        sec.blocks.append(Missing("Kineto traces", f"no *.pt.trace.json[.gz] in {run.path} or its tb/ (tracing was "
                                  f"off, or the run predates it; {TRACES_HOW} traces)"))
    else:
        traced = info.get("trace_steps") or info.get("steps") or []
        per_worker: dict[str, int] = {}
        for t in run.traces:
            per_worker[t.worker] = per_worker.get(t.worker, 0) + 1
        rows, skipped = [], []
        for t in run.traces:
            rank, steps, step_ms = None, None, None
            if t.bytes <= scan_bytes:
                try:
                    summary = summarize_trace(t.path)  # streaming: memory does not grow with the file
                except TraceFormatError as err:
                    sec.blocks.append(Missing(f"trace {t.path.name}", str(err)))
                    continue
                if summary.rank is not None:
                    rank = f"{summary.rank} of {summary.world_size}"
                steps = ", ".join(str(n) for n in sorted(summary.steps)) or "none"
                step_ms = statistics.median(summary.steps.values()) if summary.steps else None
                n = len(summary.steps) or None
            else:
                skipped.append(t.path.name)
                n = len(traced) if traced and per_worker[t.worker] == 1 else None
            rows.append([str(t.path.relative_to(run.path)), t.worker, rank, steps, _mib(t.bytes),
                         None if not n else _mib(t.bytes / n), step_ms])
        sec.blocks.append(Table(
            ["file", "worker", "rank (distributedInfo)", "steps (ProfilerStep#)", "MiB", "MiB per step",
             "traced step ms (median)"], rows, id="traces-table",
            method="file size on disk (gzip-compressed when the name ends in .gz) over the ProfilerStep markers in "
                   "the file; traced step ms is the ProfilerStep range (slower than an untraced step: the profile's "
                   "figures leave traced steps out)"))
        if skipped:
            sec.blocks.append(Para(f"Not scanned (over {scan_bytes / MiB:.0f} MiB each; steps from profile.json): "
                                   + ", ".join(skipped) + ". `trainprof report --scan-traces` reads them (streaming)."))
        sec.blocks.append(Para(f"Open with `trainprof tb {run.path}` (TensorBoard's PyTorch Profiler tab: each rank "
                               "is a worker), or load a file into https://ui.perfetto.dev or chrome://tracing. "
                               f"Module ranges are named trainprof::<phase>::<module> ({ROOT_LABEL} = the model itself), "
                               "phase regions trainprof::<phase>."))
    if run.scalars:
        sec.blocks.append(Para("TensorBoard scalars (phases, tokens/s, TFLOP/s, memory, exposed communication per "
                               f"step) are in {', '.join(str(f.relative_to(run.path)) for f in run.scalars)}."))
    else:
        sec.blocks.append(Missing("TensorBoard scalars", "no events file under tb/; `trainprof report` writes them"))


SECTIONS = (answer_section, advice_and_projections, facts_section, methods_section, phases_section,
            pipeline_section, categories_section, top_modules_section, module_phase_section, ops_section,
            gpu_section, comm_section, memory_section, flops_section, ranks_section)


def build_run_report(run: RunData, *, trace_scan_bytes: int = TRACE_SCAN_BYTES, plots: bool = True) -> Document:
    """The report of one run as a Document (render with render_markdown / render_html).

    Args:
        run: the loaded run dir.
        trace_scan_bytes: trace files up to this size on disk are read (streaming) for their ranks and
            ProfilerStep markers; larger ones are listed from profile.json alone, to keep a report fast.
        plots: draw the figures (needs matplotlib).
    """
    p = run.profile or {}
    recipe, settings = recipe_of(run), run_settings(run)
    name = dig(recipe, "output", "name") or run.name
    # the recipe's name stays when its model is overridden (llama70b_qlora run as llama2-7b): say what ran
    ran = " ".join(str(x) for x in (settings.keys.get("model.name"), settings.keys.get("task.kind")) if x)
    subtitle = "; ".join(x for x in (run.path.name, ran, f"profile from {run.source}") if x)
    doc = Document(f"trainprof report: {name}", subtitle=subtitle, plots=plots)
    if run.profile is None:
        sec = doc.section("Run facts", id="facts")
        sec.blocks.append(Missing("profile", f"no profile.json, profile.rank*.json or rank*.json in {run.path} "
                                  "(the run failed before writing one)"))
        for f in run.failures:
            sec.blocks.append(Para(f"rank {f.get('rank')} failed: {f.get('kind')}: {f.get('message')}"))
        traces_section(doc, run, trace_scan_bytes)
        return doc
    for build in SECTIONS:
        build(doc, run)
    traces_section(doc, run, trace_scan_bytes)
    if p.get("schema_version", 1) < 1:
        doc.sections[0].blocks.insert(0, Missing("profile.json", "only the runner's per-rank step files exist"))
    if not plots and run.measured_steps:
        doc.sections[0].blocks.insert(0, Missing("plots", f"matplotlib is not installed; {INSTALL_HINT}"))
    return doc


def inference_run_dir_text(run: RunData) -> str:
    """One line: the dir is a `trainprof infer` run dir, and where its report is."""
    if run.inference is not None:
        return (f"'{run.path}' is an inference run dir: its report is inference.md / inference.html, written by "
                "`trainprof infer`; `trainprof report` reports training run dirs")
    return (f"'{run.path}' is an inference run dir that was interrupted before any batch size finished "
            f"({run.inference_interrupted.get('stopped_during', 'see inference.interrupted.json')}): it has no report; "
            "run `trainprof infer` again")


def write_reports(run_dir: str | Path, *, scalars: bool = True,
                  trace_scan_bytes: int = TRACE_SCAN_BYTES) -> dict[str, Path]:
    """Write report.md (+ its PNGs under report_plots/) and report.html into the run dir, and refresh
    summary.md, the CSV tables and the TensorBoard scalars when the run has a profile. A part that needs
    a package which is not installed is left out and the rest written.

    Args:
        run_dir: the run directory.
        scalars: also (re)write the TensorBoard scalars.
        trace_scan_bytes: see build_run_report.
    Returns:
        name -> path of what was written.
    Raises:
        RunDirError: the path is not a run dir, or is an inference run dir (nothing is written into it).
        ReportIncomplete: after writing the rest, when a part could not be made (names the package).
    """
    from trainprof.report.summary import write_summary

    run = load_run(run_dir)
    if not run.is_run:
        raise RunDirError(f"'{run.path}' is not a run dir: no profile.json, profile.rank*.json, rank*.json, "
                          f"inference.json, failure-rank*.json or recipe.yaml in it; pass a run dir written by "
                          f"{WRITERS} (runs/<run>/)")
    if run.is_inference:
        raise RunDirError(inference_run_dir_text(run))
    out: dict[str, Path] = {}
    missing: list[NotWritten] = []
    if run.profile is not None and "modules" in run.profile:  # written by the step profiler
        write_summary(run.profile, run.path)
        out["summary"] = run.path / "summary.md"
    if scalars and run.profile is not None and run.measured_steps:
        from trainprof.report.tensorboard import write_tensorboard_scalars

        try:
            out["scalars"] = write_tensorboard_scalars(run.profile, run.path)
            run = load_run(run_dir)  # the report lists the events file just written
        except ImportError:
            missing.append(NotWritten(part="TensorBoard scalars", package="tensorboard"))
    plots = importable("matplotlib")
    if not plots and run.measured_steps:  # a run that failed before its first step has nothing to plot
        missing.append(NotWritten(part="plots (report_plots/, figures in report.html)", package="matplotlib"))
    doc = build_run_report(run, trace_scan_bytes=trace_scan_bytes, plots=plots)
    for fig in doc.figures():
        path = run.path / fig.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(fig.png)
    out["md"] = run.path / "report.md"
    atomic_write_text(out["md"], render_markdown(doc))
    out["html"] = run.path / "report.html"
    atomic_write_text(out["html"], render_html(doc))
    if missing:
        raise ReportIncomplete(run.path, missing, out)
    return out


def write_run_files(profile: dict[str, Any], run_dir: str | Path) -> dict[str, Path]:
    """Everything a finished run's directory holds besides the rank files: profile.json, the CSV tables
    and summary.md, report.md / report.html and the TensorBoard scalars. A report problem is one line on
    stderr, not an exception: it must not fail a finished run, and `trainprof report` can retry.

    Returns:
        name -> path of what was written.
    """
    import sys

    from trainprof.io import atomic_write_json

    atomic_write_json(Path(run_dir) / "profile.json", profile)
    try:
        return write_reports(run_dir)
    except ReportIncomplete as err:
        print(f"trainprof: {err}", file=sys.stderr)
        return err.written
    except Exception as err:  # noqa: BLE001  the run finished; its report can be made again
        print(f"trainprof: report not written ({type(err).__name__}: {err}); run `trainprof report {run_dir}`",
              file=sys.stderr)
        return {"profile": Path(run_dir) / "profile.json"}
