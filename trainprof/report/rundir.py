"""Reading a run dir for reports: profile.json (or its rank files), recipe.yaml, failures and the
trace files (beside profile.json and under tb/), tolerating run dirs written by older versions (parts
they lack are named, not crashed on). No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainprof.analysis import records
from trainprof.analysis.trace import find_traces, is_trace_file
from trainprof.io import profile_file, read_json
from trainprof.layout import TRACES_HOW
from trainprof.phases import PHASES, PIPELINE_PHASES


def module_label(m: dict[str, Any]) -> str:
    """A module row's name for tables; a pipeline stage's rows say which stage ran them."""
    return records.module_label(m["name"]) + (f" [stage {m['stage']}]" if "stage" in m else "")


def report_phases(profile: dict[str, Any] | None) -> tuple[str, ...]:
    """The phases a report shows: pipeline_bubble only for a pipeline run (elsewhere it is 0 or absent)."""
    return PIPELINE_PHASES if (profile or {}).get("pipeline") else PHASES


class RunDirError(ValueError):
    """The path is not a readable run dir (one line: what, where, what to do)."""


# every profile has had these, from the pre-profiler runner's rank files on; a JSON file with none of them
# is some other program's
PROFILE_FIELDS = ("steps", "summary", "env")
WRITERS = "`trainprof run`, `trainprof wrap` or a trainprof callback"
INFERENCE_INTERRUPTED = "inference.interrupted.json"  # an interrupted `trainprof infer` run (inference/interrupt.py)


def existing_run_dir(path: str | Path) -> Path:
    """`path` as a Path; RunDirError where it does not exist or is a file."""
    path = Path(path)
    if not path.exists():
        raise RunDirError(f"run dir '{path}' does not exist; pass a run dir written by {WRITERS} (runs/<run>/)")
    if not path.is_dir():
        raise RunDirError(f"run dir '{path}' is a file; pass the directory that holds the run ('{path.parent}')")
    return path


def read_profile_file(path: Path) -> dict[str, Any]:
    """A profile file; RunDirError where it is valid JSON but not a trainprof profile."""
    doc = read_json(path)
    if not isinstance(doc, dict) or not any(k in doc for k in PROFILE_FIELDS):
        raise RunDirError(f"'{path}' is not a trainprof profile (it has none of {', '.join(PROFILE_FIELDS)}); "
                          f"pass a run dir written by {WRITERS}")
    return doc


@dataclass
class TraceFile:
    """A trace under tb/: its path, size and (from its file name) the worker it belongs to."""

    path: Path
    bytes: int
    worker: str


@dataclass
class RunData:
    """Everything a report reads from one run dir.

    Attributes:
        path: the run dir.
        profile: profile.json (or the merge of profile.rank*.json), None when neither exists.
        source: which file(s) `profile` came from.
        recipe_text: recipe.yaml as written (None when absent).
        failures: failure-rank<N>.json documents.
        traces: trace files under tb/.
        scalars: TensorBoard event files under tb/.
        inference: inference.json of a `trainprof infer` run dir (None in a training run dir).
        inference_interrupted: inference.interrupted.json of an interrupted `trainprof infer` run dir.
    """

    path: Path
    profile: dict[str, Any] | None
    source: str
    recipe_text: str | None = None
    failures: list[dict[str, Any]] = field(default_factory=list)
    traces: list[TraceFile] = field(default_factory=list)
    scalars: list[Path] = field(default_factory=list)
    inference: dict[str, Any] | None = None
    inference_interrupted: dict[str, Any] | None = None

    @classmethod
    def of_profile(cls, profile: dict[str, Any], path: str | Path) -> RunData:
        """A run being written: its profile in hand, the run dir's other files not read."""
        return cls(path=Path(path), profile=profile, source="profile.json")

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def is_inference(self) -> bool:
        """Whether `trainprof infer` wrote the dir (its report is inference.md, not report.md)."""
        return self.profile is None and (self.inference is not None or self.inference_interrupted is not None)

    @property
    def is_run(self) -> bool:
        """Whether the dir holds anything a run writes: a profile of any version, inference.json, a
        rank's failure record, or recipe.yaml (the runner's first file; all a killed run may leave)."""
        return (self.profile is not None or self.is_inference or bool(self.failures)
                or self.recipe_text is not None)

    @property
    def has_phases(self) -> bool:
        """Whether the profile comes from the step profiler (phases per step, modules)."""
        p = self.profile or {}
        return bool(p.get("steps")) and "phases_ms" in p["steps"][0]

    @property
    def measured_steps(self) -> list[dict[str, Any]]:
        return [s for s in (self.profile or {}).get("steps", []) if not s.get("warmup") and s.get("step", 0) >= 0]


