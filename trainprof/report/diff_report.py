"""`trainprof diff RUN_A RUN_B`: the diff as a Document (Markdown / HTML) and as one CSV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.analysis.diff import (DEFAULT_BAND, DEFAULT_INFER_MIN_MS, DEFAULT_MIN_MS, GPU_MIN_BAND,
                                    MODULES_NOT_JUDGED_WHY, NOISE_SAFETY, CommDiffRow, DiffRow, ProfileDiff,
                                    PartLeftOut, compiled_regions, diff_inference, diff_profiles, region_of)
from trainprof.errors import UserError
from trainprof.analysis.records import module_label
from trainprof.io import atomic_write_text, dig
from trainprof.report import plots
from trainprof.report.document import Document, Facts, Figure, Missing, Para, Table, fmt, render_csv, render_html
from trainprof.report.document import render_markdown
from trainprof.report.rundir import RunData, RunDirError, load_run, run_peak_memory
from trainprof.report.sections import (ISSUE_TO_COMPLETION, cpu_model, hardware_text, machine_load_text, names_text,
                                       throughput_text, untyped_wrappers_text)

FORMATS = ("md", "html", "csv")
CSV_COLUMNS = ["kind", "name", "phase", "a_ms", "b_ms", "change", "faster_by", "speedup", "verdict", "spread_a",
               "spread_b", "stat", "noise_band", "step_noise_ms", "noise_spread"]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:+.1f}%"


def _method(d: ProfileDiff, a: dict[str, Any], b: dict[str, Any]) -> str:
    stat = ("medians over each run's measured steps without FLOP counting or operator tracing (modules: median "
            "over ranks)" if d.stat == "median" else
            "the fastest measured step of each row (rank 0's per-step series)")
    timers = {x.get("env", {}).get("timer_description") or x.get("env", {}).get("timer") for x in (a, b)} - {None}
    return (f"ms per optimizer step, {stat}; change = B/A - 1, faster by = (A-B)/A, speedup = A/B; B is faster "
            f"when B < A/{1 + d.band:.2f} and slower when B > A*{1 + d.band:.2f} (noise band {_band_text(d)}); rows "
            f"under {d.min_ms} ms in both runs are too small to judge; spread = interquartile range / median of "
            f"the per-step values; a row whose change is within {NOISE_SAFETY}x its wider spread is within noise "
            f"whatever the band, its verdict naming that spread; {_step_noise_text(d)}; timer: "
            f"{'; '.join(sorted(timers)) or 'not recorded'}")


def _step_noise_text(d: ProfileDiff) -> str:
    """The step's-noise rule in one sentence, with its figure and where that came from."""
    if d.step_noise_ms is None:
        return ("no row is judged against the step's noise: " + ("the band holds each row's own noise, from repeats"
                if d.band_source == "repeat" else "the band was given" if d.band_source == "given" else
                "a step time is missing"))
    if d.step_spread:
        source = (f"{NOISE_SAFETY}x its wider step-to-step spread ("
                  + ", ".join(f"{side} {100 * x:.1f}%" for side, x in sorted(d.step_spread.items())) + ")")
    else:
        source = "the noise band (neither a repeat nor a step spread measured the step's own)"
    return (f"a row that changed by fewer ms than the step's noise ({fmt(d.step_noise_ms)} ms: the faster step x "
            f"{source}) is within noise whatever its ratio: time the machine takes from a step can land in any one "
            "row")


def verdict_text(row: DiffRow) -> str:
    """The verdict, naming the row's own spread, or the step's noise, where that, not the run's band, made it
    noise."""
    if row.noise_spread is not None:
        return f"{row.verdict} (row spread {100 * row.noise_spread:.0f}%)"
    if row.step_noise_ms is not None:
        return f"{row.verdict} (the step's noise: {fmt(row.step_noise_ms)} ms)"
    return row.verdict


