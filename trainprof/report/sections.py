"""The sections every rendering of a run shares. summary.md, report.md / report.html and the terminal
summary at the end of a run are built from these, so each figure is worded in one place. Each builder
adds a Section to a Document from a RunData (report/rundir.py); `doc.plots` and `doc.compact` choose
figures and detail (report/document.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trainprof.analysis import records
from trainprof.analysis.diff import compiled_regions, part_members, region_of, used_steps
from trainprof.report import plots
from trainprof.report.advisor import RunFigures, advise, bottleneck, checks_text, host_bound_text, overrides_text
from trainprof.report.document import Document, Figure, Missing, Para, Table, fmt
from trainprof.report.pipeline import bubble_text
from trainprof.report.rundir import run_peak_memory
from trainprof.io import dig
from trainprof.layout import TRACES_HOW
from trainprof.recipe import DEEPSPEED_ZERO_DEFAULTS
from trainprof.report.rundir import (RunData, module_label, module_time, report_phases, step_peak_memory,
                                     top_modules, trace_size_text)

TOP_MODULES = 15
TOP_OPS = 25
MiB = 2**20
ADVICE_FILE = ("projections", "advice.json")  # `trainprof project RUN --advice`: predicted gains of the advice

# Zhang et al.'s (arXiv 2311.03687) Llama2-7B rows: (label, which modules belong to it)
CATEGORIES: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
    ("embedding", lambda m: m["type"] == "Embedding" or m["name"].endswith("embed_tokens")),
    ("decoder layers", lambda m: m["type"].endswith(("DecoderLayer", "TransformerLayer"))),  # HF | Megatron
    ("attention", lambda m: m["type"].endswith("Attention")),
    ("MLP", lambda m: m["type"].endswith("MLP")),
    ("norms", lambda m: m["type"].endswith(("RMSNorm", "LayerNorm"))),
    ("head", lambda m: m["name"].endswith("lm_head")),
]


WRAPPER_TYPE = "OptimizedModule"  # a torch.compile wrapper's type, as profiles recorded before its module's type


def names_text(names: list[str], shown: int = 3) -> str:
    """Module names for a sentence: the first `shown`, then how many more."""
    text = ", ".join(records.module_label(n) for n in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def inside_regions_text(regions: list[str]) -> str:
    """Where the time of modules inside compiled regions went: into the regions' own."""
    one = len(regions) == 1
    return f"inside compiled region{'' if one else 's'} {names_text(regions)}: timed with {'it' if one else 'them'}"


def _mib(x: float | None) -> float | None:
    return None if x is None else x / MiB


def _pct(x: float | None, total: float | None) -> str:
    return "n/a" if x is None or not total else f"{100 * x / total:.1f}%"


def _mib_text(x: float | None) -> str:
    return "n/a" if x is None else f"{x / MiB:,.1f} MiB"


# -- figures worded once -------------------------------------------------------------------------------

def model_states_text(state: dict[str, Any]) -> str:
    """Model-state bytes of one rank in words, with the share of optimizer states held quantized."""
    # no separate copy where the params themselves are the fp32 weights the optimizer updates (torch, FSDP2)
    master = f"fp32 master {_mib_text(state['master_params'])}" if state["master_params"] else "no separate fp32 master"
    text = (f"params {_mib_text(state['params'])}, grads {_mib_text(state['grads'])}, optimizer states "
            f"{_mib_text(state['optimizer_states'])}, {master}")
    elements, quantized = state.get("optimizer_state_elements"), state.get("optimizer_state_quantized_elements")
    if elements and quantized:
        text += f" ({100 * quantized / elements:.1f}% of optimizer-state elements block-quantized)"
    return text


def compile_text(profile: dict[str, Any]) -> str:
    """Whether the model ran torch.compile'd, its regions, the module granularity and dynamo's evidence."""
    c = profile.get("compile") or {}
    if not c.get("compiled"):
        return "not compiled (eager); modules timed per module"
    regions = c.get("regions") or []
    text = (f"torch.compile, {len(regions)} compiled region(s) ({names_text(regions)}); modules timed per compiled "
            f"region, {c.get('modules_inside_regions', 0)} modules inside them have no own times")
    measured = dig(c, "dynamo", "during_measured_steps") or {}
    total = dig(c, "dynamo", "total") or {}
    if total:
        text += (f"; dynamo: {total['graphs_captured']} graph(s) captured, {total['graph_breaks']} graph break(s), "
                 f"{measured.get('frames_converted', 'n/a')} frame(s) (re)compiled during measured steps")
    return text