def _worker(name: str) -> str:
    """The TensorBoard plugin's worker name: the file name up to an optional `.<digits>` span and the
    .pt.trace.json[.gz] suffix."""
    stem = name.split(".pt.trace.json")[0]
    head, _, tail = stem.rpartition(".")
    return head if head and tail.isdigit() else stem


def run_traces(path: str | Path) -> list[Path]:
    """The trace files of a run dir, where `trainprof replay` looks too: beside profile.json (a folder kept
    in profiles/ stores its rank 0 trace there) and under tb/ (find_traces)."""
    path = Path(path)
    beside = sorted(p for p in path.iterdir() if p.is_file() and is_trace_file(p)) if path.is_dir() else []
    return [*beside, *find_traces(path)]


def _old_rank_files(path: Path) -> dict[str, Any] | None:
    """A profile-like document from the rank<N>.json step files the runner wrote before the step
    profiler existed (wall time, loss, tokens and peak memory per step)."""
    files = sorted(path.glob("rank[0-9]*.json"))
    if not files:
        return None
    ranks = [read_json(f) for f in files]
    steps = [s for s in ranks[0].get("steps", []) if not s.get("warmup")]
    return {"schema_version": 0, "steps": steps, "summary": {}, "env": {}, "ranks": [
        {"rank": r.get("rank"), "step_ms_median": None} for r in ranks]}


def load_run(path: str | Path) -> RunData:
    """Load a run dir.

    Args:
        path: a run dir (runs/<name>-<timestamp>/).
    Returns:
        RunData; `profile` is None only when the dir has no profile of any kind.
    Raises:
        RunDirError: the path does not exist, is not a directory, or its profile.json is not a profile.
        UserError: a JSON file in it is cut short (the run was stopped while writing it).
    """
    path = existing_run_dir(path)
    profile, source = None, "none"
    recovered = []
    kept = profile_file(path)
    if kept is None and list(path.glob("profile.rank*.journal.jsonl")):
        from trainprof.profiler.journal import recover_journals  # imports torch: only for a killed run

        recovered = recover_journals(path)
        kept = profile_file(path)
    if kept is not None:
        profile, source = read_profile_file(kept), kept.name
    elif list(path.glob("profile.rank*.json")):
        from trainprof.analysis.merge import merge_rank_files

        profile, source = merge_rank_files(path), "profile.rank*.json (merged now: profile.json is missing)"
        partial = sorted(path.glob("profile.rank*.partial.json"))
        if partial:  # written by a rank that failed or was stopped: only its finished steps
            reasons = [read_json(f).get("partial_reason") or f.name for f in partial]
            profile.update(partial=True, partial_reason="; ".join(reasons))
            source = f"profile.rank*.partial.json (partial: {len(partial)} rank(s) stopped early; merged now)"
            if recovered:
                source += f"; {', '.join(f.name for f in recovered)} rebuilt from the killed ranks' journals"
    else:
        old = _old_rank_files(path)
        if old is not None:
            profile, source = old, "rank<N>.json (step times only)"
    recipe = path / "recipe.yaml"
    traces = [TraceFile(p, p.stat().st_size, _worker(p.name)) for p in run_traces(path)]
    tb = path / "tb"
    scalars = sorted([*tb.glob("events.out.tfevents.*"), *tb.glob("*/events.out.tfevents.*")]) if tb.is_dir() else []
    return RunData(
        path=path, profile=profile, source=source,
        recipe_text=recipe.read_text() if recipe.is_file() else None,
        failures=[read_json(f) for f in sorted(path.glob("failure-rank*.json"))],
        traces=traces, scalars=scalars,
        inference=read_json(infer) if (infer := path / "inference.json").is_file() else None,
        inference_interrupted=read_json(stop) if (stop := path / INFERENCE_INTERRUPTED).is_file() else None,
    )


