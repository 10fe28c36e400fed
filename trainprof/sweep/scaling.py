"""Scaling efficiency across world sizes, and where the lost efficiency went.

    efficiency E(N) = tput(N) * N0 / (N * tput(N0))      tput: global tokens/s from profile.json;
                                                         N0: the smallest world size measured (1 usually)

This one formula serves weak scaling (fixed per-rank batch: ideal tput grows with N) and strong
scaling (fixed global batch: ideal step time shrinks with N). Where the lost part went is read from the
profiles' phase split, in ms per step of the N-rank run:

    T(N)       = global tokens per step / tput(N)        the step time the throughput implies
    excess     = T(N) * (1 - E(N))                       the time over a perfectly scaled step
    r          = per-rank tokens per step at N / at N0   (1 for weak scaling, N0/N for strong)
    imbalance  = max over ranks - median over ranks of the busy time (step minus blocked in collectives
                 and data wait; the step time per rank when no busy time is recorded): the straggler's lead
    comm       = growth - min(imbalance, max(growth, 0)),  growth = comm_exposed(N) - r * comm_exposed(N0)
                 (waiting for the straggler shows up as exposed communication on the other ranks; taking
                 it out keeps it from being counted twice)
    idle       = (data_wait + unattributed)(N) - r * (same)(N0)
    compute    = (forward + backward + recompute + optimizer)(N) - r * (same)(N0)
    other      = excess - comm - idle - imbalance - compute   (the `other` phase, and what the phases miss)

Each part divided by T(N) is the efficiency it cost, so E + the parts = 1 exactly. Phase values are
medians over ranks when the profile has them (summary.across_ranks), else the profile's own. A part
whose inputs are missing is null with the reason, and `other` takes its share.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprof.analysis.bandwidth import bandwidth_gbps
from trainprof.projection.changes import STEP_NEUTRAL_KEYS
from trainprof.report.plots import figure, legend_if_labelled, pyplot, save_figure
from trainprof.report.rundir import read_profile_file
from trainprof.report.tables import Column, fmt_num, fmt_pct, fmt_text, write_tables

PARTS = ("comm", "idle", "imbalance", "compute", "other")
PART_LABELS = {"comm": "exposed communication growth", "idle": "idle (data wait + unattributed) growth",
               "imbalance": "rank imbalance / straggler", "compute": "compute slowdown", "other": "other"}
EFFICIENCY_FORMULA = "efficiency = tput(N) * N0 / (N * tput(N0)), tput = global tokens/s from profile.json, " \
                     "N0 = smallest world size measured"


def strong_overrides(micro_batch: int, grad_accum: int, n_ref: int, n: int) -> list[str]:
    """Overrides that keep the global batch of n_ref ranks (micro_batch x grad_accum x n_ref) on n ranks:
    the largest micro batch <= micro_batch that divides the per-rank samples, the rest as accumulation."""
    from trainprof.errors import UserError

    global_batch = micro_batch * grad_accum * n_ref
    if global_batch % n:
        raise UserError(f"strong scaling: the global batch {global_batch} (micro batch {micro_batch} x grad_accum "
                        f"{grad_accum} x {n_ref} ranks) does not split over {n} ranks; pick a micro batch or "
                        "grad_accum that makes it divisible")
    per_rank = global_batch // n
    mbs = max(d for d in range(1, min(micro_batch, per_rank) + 1) if per_rank % d == 0)
    return [f"train.micro_batch_size={mbs}", f"train.grad_accum={per_rank // mbs}"]


# recipe keys that may differ between runs of one configuration: those that do not change a step's work (how
# long a run is, its seed, what the profiler records, where it wrote) and a wrapped run's reasons for a key
_PER_RUN_PREFIXES = (*STEP_NEUTRAL_KEYS, "unknown.")
_BATCH_KEYS = ("train.micro_batch_size", "train.grad_accum")


@dataclass(slots=True, kw_only=True)
class SettingDifference:
    """A recipe setting that is not the same in every run of a scaling report."""

    key: str
    values: dict[int, Any]  # world size -> the run's value ("not set" where its recipe lacks the key)
    why: str = ""  # for the batch: what a scaling mode would keep equal and did not

    def text(self) -> str:
        per_run = ", ".join(f"N={n}: {v}" for n, v in self.values.items())
        return f"{self.key} ({per_run}){'; ' + self.why if self.why else ''}"


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _settings(profile: dict[str, Any]) -> dict[str, Any] | None:
    """The run's settings, flat: its resolved recipe, or a wrapped run's workload; None without either."""
    recipe = profile.get("recipe") or profile.get("workload")
    if not isinstance(recipe, dict):
        return None
    return {k: v for k, v in _flat(recipe).items()
            if not any(k == p or (p.endswith(".") and k.startswith(p)) for p in _PER_RUN_PREFIXES)}


def setting_differences(points: list[dict[str, Any]]) -> list[SettingDifference]:
    """The recipe settings in which the runs differ, other than what a world-size change itself changes:
    the output dir, and the per-rank batch where either it (weak scaling) or the global batch (strong
    scaling: micro batch x grad_accum x N) is the same in every run. Runs without a recipe are left out."""
    runs = sorted(((p["world_size"], s) for p in points if (s := _settings(p["profile"])) is not None),
                  key=lambda r: r[0])
    if len(runs) < 2:
        return []
    diffs = []
    for key in sorted({k for _, s in runs for k in s} - set(_BATCH_KEYS)):
        values = {n: s.get(key, "not set") for n, s in runs}
        if len({repr(v) for v in values.values()}) > 1:
            diffs.append(SettingDifference(key=key, values=values))
    batch = {n: (s.get("train.micro_batch_size"), s.get("train.grad_accum", 1)) for n, s in runs}
    if all(isinstance(m, int) and isinstance(a, int) for m, a in batch.values()):
        per_rank = {n: m * a for n, (m, a) in batch.items()}
        if len(set(per_rank.values())) > 1 and len({n * b for n, b in per_rank.items()}) > 1:
            diffs.append(SettingDifference(
                key=" x ".join(_BATCH_KEYS), values={n: f"{m}x{a}" for n, (m, a) in batch.items()},
                why="neither the per-rank batch (weak scaling) nor the global batch (strong scaling) is the same"))
    elif len(set(batch.values())) > 1:
        diffs.append(SettingDifference(key=" x ".join(_BATCH_KEYS), values={n: f"{m}x{a}" for n, (m, a) in batch.items()}))
    return diffs


def load_run(run_dir: Path) -> dict[str, Any]:
    profile = read_profile_file(run_dir / "profile.json")  # cut short or not a profile: a one-line error
    return {"run_dir": str(run_dir), "profile": profile, "world_size": (profile.get("env") or {}).get("world_size")}


def collect_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Run dirs given directly, or dirs holding run dirs (as collected from a cluster)."""
    from trainprof.errors import UserError

    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "profile.json").is_file():
            found.append(p)
        elif p.is_dir():
            inner = sorted(q.parent for q in p.glob("**/profile.json"))
            if not inner:
                raise UserError(f"'{p}' holds no profile.json; pass run dirs written by trainprof.run")
            found += inner
        else:
            raise UserError(f"run dir '{p}' not found")
    runs = [load_run(p) for p in found]
    for r in runs:
        n = r["world_size"]
        if n is None:
            raise UserError(f"'{r['run_dir']}/profile.json' has no env.world_size; is it a trainprof profile?")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"'{r['run_dir']}/profile.json': env.world_size is {n!r} ({type(n).__name__}), not an "
                            "integer >= 1; fix the profile or pass another run dir")
    return runs