def _band_text(d: ProfileDiff) -> str:
    if d.band_source == "repeat":
        noise = sorted(d.repeat_noise.items())
        if len(noise) == 1:
            return (f"{100 * d.band:.0f}%: {NOISE_SAFETY}x the largest difference, {100 * noise[0][1]:.0f}%, between "
                    f"{noise[0][0]} and its repeat")
        return (f"{100 * d.band:.0f}%: {NOISE_SAFETY}x the wider of each run's largest difference from its repeat ("
                + ", ".join(f"{side} {100 * x:.0f}%" for side, x in noise) + ")")
    if d.band_source == "given":
        return f"{100 * d.band:.0f}%, given with --noise"
    if d.band_source == "spread":
        spreads = ", ".join(f"{side} {100 * x:.1f}%" for side, x in sorted(d.step_spread.items()))
        return (f"{100 * d.band:.0f}%: {NOISE_SAFETY}x the wider step-time spread (interquartile range / median) of "
                f"the two GPU runs ({spreads}), at least {100 * GPU_MIN_BAND:.0f}%; the "
                f"{100 * DEFAULT_BAND[d.stat]:.0f}% default was measured on CPU runs (docs/reports.md); --repeat "
                "measures it instead")
    where = ("identical runs of a tiny model on a shared 2-core CPU machine (docs/reports.md); --repeat measures "
             "it for these runs")
    if d.stat == "p50":
        return f"{100 * d.band:.0f}%, the default for inference latencies, measured on {where}"
    if d.band_source == "widened":
        whose = "their steps vary" if len(d.step_spread) == 2 else f"{next(iter(d.step_spread))}'s steps vary"
        return (f"{100 * d.band:.0f}%: the {100 * DEFAULT_BAND[d.stat]:.0f}% default for --stat {d.stat} widened to "
                f"{NOISE_SAFETY}x {_spread_whose(d)}: {whose} more than the identical runs the default was measured "
                "on (docs/reports.md), so a change inside that is not told from noise; --repeat measures the band "
                "instead")
    if len(d.step_spread) == 2:
        spreads = ", ".join(f"{side} {100 * x:.0f}%" for side, x in sorted(d.step_spread.items()))
        within = f" (the runs' step-time spreads, {spreads}, x{NOISE_SAFETY} fit inside it)"
    else:
        within = f" ({_spread_whose(d)}, x{NOISE_SAFETY}, fits inside it)" if d.step_spread else ""
    return f"{100 * d.band:.0f}%, the default for --stat {d.stat}, measured on {where}{within}"


def _spread_whose(d: ProfileDiff) -> str:
    """The step-time spread the band was widened to (or that fits inside it), with its figures: the wider of both
    runs', or that of the one run with enough steps for one, the other named."""
    spreads = ", ".join(f"{side} {100 * x:.0f}%" for side, x in sorted(d.step_spread.items()))
    if len(d.step_spread) == 2:
        return f"the wider step-time spread (interquartile range / median) of these runs ({spreads})"
    side, spread = next(iter(d.step_spread.items()))
    other = "B" if side == "A" else "A"
    n = d.used.get(other, 0)
    return (f"{side}'s step-time spread (interquartile range / median), {100 * spread:.0f}% ({other} has {n} used "
            f"step{'s' * (n != 1)}, too few for one: under 4)")


def repeat_warning(side: str, changes: list[tuple[str, Any, Any]]) -> str:
    """What a repeat of another recipe does to the noise band, naming the keys."""
    keys = ", ".join(f"{k}: {va} -> {vb}" for k, va, vb in changes[:4]) + (", ..." if len(changes) > 4 else "")
    return (f"The repeat of {side} is not {side}'s recipe ({keys}): the noise band measured from it holds that "
            "change as well as the noise")


def _table(rows, method: str, id: str, name_header: str, phase_header: str = "phase") -> Table:
    return Table([name_header, phase_header, "A ms", "B ms", "change", "faster by", "speedup", "verdict", "spread A",
                  "spread B"],
                 [[module_label(r.name), r.phase, r.a_ms, r.b_ms, _pct(r.change), _pct(r.faster_by),
                   None if r.speedup is None else f"{r.speedup:.2f}x", verdict_text(r),
                   None if r.spread_a is None else f"{100 * r.spread_a:.0f}%",
                   None if r.spread_b is None else f"{100 * r.spread_b:.0f}%"] for r in rows],
                 method=method, id=id, numeric=[False, False, True, True, True, True, True, False, True, True])


