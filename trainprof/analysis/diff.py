"""Run-to-run diff: per-phase, per-module (and per model part) time of run B against run A, with a
verdict against a noise band. Modules are matched by name; what exists on one side only is listed.

Statistic: `median` compares the profiles' own figures (medians over the measured, uninstrumented
steps; for modules the median over ranks of those). `min` compares the fastest measured step of each
row (per-step series: steps[].phases_ms, and steps[].modules_ms where the profile has it, rank 0):
on a shared machine, time stolen by other processes only ever adds, so the minimum over steps is the
most repeatable estimate of a row's own cost (as timeit does).

Verdict, symmetric in ratio (noise on a time is a factor, not an offset): B is "faster" when
B < A / (1 + band), "slower" when B > A * (1 + band), else "within noise"; a training row whose change is
within NOISE_SAFETY x its own wider step-to-step spread is "within noise" too, that spread kept (`noise_spread`):
its steps vary more than the change, whatever the band; and, where no repeat measured the band (nor was it
given), so is one that changed by fewer ms than the step's noise (`step_noise_ms`: NOISE_SAFETY x the step's
wider step spread, else the band, times the faster step): time the machine takes from a step can land in any one
row, so a ratio alone makes small rows headlines. Rows under `min_ms` in
both runs are "too small" (one preemption is most of them), and so is a model part whose modules are
each under `min_ms`. The band is measured: from a repeat of run A (`repeat`: an identical run; band =
NOISE_SAFETY x the largest ratio between A and its repeat over the judged rows), and of run B (`repeat_b`)
where given, taking the wider: a slow spell of the machine during B's run alone shows only there. Else, for two
GPU runs, it is NOISE_SAFETY x the wider of their steps' spreads (at least GPU_MIN_BAND): the defaults were
measured on identical runs of a tiny model on a shared 2-core CPU machine, not on a GPU. Else it is the default
per statistic (docs/reports.md says how each was measured), widened to NOISE_SAFETY x the wider step spread known
(a run with fewer than 4 used steps has none) where the runs' own steps are more uneven than the machine the
default was measured on.

What each run was set up to do is compared too: the recipes (`trainprof run`), or the workloads that runs of
`trainprof wrap`, the callbacks and `trainprof.Profiler` record instead (the recipe keys they could read), and
the tokens per step, since step times over different work are not a speed-up.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Callable

from trainprof.io import dig
from trainprof.phases import MODULE_PHASES, PHASES, PIPELINE_PHASES
from trainprof.shapes import DIM_KEYS, SHAPES

STATS = ("median", "min")
DEFAULT_BAND = {"median": 0.25, "min": 0.15}  # measured, see docs/reports.md
DEFAULT_MIN_MS = 1.0  # rows under 1 ms: a single preemption (~1 ms) is most of them
NOISE_SAFETY = 1.5  # one repeat pair samples the noise once; 1.5x its largest ratio covers a second draw
MIN_BAND = 0.10  # the noise of identical runs on a quiet machine (docs/reports.md)
# two GPU runs without a repeat: their own steps' spread speaks instead of the CPU defaults, at least 5% (what
# identical GPU runs in profiles/ differed by: docs/reports.md)
GPU_MIN_BAND = 0.05


@dataclass
class DiffRow:
    """One compared figure. change = b/a - 1 (negative: B is faster); speedup = a/b."""

    kind: str  # "step" | "phase" | "part" | "module"
    name: str
    phase: str
    a_ms: float | None
    b_ms: float | None
    verdict: str = ""
    spread_a: float | None = None  # step-to-step relative IQR, where per-step values exist
    spread_b: float | None = None
    # the row's wider spread where NOISE_SAFETY x it, not the run's band, made its change "within noise"
    noise_spread: float | None = None
    # the step's noise (ms) where the row's change, beyond the band, was less than it and so "within noise"
    step_noise_ms: float | None = None

    @property
    def change(self) -> float | None:
        return self.b_ms / self.a_ms - 1 if self.a_ms and self.b_ms is not None else None

    @property
    def speedup(self) -> float | None:
        """A/B; None where a side is missing or zero (a row new or gone in B has no ratio, as change has none)."""
        return self.a_ms / self.b_ms if self.a_ms and self.b_ms else None

    @property
    def spread(self) -> float | None:
        """The wider of the two sides' step-to-step spreads (None where neither has one)."""
        return max((x for x in (self.spread_a, self.spread_b) if x is not None), default=None)

    @property
    def faster_by(self) -> float | None:
        """(A - B) / A: "B is X% faster" in Zhang et al.'s (arXiv 2311.03687) sense (time saved)."""
        c = self.change
        return None if c is None else -c