def built_in_zero_init(profile: dict[str, Any]) -> bool:
    """Whether trainprof's DeepSpeed engine built the model inside deepspeed.zero.Init (a recipe run at ZeRO-3);
    a wrapped script's own ZeRO-3 may or may not have, so it is not claimed there."""
    engine = dig(profile, "recipe", "engine") or {}
    return engine.get("kind") == "deepspeed" and engine.get("zero_stage") == 3


def _loss_text(run: RunData) -> str:
    losses = [s["loss"] for s in run.measured_steps if s.get("loss") is not None]  # a partial run may lack some
    if not losses:
        return "n/a"
    text = f"{losses[0]:.4f} -> {losses[-1]:.4f}"
    if built_in_zero_init(run.profile or {}):
        text += (" (ZeRO-3 builds the model inside deepspeed.zero.Init, whose initial weights differ from other "
                 "engines' at the same seed: compare losses only between ZeRO-3 runs)")
    return text


def zero3_persistence_text(profile: dict[str, Any]) -> str | None:
    """Why a ZeRO-3 run's comm table shows few parameter all-gathers: small parameters stay whole on every
    rank (stage3_param_persistence_threshold); None for other runs."""
    figures = RunFigures(profile)
    if figures.zero_stage != 3:  # only DeepSpeed has a stage 3 (FSDP2 runs record zero_stage 0)
        return None
    key = "stage3_param_persistence_threshold"
    threshold = dig(figures.config, "zero_optimization", key)
    source = f"{key} in the engine's config"
    if threshold is None:
        threshold = dig(figures.recipe, "deepspeed", "zero_optimization", key)
        source = f"the recipe's deepspeed.zero_optimization.{key}"
    if threshold is None:
        threshold, source = DEEPSPEED_ZERO_DEFAULTS[key], f"DeepSpeed's default {key}; the run set none"
    return (f"ZeRO-3 keeps every parameter of at most {int(threshold):,} elements ({source}) whole on every rank: "
            "those are not all-gathered before each use, only once after each optimizer step, so a model whose layers "
            "are small (as the quickstart's tiny model's are) shows few forward and backward all-gathers; "
            "docs/memory.md has what else the threshold changes.")


def _flops_text(s: dict[str, Any]) -> str:
    if s.get("achieved_tflops") is None:
        return f"n/a ({s.get('mfu_reason') or 'no FLOP count in this run dir'})"
    if s.get("mfu") is None:
        mfu = f"MFU n/a ({s.get('mfu_reason', 'no known peak')})"
    else:
        # MFU counts model FLOPs (recompute left out) against the dense peak, so it need not be achieved / peak
        model = f"{s['model_tflops']:.4g} TFLOP/s of model FLOPs" if s.get("model_tflops") is not None else "model FLOPs"
        peak = s.get("peak") or {}
        kind = str(peak.get("key", "")).removeprefix("peak_").removesuffix("_tflops").replace("_", " ")
        mfu = (f"MFU {100 * s['mfu']:.1f}% ({model} / the {kind} peak {peak.get('tflops', 'n/a')} TFLOP/s: "
               f"{peak.get('source')})")
    scope = f" {s['flops_scope']}" if s.get("flops_scope") else ""
    text = f"{s['achieved_tflops']:.4g} per rank ({s['flops_per_step']:.3e} FLOPs per step as executed{scope}); {mfu}"
    if s.get("measured_over_analytic") is not None:
        text += f"; measured / analytic (PaLM 6N+12LHQT) {s['measured_over_analytic']:.3f}"
    elif s.get("analytic_reason"):
        text += f"; {s['analytic_reason']}"
    return text


def _peak_memory_text(s: dict[str, Any]) -> str:
    """run_peak_memory (the figure the sweep tables, the advisor and the projection read too), with its meter."""
    peak = run_peak_memory(s)
    if peak is None:
        return "n/a"
    if s.get("peak_memory_bytes_max"):
        return f"{_mib_text(peak)} ({str(s.get('memory_meter', 'meter not recorded')).split(':')[0]})"
    return f"{_mib_text(peak)} (largest phase peak; {s.get('peak_memory_method', 'method not recorded')})"


def cpu_model(env: dict[str, Any]) -> str | None:
    """A CPU run's processor model, which tells its machine apart (a CPU's device name is its architecture);
    None for a GPU run or where it was not recorded."""
    return env.get("host_cpu") if env.get("device_type") == "cpu" else None


def machine_load_text(load: dict[str, Any] | None) -> str | None:
    """One line on a run's machine load; None when not recorded."""
    if not load:
        return None
    text = f"1-minute load average {load['start']:g} at start, {load['end']:g} at end, on {load['cores']} cores"
    if load.get("busy"):
        text += ("; more runnable threads than cores (other work, or this run's own threads): its times hold the "
                 "machine's contention")
    return text