def _training_side(run: RunData) -> str:
    """Where a training run ran and how fast, worded as its run report words them: the summary's tokens/s
    and median step (the slowest rank's beside rank 0's when there are several)."""
    p = run.profile or {}
    s, env = p.get("summary") or {}, p.get("env") or {}
    median, slowest = dig(s, "step_ms", "median"), dig(s, "across_ranks", "step_ms_median", "max")
    step = f"median step {fmt(median)} ms"
    if (env.get("world_size") or 1) > 1 and slowest is not None:
        step = f"median step {fmt(slowest)} ms on the slowest rank ({fmt(median)} ms on rank {p.get('steps_rank', 0)})"
    return (f"{hardware_text(env)}; {throughput_text(s)}; {step}, wall time of an optimizer step over "
            f"{s.get('steps_used', len(run.measured_steps))} measured steps "
            f"({s.get('steps_used_description') or 'all measured steps'}; {env.get('timer', 'timer not recorded')} timer)")


def _machine(env: dict[str, Any]) -> str:
    """What tells two runs' hardware apart: the device's name, and for a CPU (named by its architecture) the
    host's model."""
    device = str(env.get("device") or "device not recorded")
    return f"{device} ({cpu_model(env)})" if cpu_model(env) else device


def _hardware_note(env_a: dict[str, Any], env_b: dict[str, Any]) -> str | None:
    """A warning when A and B ran on different machines or rank counts: every change then holds that too."""
    if _machine(env_a) != _machine(env_b):
        return (f"A and B ran on different machines ({_machine(env_a)} vs {_machine(env_b)}): each change below "
                "mixes the hardware with any difference in settings.")
    busy = [side for side, env in (("A", env_a), ("B", env_b)) if (env.get("machine_load") or {}).get("busy")]
    if busy:
        loads = "; ".join(f"{side}: {machine_load_text(env.get('machine_load'))}" for side, env in
                          (("A", env_a), ("B", env_b)) if env.get("machine_load"))
        return (f"{' and '.join(busy)} ran on a machine with more runnable threads than cores ({loads}): a change "
                "below can be the machine's load rather than the settings; repeat on a quiet machine or with --repeat.")
    if env_a.get("world_size") != env_b.get("world_size"):
        return (f"A and B ran on different rank counts ({env_a.get('world_size', '?')} vs "
                f"{env_b.get('world_size', '?')}): each change below holds that as well as any recipe change.")
    return None


FEW_STEPS = 3  # fewer measured steps than this: no spread to tell a change from one slow step