def _tokens_per_step(profile: dict[str, Any], world_size: int) -> float | None:
    """Global tokens per optimizer step, from the resolved recipe (micro batch x accumulation x seq x ranks)."""
    r = profile.get("recipe") or {}
    try:
        t = r["train"]
        return t["micro_batch_size"] * t["grad_accum"] * r["data"]["seq_len"] * world_size
    except (KeyError, TypeError):
        steps = profile.get("steps") or []
        return steps[0].get("tokens") if steps else None


def _throughput(profile: dict[str, Any], world_size: int) -> tuple[float | None, str | None]:
    """(global tokens/s, None) from the profile; else derived from the recipe's tokens per step and the
    median step time, with a note saying so."""
    s = profile.get("summary") or {}
    if s.get("tokens_per_s"):
        return s["tokens_per_s"], None
    tok, step_ms = _tokens_per_step(profile, world_size), (s.get("step_ms") or {}).get("median")
    if tok and step_ms:
        return tok / (step_ms / 1e3), ("tokens/s derived as micro batch x grad_accum x seq_len x ranks (recipe) / "
                                       "median step ms, the profile having no summary.tokens_per_s")
    return None, None


def _phases(profile: dict[str, Any]) -> dict[str, float] | None:
    s = profile.get("summary") or {}
    across = (s.get("across_ranks") or {}).get("phases_ms")
    if isinstance(across, dict) and across:
        out = {p: v.get("median") if isinstance(v, dict) else v for p, v in across.items()}
    elif isinstance(s.get("phases_ms"), dict):
        out = dict(s["phases_ms"])
    else:
        return None
    if s.get("unattributed_ms") is not None:
        out["unattributed"] = s["unattributed_ms"]
    return out