def hardware_text(env: dict[str, Any]) -> str:
    """The device a run used: name (type) x ranks, with a CPU's model beside its architecture."""
    host = f", {cpu_model(env)}" if cpu_model(env) else ""
    ranks = env.get("world_size")
    return (f"{env.get('device', 'n/a')} ({env.get('device_type', 'device type not recorded')}{host}) x "
            f"{'?' if ranks is None else ranks} rank{'' if ranks == 1 else 's'}")


def throughput_text(s: dict[str, Any]) -> str:
    """The summary's tokens/s with its scope (which ranks' tokens over which rank's median step)."""
    return (f"{fmt(s.get('tokens_per_s'), 0)} tokens/s "
            f"({s.get('tokens_per_s_scope') or s.get('tokens_per_s_method') or 'scope not recorded'})")


def headline_facts(run: RunData) -> list[tuple[str, str]]:
    """The run's answer as (label, text) pairs: throughput, step time, bottleneck, closure, FLOPs, memory
    and parameters. The report's opening, summary.md's Measurements and the terminal summary show these."""
    p = run.profile or {}
    s, env = p.get("summary") or {}, p.get("env") or {}
    neck = bottleneck(p)
    phases = {k: v for k, v in (s.get("phases_ms") or {}).items() if v}
    frac, frac_max = s.get("unattributed_frac"), s.get("unattributed_frac_max")
    facts = [
        ("throughput", throughput_text(s)),
        ("time of a step", f"{fmt(dig(s, 'step_ms', 'median'))} ms median (min {fmt(dig(s, 'step_ms', 'min'))}, "
                           f"max {fmt(dig(s, 'step_ms', 'max'))}) over {s.get('steps_used', len(run.measured_steps))} "
                           f"measured steps ({s.get('steps_used_description') or 'all measured steps'})"),
        ("bottleneck", host_bound_text(p) or (f"{neck[0]}: {100 * neck[1]:.1f}% of the step (the largest median phase)"
                                              if neck else "n/a (no phases measured)")),
        ("phases, median ms", ", ".join(f"{k} {v:.1f}" for k, v in phases.items())
         + " (each its own median over the steps used; they need not add up to the median step)" if phases
         else "profiler off"),
        ("closure", "n/a" if frac is None else f"{100 * frac:.2f}% of the step unattributed (median; max "
                                               f"{'n/a' if frac_max is None else f'{100 * frac_max:.2f}%'})"),
        ("device", f"{env.get('device', 'n/a')} x {env.get('world_size', '?')} ranks "
                   f"({env.get('timer', 'n/a')} timer)"),
        ("achieved TFLOP/s", _flops_text(s)),
        ("loss first -> last", _loss_text(run)),
        ("peak memory", _peak_memory_text(s)),
    ]
    load = env.get("machine_load") or {}
    if load.get("busy"):  # beside the figures it slowed
        facts.append(("machine load", machine_load_text(load)))
    if p.get("partial"):  # first: every figure after it stands on the steps that finished
        reason = f" ({p['partial_reason']})" if p.get("partial_reason") else ""
        facts.insert(0, ("status", f"partial: the run did not finish every step{reason}"))
    if s.get("activation_bytes") is not None:
        facts.append((f"activations (rank {p.get('steps_rank', 0)})",
                      f"{_mib_text(s['activation_bytes'])} saved for backward per micro batch"))
    if p.get("model_state_bytes"):
        facts.append((f"model states (rank {p.get('steps_rank', 0)})", model_states_text(p["model_state_bytes"])))
    if p.get("params"):
        facts.append(("params total / trainable", f"{p['params']['total']:,} / {p['params']['trainable']:,}"))
    if p.get("straggler"):
        st = p["straggler"]
        facts.append(("straggler", f"rank {st['rank']} is {100 * st['slower_by_frac']:.1f}% slower "
                                   f"({st.get('description') or st.get('metric')})"))
    if dig(p, "compile", "compiled"):
        facts.append(("compiled", compile_text(p)))
    if p.get("ops_info"):
        facts.append(("trace per step", trace_size_text(p, run.path)))
    pl = p.get("pipeline")
    if pl and "stages" in pl:
        bal = pl.get("balance") or {}
        facts.append(("pipeline bubble", bubble_text(pl)))
        facts.append(("stage imbalance", f"{100 * bal['imbalance']:.1f}% (slowest stage {bal['slowest_stage']})"
                      if bal.get("imbalance") is not None else "n/a"))
    return facts


# -- sections ------------------------------------------------------------------------------------------

def advice_result(run: RunData) -> dict[str, Any]:
    """advise() on the run, with the gains `trainprof project RUN --advice` predicted when it ran."""
    import json

    predicted = run.path.joinpath(*ADVICE_FILE)
    return advise(run.profile or {}, json.loads(predicted.read_text())["advice"] if predicted.is_file() else None)


