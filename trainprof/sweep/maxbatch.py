"""The largest micro batch that fits: double from a start value until a try runs out of memory, then
bisect between the last fit and the first failure. Every try is a fresh process (a cell), so
an out-of-memory failure cannot poison the next try, and tries are cached in the state file (resume).

What counts as "does not fit": a try that failed with kind `oom` (a rank's CUDA OOM, or the CPU cap
train.memory_cap_gb), or a rank killed by SIGKILL (what the kernel OOM killer sends; the table notes
it). Any other failure stops the search: it is not a memory limit and bisecting around it would lie.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from trainprof.sweep.runner import run_cell
from trainprof.sweep.spec import Cell, make_cell
from trainprof.sweep.state import SweepState
from trainprof.report.plots import figure, legend_if_labelled, pyplot, save_figure
from trainprof.report.tables import Column, fmt_num, fmt_pct, fmt_text, write_tables


class SearchInterrupted(KeyboardInterrupt):
    """The search was interrupted (Ctrl-C, SIGTERM); carries the result row of the tries that finished."""

    def __init__(self, row: dict[str, Any]) -> None:
        super().__init__("maxbatch interrupted")
        self.row = row


class TryFailed(Exception):
    """A try failed for a reason other than memory; carries its state record."""

    def __init__(self, record: dict[str, Any]) -> None:
        f = record.get("failure") or {}
        super().__init__(f"{f.get('kind')}: {f.get('message')}")
        self.record = record


@dataclass(kw_only=True)
class Search:
    max_fit: int | None = None  # the answer; None: not even `start` fits
    first_fail: int | None = None  # the smallest size seen not to fit (max_fit + 1 once bisection ends)
    bounded: bool = True  # False: everything up to `limit` fit
    tried: list[int] = field(default_factory=list)


def search_max_batch(fits: Callable[[int], bool], *, start: int = 1, limit: int = 4096) -> Search:
    """Doubling from `start`, then bisection. `fits(b)` returns True / False or raises TryFailed."""
    s = Search()
    b = start
    while True:
        s.tried.append(b)
        if fits(b):
            s.max_fit = b
            if b >= limit:
                s.bounded = False
                return s
            b = min(b * 2, limit)
        else:
            s.first_fail = b
            break
    if s.max_fit is None:
        return s
    lo, hi = s.max_fit, s.first_fail
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s.tried.append(mid)
        if fits(mid):
            lo = mid
        else:
            hi = mid
    s.max_fit, s.first_fail = lo, hi
    return s


def counts_as_oom(record: dict[str, Any]) -> bool:
    f = record.get("failure") or {}
    return f.get("kind") == "oom" or (f.get("kind") == "killed" and f.get("signal") == signal.SIGKILL.name)


def try_overrides(batch: int, steps: int) -> list[str]:
    """Overrides of one try: the micro batch, no operator trace (a traced step runs slower, and a try's few
    steps would all be traced ones, so its tokens/s would be theirs), and (steps > 0) a short run: peak
    memory is reached in the first steps, once optimizer states exist."""
    extra = [f"train.micro_batch_size={batch}", "profile.ops=false"]
    if steps > 0:
        extra += [f"train.steps={steps}", "train.warmup_steps=1"]
    return extra


def run_search(recipe_path: str, overrides: list[str], *, label: str, nproc: int, nnodes: int, out_dir: Path,
               state: SweepState, timeout_s: float, start: int, limit: int, steps: int) -> dict[str, Any]:
    """Search one configuration; returns its result row (tries are in the state file)."""
    tries: dict[int, Cell] = {}

    def fits(batch: int) -> bool:
        cell, _ = make_cell(recipe_path, [*overrides, *try_overrides(batch, steps)],
                            label=f"mbs={batch} {label}", nproc=nproc, nnodes=nnodes)
        tries[batch] = cell
        if state.should_run(cell.key):
            run_cell(cell, out_dir, state, timeout_s=timeout_s)
        rec = state.update(cell.key, {"config": label, "micro_batch_size": batch})
        fit = rec["status"] == "done"
        f = rec.get("failure") or {}
        mem = (rec.get("values") or {}).get("peak_memory_mib") if fit else \
            (None if f.get("peak_memory_bytes") is None else f["peak_memory_bytes"] / 2**20)
        print(f"  micro batch {batch}: {'fits' if fit else f.get('kind')}"
              + (f", peak memory {mem:,.0f} MiB" if mem is not None else ""), file=sys.stderr)
        if fit:
            return True
        if counts_as_oom(rec):
            return False
        raise TryFailed(rec)

    row: dict[str, Any] = {"config": label, "world_size": nproc * nnodes, "overrides": " ".join(overrides)}
    try:
        s = search_max_batch(fits, start=start, limit=limit)
    except KeyboardInterrupt:
        raise SearchInterrupted(best_so_far(row, tries, state)) from None
    except TryFailed as err:
        f = err.record.get("failure") or {}
        row.update(status="error", max_micro_batch=None, failure_kind=f.get("kind"), failure_message=f.get("message"),
                   note=f"search stopped: micro batch {err.record.get('micro_batch_size')} failed with "
                        f"{f.get('kind')} (not out of memory); see {err.record.get('log')}",
                   tries=len(tries))
        return row
    row.update(status="found" if s.bounded and s.max_fit else ("none fits" if s.max_fit is None else "limit"),
               max_micro_batch=s.max_fit, first_fail=s.first_fail, tries=len(s.tried))
    _add_try_figures(row, state, tries, s.max_fit, s.first_fail)
    if not s.bounded:
        row["note"] = f"every size up to --max {limit} fit; raise --max to find the limit"
    elif s.max_fit is None:
        why = row.get("failure_message") or "see maxbatch_tries"
        row["note"] = f"micro batch {start} does not fit: {why}"
        print(f"  none fits: {row['note']}", file=sys.stderr)
    return row


def _add_try_figures(row: dict[str, Any], state: SweepState, tries: dict[int, Cell], max_fit: int | None,
                     first_fail: int | None) -> None:
    """The figures of the try at the max, and the failure of the first failing try, into the result row."""
    if max_fit is not None:
        rec = state.get(tries[max_fit].key)
        values = rec.get("values") or {}
        row.update(tokens_per_s=values.get("tokens_per_s"), step_ms=values.get("step_ms"),
                   peak_memory_mib=values.get("peak_memory_mib"), run_dir=rec.get("run_dir"))
    if first_fail is not None:
        f = state.get(tries[first_fail].key).get("failure") or {}
        row.update(failure_kind=f.get("kind") + (f" {f['signal']}" if f.get("signal") else ""),
                   failure_message=f.get("message"),
                   failure_memory_mib=None if f.get("peak_memory_bytes") is None else f["peak_memory_bytes"] / 2**20)


def best_so_far(row: dict[str, Any], tries: dict[int, Cell], state: SweepState) -> dict[str, Any]:
    """The result row of an interrupted search, marked partial: the largest try that fit so far and the
    smallest above it that ran out of memory (the answer lies between; the search had not closed the gap)."""
    finished = {b: state.get(c.key) or {} for b, c in tries.items()}
    fit = [b for b, rec in finished.items() if rec.get("status") == "done"]
    best = max(fit) if fit else None
    failed = [b for b, rec in finished.items() if rec.get("status") == "failed" and counts_as_oom(rec)
              and (best is None or b > best)]
    first_fail = min(failed) if failed else None
    done = sum(rec.get("status") in ("done", "failed") for rec in finished.values())
    row.update(status="interrupted (partial)", max_micro_batch=best, first_fail=first_fail, tries=done)
    _add_try_figures(row, state, tries, best, first_fail)
    gap = f"the max lies in [{best}, {first_fail})" if best is not None and first_fail is not None else \
        "no try fit yet" if best is None else f"{best} fits; larger sizes were not tried yet"
    row["note"] = f"search interrupted after {done} finished tries: best so far, not the answer ({gap}); " \
                  "run the same command again to resume"
    return row


RESULT_COLUMNS = [
    Column("config", "config"),
    Column("world_size", "ranks", fmt_text),
    Column("status", "status"),
    Column("max_micro_batch", "max micro batch", fmt_text),
    Column("first_fail", "first failing", fmt_text),
    Column("failure_kind", "failure at first failing", fmt_text),
    Column("failure_memory_mib", "memory at failure MiB", fmt_num(0)),
    Column("tokens_per_s", "tokens/s at max", fmt_num(0)),
    Column("step_ms", "step ms at max", fmt_num(1)),
    Column("peak_memory_mib", "peak memory MiB at max", fmt_num(0)),
    Column("tries", "tries", fmt_text),
    Column("note", "note", fmt_text),
    Column("failure_message", "failure message", fmt_text),
    Column("overrides", "overrides", fmt_text),
    Column("run_dir", "run dir at max", fmt_text),
]
TRY_COLUMNS = [
    Column("config", "config"),
    Column("micro_batch_size", "micro batch", fmt_text),
    Column("status", "status"),
    Column("failure_kind", "failure", fmt_text),
    Column("tokens_per_s", "tokens/s", fmt_num(0)),
    Column("steps_used", "measured steps", fmt_text),
    Column("step_spread", "step spread (max-min)/median", fmt_pct),
    Column("peak_memory_mib", "peak memory MiB", fmt_num(0)),
    Column("failure_memory_mib", "memory at failure MiB", fmt_num(0)),
    Column("failure_message", "failure message", fmt_text),
    Column("cell_id", "cell id", fmt_text),
]


def try_rows(state: SweepState) -> list[dict[str, Any]]:
    rows = []
    for rec in state.cells.values():
        if rec.get("micro_batch_size") is None:
            continue
        f = rec.get("failure") or {}
        values = rec.get("values") or {}
        rows.append({"config": rec.get("config"), "micro_batch_size": rec["micro_batch_size"],
                     "status": rec["status"], "failure_kind": f.get("kind"), "failure_message": f.get("message"),
                     "failure_memory_mib": None if f.get("peak_memory_bytes") is None else f["peak_memory_bytes"] / 2**20,
                     "tokens_per_s": values.get("tokens_per_s"), "peak_memory_mib": values.get("peak_memory_mib"),
                     "steps_used": values.get("steps_used"), "step_spread": values.get("step_spread"),
                     "cell_id": rec["id"]})
    first_seen = {c: i for i, c in enumerate(dict.fromkeys(r["config"] for r in rows))}
    return sorted(rows, key=lambda r: (first_seen[r["config"]], r["micro_batch_size"]))


def write_maxbatch_report(out_dir: Path, rows: list[dict[str, Any]], state: SweepState, *, title: str,
                          notes: list[str]) -> list[Path]:
    tries = try_rows(state)
    chart = _chart(out_dir / "maxbatch.png", rows, tries, notes)
    paths = write_tables(out_dir / "maxbatch", rows, RESULT_COLUMNS, title=title, notes=notes,
                         image=chart.name)
    paths += write_tables(out_dir / "maxbatch_tries", tries, TRY_COLUMNS, title=f"{title}: every try", notes=notes)
    return [*paths, chart]


def _chart(path: Path, rows: list[dict[str, Any]], tries: list[dict[str, Any]], notes: list[str]) -> Path:
    plt = pyplot()
    fig, (ax1, ax2), rect = figure(plt, 2, width_in=14, plot_height_in=3.2 + 0.3 * len(rows), notes=notes)
    for config in dict.fromkeys(t["config"] for t in tries):
        mine = [t for t in tries if t["config"] == config]
        ok = [(t["micro_batch_size"], t["peak_memory_mib"]) for t in mine if t["status"] == "done"]
        bad = [(t["micro_batch_size"], t["failure_memory_mib"] or 0) for t in mine if t["status"] == "failed"]
        line = ax1.plot(*zip(*ok), marker="o", label=config)[0] if ok else None
        if bad:
            ax1.scatter(*zip(*bad), marker="x", s=60, color=line.get_color() if line else "#b00000")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("micro batch size (x = failed try, at the memory it recorded)")
    ax1.set_ylabel("peak memory per rank, MiB")
    legend_if_labelled(ax1, fontsize=7)
    y = list(range(len(rows)))
    ax2.barh(y, [r.get("max_micro_batch") or 0 for r in rows], color="#4c72b0")
    ax2.set_yticks(y)
    ax2.set_yticklabels([f"{r['config']} (n={r['world_size']})" for r in rows], fontsize=8)
    ax2.invert_yaxis()
    ax2.set_title("largest micro batch that fits", fontsize=9)
    for yi, r in zip(y, rows):
        ax2.text(r.get("max_micro_batch") or 0, yi, f" {r.get('max_micro_batch')} ({r['status']})", va="center",
                 fontsize=8)
    return save_figure(fig, path, rect)