@dataclass(slots=True, kw_only=True)
class CommSide:
    """One collective (op, phase) of one run, as its profile's comm block has it: medians over its measured steps."""

    calls: int
    bytes: int
    exposed_ms: float | None
    total_ms: float | None  # issue to completion

    @classmethod
    def of(cls, row: dict[str, Any]) -> CommSide:
        return cls(calls=row.get("calls") or 0, bytes=row.get("bytes") or 0, exposed_ms=row.get("exposed_ms"),
                   total_ms=row.get("total_ms"))


@dataclass(slots=True, kw_only=True)
class CommDiffRow:
    """A collective by op and phase in A and B (None on the side that did not issue it); shown, not judged."""

    op: str
    phase: str
    a: CommSide | None
    b: CommSide | None


def comm_diff(a: dict[str, Any], b: dict[str, Any]) -> list[CommDiffRow]:
    """The collectives of both profiles' comm blocks matched by (op, phase): A's order, then B's own."""
    sides = [{(c["op"], c["phase"]): CommSide.of(c) for c in p.get("comm") or []} for p in (a, b)]
    keys = list(dict.fromkeys([*sides[0], *sides[1]]))
    return [CommDiffRow(op=op, phase=phase, a=sides[0].get((op, phase)), b=sides[1].get((op, phase)))
            for op, phase in keys]


def compiled_regions(profile: dict[str, Any]) -> list[str]:
    """The profiled names of a run's torch.compile'd regions ("" is the whole model); [] for an eager run."""
    c = profile.get("compile") or {}
    return list(c.get("regions") or []) if c.get("compiled") else []


def region_of(name: str, regions: list[str]) -> str | None:
    """The compiled region a module runs inside (a region is not inside itself); None outside every region."""
    return next((r for r in regions if name != r and (r == "" or name.startswith(f"{r}."))), None)