def recipe_of(run: RunData) -> dict[str, Any]:
    """The resolved recipe: profile.json's, else recipe.yaml's, else {}."""
    recipe = (run.profile or {}).get("recipe")
    if recipe:
        return recipe
    if run.recipe_text:
        import yaml

        return yaml.safe_load(run.recipe_text) or {}
    return {}


def step_tflops(profile: dict[str, Any], step: dict[str, Any]) -> float | None:
    """Achieved TFLOP/s of one step: the counted FLOPs per step (same every step) over its wall time."""
    flops = (profile.get("summary") or {}).get("flops_per_step")
    return flops / (step["wall_ms"] / 1e3) / 1e12 if flops and step.get("wall_ms") else None


def step_tokens_per_s(step: dict[str, Any]) -> float | None:
    return step["tokens"] / (step["wall_ms"] / 1e3) if step.get("tokens") and step.get("wall_ms") else None


def step_peak_memory(step: dict[str, Any]) -> dict[str, int | None]:
    """Peak memory per phase of one step ({"step": bytes} for runs written before the profiler)."""
    peaks = step.get("peak_memory_bytes")
    if isinstance(peaks, dict):
        return peaks
    return {"step": peaks} if peaks is not None else {}


def run_peak_memory(summary: dict[str, Any]) -> int | None:
    """A run's peak memory per rank from its profile summary: the runner's step peak over the run, else (a
    wrapped script's run: the loop is the script's, there is no runner) the highest of the profiler's
    per-phase peaks, the same meter reset at each phase's start."""
    if summary.get("peak_memory_bytes_max"):
        return int(summary["peak_memory_bytes_max"])
    peaks = [v for v in (summary.get("peak_memory_bytes") or {}).values() if v]
    return int(max(peaks)) if peaks else None


def module_time(m: dict[str, Any], self_time: bool = False) -> float:
    """forward + backward + recompute ms of a module row (its self part with self_time)."""
    p = "self_" if self_time else ""
    return sum(m.get(f"{p}{k}_ms") or 0.0 for k in ("forward", "backward", "recompute"))


def top_modules(profile: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """The n modules with the most self time (forward + backward + recompute), the ones that do the
    work: inclusive time would rank the model and its containers first."""
    mods = [m for m in profile.get("modules") or [] if module_time(m, self_time=True) > 0]
    return sorted(mods, key=lambda m: -module_time(m, self_time=True))[:n]


def trace_size_text(profile: dict[str, Any], run_dir: Path | None = None) -> str:
    """One line for a run summary: the Kineto trace size per traced step and where the traces are (tb/, or
    beside profile.json in a folder kept in profiles/), or why there is none."""
    info = profile.get("ops_info") or {}
    if not info.get("enabled"):
        return f"no operator trace (tracing off; {TRACES_HOW} traces)"
    per_step = info.get("trace_bytes_per_step")
    if not per_step:
        return "operator trace not written"
    gz = "gzip, " if info.get("trace_gzip") else ""
    return (f"{per_step / 2**20:,.2f} MiB per traced step per rank ({gz}steps {info.get('trace_steps')}, "
            f"{(info.get('trace_bytes') or 0) / 2**20:,.2f} MiB on rank 0; {_traces_where(run_dir)})")


def _traces_where(run_dir: Path | None) -> str:
    beside = run_dir is not None and run_dir.is_dir() and any(is_trace_file(f) for f in run_dir.iterdir())
    return "beside profile.json" if beside else "tb/"