def advice_section(doc: Document, run: RunData) -> None:
    """"What to change": each triggered rule with its measured trigger, threshold, action, gain bound and
    overrides (trainprof.report.advisor); the checks that ran when nothing triggered."""
    result = advice_result(run)
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


def methods_section(doc: Document, run: RunData) -> None:
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
    if dig(s, "analytic", "formula"):
        rows.append(["analytic FLOPs cross-check", s["analytic"]["formula"]])
    if rows:
        sec.blocks.append(Table(["figure", "how it was measured"], rows, id="methods-table", numeric=[False, False]))
    else:
        sec.blocks.append(Missing("measurement methods", "profile.json has no `measurement` block (older run dir)"))


def phases_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    s = p.get("summary") or {}
    sec = doc.section("Phases (per step, median)", id="phases")
    steps = run.measured_steps
    if not steps:
        sec.blocks.append(Missing("steps", "the profile has no measured steps"))
        return
    if not run.has_phases:
        sec.blocks.append(Missing("phase breakdown", "this run dir predates the step profiler or ran with "
                                  "profile.enabled false: steps have wall time only (no steps[].phases_ms)"))
        if doc.plots:
            sec.blocks.append(Figure(plots.step_bars(steps), "Wall time per measured step (host clock around one "
                                     "optimizer step; the slowest rank's)", f"{plots.PLOTS_DIR}/steps.png", id="fig-steps"))
        sec.blocks.append(Table(["step", "wall ms", "loss", "tokens"],
                                [[st["step"], st.get("wall_ms"), st.get("loss"), st.get("tokens")] for st in steps],
                                id="steps-table"))
        return
    shown = report_phases(p)
    if doc.plots:
        sec.blocks.append(Figure(plots.phase_bars(steps, shown),
                                 "Phases per measured step on rank " + str(p.get("steps_rank", 0)) + " (ms, stacked; "
                                 "together they add up to the step's wall time)", f"{plots.PLOTS_DIR}/phases.png",
                                 id="fig-phases"))
    step_ms = dig(s, "step_ms", "median")
    phases = s.get("phases_ms") or {}
    rows = [[ph, phases.get(ph), _pct(phases.get(ph), step_ms)] for ph in shown]
    rows.append(["unattributed (closure error)", s.get("unattributed_ms"), _pct(s.get("unattributed_ms"), step_ms)])
    parts = [phases.get(ph) for ph in shown] + [s.get("unattributed_ms")]
    total = sum(x for x in parts if x is not None) if any(x is not None for x in parts) else None
    rows.append(["sum of the rows above", total, _pct(total, step_ms)])
    medians = (f"each row is that phase's own median over the measured steps, and shares are of the median step "
               f"({step_ms:.1f} ms), so they need not add up to 100%; each step's phases add up to its wall time "
               "(the per-step table of report.md)") if step_ms else None
    sec.blocks.append(Table(["phase", "ms per step (median)", "share of step"], rows,
                            method="; ".join(x for x in (dig(p, "measurement", "phases"), medians) if x),
                            id="phases-table"))
    if doc.compact:
        return
    cols = ["step", "wall ms", *shown, "unattributed", "instrumented"]
    sec.blocks.append(Table(cols, [[st["step"], st["wall_ms"], *(st["phases_ms"].get(ph) for ph in shown),
                                    st.get("unattributed_ms"), ", ".join(st.get("instrumented") or []) or "-"]
                                   for st in steps], id="steps-table", method=dig(p, "measurement", "timer")))