def part_members(modules: list[dict[str, Any]], match: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
    """The outermost modules a model part's predicate matches (a norm inside a norm wrapper counts once)."""
    members = [m for m in modules if match(m)]
    names = {m["name"] for m in members}
    return [m for m in members if not any(m["name"].startswith(n + ".") for n in names if n)]


@dataclass(slots=True, kw_only=True)
class PartLeftOut:
    """Modules of a model part that one run timed and the other ran inside its compiled regions, timed with
    them: left out of the part's row, which compares the modules timed in both (`row`: whether one is left)."""

    part: str
    side: str  # the run that timed them: "A" | "B"
    modules: list[str]
    regions: list[str]  # the other run's compiled regions they ran inside
    row: bool


@dataclass
class ProfileDiff:
    """The result of `diff_profiles`; rows in display order."""

    stat: str
    band: float
    min_ms: float
    steps: list[DiffRow] = field(default_factory=list)
    phases: list[DiffRow] = field(default_factory=list)
    parts: list[DiffRow] = field(default_factory=list)
    parts_left_out: list[PartLeftOut] = field(default_factory=list)
    modules: list[DiffRow] = field(default_factory=list)
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    recipe_changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    band_source: str = "default"  # "default" | "given" | "repeat" | "spread" (GPU) | "widened" (CPU default)
    step_spread: dict[str, float] = field(default_factory=dict)  # "A"/"B": the step's relative IQR, where >= 4 steps
    used: dict[str, int] = field(default_factory=dict)  # "A"/"B": the measured steps each side's figures stand on
    # what differs in the work measured, A and B values: inference runs' settings.* keys (prompt_len, new_tokens,
    # ...); training runs' tokens_per_step (the summary's, else the recipe keys that set it)
    workload_changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    # "A"/"B": where the compared settings come from ("recipe", "workload" or "none"), and which keys were compared
    settings_from: dict[str, str] = field(default_factory=lambda: {"A": "recipe", "B": "recipe"})
    settings_compared: list[str] = field(default_factory=list)
    settings_unknown: dict[str, dict[str, str]] = field(default_factory=dict)  # "A"/"B": a workload's `unknown`
    repeat_noise: dict[str, float] = field(default_factory=dict)  # "A"/"B": largest ratio - 1 against its repeat
    # "A"/"B": the recipe keys where a repeat is not its run's recipe (its band then holds that change too)
    repeat_changes: dict[str, list[tuple[str, Any, Any]]] = field(default_factory=dict)
    # how far the step may move as noise, in ms; None where repeats measured the band (or it was given): it holds
    # each row's own noise then
    step_noise_ms: float | None = None
    comm: list[CommDiffRow] = field(default_factory=list)
    comm_recorded: dict[str, bool] = field(default_factory=dict)  # "A"/"B": whether its profile has a comm block

    def rows(self) -> list[DiffRow]:
        return [*self.steps, *self.phases, *self.parts, *self.modules]


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def recipe_changes(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """Dotted recipe keys whose values differ (output.* left out: names and dirs always differ)."""
    fa, fb = _flatten(a or {}), _flatten(b or {})
    keys = sorted(set(fa) | set(fb))
    return [(k, fa.get(k), fb.get(k)) for k in keys if fa.get(k) != fb.get(k) and not k.startswith("output.")]


@dataclass(slots=True, kw_only=True)
class RunSettings:
    """How a run was set up, as its profile records it: the resolved recipe (`trainprof run`), else the
    workload (wrap, the callbacks, Profiler: the recipe keys it could read), else nothing."""

    source: str  # "recipe" | "workload" | "none"
    keys: dict[str, Any]  # dotted recipe keys
    unknown: dict[str, str]  # workload keys it could not read, or assumed, and why

    @classmethod
    def of(cls, profile: dict[str, Any]) -> RunSettings:
        if profile.get("recipe"):
            return cls(source="recipe", keys=_flatten(profile["recipe"]), unknown={})
        workload = dict(profile.get("workload") or {})
        unknown = dict(workload.pop("unknown", None) or {})
        return cls(source="workload" if workload else "none", keys=_flatten(workload) if workload else {},
                   unknown=unknown)

    def comparable(self) -> dict[str, Any]:
        """Keys with a value; a recipe's named shape spelled out as dims, as a workload records it."""
        keys = {k: v for k, v in self.keys.items() if v is not None and k != "model.name"}
        shape = SHAPES.get(self.keys.get("model.name")) if self.source == "recipe" else None
        if shape is not None:
            keys.update({f"model.{k}": getattr(shape, k) for k in DIM_KEYS if keys.get(f"model.{k}") is None})
        return keys


def settings_changes(a: RunSettings, b: RunSettings) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """The keys that differ, and the keys compared. Two recipes: every key either has (output.* left out). A
    workload on either side: the keys both record with a value (a workload holds only what it could read, and
    its model is always named custom, so a recipe's named shape is compared by its dims). Nothing recorded on a
    side: nothing compared."""
    if a.source == b.source == "recipe":
        return recipe_changes(a.keys, b.keys), sorted(k for k in a.keys.keys() | b.keys.keys()
                                                      if not k.startswith("output."))
    if "none" in (a.source, b.source):
        return [], []
    ka, kb = a.comparable(), b.comparable()
    keys = sorted(k for k in ka.keys() & kb.keys() if not k.startswith("output."))
    return [(k, ka[k], kb[k]) for k in keys if ka[k] != kb[k]], keys


WORK_KEYS = ("train.micro_batch_size", "train.grad_accum", "data.seq_len")  # what sets the tokens of a step


def work_changes(a: dict[str, Any], b: dict[str, Any],
                 changes: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """tokens_per_step (the summaries') where it differs; where a side lacks it, the changed keys that set it."""
    ta, tb = dig(a, "summary", "tokens_per_step"), dig(b, "summary", "tokens_per_step")
    if ta is not None and tb is not None:
        return [] if ta == tb else [("tokens_per_step", ta, tb)]
    return [c for c in changes if c[0] in WORK_KEYS]


def used_steps(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """The steps the profile's medians use: measured, not instrumented (all measured if every one was)."""
    measured = [s for s in profile.get("steps") or [] if not s.get("warmup") and s.get("step", 0) >= 0]
    clean = [s for s in measured if not s.get("instrumented")]
    return clean or measured


def _spread(values: list[float]) -> float | None:
    """Relative interquartile range of per-step values (None with fewer than 4)."""
    if len(values) < 4:
        return None
    q = statistics.quantiles(values, n=4)
    med = statistics.median(values)
    return (q[2] - q[0]) / med if med else None


def _stat(values: list[float], stat: str) -> float | None:
    if not values:
        return None
    return min(values) if stat == "min" else float(statistics.median(values))


def _module_series(profile: dict[str, Any]) -> dict[tuple[str, str], list[float]] | None:
    """(module, phase) -> per-step ms from steps[].modules_ms (None when the profile has none)."""
    steps = used_steps(profile)
    if not steps or not all("modules_ms" in s for s in steps):
        return None
    out: dict[tuple[str, str], list[float]] = {}
    for s in steps:
        for name, values in s["modules_ms"].items():
            for i, phase in enumerate(MODULE_PHASES):
                v = values[i] if isinstance(values, (list, tuple)) else values.get(phase, 0.0)
                out.setdefault((name, phase), []).append(v)
    # a module that did not run in a step counts as 0 there, as in the profile's medians
    for series in out.values():
        series.extend([0.0] * (len(steps) - len(series)))
    return out


def _verdict(row: DiffRow, band: float, min_ms: float) -> str:
    if row.a_ms is None or row.b_ms is None:
        return "only in A" if row.b_ms is None else "only in B"
    if max(row.a_ms, row.b_ms) < min_ms:
        return "too small"
    if not row.a_ms or not row.b_ms:
        return "new in B" if not row.a_ms else "gone in B"
    if row.b_ms < row.a_ms / (1 + band):
        return "faster"
    if row.b_ms > row.a_ms * (1 + band):
        return "slower"
    return "within noise"


def _judge(row: DiffRow, band: float, min_ms: float, step_noise_ms: float | None) -> None:
    """A training row's verdict against the run's band; a change beyond it that is within NOISE_SAFETY x the
    row's own wider spread (as the band is of the step's) is "within noise" too, with that spread kept: the
    row's own steps vary more than its change, whatever the step as a whole does. So is a change of fewer ms
    than the step's noise (kept): time the machine takes from a step can land in any one row of it."""
    row.verdict = row.verdict or _verdict(row, band, min_ms)
    spread, ratio = row.spread, noise_ratio(row)
    if row.verdict in ("faster", "slower") and spread is not None and ratio is not None \
            and ratio <= NOISE_SAFETY * spread:
        row.verdict, row.noise_spread = "within noise", spread
    if row.verdict in ("faster", "slower") and row.kind != "step" and step_noise_ms is not None \
            and abs(row.b_ms - row.a_ms) < step_noise_ms:
        row.verdict, row.step_noise_ms = "within noise", step_noise_ms


def _step_noise(out: ProfileDiff) -> None:
    """The step's noise, where no repeat measured the band and none was given (a repeat's band holds each row's
    own noise, measured): how far the step may move between identical runs, as a ratio of the faster step and in
    ms: NOISE_SAFETY x the wider of its known step-to-step spreads, else the band."""
    step = out.steps[0] if out.steps else None
    if step is None or not step.a_ms or not step.b_ms or out.band_source in ("repeat", "given"):
        return
    noise = NOISE_SAFETY * max(out.step_spread.values()) if out.step_spread else out.band
    out.step_noise_ms = noise * min(step.a_ms, step.b_ms)


def noise_ratio(row: DiffRow) -> float | None:
    """max(B/A, A/B) - 1 of a row (None when a side is zero or missing)."""
    if not row.a_ms or not row.b_ms:
        return None
    return max(row.b_ms / row.a_ms, row.a_ms / row.b_ms) - 1


def _repeat_noise(rows: list[DiffRow]) -> float:
    """The largest ratio - 1 over the judged rows of a run diffed against its repeat."""
    ratios = [noise_ratio(r) for r in rows if r.verdict != "too small"]
    return max((x for x in ratios if x is not None), default=0.0)


def _band_fields(band: float | None, default: float, self_diffs: dict[str, ProfileDiff],
                 judged: Callable[[ProfileDiff], list[DiffRow]],
                 step_spread: dict[str, float] | None = None, gpu: bool = False) -> dict[str, Any]:
    """ProfileDiff's band, band_source, repeat_noise, repeat_changes and step_spread: `band` where given; else
    NOISE_SAFETY x the wider side's repeat noise (at least MIN_BAND), from `self_diffs` (each run diffed against
    its repeat, "A"/"B") over their `judged` rows; else NOISE_SAFETY x the wider of `step_spread` (the runs' step
    spreads; a run with too few steps has none), at least GPU_MIN_BAND for two GPU runs that both have one, and at
    least the default otherwise (a CPU default measured on steadier runs than these cannot tell their change from
    noise); else the default."""
    noise = {side: _repeat_noise(judged(d)) for side, d in self_diffs.items()}
    step_spread = step_spread or {}
    spread_band = NOISE_SAFETY * max(step_spread.values(), default=0.0)
    if band is not None:
        source = "given"
    elif noise:
        band, source = max(MIN_BAND, NOISE_SAFETY * max(noise.values())), "repeat"
    elif gpu and len(step_spread) == 2:  # one run's spread alone would narrow the band on the other's unknown
        band, source = max(GPU_MIN_BAND, spread_band), "spread"
    elif spread_band > default:
        band, source = spread_band, "widened"
    else:
        band, source = default, "default"
    return {"band": band, "band_source": source, "repeat_noise": noise, "step_spread": step_spread,
            "repeat_changes": {side: d.recipe_changes for side, d in self_diffs.items() if d.recipe_changes}}


def both_gpu(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all((p.get("env") or {}).get("device_type") == "cuda" for p in (a, b))


def step_spreads(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """{"A": x, "B": y}: each run's step-time spread (relative IQR of its used steps' wall_ms), for each run with
    at least 4 such steps; a run with fewer has none and is left out, so the other's still widens the band."""
    spreads = {}
    for side, profile in (("A", a), ("B", b)):
        spread = _spread([s["wall_ms"] for s in used_steps(profile) if s.get("wall_ms") is not None])
        if spread is not None:
            spreads[side] = spread
    return spreads


@dataclass(slots=True, kw_only=True)
class _Side:
    """One run as the diff reads it: its used steps, summary, modules by name and per-step module series."""

    steps: list[dict[str, Any]]
    summary: dict[str, Any]
    mods: dict[str, dict[str, Any]]
    series: dict[tuple[str, str], list[float]] | None

    @classmethod
    def of(cls, profile: dict[str, Any]) -> _Side:
        return cls(steps=used_steps(profile), summary=profile.get("summary") or {},
                   mods={m["name"]: m for m in profile.get("modules") or []}, series=_module_series(profile))

    def module_ms(self, name: str, phase: str, stat: str) -> float | None:
        """A module's ms in a phase: its fastest step (stat min, where per-step series exist) or its median."""
        if name not in self.mods:
            return None
        if stat == "min" and self.series is not None and (name, phase) in self.series:
            return min(self.series[(name, phase)])
        return self.mods[name].get(f"{phase}_ms")


def diff_profiles(a: dict[str, Any], b: dict[str, Any], *, stat: str = "median", band: float | None = None,
                  min_ms: float = DEFAULT_MIN_MS, repeat: dict[str, Any] | None = None,
                  repeat_b: dict[str, Any] | None = None,
                  parts: list[tuple[str, Callable[[dict[str, Any]], bool]]] | None = None) -> ProfileDiff:
    """Compare run B against run A: the noise band, then the step and phase rows, the model-part rows,
    the module rows, each row's verdict, and the collectives side by side (`comm`, not judged).

    Args:
        a, b: profile.json documents (older ones without phases/modules give fewer rows, with a note).
        stat: "median" (the profiles' figures) or "min" (fastest measured step per row).
        band: ratio counted as noise (0.15: within 15% either way); default: measured from `repeat`,
            else, for two GPU runs, from their steps' spread (`step_spreads`), else DEFAULT_BAND[stat] widened
            to NOISE_SAFETY x that spread where it is wider.
        min_ms: rows where both runs are below this many ms per step are "too small".
        repeat: a repeat of run A (same recipe, same machine): the band becomes NOISE_SAFETY x the
            largest ratio between A and the repeat over the judged rows (at least MIN_BAND).
        repeat_b: a repeat of run B, measured the same way; the band is the wider of the two sides'.
        parts: (label, module predicate) groups summed per phase (outermost matching modules only),
            e.g. trainprof.report.sections.CATEGORIES.
    Returns:
        The diff; `rows()` lists every compared figure.
    """
    if stat not in STATS:
        raise ValueError(f"stat '{stat}' is not one of {', '.join(STATS)}")
    self_diffs = {} if band is not None else {
        side: diff_profiles(run, again, stat=stat, band=0.0, min_ms=min_ms, parts=parts)
        for side, run, again in (("A", a, repeat), ("B", b, repeat_b)) if again is not None}
    settings = {"A": RunSettings.of(a), "B": RunSettings.of(b)}
    changes, compared = settings_changes(settings["A"], settings["B"])
    out = ProfileDiff(stat=stat, min_ms=min_ms, recipe_changes=changes, settings_compared=compared,
                      settings_from={side: s.source for side, s in settings.items()},
                      workload_changes=work_changes(a, b, changes),
                      **_band_fields(band, DEFAULT_BAND[stat], self_diffs,
                                     lambda d: [r for r in d.rows() if r.kind != "step"], step_spreads(a, b),
                                     gpu=both_gpu(a, b)))
    out.settings_unknown = {side: s.unknown for side, s in settings.items() if s.unknown and compared}
    sa, sb = _Side.of(a), _Side.of(b)
    regions = {"A": compiled_regions(a), "B": compiled_regions(b)}
    out.used = {"A": len(sa.steps), "B": len(sb.steps)}
    _step_and_phase_rows(out, sa, sb, pipeline=bool(a.get("pipeline") or b.get("pipeline")))
    if not sa.mods or not sb.mods:
        out.notes.append("modules: at least one run has no module times (an older run dir, or the profiler off)")
    elif stat == "min" and (sa.series is None or sb.series is None):
        out.notes.append("modules: per-step module times are missing in at least one run, so module rows use "
                         "the profiles' medians, not the minimum")
    out.parts.extend(_part_rows(out, sa, sb, parts or [], regions))
    out.modules.extend(_module_rows(sa, sb, stat))
    out.only_a = [n for n in sa.mods if n not in sb.mods]
    out.only_b = [n for n in sb.mods if n not in sa.mods]
    out.comm, out.comm_recorded = comm_diff(a, b), {"A": a.get("comm") is not None, "B": b.get("comm") is not None}
    _step_noise(out)
    for row in out.rows():
        _judge(row, out.band, min_ms, out.step_noise_ms)
    return out


def _series_row(out: ProfileDiff, sa: _Side, sb: _Side, kind: str, name: str, phase: str,
                get: Callable[[dict[str, Any]], float | None], summary_a: float | None,
                summary_b: float | None) -> DiffRow:
    """A row with per-step values on both sides: the profiles' medians (stat median) or the fastest step."""
    va = [v for v in (get(s) for s in sa.steps) if v is not None]
    vb = [v for v in (get(s) for s in sb.steps) if v is not None]
    if out.stat == "median" and summary_a is not None and summary_b is not None:
        ra, rb = summary_a, summary_b
    else:
        ra, rb = _stat(va, out.stat), _stat(vb, out.stat)
    return DiffRow(kind, name, phase, ra, rb, spread_a=_spread(va), spread_b=_spread(vb))


def _step_and_phase_rows(out: ProfileDiff, sa: _Side, sb: _Side, *, pipeline: bool) -> None:
    """The step's wall time, then each phase (the bubble only where a run is a pipeline stage)."""
    out.steps.append(_series_row(out, sa, sb, "step", "step", "wall", lambda s: s.get("wall_ms"),
                                 dig(sa.summary, "step_ms", "median"), dig(sb.summary, "step_ms", "median")))
    if not all(side.steps and "phases_ms" in side.steps[0] for side in (sa, sb)):
        out.notes.append("phases: at least one run has no per-step phase breakdown (an older run dir)")
        return
    for phase in PIPELINE_PHASES if pipeline else PHASES:
        out.phases.append(_series_row(out, sa, sb, "phase", phase, phase, lambda s, p=phase: s["phases_ms"].get(p),
                                      dig(sa.summary, "phases_ms", phase), dig(sb.summary, "phases_ms", phase)))


def _part_rows(out: ProfileDiff, sa: _Side, sb: _Side, parts: list[tuple[str, Callable[[dict[str, Any]], bool]]],
               regions: dict[str, list[str]]) -> list[DiffRow]:
    """Per model part and module phase, the sum over its outermost matching modules on each side; its spread is
    that of the per-step sums, where per-step module times exist. A module one side ran inside the other's
    compiled regions (timed with them there) is left out on both, in `out.parts_left_out`: a part is compared
    over the modules timed in both runs."""
    rows = []
    for label, match in parts:
        members, left_out = [], []
        for side, mods, other in (("A", sa.mods, "B"), ("B", sb.mods, "A")):
            found = part_members(list(mods.values()), match)
            hidden = [m["name"] for m in found if region_of(m["name"], regions[other]) is not None]
            members.append([m for m in found if m["name"] not in hidden])
            if hidden:
                left_out.append(PartLeftOut(part=label, side=side, modules=hidden, row=False, regions=list(
                    dict.fromkeys(region_of(n, regions[other]) for n in hidden))))
        for phase in MODULE_PHASES:
            row = _part_row(sa, sb, label, phase, members, out.stat, out.min_ms)
            if row is not None:
                rows.append(row)
        for gone in left_out:
            gone.row = any(r.name == label for r in rows)
        out.parts_left_out.extend(left_out)
    return rows


def _part_row(sa: _Side, sb: _Side, label: str, phase: str, members: list[list[dict[str, Any]]], stat: str,
              min_ms: float) -> DiffRow | None:
    """One part's row in one phase; None where a side has none of its modules or neither has time."""
    values, spreads, largest = [], [], 0.0
    for side, mods in zip((sa, sb), members):
        member_ms = [side.module_ms(m["name"], phase, stat) or 0.0 for m in mods]
        largest = max([largest, *member_ms])
        values.append(sum(member_ms) if mods else None)
        spreads.append(None if side.series is None else _spread(
            [sum(step) for step in zip(*(side.series.get((m["name"], phase), [0.0] * len(side.steps))
                                         for m in mods))]))
    if not any(values) or None in values:
        return None
    row = DiffRow("part", label, phase, values[0], values[1], spread_a=spreads[0], spread_b=spreads[1])
    # a sum of modules that are each too small to judge is not judged either: per-call
    # effects (hook cost, cache state the previous module left) add up in it
    if largest < min_ms:
        row.verdict = "too small"
    return row


def _module_rows(sa: _Side, sb: _Side, stat: str) -> list[DiffRow]:
    """Per module present in both runs (A's order) and module phase with time on either side."""
    rows = []
    for name in (n for n in sa.mods if n in sb.mods):
        for phase in MODULE_PHASES:
            va, vb = sa.module_ms(name, phase, stat), sb.module_ms(name, phase, stat)
            if not va and not vb:
                continue
            row = DiffRow("module", name, phase, va, vb)
            if sa.series is not None and sb.series is not None:
                row.spread_a = _spread(sa.series.get((name, phase), []))
                row.spread_b = _spread(sb.series.get((name, phase), []))
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------
# Inference runs (trainprof infer: inference.json)
# ---------------------------------------------------------------------------------------------

# p50 latencies compared per batch size (vLLM's benchmark_serving definitions, as inference.json has them)
INFERENCE_LATENCIES = (("ttft_ms", "TTFT p50"), ("tpot_ms", "TPOT p50"), ("itl_ms", "ITL p50"), ("e2el_ms", "E2EL p50"))
# the latency rows are p50s over requests (and tokens), not one sample each: none is "too small" by default
DEFAULT_INFER_MIN_MS = 0.0
DEFAULT_BAND["p50"] = 0.40  # NOISE_SAFETY x the largest ratio between identical runs' latency rows (docs/reports.md)
# settings that change the work each request does (or which batch sizes were run): a latency diff across them
# measures the workload, not the model or the machine (requests and warmup only change how many were sampled)
WORKLOAD_SETTINGS = ("prompt_len", "new_tokens", "batch_sizes", "generate")
MODULE_NOT_JUDGED = "not judged (one call)"
MODULES_NOT_JUDGED_WHY = ("Each module row is one hooked generate call per batch size (prefill: one forward; decode "
                          "step: that call's mean), so the rows are shown, not judged: one call is too few to tell "
                          "a change from noise (docs/reports.md says how far identical runs differ on them).")


def _sample_spread(result: dict[str, Any], key: str) -> float | None:
    """Relative IQR of an inference result's samples of `key` (one per measured call; ITL: every token gap),
    as training rows' spread is of per-step values; None where inference.json has no samples or too few."""
    return _spread((result.get("samples") or {}).get(key) or [])


def diff_inference(a: dict[str, Any], b: dict[str, Any], *, band: float | None = None,
                   min_ms: float = DEFAULT_INFER_MIN_MS, repeat: dict[str, Any] | None = None,
                   repeat_b: dict[str, Any] | None = None) -> ProfileDiff:
    """Compare inference run B against A (inference.json documents), per batch size both measured.

    The p50 latencies (TTFT, TPOT, ITL, E2EL) and ms per output token (1000 / output tokens/s) are
    "latency" rows, judged as in `diff_profiles` against `band` (from `repeat`, a repeat of A, and `repeat_b`,
    one of B, over the latency rows; else DEFAULT_BAND["p50"]). Each module's prefill and per-decode-step ms
    (matched by name) are "module" rows, shown but not judged: they come from one hooked generate call per
    batch size, and identical runs here differed by up to 177% on them. A latency row's spread is the relative
    IQR of each run's samples (`_sample_spread`); module rows, one call each, have none. Batch sizes and
    modules on one side only are in notes and only_a/only_b; `recipe_changes` includes the changed `settings.*`, and
    `workload_changes` those of WORKLOAD_SETTINGS."""
    self_diffs = {} if band is not None else {
        side: diff_inference(run, again, band=0.0, min_ms=min_ms)
        for side, run, again in (("A", a, repeat), ("B", b, repeat_b)) if again is not None}
    changes = recipe_changes(a.get("recipe"), b.get("recipe"))
    changes += [(f"settings.{k}", va, vb) for k, va, vb in recipe_changes(a.get("settings"), b.get("settings"))]
    settings_a, settings_b = a.get("settings") or {}, b.get("settings") or {}
    workload = [(k, settings_a.get(k), settings_b.get(k)) for k in WORKLOAD_SETTINGS
                if settings_a.get(k) != settings_b.get(k)]
    out = ProfileDiff(stat="p50", min_ms=min_ms, recipe_changes=changes, workload_changes=workload,
                      **_band_fields(band, DEFAULT_BAND["p50"], self_diffs, lambda d: d.steps))
    by_a = {r["batch_size"]: r for r in a.get("results") or []}
    by_b = {r["batch_size"]: r for r in b.get("results") or []}
    common = sorted(by_a.keys() & by_b.keys())
    one_side = sorted(by_a.keys() ^ by_b.keys())
    if not common:
        out.notes.append(f"batch sizes: none measured in both runs (A: {sorted(by_a)}, B: {sorted(by_b)})")
    elif one_side:
        out.notes.append(f"batch sizes: {', '.join(map(str, one_side))} measured in one run only, not compared")
    for bs in common:
        ra, rb = by_a[bs], by_b[bs]
        label = f"batch {bs}"
        for key, name in INFERENCE_LATENCIES:
            va, vb = (ra.get(key) or {}).get("p50"), (rb.get(key) or {}).get("p50")
            if va is not None or vb is not None:
                out.steps.append(DiffRow("latency", label, name, va, vb, spread_a=_sample_spread(ra, key),
                                         spread_b=_sample_spread(rb, key)))
        # ms per output token of one call is its E2EL / (tokens x batch): E2EL's relative spread
        out.steps.append(DiffRow("latency", label, "ms per output token", 1e3 / ra["output_tokens_per_s"],
                                 1e3 / rb["output_tokens_per_s"], spread_a=_sample_spread(ra, "e2el_ms"),
                                 spread_b=_sample_spread(rb, "e2el_ms")))
        mods_a = {m["name"]: m for m in ra.get("modules") or []}
        mods_b = {m["name"]: m for m in rb.get("modules") or []}
        both = [n for n in mods_a if n in mods_b]
        # a module inside a compiled layer (or a container never called) has no time (null; 0 in older runs)
        untimed = [n for n in both if mods_a[n].get("not_timed") or mods_b[n].get("not_timed")]
        timed_once = [n for n in untimed if any(m[n][k] for m in (mods_a, mods_b) for k in ("prefill_ms", "decode_ms"))]
        if timed_once:  # timed on one side only: a 0 against a time would read as a change
            out.notes.append(f"{label}: {len(timed_once)} module(s) not timed in A or B (inside a compiled layer, "
                             f"or never called), left out, e.g. {timed_once[0]}")
        for name in (n for n in both if n not in untimed):
            for phase, key in (("prefill", "prefill_ms"), ("decode step", "decode_ms")):
                va, vb = mods_a[name][key], mods_b[name][key]
                if va or vb:
                    out.modules.append(DiffRow("module", name, f"{phase}, {label}", va, vb, verdict=MODULE_NOT_JUDGED))
        out.only_a += [n for n in mods_a if n not in mods_b and n not in out.only_a]
        out.only_b += [n for n in mods_b if n not in mods_a and n not in out.only_b]
    for row in out.rows():
        row.verdict = row.verdict or _verdict(row, out.band, min_ms)
    return out
