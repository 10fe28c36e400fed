"""`trainprof report RUN_DIR`: report.md and a self-contained report.html of one run: run facts and
how each figure was measured, phases per step, modules, module x phase, operators, communication,
memory, FLOPs/MFU, ranks and traces. Every number comes from the run dir (profile.json and the files
beside it); what a run dir lacks is named in the report. Imports neither torch nor deepspeed.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from trainprof.analysis.trace import TraceFormatError, summarize_trace
from trainprof.io import atomic_write_text
from trainprof.report import plots
from trainprof.report.document import Details, Document, Facts, Figure, Missing, Para, Table, fmt
from trainprof.report.document import render_html, render_markdown
from trainprof.report.pipeline import pipeline_section
from trainprof.report.summary import compile_text
from trainprof.report.rundir import (RunData, load_run, module_label, module_time, recipe_of, report_phases,
                                     step_peak_memory, top_modules)

PLOTS_DIR = "report_plots"  # PNGs for report.md, beside it
TOP_MODULES = 15
TOP_OPS = 25
MiB = 2**20
TRACE_SCAN_BYTES = 32 * MiB  # traces larger than this (on disk) are listed, not read, unless asked


def _mib(x: float | None) -> float | None:
    return None if x is None else x / MiB


def _pct(x: float | None, total: float | None) -> str:
    return "n/a" if x is None or not total else f"{100 * x / total:.1f}%"


def _get(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


# -- sections ----------------------------------------------------------------------------------------

def facts_section(doc: Document, run: RunData) -> None:
    p, recipe = run.profile or {}, recipe_of(run)
    env, s = p.get("env") or {}, p.get("summary") or {}
    sec = doc.section("Run facts", id="facts")
    model, data, train = recipe.get("model") or {}, recipe.get("data") or {}, recipe.get("train") or {}
    engine, task = recipe.get("engine") or {}, recipe.get("task") or {}
    step_ms = _get(s, "step_ms", "median")
    items = [
        ("run dir", str(run.path)),
        ("profile source", run.source),
        ("model", f"{model.get('name', 'n/a')} ({model.get('dtype', '?')}, attention {model.get('attention', '?')}, "
                  f"recompute {model.get('recompute', '?')}, compile {model.get('compile', False)})"),
        ("compile", compile_text(p)),
        ("task", str(task.get("kind", "n/a"))),
        ("engine", f"{engine.get('kind', 'n/a')}, "
                   + (f"FSDP2 reshard_after_forward {engine.get('reshard_after_forward')}" if engine.get("kind") == "fsdp"
                      else f"ZeRO stage {engine.get('zero_stage', '?')}") + f", offload {engine.get('offload', '?')}"),
        ("batch", f"micro batch {train.get('micro_batch_size', '?')} x grad accum {train.get('grad_accum', '?')} x "
                  f"seq {data.get('seq_len', '?')} per rank"),
        ("steps", f"{train.get('steps', '?')} measured after {train.get('warmup_steps', '?')} warm-up; "
                  f"{s.get('steps_used', len(run.measured_steps))} used for medians "
                  f"({s.get('steps_used_description', 'all measured steps')})"),
        ("hardware", f"{env.get('device', 'n/a')} ({env.get('device_type', 'device type not recorded')}) x "
                     f"{env.get('world_size', '?')} ranks"),
        ("versions", ", ".join(f"{k} {env[k]}" for k in ("torch", "deepspeed", "transformers") if env.get(k))
         or "not recorded"),
        ("timer", f"{env.get('timer', 'n/a')}: {env.get('timer_description', 'not recorded')}"),
        ("step time (median)", f"{fmt(step_ms)} ms (min {fmt(_get(s, 'step_ms', 'min'))}, "
                               f"max {fmt(_get(s, 'step_ms', 'max'))})"),
        ("tokens/s", f"{fmt(s.get('tokens_per_s'), 0)} "
                     f"({s.get('tokens_per_s_scope') or s.get('tokens_per_s_method') or 'scope not recorded'})"),
    ]
    if s.get("achieved_tflops") is not None:
        mfu = "n/a" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%"
        items.append(("achieved TFLOP/s", f"{s['achieved_tflops']:.4g} per rank; MFU {mfu}"))
    if p.get("partial"):
        reason = f" ({p['partial_reason']})" if p.get("partial_reason") else ""
        items.append(("status", f"partial: the run did not finish every step{reason}"))
    for f in run.failures:
        items.append((f"failure on rank {f.get('rank')}", f"{f.get('kind')}: {f.get('message')}"))
    sec.blocks.append(Facts(items))
    if p.get("straggler"):
        st = p["straggler"]
        sec.blocks.append(Para(f"Straggler: rank {st['rank']} is {100 * st['slower_by_frac']:.1f}% slower "
                               f"({st.get('description', st.get('metric'))})."))
    if run.recipe_text or recipe:
        import yaml

        sec.blocks.append(Details("resolved recipe", run.recipe_text or yaml.safe_dump(recipe, sort_keys=False)))
    else:
        sec.blocks.append(Missing("recipe", "no recipe.yaml and no recipe in profile.json"))


def answer_section(doc: Document, run: RunData) -> None:
    """The answer for a decision maker first: throughput, time of a step, the bottleneck phase and
    what to change (trainprof.report.advisor); the method details follow in later sections."""
    from trainprof.report.advisor import advise, bottleneck, checks_text, overrides_text

    p = run.profile or {}
    s = p.get("summary") or {}
    sec = doc.section("The answer", id="answer")
    neck = bottleneck(p)
    sec.blocks.append(Facts([
        ("throughput", f"{fmt(s.get('tokens_per_s'), 0)} tokens/s "
                       f"({s.get('tokens_per_s_scope') or 'scope not recorded'})"),
        ("time of a step", f"{fmt(_get(s, 'step_ms', 'median'))} ms (median over "
                           f"{s.get('steps_used', len(run.measured_steps))} measured steps)"),
        ("bottleneck", f"{neck[0]}: {100 * neck[1]:.1f}% of the step (the largest median phase)" if neck
         else "n/a (no phases measured)"),
        ("closure", f"{100 * s['unattributed_frac']:.2f}% of the step unattributed"
         if s.get("unattributed_frac") is not None else "n/a"),
    ]))
    projected = run.path / "projection" / "advice.json"  # `trainprof project RUN --advice`
    result = advise(p, json.loads(projected.read_text())["advice"] if projected.is_file() else None)
    sec = doc.section("What to change", id="advice")
    if not result["advice"]:
        sec.blocks.append(Para(f"Nothing triggered. Checks: {checks_text(result['checks'])}."))
        return
    rows = [[a["title"], a["trigger"]["text"], a["trigger"]["threshold"], a["action"], a["gain"]["text"],
             overrides_text(a["overrides"]) or "-",
             f"{100 * a['predicted_gain']:+.1f}% tokens/s ({a['predicted_gain_source']})" if a["predicted_gain"] is not None
             else f"n/a: {a['predicted_gain_reason']}"]
            for a in result["advice"]]
    sec.blocks.append(Table(["advice", "measured trigger", "fires at", "what to do", "what it can gain (bound)",
                             "overrides", "predicted gain"], rows, id="advice-table", numeric=[False] * 7,
                            method="each rule reads this run's profile.json; 'what it can gain' is an upper bound derived "
                                   "from the measured figure; 'predicted gain' is the step model's projection of the "
                                   "overrides (trainprof project RUN_DIR --advice)"))


def method_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    s = p.get("summary") or {}
    sec = doc.section("How each figure was measured", id="methods")
    rows = [[k, v] for k, v in (p.get("measurement") or {}).items()]
    for key, label in (("tokens_per_s_scope", "tokens/s"), ("tokens_per_s_method", "tokens/s"),
                       ("steps_used_description", "steps used"), ("peak_memory_method", "peak memory per phase"),
                       ("memory_meter", "peak memory"), ("flops_convention", "FLOPs and MFU"),
                       ("achieved_tflops_scope", "achieved TFLOP/s")):
        if s.get(key) and all(s[key] != text for _, text in rows):
            rows.append([label, s[key]])
    if _get(s, "analytic", "formula"):
        rows.append(["analytic FLOPs cross-check", s["analytic"]["formula"]])
    if rows:
        sec.blocks.append(Table(["figure", "how it was measured"], rows, id="methods-table", numeric=[False, False]))
    else:
        sec.blocks.append(Missing("measurement methods", "profile.json has no `measurement` block (older run dir)"))


def phases_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    s = p.get("summary") or {}
    sec = doc.section("Where a step goes: phases", id="phases")
    steps = run.measured_steps
    if not steps:
        sec.blocks.append(Missing("steps", "the profile has no measured steps"))
        return
    method = _get(p, "measurement", "phases")
    if not run.has_phases:
        sec.blocks.append(Missing("phase breakdown", "this run dir predates the step profiler or ran with "
                                  "profile.enabled false: steps have wall time only (no steps[].phases_ms)"))
        sec.blocks.append(Figure(plots.step_bars(steps), "Wall time per measured step (host clock around one "
                                 "optimizer step; the slowest rank's)", f"{PLOTS_DIR}/steps.png", id="fig-steps"))
        sec.blocks.append(Table(["step", "wall ms", "loss", "tokens"],
                                [[st["step"], st.get("wall_ms"), st.get("loss"), st.get("tokens")] for st in steps],
                                id="steps-table"))
        return
    shown = report_phases(p)
    sec.blocks.append(Figure(plots.phase_bars(steps, shown),
                             "Phases per measured step on rank " + str(p.get("steps_rank", 0)) + " (ms, stacked; "
                             "together they add up to the step's wall time)", f"{PLOTS_DIR}/phases.png",
                             id="fig-phases"))
    step_ms = _get(s, "step_ms", "median")
    phases = s.get("phases_ms") or {}
    rows = [[ph, phases.get(ph), _pct(phases.get(ph), step_ms)] for ph in shown]
    rows.append(["unattributed (closure error)", s.get("unattributed_ms"), _pct(s.get("unattributed_ms"), step_ms)])
    sec.blocks.append(Table(["phase", "ms per step (median)", "share of step"], rows, method=method,
                            id="phases-table"))
    cols = ["step", "wall ms", *shown, "unattributed", "instrumented"]
    sec.blocks.append(Table(cols, [[st["step"], st["wall_ms"], *(st["phases_ms"].get(ph) for ph in shown),
                                    st.get("unattributed_ms"), ", ".join(st.get("instrumented") or []) or "-"]
                                   for st in steps], id="steps-table", method=_get(p, "measurement", "timer")))


def modules_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    modules = p.get("modules") or []
    meas = _get(p, "measurement", "module_times")
    sec = doc.section("Top modules", id="modules")
    if not modules:
        sec.blocks.append(Missing("module times", "profile.json has no modules (older run dir, or profile.enabled "
                                  "false)"))
        doc.section("Module x phase", id="module-phase").blocks.append(
            Missing("module x phase table", "no module times in this run dir"))
        return
    try:
        from trainprof.report.summary import category_rows

        cats = category_rows(p)
        step_ms = _get(p, "summary", "step_ms", "median")
        rows = []
        for r in cats:
            total = sum(v for v in (r["forward_ms"], r["backward_ms"], r["recompute_ms"], r["optimizer_ms"]) if v)
            rows.append([r["label"], "" if r["modules"] is None else (r["modules"] or "not profiled at this depth"),
                         r["forward_ms"], r["backward_ms"], r["recompute_ms"], r["optimizer_ms"], _pct(total, step_ms)])
        sec.blocks.append(Para("By part of the model (Zhang et al.'s Llama2-7B table, arXiv 2311.03687), ms per step, median"
                               + (" (summed over the pipeline stages, which run side by side: shares can add up past "
                                  "100%)" if p.get("pipeline") else "") + ":"))
        sec.blocks.append(Table(["part", "modules", "forward ms", "backward ms", "recompute ms", "optimizer ms",
                                 "share of step"], rows, method=meas, id="categories-table"))
    except (KeyError, TypeError) as err:  # a profile without the fields the category table needs
        sec.blocks.append(Missing("model-part table", f"profile.json lacks {err}"))
    top = top_modules(p, TOP_MODULES)
    if top:
        labels = [module_label(m) for m in top]
        parts = {ph: [m.get(f"self_{ph}_ms") or 0.0 for m in top] for ph in ("forward", "backward", "recompute")}
        sec.blocks.append(Figure(plots.module_bars(labels, parts, "self ms per step (median; children excluded)"),
                                 f"Top {len(top)} modules by self time, forward / backward / recompute",
                                 f"{PLOTS_DIR}/modules.png", id="fig-modules"))
        sec.blocks.append(Table(
            ["module", "type", "self fwd ms", "self bwd ms", "self recompute ms", "fwd ms (incl.)", "bwd ms (incl.)",
             "share of step"],
            [[module_label(m), m.get("type"), m.get("self_forward_ms"), m.get("self_backward_ms"),
              m.get("self_recompute_ms"), m.get("forward_ms"), m.get("backward_ms"),
              _pct(module_time(m, self_time=True), _get(p, "summary", "step_ms", "median"))] for m in top],
            method=meas, id="top-modules-table"))
    mp = doc.section("Module x phase", id="module-phase")
    cols = ["module", "type", "calls", "forward ms", "backward ms", "recompute ms", "comm ms", "comm exposed ms",
            "self fwd ms", "self bwd ms", "GFLOPs", "params"]
    rows = [["  " * m.get("depth", 0) + module_label(m), m.get("type"), m.get("calls"), m.get("forward_ms"),
             m.get("backward_ms"), m.get("recompute_ms"), m.get("comm_ms"), m.get("comm_exposed_ms"),
             m.get("self_forward_ms"), m.get("self_backward_ms"),
             None if m.get("flops") is None else m["flops"] / 1e9, m.get("params")] for m in modules]
    spread = " With several ranks each figure is the median over ranks (profile.json modules[].ranks_spread has " \
             "min/max)." if (_get(p, "env", "world_size") or 1) > 1 else ""
    mp.blocks.append(Table(cols, rows, method=(meas or "") + spread, id="module-phase-table",
                           numeric=[False, False] + [True] * 10))


def ops_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    ops, info = p.get("ops") or [], p.get("ops_info") or {}
    sec = doc.section("Operators", id="operators")
    if not ops:
        why = ("operator tracing was off (recipe profile.ops: false); turn it on to get operators and traces"
               if not info.get("enabled") else "operator tracing was on but recorded no operators")
        sec.blocks.append(Missing("operator table", why if p.get("modules") is not None else
                                  "this run dir predates the operator tracer"))
        return
    cost = info.get("cost_frac")
    sec.blocks.append(Para(f"Traced steps: {info.get('steps')}; top {min(TOP_OPS, len(ops))} of {len(ops)} "
                           f"(operator, module, phase) rows by self time, per traced step."
                           + (f" Tracing made those steps {100 * cost:.0f}% slower; they are left out of every "
                              "other figure." if cost is not None else "")))
    cuda = _get(p, "env", "device_type") == "cuda"
    sec.blocks.append(Table(
        ["operator", "module", "phase", "calls", "self ms", "GFLOPs"],
        [[o["name"], "-" if o.get("module") is None else (o["module"] or "<model>"), o.get("phase"), o.get("calls"),
          o.get("self_ms"), None if o.get("flops") is None else o["flops"] / 1e9] for o in ops[:TOP_OPS]],
        method=(info.get("mechanism", "torch.profiler") + "; self time excludes child operators and is "
                + ("CUDA kernel time" if cuda else "host time (CPU ops run synchronously)")
                + "; GFLOPs are torch.profiler's with_flops estimates (matmul/conv only, n/a where it has none)"),
        id="ops-table"))


def comm_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    comm = p.get("comm")
    sec = doc.section("Communication", id="communication")
    if not comm:
        why = ("profile.json has no comm block (older run dir)" if comm is None else
               "no collectives were recorded (a single rank, or the engine issued none the profiler can see)")
        sec.blocks.append(Missing("communication table", why))
        return
    step_ms = _get(p, "summary", "step_ms", "median")
    exposed = _get(p, "summary", "phases_ms", "comm_exposed")
    sec.blocks.append(Para(f"Exposed communication: {fmt(exposed)} ms per step "
                           f"({_pct(exposed, step_ms)} of the step)."))
    meas = p.get("measurement") or {}
    sec.blocks.append(Table(
        ["op", "phase", "group", "calls", "MiB", "total ms", "exposed ms", "algbw GB/s", "busbw GB/s"],
        [[c["op"], c["phase"], c.get("group_size"), c.get("calls"), _mib(c.get("bytes")), c.get("total_ms"),
          c.get("exposed_ms"), c.get("algbw_gbps"), c.get("busbw_gbps")] for c in comm],
        method=f"{meas.get('comm_exposed', '')}; bandwidth: {meas.get('comm_bandwidth', '')}; rank "
               f"{p.get('steps_rank', 0)}'s collectives, medians over steps", id="comm-table"))


def memory_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    s = p.get("summary") or {}
    sec = doc.section("Memory", id="memory")
    peaks = s.get("peak_memory_bytes")
    if isinstance(peaks, dict) and any(v is not None for v in peaks.values()):
        mib = {k: v / MiB for k, v in peaks.items() if v is not None}
        sec.blocks.append(Figure(plots.memory_bars(mib, "peak MiB"), "Peak memory per phase (max over measured "
                                 "steps)", f"{PLOTS_DIR}/memory.png", id="fig-memory"))
        sec.blocks.append(Table(["phase", "peak MiB"], [[k, _mib(v)] for k, v in peaks.items()],
                                method=s.get("peak_memory_method"), id="memory-table"))
    elif s.get("peak_memory_bytes_max") is not None:
        sec.blocks.append(Missing("memory per phase", "this run dir records one peak per step, not per phase"))
        sec.blocks.append(Table(["what", "peak MiB"],
                                [["whole step, max over steps", _mib(s["peak_memory_bytes_max"])]],
                                method=s.get("memory_meter"), id="memory-table"))
    else:
        per_step = [step_peak_memory(st) for st in run.measured_steps]
        if any(per_step):
            sec.blocks.append(Table(["step", *per_step[0].keys()],
                                    [[st["step"], *(_mib(v) for v in pk.values())]
                                     for st, pk in zip(run.measured_steps, per_step)], id="memory-table"))
        else:
            sec.blocks.append(Missing("memory", "no peak memory in this run dir"))
    state = p.get("model_state_bytes")
    if state:
        sec.blocks.append(Table(["model state", "MiB"], [[k, _mib(v)] for k, v in state.items()
                                                         if isinstance(v, (int, float))],
                                method=f"rank {p.get('steps_rank', 0)}: " + state.get(
                                    "method", "bytes this rank stores, each storage counted once"),
                                id="model-state-table"))


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


def ranks_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    ranks = [r for r in p.get("ranks") or [] if r.get("phases_ms")]
    if len(ranks) < 2:
        return
    sec = doc.section("Ranks", id="ranks")
    shown = report_phases(p)
    sec.blocks.append(Table(["rank", "step ms", "busy ms", *shown],
                            [[r["rank"], r.get("step_ms_median"), r.get("busy_ms_median"),
                              *(r["phases_ms"].get(ph) for ph in shown)] for r in ranks],
                            method="medians over each rank's measured steps; busy = step minus exposed communication, "
                                   "data wait and pipeline bubble (what a straggler is judged by)", id="ranks-table"))


def traces_section(doc: Document, run: RunData, scan_bytes: int = TRACE_SCAN_BYTES) -> None:
    p = run.profile or {}
    info = p.get("ops_info") or {}
    sec = doc.section("Traces and TensorBoard", id="traces")
    if not run.traces:
        sec.blocks.append(Missing("Kineto traces", "no *.pt.trace.json[.gz] under tb/ (recipe profile.ops was off, "
                                  "or the run predates tracing)"))
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
                               "Module ranges are named trainprof::<phase>::<module> (<model> = the model itself), "
                               "phase regions trainprof::<phase>."))
    if run.scalars:
        sec.blocks.append(Para("TensorBoard scalars (phases, tokens/s, TFLOP/s, memory, exposed communication per "
                               f"step) are in {', '.join(str(f.relative_to(run.path)) for f in run.scalars)}."))
    else:
        sec.blocks.append(Missing("TensorBoard scalars", "no events file under tb/; `trainprof report` writes them"))


def projection_section(doc: Document, run: RunData) -> None:
    """Measured next to projected: what `trainprof project` predicted from this run (projection/)."""
    from trainprof.projection.views import run_projection

    sec = doc.section("Projected", id="projected")
    proj = run_projection(run.path)
    if proj is None:
        sec.blocks.append(Para(f"Not projected yet: `trainprof project {run.path} --to h100-sxm,rtx4090` (or "
                               "key=value changes) predicts other hardware and settings from this run and adds them "
                               "here, beside the measurement."))
        return
    src = proj["source"]
    rows = [["measured (this run)", src["device"], src["world_size"], "none", src["step_ms"], src.get("tokens_per_s"),
             None, _mib(src.get("peak_memory_bytes")), None]]
    for p in proj["predictions"]:
        rows.append([f"projected #{p['rank']}" if p.get("rank") else "projected", p["hardware"], p["world_size"],
                     " ".join(p["overrides"]) or "none", p["step_ms"], p["tokens_per_s"], p.get("mfu"),
                     _mib(p.get("memory_per_rank_bytes")), p.get("expected_error_pct")])
    sec.blocks.append(Table(
        ["", "hardware", "GPUs", "changes", "step ms", "tokens/s", "MFU", "memory/rank MiB", "expected error %"], rows,
        method="projected by trainprof's step model from this run (projection/projection.json, which lists each "
               "prediction's assumptions); expected error: the validated step-time MAPE for that kind of change, "
               "n/a where not validated", id="projection-table"))


SECTIONS = (answer_section, facts_section, method_section, phases_section, pipeline_section, modules_section,
            ops_section, comm_section, memory_section, flops_section, ranks_section, projection_section)


def build_run_report(run: RunData, *, trace_scan_bytes: int = TRACE_SCAN_BYTES) -> Document:
    """The report of one run as a Document (render with render_markdown / render_html).

    Args:
        run: the loaded run dir.
        trace_scan_bytes: trace files up to this size on disk are read (streaming) for their ranks and
            ProfilerStep markers; larger ones are listed from profile.json alone, to keep a report fast.
    """
    p = run.profile or {}
    recipe = recipe_of(run)
    name = _get(recipe, "output", "name") or run.name
    doc = Document(f"trainprof report: {name}", subtitle=f"{run.path.name}; profile from {run.source}")
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
    return doc


def write_reports(run_dir: str | Path, *, scalars: bool = True,
                  trace_scan_bytes: int = TRACE_SCAN_BYTES) -> dict[str, Path]:
    """Write report.md (+ its PNGs under report_plots/) and report.html into the run dir, and refresh the
    TensorBoard scalars in tb/ when the run has a profile.

    Args:
        run_dir: the run directory.
        scalars: also (re)write the TensorBoard scalars.
        trace_scan_bytes: see build_run_report.
    Returns:
        name -> path of what was written.
    """
    run = load_run(run_dir)
    out: dict[str, Path] = {}
    if scalars and run.profile is not None and run.measured_steps:
        from trainprof.report.tensorboard import write_tensorboard_scalars

        out["scalars"] = write_tensorboard_scalars(run.profile, run.path)
        run = load_run(run_dir)  # the report lists the events file just written
    doc = build_run_report(run, trace_scan_bytes=trace_scan_bytes)
    for fig in doc.figures():
        path = run.path / fig.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(fig.png)
    out["md"] = run.path / "report.md"
    atomic_write_text(out["md"], render_markdown(doc))
    out["html"] = run.path / "report.html"
    atomic_write_text(out["html"], render_html(doc))
    return out
