"""`trainprof diff RUN_A RUN_B`: the diff as a Document (Markdown / HTML) and as one CSV."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.analysis.diff import DEFAULT_MIN_MS, NOISE_SAFETY, ProfileDiff, diff_profiles
from trainprof.io import atomic_write_text
from trainprof.report import plots
from trainprof.report.document import Document, Facts, Figure, Missing, Para, Table, render_csv, render_html
from trainprof.report.document import render_markdown
from trainprof.report.rundir import RunData, RunDirError, load_run

FORMATS = ("md", "html", "csv")
CSV_COLUMNS = ["kind", "name", "phase", "a_ms", "b_ms", "change", "faster_by", "speedup", "verdict", "spread_a",
               "spread_b", "stat", "noise_band"]


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
            f"the per-step values; timer: {'; '.join(sorted(timers)) or 'not recorded'}")


def _band_text(d: ProfileDiff) -> str:
    if d.band_source == "repeat":
        return (f"{100 * d.band:.0f}%: {NOISE_SAFETY}x the largest difference, {100 * (d.repeat_noise or 0):.0f}%, "
                "between A and its repeat")
    if d.band_source == "given":
        return f"{100 * d.band:.0f}%, given with --noise"
    return f"{100 * d.band:.0f}%, the default for --stat {d.stat}, measured on identical runs (docs/reports.md)"


def _table(rows, method: str, id: str, name_header: str) -> Table:
    return Table([name_header, "phase", "A ms", "B ms", "change", "faster by", "speedup", "verdict", "spread A",
                  "spread B"],
                 [[r.name or "<model>", r.phase, r.a_ms, r.b_ms, _pct(r.change), _pct(r.faster_by),
                   None if r.speedup is None else f"{r.speedup:.2f}x", r.verdict,
                   None if r.spread_a is None else f"{100 * r.spread_a:.0f}%",
                   None if r.spread_b is None else f"{100 * r.spread_b:.0f}%"] for r in rows],
                 method=method, id=id, numeric=[False, False, True, True, True, True, True, False, True, True])


def build_diff_document(run_a: RunData, run_b: RunData, d: ProfileDiff,
                        run_repeat: RunData | None = None) -> Document:
    a, b = run_a.profile or {}, run_b.profile or {}
    doc = Document("trainprof diff", subtitle=f"A = {run_a.path.name}, B = {run_b.path.name}")
    sec = doc.section("Runs", id="runs")
    facts = [("A", str(run_a.path)), ("B", str(run_b.path))]
    if run_repeat is not None:
        facts.append(("repeat of A", str(run_repeat.path)))
    facts += [("statistic", d.stat), ("noise band", f"{_band_text(d)}; rows under {d.min_ms} ms not judged")]
    sec.blocks.append(Facts(facts))
    if d.recipe_changes:
        sec.blocks.append(Table(["recipe key", "A", "B"], [[k, str(va), str(vb)] for k, va, vb in d.recipe_changes],
                                id="recipe-changes", numeric=[False, False, False]))
    else:
        sec.blocks.append(Para("The two recipes are the same (apart from output.*): differences are noise or the "
                               "machine."))
    for note in d.notes:
        sec.blocks.append(Missing(note.split(":")[0], note.split(":", 1)[1].strip()))
    method = _method(d, a, b)
    sec = doc.section("Step and phases", id="phases")
    sec.blocks.append(_table([*d.steps, *d.phases], method, "phase-diff", "figure"))
    if d.parts:
        sec = doc.section("Model parts (Zhang et al.'s (arXiv 2311.03687) table)", id="parts")
        sec.blocks.append(_table(d.parts, method, "part-diff", "part"))
    sec = doc.section("Modules (matched by name)", id="modules")
    if d.modules:
        judged = [r for r in d.modules if r.change is not None and r.verdict not in ("too small",)]
        judged.sort(key=lambda r: -max(r.a_ms or 0, r.b_ms or 0))
        shown = judged[:25]
        if shown:
            sec.blocks.append(Figure(plots.speedup_bars([f"{r.name or '<model>'} {r.phase}" for r in shown],
                                                        [r.change for r in shown], d.band),
                                     f"Time change of the {len(shown)} largest module rows (B vs A)",
                                     "diff_plots/modules.png", id="fig-diff"))
        sec.blocks.append(_table(d.modules, method, "module-diff", "module"))
    else:
        sec.blocks.append(Missing("module diff", "no module present in both runs"))
    if d.only_a or d.only_b:
        sec = doc.section("On one side only", id="one-side")
        sec.blocks.append(Table(["module", "only in"], [[n or "<model>", "A"] for n in d.only_a]
                                + [[n or "<model>", "B"] for n in d.only_b], id="one-side-table",
                                numeric=[False, False]))
    return doc


def diff_csv(d: ProfileDiff) -> str:
    table = Table(CSV_COLUMNS, [[r.kind, r.name, r.phase, r.a_ms, r.b_ms, r.change, r.faster_by, r.speedup, r.verdict,
                                 r.spread_a, r.spread_b, d.stat, d.band] for r in d.rows()]
                  + [["module", n, "", None, None, None, None, None, "only in A", None, None, d.stat, d.band]
                     for n in d.only_a]
                  + [["module", n, "", None, None, None, None, None, "only in B", None, None, d.stat, d.band]
                     for n in d.only_b])
    return render_csv(table)


def run_diff(path_a: str | Path, path_b: str | Path, *, stat: str = "min", band: float | None = None,
             min_ms: float | None = None, repeat: str | Path | None = None) -> tuple[ProfileDiff, Document]:
    """Load two run dirs (and optionally a repeat of A, to measure the noise band) and diff them; model
    parts are the summary's Llama2 categories."""
    from trainprof.report.summary import CATEGORIES

    runs = []
    for p in (path_a, path_b, repeat):
        if p is None:
            runs.append(None)
            continue
        run = load_run(p)
        if run.profile is None:
            raise RunDirError(f"run dir '{p}' has no profile.json (nor rank files); nothing to compare")
        runs.append(run)
    d = diff_profiles(runs[0].profile, runs[1].profile, stat=stat, band=band,
                      min_ms=DEFAULT_MIN_MS if min_ms is None else min_ms, parts=CATEGORIES,
                      repeat=runs[2].profile if runs[2] is not None else None)
    return d, build_diff_document(runs[0], runs[1], d, runs[2])


def write_diff(d: ProfileDiff, doc: Document, out_dir: str | Path,
               formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    """Write diff.md (+ diff_plots/), diff.html and diff.csv into out_dir."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
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