def _imbalance_ms(profile: dict[str, Any]) -> tuple[float | None, str]:
    ranks = [r for r in profile.get("ranks") or [] if isinstance(r, dict)]
    if len(ranks) < 2:
        return 0.0, "one rank"
    for key in ("busy_ms_median", "step_ms_median"):
        values = [r.get(key) for r in ranks]
        if all(isinstance(v, (int, float)) for v in values):
            return max(values) - statistics.median(values), key
    return None, "profile.json ranks[] have no busy_ms_median or step_ms_median"


def _group(p: dict[str, float], keys: tuple[str, ...]) -> float | None:
    vals = [p.get(k) for k in keys]
    return None if any(v is None for v in vals) else sum(vals)


def analyze(points: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Efficiency and lost-efficiency parts per point.

    Args:
        points: [{label, world_size, run_dir, profile}], any order.
    Returns:
        (rows sorted by world size, null reasons as notes).
    """
    pts = sorted(points, key=lambda p: p["world_size"])
    ref = pts[0]
    n0 = ref["world_size"]
    tput0, how0 = _throughput(ref["profile"], n0)
    tok0 = _tokens_per_step(ref["profile"], n0)
    ph0 = _phases(ref["profile"])
    reasons: dict[str, str] = {}
    rows = []
    for p in pts:
        prof, n = p["profile"], p["world_size"]
        s = prof.get("summary") or {}
        tput, how = _throughput(prof, n)
        if how or how0:
            reasons["tokens/s"] = how or how0
        tok = _tokens_per_step(prof, n)
        row: dict[str, Any] = {"label": p.get("label") or Path(p["run_dir"]).name, "world_size": n,
                               "tokens_per_s": tput, "step_ms": (s.get("step_ms") or {}).get("median"),
                               "run_dir": p["run_dir"],
                               "straggler": (prof.get("straggler") or {}).get("rank") if prof.get("straggler") else None}
        if not tput or not tput0:
            row["efficiency"] = None
            reasons["efficiency"] = "a run has no summary.tokens_per_s (nor step time and tokens per step)"
            rows.append(row)
            continue
        eff = tput * n0 / (n * tput0)
        row["efficiency"] = eff
        row["ideal_tokens_per_s"] = tput0 * n / n0
        t_n = tok / tput * 1e3 if tok else row["step_ms"]
        excess = t_n * (1 - eff)
        row["implied_step_ms"], row["excess_ms"] = t_n, excess
        r = (tok / n) / (tok0 / n0) if tok and tok0 else 1.0
        ph = _phases(prof)
        imb, imb_src = _imbalance_ms(prof)
        parts: dict[str, float | None] = {"imbalance": imb}
        if imb is None:
            reasons["imbalance"] = imb_src
        if ph is None or ph0 is None:
            parts.update(comm=None, idle=None, compute=None)
            reasons["comm, idle, compute"] = ("profile.json has no summary.phases_ms (the step profiler's phase "
                                              "split); their share is in `other`")
        else:
            ce = _group(ph, ("comm_exposed",))
            ce0 = _group(ph0, ("comm_exposed",))
            if ce is None or ce0 is None:
                parts["comm"] = None
            else:  # the straggler's lead is already counted as imbalance: take it out of the growth it hides in
                growth = ce - r * ce0
                parts["comm"] = growth - min(imb or 0.0, max(growth, 0.0))
            idle_keys = ("data_wait", "unattributed") if "unattributed" in ph and "unattributed" in ph0 else ("data_wait",)
            i1, i0 = _group(ph, idle_keys), _group(ph0, idle_keys)
            parts["idle"] = None if i1 is None or i0 is None else i1 - r * i0
            comp = ("forward", "backward", "recompute", "optimizer")
            c1, c0 = _group(ph, comp), _group(ph0, comp)
            parts["compute"] = None if c1 is None or c0 is None else c1 - r * c0
        if n == n0:  # the baseline: 100% against itself by definition, which its label says
            parts = {k: (0.0 if v is not None else None) for k, v in parts.items()}
            row["label"] += " (baseline)"
        parts["other"] = excess - sum(v for v in parts.values() if v is not None)
        for k in PARTS:
            row[f"{k}_ms"] = parts.get(k)
            row[f"{k}_lost"] = None if parts.get(k) is None or not t_n else parts[k] / t_n
        rows.append(row)
    notes = [f"{k}: {v}" if k == "tokens/s" else f"{k} n/a: {v}" for k, v in reasons.items()]
    return rows, notes


def comm_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world size and collective: calls, bytes, time and bandwidth per step (summed over phases)."""
    rows = []
    for p in sorted(points, key=lambda p: p["world_size"]):
        agg: dict[str, dict[str, Any]] = {}
        for c in p["profile"].get("comm") or []:
            a = agg.setdefault(c.get("op", "?"), {"world_size": p["world_size"], "op": c.get("op", "?"), "calls": 0,
                                                  "bytes": 0, "total_ms": 0.0, "exposed_ms": 0.0,
                                                  "group_size": c.get("group_size") or p["world_size"]})
            for k in ("calls", "bytes", "total_ms", "exposed_ms"):
                a[k] += c.get(k) or 0
        for a in agg.values():
            a["algbw_gbps"], a["busbw_gbps"] = bandwidth_gbps(a["op"], a["bytes"], a["total_ms"] / 1e3, a["group_size"])
            rows.append(a)
    return rows


SCALE_COLUMNS = [
    Column("label", "run"),
    Column("world_size", "ranks (N)", fmt_text),
    Column("tokens_per_s", "tokens/s", fmt_num(0)),
    Column("ideal_tokens_per_s", "ideal tokens/s", fmt_num(0)),
    Column("efficiency", "efficiency", fmt_pct),
    *[Column(f"{k}_lost", f"lost: {PART_LABELS[k]}", fmt_pct) for k in PARTS],
    Column("step_ms", "step ms (median)", fmt_num(1)),
    Column("implied_step_ms", "step ms implied by tokens/s", fmt_num(1)),
    Column("excess_ms", "excess ms over ideal", fmt_num(1)),
    *[Column(f"{k}_ms", f"{k} ms", fmt_num(1)) for k in PARTS],
    Column("straggler", "straggler rank", fmt_text),
    Column("run_dir", "run dir", fmt_text),
]
COMM_COLUMNS = [
    Column("world_size", "ranks (N)", fmt_text),
    Column("op", "collective"),
    Column("group_size", "group size", fmt_text),
    Column("calls", "calls / step", fmt_num(1)),
    Column("bytes", "MiB / step", lambda b: "n/a" if b is None else f"{b / 2**20:,.2f}"),
    Column("total_ms", "total ms / step", fmt_num(2)),
    Column("exposed_ms", "exposed ms / step", fmt_num(2)),
    Column("algbw_gbps", "algbw GB/s", fmt_num(3, thousands=False)),
    Column("busbw_gbps", "busbw GB/s", fmt_num(3, thousands=False)),
]


def cpu_threads_note(points: list[dict[str, Any]]) -> str | None:
    """A note where the runs' ranks had different numbers of CPU threads (env.cpu_threads, per rank): on a
    CPU the ranks share the cores, so N ranks each get fewer threads and compute slows for that reason too."""
    threads = {p["world_size"]: (p["profile"].get("env") or {}).get("cpu_threads") for p in
               sorted(points, key=lambda p: p["world_size"])}
    known = {n: t for n, t in threads.items() if isinstance(t, int)}
    if len(set(known.values())) < 2:
        return None
    per_run = ", ".join(f"N={n}: {t}" for n, t in known.items())
    return (f"CPU threads per rank differ between the runs (env.cpu_threads: {per_run}): the ranks share the "
            "machine's cores, so part of the compute slowdown is each rank having fewer threads, not scaling overhead")


def measurement_notes(points: list[dict[str, Any]], mode: str,
                      differences: list[SettingDifference] = ()) -> list[str]:
    prof = min(points, key=lambda p: p["world_size"])["profile"] if points else {}
    s, env, meas = prof.get("summary") or {}, prof.get("env") or {}, prof.get("measurement") or {}
    notes = [EFFICIENCY_FORMULA,
             f"scaling mode: {mode}",
             "baseline: the smallest world size measured; its efficiency is 100% by definition (against itself)"]
    if differences:
        notes.append("settings differ between the runs (compared anyway, --allow-different-settings): "
                     + "; ".join(d.text() for d in differences))
    threads = cpu_threads_note(points)
    if threads:
        notes.append(threads)
    notes += ["lost efficiency: each part is ms per step over the perfectly scaled step, divided by the step time "
              "tokens/s implies; parts + efficiency = 100% (see trainprof/sweep/scaling.py for each part's formula)",
              f"tokens/s: {s.get('tokens_per_s_method') or s.get('tokens_per_s_scope') or 'global tokens per step / median step'}",
              f"timer: {env.get('timer', '?')}" + (f" ({meas['timer']})" if meas.get("timer") else "")]
    if meas.get("phases"):
        notes.append(f"phases: {meas['phases']}")
    if meas.get("comm_exposed"):
        notes.append(f"comm_exposed: {meas['comm_exposed']}")
    notes.append("bandwidth: " + (meas.get("comm_bandwidth") or "nccl-tests PERFORMANCE.md formulas "
                                  "(trainprof/analysis/bandwidth.py), t = issue-to-completion"))
    return notes


def write_scale_report(out_dir: Path, rows: list[dict[str, Any]], comms: list[dict[str, Any]], notes: list[str], *,
                       title: str) -> list[Path]:
    chart = _chart(out_dir / "scaling.png", rows, comms, notes)
    paths = write_tables(out_dir / "scaling", rows, SCALE_COLUMNS, title=title, notes=notes, image=chart.name)
    comm_notes = notes[-1:] if comms else ["profile.json has no comm records (the step profiler's collective "
                                           "records are not in these runs, or every run had one rank)"]
    paths += write_tables(out_dir / "scaling_comm", comms, COMM_COLUMNS, title=f"{title}: collectives", notes=comm_notes)
    return [*paths, chart]


def _chart(path: Path, rows: list[dict[str, Any]], comms: list[dict[str, Any]], notes: list[str]) -> Path:
    plt = pyplot()
    panels = 3 if comms else 2
    fig, axes, rect = figure(plt, panels, width_in=5.5 * panels + 1, plot_height_in=4.5, notes=notes)
    ax = axes[0]
    x = list(range(len(rows)))
    labels = [f"N={r['world_size']}" for r in rows]
    eff = [r.get("efficiency") or 0 for r in rows]
    ax.bar(x, eff, color="#55a868", label="efficiency")
    colors = {"comm": "#c44e52", "idle": "#8172b2", "imbalance": "#dd8452", "compute": "#4c72b0", "other": "#999999"}
    up, down = list(eff), [0.0] * len(rows)
    for k in PARTS:
        vals = [r.get(f"{k}_lost") or 0 for r in rows]
        pos = [max(v, 0) for v in vals]
        neg = [min(v, 0) for v in vals]
        ax.bar(x, pos, bottom=up, color=colors[k], label=PART_LABELS[k])
        if any(neg):
            ax.bar(x, neg, bottom=down, color=colors[k], hatch="//", alpha=0.6)
        up = [a + b for a, b in zip(up, pos)]
        down = [a + b for a, b in zip(down, neg)]
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylim(min(down) - 0.05, max(up) + 0.05)
    ax.set_xticks(x)
    ax.set_xticklabels(labels)
    ax.set_ylabel("fraction of a perfectly scaled step")
    ax.set_title("scaling efficiency and where the rest went\n(hatched below 0: a part that got faster)", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    ax = axes[1]
    ns = [r["world_size"] for r in rows]
    ax.plot(ns, [r.get("tokens_per_s") or 0 for r in rows], marker="o", label="measured")
    ax.plot(ns, [r.get("ideal_tokens_per_s") or 0 for r in rows], ls="--", color="gray", label="ideal (linear)")
    for r in rows:
        if r.get("efficiency") is not None:
            ax.annotate(f"{100 * r['efficiency']:.1f}%", (r["world_size"], r.get("tokens_per_s") or 0), fontsize=8,
                        textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("ranks N")
    ax.set_ylabel("tokens/s (global)")
    ax.set_title("throughput", fontsize=9)
    ax.legend(fontsize=7)
    if comms:
        ax = axes[2]
        for op in dict.fromkeys(c["op"] for c in comms):
            mine = [c for c in comms if c["op"] == op and c.get("busbw_gbps") is not None and c["group_size"] > 1]
            if mine:
                ax.plot([c["world_size"] for c in mine], [c["busbw_gbps"] for c in mine], marker="o", label=op)
        ax.set_xlabel("ranks N")
        ax.set_ylabel("busbw GB/s")
        ax.set_title("achieved bus bandwidth per collective", fontsize=9)
        legend_if_labelled(ax, fontsize=7)
    return save_figure(fig, path, rect)