def category_rows(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """The Llama2-7B table rows: per category, summed forward/backward/recompute ms per step over its outermost
    timed modules (`modules` of them); `inside`: its modules inside compiled regions, which have no own times
    (profile.json compile.modules_inside), and `regions`, the regions that timed them."""
    modules = profile["modules"]
    regions = compiled_regions(profile)
    inside_all = dig(profile, "compile", "modules_inside") or []
    inside_names = {m["name"] for m in inside_all}
    rows = []
    for label, match in CATEGORIES:
        found = part_members([*modules, *inside_all], match)
        members = [m for m in found if m["name"] not in inside_names]
        inside = [m["name"] for m in found if m["name"] in inside_names]
        row = {"label": label, "modules": len(members), "inside": inside,
               "regions": list(dict.fromkeys(region_of(n, regions) for n in inside)),
               "forward_ms": None, "backward_ms": None, "recompute_ms": None, "optimizer_ms": None}
        if members:
            row.update({ph: sum(m[ph] for m in members) for ph in ("forward_ms", "backward_ms", "recompute_ms")})
        rows.append(row)
    rows.append({"label": "optimizer", "modules": None, "inside": [], "regions": [], "forward_ms": None,
                 "backward_ms": None, "recompute_ms": None,
                 "optimizer_ms": profile["summary"]["phases_ms"]["optimizer"]})
    return rows


def _part_modules_text(row: dict[str, Any], profile: dict[str, Any]) -> str | int | None:
    """The model-part table's modules cell: how many it sums, and where the ones without own times went."""
    n, inside = row["modules"], row["inside"]
    if n is None:  # the optimizer: a phase, not modules
        return ""
    if inside:
        where = inside_regions_text(row["regions"])
        return f"{n} timed; {len(inside)} more {where}, not in this row" if n else f"{len(inside)} {where}"
    if n:
        return n
    regions = compiled_regions(profile)
    if regions and "modules_inside" not in (profile.get("compile") or {}):  # recorded before the list was kept
        one = len(regions) == 1
        return (f"none timed outside compiled region{'' if one else 's'} {names_text(regions)} (this profile does not "
                f"list the modules inside {'it' if one else 'them'}, which are timed with {'it' if one else 'them'})")
    return "not profiled at this depth"


def untyped_wrappers_text(profile: dict[str, Any]) -> str | None:
    """Rows a profile recorded as torch.compile wrappers, without their compiled module's type (before
    trainprof recorded it): no part can count them; None where there are none."""
    names = [m["name"] for m in profile.get("modules") or [] if m.get("type") == WRAPPER_TYPE]
    if not names:
        return None
    one = len(names) == 1
    return (f"{names_text(names)} {'is a torch.compile wrapper' if one else 'are torch.compile wrappers'} that this "
            "profile records without the type of the module compiled (it was written before trainprof recorded that "
            f"type), so no part counts {'it' if one else 'them'}; the top modules table has "
            f"{'its' if one else 'their'} "
            "times.")


def categories_section(doc: Document, run: RunData) -> None:
    """Zhang et al.'s Llama2-7B table: embedding, decoder layers, attention, MLP, norms, head, optimizer."""
    p = run.profile or {}
    sec = doc.section("Where a step goes, by part of the model", id="categories")
    if not p.get("modules"):
        sec.blocks.append(Missing("module times", "profile.json has no modules (older run dir, or profile.enabled "
                                  "false)"))
        return
    try:
        step_ms = dig(p, "summary", "step_ms", "median")
        rows = []
        for r in category_rows(p):
            times = [v for v in (r["forward_ms"], r["backward_ms"], r["recompute_ms"], r["optimizer_ms"])
                     if v is not None]
            rows.append([r["label"], _part_modules_text(r, p), r["forward_ms"], r["backward_ms"], r["recompute_ms"],
                         r["optimizer_ms"], _pct(sum(times) if times else None, step_ms)])
    except (KeyError, TypeError) as err:  # a profile without the fields the category table needs
        sec.blocks.append(Missing("model-part table", f"profile.json lacks {err}"))
        return
    sec.blocks.append(Para("By part of the model (Zhang et al.'s Llama2-7B table, arXiv 2311.03687), ms per step, median"
                           + (" (summed over the pipeline stages, which run side by side: shares can add up past "
                              "100%)" if p.get("pipeline") else "")
                           + "; attention, MLP and norms are inside the decoder layers (the final norm aside), so "
                             "their rows are part of that row's and the shares are not meant to add up:"))
    sec.blocks.append(Table(["part", "modules", "forward ms", "backward ms", "recompute ms", "optimizer ms",
                             "share of step"], rows, method=dig(p, "measurement", "module_times"),
                            id="categories-table"))
    untyped = untyped_wrappers_text(p)
    if untyped:
        sec.blocks.append(Para(untyped))


def top_modules_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    top = top_modules(p, TOP_MODULES)
    if not top:
        return
    sec = doc.section("Top modules", id="modules")
    labels = [module_label(m) for m in top]
    if doc.plots:
        parts = {ph: [m.get(f"self_{ph}_ms") or 0.0 for m in top] for ph in ("forward", "backward", "recompute")}
        sec.blocks.append(Figure(plots.module_bars(labels, parts, "self ms per step (median; children excluded)"),
                                 f"Top {len(top)} modules by self time, forward / backward / recompute",
                                 f"{plots.PLOTS_DIR}/modules.png", id="fig-modules"))
    step_ms = dig(p, "summary", "step_ms", "median")
    sec.blocks.append(Table(
        ["module", "type", "self fwd ms", "self bwd ms", "self recompute ms", "fwd ms (incl.)", "bwd ms (incl.)",
         "share of step"],
        [[label, m.get("type"), m.get("self_forward_ms"), m.get("self_backward_ms"), m.get("self_recompute_ms"),
          m.get("forward_ms"), m.get("backward_ms"), _pct(module_time(m, self_time=True), step_ms)]
         for label, m in zip(labels, top)],
        method=dig(p, "measurement", "module_times"), id="top-modules-table"))


def module_phase_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    modules = p.get("modules") or []
    sec = doc.section("Module x phase", id="module-phase")
    if not modules:
        sec.blocks.append(Missing("module x phase table", "no module times in this run dir"))
        return
    cols = ["module", "type", "calls", "forward ms", "backward ms", "recompute ms", "comm ms", "comm exposed ms",
            "self fwd ms", "self bwd ms", "GFLOPs", "params"]
    rows = [["  " * m.get("depth", 0) + module_label(m), m.get("type"), m.get("calls"), m.get("forward_ms"),
             m.get("backward_ms"), m.get("recompute_ms"), m.get("comm_ms"), m.get("comm_exposed_ms"),
             m.get("self_forward_ms"), m.get("self_backward_ms"),
             None if m.get("flops") is None else m["flops"] / 1e9, m.get("params")] for m in modules]
    spread = " With several ranks each figure is the median over ranks (profile.json modules[].ranks_spread has " \
             "min/max)." if (dig(p, "env", "world_size") or 1) > 1 else ""
    sec.blocks.append(Table(cols, rows, method=(dig(p, "measurement", "module_times") or "") + spread,
                            id="module-phase-table", numeric=[False, False] + [True] * 10))


# fewer traced or untraced steps than this a side, and a difference between them is not told from noise
MIN_STEPS_A_SIDE = 3


@dataclass(slots=True, kw_only=True)
class TracingCost:
    """What operator tracing did to the traced steps: `cost` is ops_info.cost_frac (median traced step /
    median untraced step - 1); `verdict` is "few steps", "busy machine", "slower" or "faster" (every traced
    step beyond the untraced range) or "overlap"; `busy` says how the run recorded its machine as busy."""
    cost: float
    traced_ms: list[float]
    untraced_ms: list[float]
    verdict: str
    busy: str | None = None


def busy_machine_text(env: dict[str, Any]) -> str | None:
    """How the run recorded its machine as contended (env.machine_load busy, env.oversubscribed); None if not."""
    load, over = env.get("machine_load") or {}, env.get("oversubscribed")
    if load.get("busy"):
        return f"1-minute load average {load['start']:g} to {load['end']:g} on {load['cores']} cores"
    if over:
        return f"{over['threads']} threads on {over['cores']} cores"
    return None


def tracing_cost(profile: dict[str, Any]) -> TracingCost | None:
    """Judge ops_info.cost_frac from the steps themselves (the medians' rank): slower and faster by the same
    rule, a real difference only when every traced step lies beyond the untraced steps' range, there are
    enough steps a side, and the machine was not recorded as busy. None when tracing recorded no cost."""
    cost = (profile.get("ops_info") or {}).get("cost_frac")
    if cost is None:
        return None
    measured = [s for s in profile.get("steps") or [] if not s.get("warmup") and s.get("wall_ms") is not None]
    traced = [s["wall_ms"] for s in measured if "ops" in (s.get("instrumented") or [])]
    untraced = [s["wall_ms"] for s in measured if not s.get("instrumented")]
    busy = busy_machine_text(profile.get("env") or {})
    if min(len(traced), len(untraced)) < MIN_STEPS_A_SIDE:
        verdict = "few steps"
    elif busy:
        verdict = "busy machine"
    elif min(traced) > max(untraced):
        verdict = "slower"
    elif max(traced) < min(untraced):
        verdict = "faster"
    else:
        verdict = "overlap"
    return TracingCost(cost=cost, traced_ms=traced, untraced_ms=untraced, verdict=verdict, busy=busy)


def _ms_list(values: list[float]) -> str:
    return ", ".join(f"{v:,.1f}" for v in values) + " ms" if values else "none"


def tracing_cost_text(tc: TracingCost) -> str:
    """The Operators section's sentence on what tracing cost, with the step times it is judged from."""
    if round(100 * tc.cost) == 0:
        change = "as fast as"
    else:
        change = f"{100 * abs(tc.cost):.0f}% {'slower' if tc.cost > 0 else 'faster'} than"
    figures = f"traced steps {_ms_list(tc.traced_ms)}; untraced {_ms_list(tc.untraced_ms)}"
    text = (f"Traced steps ran {change} the median untraced step (median traced step / median of the steps the "
            f"medians use - 1; {figures})")
    if tc.verdict == "few steps":
        busy = f", on a busy machine ({tc.busy})," if tc.busy else ""
        short = [f"profile.ops_steps {MIN_STEPS_A_SIDE}"] if len(tc.traced_ms) < MIN_STEPS_A_SIDE else []
        if len(tc.untraced_ms) < MIN_STEPS_A_SIDE:
            short.append(f"{MIN_STEPS_A_SIDE - len(tc.untraced_ms)} more train.steps")
        return (f"{text}: with {len(tc.traced_ms)} traced and {len(tc.untraced_ms)} untraced steps (under "
                f"{MIN_STEPS_A_SIDE} a side){busy} the difference cannot be told from noise ({' and '.join(short)}"
                f"{' on a quiet machine' if tc.busy else ''} would let it be judged).")
    if tc.verdict == "busy machine":
        return f"{text}: the machine was busy ({tc.busy}), so the difference cannot be told from noise."
    if tc.verdict == "slower":
        return f"{text}: every traced step was slower than every untraced step, the cost of tracing."
    if tc.verdict == "faster":
        return (f"{text}: every traced step was faster than every untraced step; tracing only adds work, so "
                "something else about these steps differed.")
    return f"{text}: the traced steps fall within the untraced steps' range, no cost of tracing shows."


def calls_cell(calls: float | None) -> int | str | None:
    """Calls per traced step: an integer as one, a mean over traced steps that is not one to one decimal."""
    if calls is None:
        return None
    return int(calls) if float(calls).is_integer() else f"{calls:.1f}"


def flops_note(profile: dict[str, Any]) -> str:
    """What the GFLOPs column holds, and how to fill it where shapes were not recorded (FLOPs need them)."""
    text = "GFLOPs are torch.profiler's with_flops estimates (matmul/conv only, n/a for other operators)"
    if (profile.get("ops_info") or {}).get("record_shapes") is False:
        knob = "profile.record_shapes=true" if profile.get("recipe") else "record_shapes=True on the profiler"
        text = (f"GFLOPs are n/a: operator shapes were not recorded, and torch.profiler's with_flops estimates "
                f"(matmul/conv only) need them; set {knob} to get them")
    return text


def ops_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    ops, info = p.get("ops") or [], p.get("ops_info") or {}
    sec = doc.section("Operators", id="operators")
    if not ops:
        why = (f"operator tracing was off; turn it on to get operators and traces: {TRACES_HOW}"
               if not info.get("enabled") else "operator tracing was on but recorded no operators")
        sec.blocks.append(Missing("operator table", why if p.get("modules") is not None else
                                  "this run dir predates the operator tracer"))
        return
    cost = tracing_cost(p)
    sec.blocks.append(Para(f"Traced steps: {info.get('steps')}; top {min(TOP_OPS, len(ops))} of {len(ops)} "
                           f"(operator, module, phase) rows by self time, per traced step."
                           + (f" {tracing_cost_text(cost)} They are left out of every other figure."
                              if cost is not None else "")))
    cuda = dig(p, "env", "device_type") == "cuda"
    sec.blocks.append(Table(
        ["operator", "module", "phase", "calls", "self ms", "GFLOPs"],
        [[o["name"], "-" if o.get("module") is None else records.module_label(o["module"]), o.get("phase"),
          calls_cell(o.get("calls")), o.get("self_ms"), None if o.get("flops") is None else o["flops"] / 1e9]
         for o in ops[:TOP_OPS]],
        method=(info.get("mechanism", "torch.profiler") + "; calls and self time are per traced step (a mean over "
                "the traced steps); self time excludes child operators and is "
                + ("CUDA kernel time" if cuda else "host time (CPU ops run synchronously)") + "; " + flops_note(p)),
        id="ops-table", numeric=[False, False, False, True, True, True]))


ISSUE_TO_COMPLETION = ("issue-to-completion: from the call that issued the collective until it completed, "
                       "including time it ran behind compute and time spent waiting for slower ranks; several "
                       "collectives in flight at once each count their whole span, so this column can add up past "
                       "the step time. Only the exposed time is part of the step's comm_exposed phase")


def pipeline_comm_text(p: dict[str, Any]) -> str:
    """On a pipeline: where the point-to-point rows' exposed time and the stages' drain went (pipeline_bubble),
    so that those rows and the exposed-communication figure above them agree; "" off pipelines."""
    pl = p.get("pipeline")
    if not pl:
        return ""
    p2p = sum(c.get("exposed_ms") or 0.0 for c in p.get("comm") or [] if c.get("peer") is not None)
    text = (f" The isend / irecv rows (transfers with a neighbouring stage, {fmt(p2p)} ms per step exposed) are "
            "time spent waiting for that stage: they are counted in the pipeline_bubble phase "
            f"({fmt(dig(p, 'summary', 'phases_ms', 'pipeline_bubble'))} ms per step), not in the exposed "
            "communication above; their share of the step is that of the bubble.")
    drains = [f"stage {st['stage']} {fmt(st['drain_ms'])} ms in {', '.join(st.get('drain_in') or ['a collective'])}"
              for st in pl.get("stages") or [] if st.get("drain_ms")]
    if drains:
        text += (" A collective's wait while another stage was still in its schedule is the pipeline draining, "
                 f"also counted as bubble (see Pipeline stages): {'; '.join(drains)} per step (median).")
    return text


def comm_section(doc: Document, run: RunData) -> None:
    """The collectives, exposed time (what the step waited for) first; issue-to-completion after it, said
    what it is where it is shown."""
    p = run.profile or {}
    comm = p.get("comm")
    sec = doc.section("Communication", id="communication")
    if not comm:
        why = ("profile.json has no comm block (older run dir)" if comm is None else
               "no collectives were recorded (a single rank, or the engine issued none the profiler can see)")
        sec.blocks.append(Missing("communication table", why))
        return
    step_ms = dig(p, "summary", "step_ms", "median")
    exposed = dig(p, "summary", "phases_ms", "comm_exposed")
    meas = p.get("measurement") or {}
    ddp = f" {meas['comm_exposed_ddp']}." if meas.get("comm_exposed_ddp") else ""
    persistence = zero3_persistence_text(p)
    sec.blocks.append(Para(f"Exposed communication: {fmt(exposed)} ms per step "
                           f"({_pct(exposed, step_ms)} of the step).{ddp}" + (f" {persistence}" if persistence else "")
                           + pipeline_comm_text(p)))
    sec.blocks.append(Table(
        ["op", "phase", "group", "calls", "exposed ms", "share of step", "MiB", "issue-to-completion ms",
         "algbw GB/s", "busbw GB/s"],
        [[c["op"], c["phase"], c.get("group_size"), c.get("calls"), c.get("exposed_ms"),
          _pct(c.get("exposed_ms"), step_ms), _mib(c.get("bytes")), c.get("total_ms"), c.get("algbw_gbps"),
          c.get("busbw_gbps")] for c in comm],
        method=f"exposed: {meas.get('comm_exposed', 'not recorded')}; {ISSUE_TO_COMPLETION}; bandwidth: "
               f"{meas.get('comm_bandwidth', 'not recorded')}; rank {p.get('steps_rank', 0)}'s collectives, medians "
               "over steps", id="comm-table"))
    used = len(used_steps(p))
    rare = [f"{c['op']} ({c['phase']}) in {c['steps']}" for c in comm if (c.get("steps") or used) < used]
    if rare:
        sec.blocks.append(Para(f"Not run in every step: {', '.join(rare)} of the {used} steps used; a row's medians "
                               "count a step that ran none as 0, so a one-off collective reads 0 calls and 0 ms."))


def memory_section(doc: Document, run: RunData) -> None:
    p = run.profile or {}
    s = p.get("summary") or {}
    sec = doc.section("Memory", id="memory")
    peaks = s.get("peak_memory_bytes")
    if isinstance(peaks, dict) and any(v is not None for v in peaks.values()):
        if doc.plots:
            mib = {k: v / MiB for k, v in peaks.items() if v is not None}
            sec.blocks.append(Figure(plots.memory_bars(mib, "peak MiB"), "Peak memory per phase (max over measured "
                                     "steps)", f"{plots.PLOTS_DIR}/memory.png", id="fig-memory"))
        sec.blocks.append(Table(["phase", "peak MiB"], [[k, _mib(v)] for k, v in peaks.items()],
                                method=s.get("peak_memory_method"), id="memory-table"))
        if dig(p, "env", "host_allocator", "mode") == "cache" and dig(p, "env", "device_type") == "cpu":
            sec.blocks.append(Para("Under train.cpu_allocator: cache the process keeps the memory it frees, so each "
                                   "phase's peak starts from the heap the earlier phases left: the per-phase peaks "
                                   "barely differ. What a micro batch keeps for backward is the activations line."))
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
    if "activation_bytes" in s:
        sec.blocks.append(Para(f"Activations saved for backward: {_mib_text(s['activation_bytes'])} per micro batch ("
                               f"{s.get('activation_bytes_method') or s.get('activation_bytes_reason')})."))
    state = p.get("model_state_bytes")
    if state:
        rank = p.get("steps_rank", 0)
        sec.blocks.append(Para(f"Model states on rank {rank}: {model_states_text(state)}."))
        sec.blocks.append(Table(["model state", "MiB"], [[k, _mib(v)] for k, v in state.items()  # bytes only
                                                         if isinstance(v, (int, float)) and not k.endswith("_elements")],
                                method=f"rank {rank}: " + state.get(
                                    "method", "bytes this rank stores, each storage counted once"),
                                id="model-state-table"))


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