def _value(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def workload_warning(changes: list[tuple[str, Any, Any]], training: bool = False) -> str:
    """What settings that change the work measured do to the verdicts, naming them: inference settings (work per
    request), or a training run's tokens per step (work per step)."""
    keys = "; ".join(f"{k}: {_value(va)} -> {_value(vb)}" for k, va, vb in changes)
    if training:
        return (f"A and B do different work per step ({keys}): each step and phase time covers different work, so "
                "faster and slower below say as much about that as about the code or the machine; compare their "
                "tokens/s above.")
    return (f"A and B measured different workloads ({keys}): each latency compares different work per request, so "
            "faster and slower below say as much about the settings as about the model or the machine.")


WORKLOAD_WHAT = ("the recipe keys that trainprof wrap, the callbacks and trainprof.Profiler read from the model and "
                 "the training loop")
SETTINGS_WHAT = {"recipe": "its recipe", "workload": f"its workload ({WORKLOAD_WHAT})",
                 "none": "neither a recipe nor a workload (an older run dir)"}


def _settings_origin(a: str, b: str) -> str:
    """Where the compared settings come from when it is not two recipes."""
    if a == b == "workload":
        return f"A and B record workloads ({WORKLOAD_WHAT}), not recipes"
    if a == b == "none":
        return "Neither A nor B records a recipe or a workload (older run dirs)"
    return f"A records {SETTINGS_WHAT[a]}, B {SETTINGS_WHAT[b]}"


def _settings_blocks(d: ProfileDiff, hardware: str | None) -> list[Any]:
    """The settings that differ (a table), or that they are the same, or that the runs do not record enough
    to say; where they came from when it was not two recipes."""
    origin = d.settings_from
    both_recipes = origin["A"] == origin["B"] == "recipe"
    blocks: list[Any] = []
    if not both_recipes:
        if not d.settings_compared:
            return [Para(f"{_settings_origin(origin['A'], origin['B'])}: whether they were set up alike is not "
                         "known, so any difference below may come from a setting as well as noise or the machine.")]
        blocks.append(Para(f"{_settings_origin(origin['A'], origin['B'])}: compared on the "
                           f"{len(d.settings_compared)} keys both record ({_key_groups(d.settings_compared)})."))
        for side, unknown in sorted(d.settings_unknown.items()):
            blocks.append(Para(f"{side}'s workload could not read, or took a guess at: "
                               + "; ".join(f"{k} ({why})" for k, why in sorted(unknown.items())) + "."))
    if d.recipe_changes:
        blocks.append(Table(["recipe key", "A", "B"], [[k, str(va), str(vb)] for k, va, vb in d.recipe_changes],
                            id="recipe-changes", numeric=[False, False, False]))
        return blocks
    same = "The two recipes are the same (apart from output.*)" if both_recipes else "These keys are the same"
    blocks.append(Para(f"{same}: differences are " + ("what the warning above names, and noise." if hardware else
                                                        "noise or the machine.")))
    return blocks


def _key_groups(keys: list[str]) -> str:
    groups: dict[str, None] = {}
    for k in keys:
        groups.setdefault(k.split(".")[0] + ".*" if "." in k else k)
    return ", ".join(groups)


def _runs_section(doc: Document, paths: tuple[Path | None, ...], d: ProfileDiff, statistic: str,
                  sides: tuple[str, str], envs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The compared run dirs (A, B, then the repeats of A and B where given), where A and B ran (`sides`),
    the statistic, the noise band, what changed between the machines and the recipes, and notes."""
    sec = doc.section("Runs", id="runs")
    facts = [(label, str(path)) for label, path in zip(("A", "B", "repeat of A", "repeat of B"), paths)
             if path is not None]
    facts += [("A ran on", sides[0]), ("B ran on", sides[1]), ("statistic", statistic),
              ("noise band", _band_text(d) + (f"; rows under {d.min_ms} ms not judged" if d.min_ms else ""))]
    sec.blocks.append(Facts(facts))
    hardware = _hardware_note(*envs)
    if hardware:
        sec.blocks.append(Para(f"Warning: {hardware}"))
    if d.workload_changes:
        sec.blocks.append(Para(f"Warning: {workload_warning(d.workload_changes, training=d.stat != 'p50')}"))
    few = {side: n for side, n in d.used.items() if n < FEW_STEPS}
    if few and d.band_source not in ("repeat", "given"):
        sides = " and ".join(f"{side} {n} measured step{'s' * (n != 1)}" for side, n in few.items())
        sec.blocks.append(Para(f"Warning: {sides}: each verdict stands on so few samples that the band, not measured "
                               "on these runs, cannot tell a change from a slow spell; run more steps (train.steps) "
                               "or give --repeat."))
    for side, changes in d.repeat_changes.items():
        sec.blocks.append(Para(f"Warning: {repeat_warning(side, changes)}."))
    sec.blocks.extend(_settings_blocks(d, hardware))
    for note in d.notes:
        sec.blocks.append(Missing(note.split(":")[0], note.split(":", 1)[1].strip()))


def build_diff_document(run_a: RunData, run_b: RunData, d: ProfileDiff, *repeats: RunData | None,
                        plots: bool = True) -> Document:
    """The diff of two training run dirs; `repeats`: the repeats of A and of B (None where not given); `plots`
    False leaves the figure out (no file will hold it)."""
    a, b = run_a.profile or {}, run_b.profile or {}
    doc = Document("trainprof diff", subtitle=f"A = {run_a.path.name}, B = {run_b.path.name}", plots=plots)
    _runs_section(doc, (run_a.path, run_b.path, *(r.path if r else None for r in repeats)), d, d.stat,
                  (_training_side(run_a), _training_side(run_b)), (a.get("env") or {}, b.get("env") or {}))
    method = _method(d, a, b)
    sec = doc.section("Step and phases", id="phases")
    if d.phases and d.steps:
        sec.blocks.append(Para(_phases_sum_text(d)))
    sec.blocks.append(_table([*d.steps, *d.phases], method, "phase-diff", "figure"))
    _comm_section(doc, d, a, b)
    _memory_section(doc, a, b)
    regions = (compiled_regions(a), compiled_regions(b))
    if d.parts or d.parts_left_out:
        sec = doc.section("Model parts (Zhang et al.'s (arXiv 2311.03687) table)", id="parts")
        if any(regions):
            sec.blocks.append(Para(" ".join(f"{side} ran torch.compile'd: modules inside its compiled regions "
                                            f"({names_text(rs)}) have no own times, so each part compares the "
                                            "modules timed in both runs."
                                            for side, rs in zip("AB", regions) if rs)))
        parts_method = (f"{method}; a part whose modules are each under {d.min_ms} ms is too small too, whatever their "
                        "sum (per-call effects such as hook cost add up in it)")
        if d.parts:
            sec.blocks.append(_table(d.parts, parts_method, "part-diff", "part"))
        notes = [_part_left_out_text(g) for g in d.parts_left_out]
        notes += [f"{side}: {text}" for side, p in zip("AB", (a, b)) if (text := untyped_wrappers_text(p))]
        if notes:
            sec.blocks.append(Para(" ".join(f"{n}." if not n.endswith(".") else n for n in notes)))
    _modules_section(doc, d, method, regions=regions)
    return doc


def _per_side(texts: list[str]) -> str:
    """How A and B measured a figure: once where alike, else each side's, said to differ."""
    return texts[0] if texts[0] == texts[1] else f"A {texts[0]}; B {texts[1]} (not alike)"


def _comm_where(row: CommDiffRow, recorded: dict[str, bool]) -> str:
    if row.a is not None and row.b is not None:
        return "both"
    side, other = ("A", "B") if row.b is None else ("B", "A")
    return f"only in {side}" if recorded.get(other) else f"{side} ({other} has no comm block)"


def _comm_section(doc: Document, d: ProfileDiff, a: dict[str, Any], b: dict[str, Any]) -> None:
    """Each side's collectives by op and phase, beside each other: what the one comm_exposed row is made of."""
    sec = doc.section("Communication", id="communication")
    if not any(d.comm_recorded.values()):
        sec.blocks.append(Missing("communication", "neither profile.json has a comm block (older run dirs)"))
        return
    if not d.comm:
        sec.blocks.append(Missing("communication", "neither run recorded a collective (a single rank, or the engine "
                                                   "issued none the profiler can see)"))
        return

    def cells(side: Any) -> list[Any]:
        if side is None:
            return [None] * 4
        return [side.calls, side.bytes / 2**20, side.exposed_ms, side.total_ms]

    rows = []
    for r in d.comm:
        ca, cb = cells(r.a), cells(r.b)
        rows.append([r.op, r.phase, *(x for pair in zip(ca, cb) for x in pair), _comm_where(r, d.comm_recorded)])
    exposed = _per_side([dig(p, "measurement", "comm_exposed") or "not recorded" for p in (a, b)])
    ranks = [p.get("steps_rank", 0) for p in (a, b)]
    sec.blocks.append(Table(
        ["op", "phase", "calls A", "calls B", "MiB A", "MiB B", "exposed ms A", "exposed ms B",
         "issue-to-completion ms A", "issue-to-completion ms B", "in"], rows, id="comm-diff",
        numeric=[False, False, True, True, True, True, True, True, True, True, False],
        method=(f"per optimizer step, each run's profile.json comm block: rank {ranks[0]} of A's and rank {ranks[1]} "
                f"of B's collectives, medians over their measured steps; exposed: {exposed}; "
                f"{ISSUE_TO_COMPLETION}; one run of each, not judged against the noise band")))


MEMORY_ROWS = (("peak memory per rank", lambda p: run_peak_memory(p.get("summary") or {})),
               ("activations saved for backward per micro batch", lambda p: dig(p, "summary", "activation_bytes")),
               ("model states", lambda p: dig(p, "model_state_bytes", "total")),
               ("model states: params", lambda p: dig(p, "model_state_bytes", "params")),
               ("model states: grads", lambda p: dig(p, "model_state_bytes", "grads")),
               ("model states: optimizer", lambda p: dig(p, "model_state_bytes", "optimizer_states")),
               ("model states: fp32 master copies", lambda p: dig(p, "model_state_bytes", "master_params")))


def _memory_section(doc: Document, a: dict[str, Any], b: dict[str, Any]) -> None:
    """What each side holds: the memory recompute, offload, ZeRO or quantization trade their time for."""
    rows = []
    for label, read in MEMORY_ROWS:
        va, vb = read(a), read(b)
        if va is None and vb is None:
            continue
        change = (vb - va) / va if va and vb is not None else None
        rows.append([label, None if va is None else va / 2**20, None if vb is None else vb / 2**20,
                     "n/a" if change is None else f"{100 * change:+.1f}%"])
    sec = doc.section("Memory", id="memory")
    if not rows:
        sec.blocks.append(Missing("memory", "neither profile recorded memory"))
        return
    peak = "peak: " + _per_side([dig(p, "summary", "peak_memory_method") or dig(p, "env", "memory_meter")
                                 or "not recorded" for p in (a, b)])
    ranks = [p.get("steps_rank", 0) for p in (a, b)]
    sec.blocks.append(Table(
        ["figure", "A MiB", "B MiB", "change"], rows, id="memory-diff", numeric=[False, True, True, False],
        method=(f"{peak}; activations: saved_tensors_hooks bytes on the FLOP-counting step; model states: bytes "
                f"the rank stores (rank {ranks[0]} of A, rank {ranks[1]} of B); one run of each, no noise band")))


def _phases_sum_text(d: ProfileDiff) -> str:
    """Why the phase rows need not add up to the step row: each row takes its own statistic over the steps."""
    each = "its own fastest measured step" if d.stat == "min" else "its own median over the measured steps"
    step = d.steps[0]
    sums = "; ".join(f"{side}: phases {fmt(sum(getattr(r, attr) or 0.0 for r in d.phases))} ms, step "
                     f"{fmt(getattr(step, attr))} ms" for side, attr in (("A", "a_ms"), ("B", "b_ms")))
    return f"Each row is {each}, not one step split into phases, so the phases need not add up to the step ({sums})."


def _part_left_out_text(g: PartLeftOut) -> str:
    """What a model part's row leaves out, and why: modules one run timed that ran inside the other's regions."""
    other = "B" if g.side == "A" else "A"
    one = len(g.regions) == 1
    plural = "" if len(g.modules) == 1 else "s"
    return (f"{g.part}: {g.side}'s {len(g.modules)} module{plural} ({names_text(g.modules)}) "
            f"ran inside {other}'s compiled region{'' if one else 's'} {names_text(g.regions)}, timed with "
            f"{'it' if one else 'them'}: " + ("left out of the row, which compares the modules timed in both runs"
                                              if g.row else "no row"))


def _one_side_reason(name: str, other: str, regions: list[str]) -> str:
    """Why a module has times on one side only: inside the other side's compiled region, or absent there."""
    r = region_of(name, regions)
    if r is None:
        return f"not profiled in {other}"
    return f"inside {other}'s compiled region {module_label(r)}: timed with it"


def _modules_section(doc: Document, d: ProfileDiff, method: str, intro: str | None = None,
                     regions: tuple[list[str], list[str]] = ([], [])) -> None:
    sec = doc.section("Modules (matched by name)", id="modules")
    if intro:
        sec.blocks.append(Para(intro))
    if d.modules:
        judged = [r for r in d.modules if r.change is not None and r.verdict != "too small"]
        judged.sort(key=lambda r: -max(r.a_ms or 0, r.b_ms or 0))
        shown = judged[:25]
        if shown and doc.plots:
            sec.blocks.append(Figure(plots.speedup_bars([f"{module_label(r.name)} {r.phase}" for r in shown],
                                                        [r.change for r in shown], d.band),
                                     f"Time change of the {len(shown)} largest module rows (B vs A)",
                                     "diff_plots/modules.png", id="fig-diff"))
        sec.blocks.append(_table(d.modules, method, "module-diff", "module"))
    else:
        sec.blocks.append(Missing("module diff", "no module present in both runs"))
    if d.only_a or d.only_b:
        sec = doc.section("On one side only", id="one-side")
        sec.blocks.append(Table(["module", "only in", "why"],
                                [[module_label(n), "A", _one_side_reason(n, "B", regions[1])] for n in d.only_a]
                                + [[module_label(n), "B", _one_side_reason(n, "A", regions[0])] for n in d.only_b],
                                id="one-side-table", numeric=[False, False, False]))


def build_inference_diff_document(paths: tuple[Path | None, ...], d: ProfileDiff, a: dict[str, Any],
                                  b: dict[str, Any], plots: bool = True) -> Document:
    """The diff of two `trainprof infer` run dirs: latencies and throughput per batch size, the modules'
    prefill and decode-step time, and memory; `plots` False leaves the figure out."""
    doc = Document("trainprof diff (inference)", subtitle=f"A = {paths[0].name}, B = {paths[1].name}", plots=plots)
    envs = (a.get("env") or {}, b.get("env") or {})
    _runs_section(doc, paths, d, "p50 over the requests of each batch size (inference.json)",
                  tuple(f"{hardware_text(env)} ({env.get('timer', 'timer not recorded')} timer); latencies and "
                        "throughput per batch size below" if env else "device not recorded" for env in envs), envs)
    timers = {x.get("method", {}).get("timer") for x in (a, b)} - {None}
    method = (f"ms; latencies as inference.json defines them ({(a.get('method') or {}).get('metrics', '')[:120]}...); "
              "ms per output token = 1000 / output tokens/s; module rows: prefill = the model's first forward, decode "
              "step = mean per decode step, windows inclusive of children, from one hooked generate call per batch "
              f"size; change = B/A - 1, speedup = A/B; verdict against the noise band ({_band_text(d)}); spread = "
              "interquartile range / median of a run's per-call values (inference.json results[].samples; ITL: "
              "every token gap; ms per output token: E2EL's), n/a with fewer than 4 and for module rows (one call); "
              f"timer: {'; '.join(sorted(timers)) or 'not recorded'}")
    sec = doc.section("Latency and throughput", id="latency")
    sec.blocks.append(_table(d.steps, method, "latency-diff", "batch", "metric"))
    by_a = {r["batch_size"]: r for r in a.get("results") or []}
    by_b = {r["batch_size"]: r for r in b.get("results") or []}
    memory_method = (f"peak: {(a.get('method') or {}).get('peak_memory_bytes', 'not recorded')}; KV cache: "
                     f"{(a.get('method') or {}).get('kv_cache_bytes', 'not recorded')}")
    sec.blocks.append(Table(["batch", "peak memory A MiB", "peak memory B MiB", "KV cache A MiB", "KV cache B MiB"],
                            [[bs, by_a[bs]["peak_memory_bytes"] / 2**20, by_b[bs]["peak_memory_bytes"] / 2**20,
                              by_a[bs]["kv_cache_bytes"] / 2**20, by_b[bs]["kv_cache_bytes"] / 2**20]
                             for bs in sorted(by_a.keys() & by_b.keys())],
                            method=memory_method, id="memory-diff", numeric=[True, True, True, True, True]))
    _modules_section(doc, d, method, MODULES_NOT_JUDGED_WHY if d.modules else None)
    return doc


def diff_csv(d: ProfileDiff) -> str:
    table = Table(CSV_COLUMNS, [[r.kind, r.name, r.phase, r.a_ms, r.b_ms, r.change, r.faster_by, r.speedup, r.verdict,
                                 r.spread_a, r.spread_b, d.stat, d.band, r.step_noise_ms, r.noise_spread]
                                for r in d.rows()]
                  + [["module", n, "", None, None, None, None, None, "only in A", None, None, d.stat, d.band, None,
                      None] for n in d.only_a]
                  + [["module", n, "", None, None, None, None, None, "only in B", None, None, d.stat, d.band, None,
                      None] for n in d.only_b])
    return render_csv(table)


def run_diff(path_a: str | Path, path_b: str | Path, *, stat: str = "min", band: float | None = None,
             min_ms: float | None = None, repeat: str | Path | None = None,
             repeat_b: str | Path | None = None, plots: bool = True) -> tuple[ProfileDiff, Document]:
    """Load two run dirs (and optionally repeats of A and of B, to measure the noise band) and diff them;
    model parts are the summary's Llama2 categories. `plots` False: no figure (nothing will be written)."""
    from trainprof.report.sections import CATEGORIES

    runs = []
    for p in (path_a, path_b, repeat, repeat_b):
        if p is None:
            runs.append(None)
            continue
        run = load_run(p)
        if run.profile is None and run.inference is None:
            raise RunDirError(f"run dir '{p}' has no profile.json (nor rank files) and no inference.json; nothing "
                              "to compare")
        runs.append(run)
    # each kind's first run dir, named with the argument that gave it
    kinds: dict[str, str] = {}
    for r, role in zip(runs, ("", "", " (--repeat)", " (--repeat-b)")):
        if r is not None:
            kinds.setdefault("inference" if r.profile is None else "training", f"'{r.path}'{role}")
    if len(kinds) > 1:
        raise RunDirError(f"{kinds['training']} is a training run dir and {kinds['inference']} an inference one "
                          "(trainprof infer): diff two of a kind")
    if "inference" in kinds:
        docs = [r.inference if r is not None else None for r in runs]
        d = diff_inference(docs[0], docs[1], band=band, min_ms=DEFAULT_INFER_MIN_MS if min_ms is None else min_ms,
                           repeat=docs[2], repeat_b=docs[3])
        return d, build_inference_diff_document(tuple(r.path if r else None for r in runs), d, docs[0], docs[1],
                                                plots=plots)
    profiles = [r.profile if r is not None else None for r in runs]
    d = diff_profiles(profiles[0], profiles[1], stat=stat, band=band,
                      min_ms=DEFAULT_MIN_MS if min_ms is None else min_ms, parts=CATEGORIES,
                      repeat=profiles[2], repeat_b=profiles[3])
    return d, build_diff_document(runs[0], runs[1], d, runs[2], runs[3], plots=plots)


def check_out_dir(out_dir: str | Path) -> None:
    """A one-line UserError when --out names something that is there and not a directory."""
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise UserError(f"--out {out_dir}: a file is there, not a directory; give a new or existing directory")


def write_diff(d: ProfileDiff, doc: Document, out_dir: str | Path,
               formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    """Write diff.md (+ diff_plots/), diff.html and diff.csv into out_dir.

    Raises:
        UserError: out_dir cannot be made a directory (a file is there, or no permission).
    """
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out_dir}: cannot create the directory ({e.strerror}); give a directory you can "
                        "write to") from None
    written: dict[str, Path] = {}
    if "md" in formats:
        for fig in doc.figures():
            (out_dir / fig.file).parent.mkdir(parents=True, exist_ok=True)
            (out_dir / fig.file).write_bytes(fig.png)
        written["md"] = out_dir / "diff.md"
        atomic_write_text(written["md"], render_markdown(doc))
    if "html" in formats:
        written["html"] = out_dir / "diff.html"
        atomic_write_text(written["html"], render_html(doc))
    if "csv" in formats:
        written["csv"] = out_dir / "diff.csv"
        atomic_write_text(written["csv"], diff_csv(d))
    return written
