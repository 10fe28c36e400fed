"""A projection's outputs, kept one folder per call: projection.json (with a generic `table` the run
report lists), .md, .csv, .html and a chart; and the table `trainprof project` prints."""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
from pathlib import Path
from typing import Any, Callable

from trainprof.io import atomic_write_json
from trainprof.projection.changes import THIS, counts_ranks
from trainprof.projection.projector import MFU_CONVENTION
from trainprof.projection.validation import COMM_BOUND_MARK, HOST_BOUND_MARK
from trainprof.report.projections import PROJECTION_FILE, PROJECTIONS_DIR
from trainprof.phases import PHASES
from trainprof.report.plots import figure, pyplot, save_figure
from trainprof.report.tables import Column, fmt_num, fmt_pct, fmt_text, write_tables

GIB = 2**30


def _fmt_bytes(x: Any) -> str:
    """GiB with two decimals, and two significant digits below 0.01 (a 0.001 GiB cap is not 0.00)."""
    if x is None:
        return "n/a"
    gib = x / GIB
    return f"{gib:.2g}" if 0 < gib < 0.01 else f"{gib:,.2f}"


def _fmt_bool(x: Any) -> str:
    return "n/a" if x is None else ("yes" if x else "no")


# a column of times to train takes one unit, chosen from its values: (name, seconds, up to this many seconds)
DURATION_UNITS = (("s", 1, 120), ("min", 60, 2 * 3600), ("h", 3600, 2 * 86400), ("days", 86400, 2 * 365.25 * 86400),
                  ("years", 365.25 * 86400, float("inf")))


def duration_unit(values: list[Any]) -> tuple[str, float]:
    """The unit one column of durations is written in: the one that suits the median of its values."""
    known = sorted(v for v in values if v is not None)
    median = known[len(known) // 2] if known else 3600
    name, per, _ = next(u for u in DURATION_UNITS if median < u[2])
    return name, per


def fmt_in(per: float) -> Callable[[Any], str]:
    """Durations (s) in a unit of `per` seconds, three significant figures at most, thousands separated."""
    def fmt(seconds: Any) -> str:
        if seconds is None:
            return "n/a"
        v = seconds / per
        return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2g}"
    return fmt


def _fmt_usd(x: Any) -> str:
    return "n/a" if x is None else f"${x:,.0f}" if x >= 100 else f"${x:.2f}"  # a small job's cost is not $0


def _devices(result: dict[str, Any]) -> str:
    """What a row's world size counts: GPUs, or ranks where the target is the CPU source's own machine."""
    cpu = [counts_ranks(p["hardware"], result["source"]["device_type"]) for p in result["predictions"]]
    return "ranks" if cpu and all(cpu) else "GPUs / ranks" if any(cpu) else "GPUs"


def columns(result: dict[str, Any]) -> list[Column]:
    """The table's columns; time to train and total cost only when tokens (and prices) were given."""
    preds, unit = result["predictions"], _devices(result)
    one = {"GPUs": "GPU", "ranks": "rank"}.get(unit, "GPU or rank")
    ordered_by = next((p.get("ordered_by") for p in preds if p.get("ordered_by")), "tokens_per_s")
    order = "order (1 = lowest $/M tokens)" if ordered_by == "cost_per_million_tokens_usd" else "order (1 = most tokens/s)"
    cols = [
        Column("order", order, fmt_text),
        Column("hardware", "hardware", fmt_text),
        Column("gpus_text", f"{unit} (nodes x per node)", fmt_text),
        Column("model", "model", fmt_text),
        Column("overrides_text", "recipe changes", fmt_text),
        Column("step_ms", "step ms", fmt_num(1)),
        Column("confidence_text", "confidence", fmt_text),
        Column("host_text", "host assumed (µs a forward op call)", fmt_text),
        Column("tokens_per_s", f"tokens/s (all {unit})", fmt_num(0)),
        Column("mfu", "MFU", fmt_pct),
        Column("scaling_text", "scaling eff.", fmt_text),
        Column("scaling_base_gpus", f"vs {unit}", fmt_text),
        Column("memory_per_rank_bytes", f"memory/{one} GiB", _fmt_bytes),
        Column("fits", "fits", _fmt_bool),
        Column("cost_per_million_tokens_usd", "$ / M tokens", fmt_num(3)),
    ]
    if result.get("tokens"):
        name, per = duration_unit([p.get("time_to_train_s") for p in preds])
        cols.append(Column("time_to_train_s", f"time to train {result['tokens']:.3g} tokens ({name})", fmt_in(per)))
        if any(p.get("cost_to_train_usd") is not None for p in preds):
            cols.append(Column("cost_to_train_usd", "total cost", _fmt_usd))
    return cols


def rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in result["predictions"]:
        row = dict(p)
        row["overrides_text"] = " ".join(p["overrides"]) or "none"
        row["gpus_text"] = f"{p['world_size']} ({p['nodes']} x {p['gpus_per_node']})" if p["nodes"] > 1 else str(p["world_size"])
        row["host_text"] = host_pace_text(p.get("host_pace"), short=True)
        row["scaling_text"] = scaling_text(p)
        out.append(row)
    return out


def scaling_text(p: dict[str, Any]) -> str:
    """The scaling-efficiency cell: the percentage, or n/a with its reason in a few words (the whole reason is
    under the table)."""
    if p.get("scaling_efficiency") is not None:
        return fmt_pct(p["scaling_efficiency"])
    why = (p.get("reasons") or {}).get("scaling_efficiency") or ""
    if why.startswith("one "):
        return "n/a (the baseline)"
    if "do not fit" in why:
        return "n/a (fewer do not fit)"
    return "n/a"


HOST_BASIS = {"own": "this run's {us:.1f}", "ceiling": "this run's, at most {us:.1f}",
              "reference": "reference {us:.1f}", "paced": "{us:.1f}: reference {ref:.1f} at this run's host pace"}


def host_pace_text(pace: dict[str, Any] | None, *, short: bool = False) -> str:
    """The host a GPU row's operator calls run at (projector's `host_pace`): e.g. "this run's, at most 33.1
    µs/call" or "reference 38.1 µs/call (2 hosts, 27.7-48.5)"; "" where the row models no host (a CPU row,
    or the source's own machine, whose phases are as measured). `short`: without the "host: " lead."""
    if not pace or pace.get("us_per_call") is None:
        return ""
    text = HOST_BASIS.get(pace["basis"], "{us:.1f}").format(us=pace["us_per_call"],
                                                              ref=pace.get("reference_us_per_call") or 0.0) + " µs/call"
    hosts = pace.get("reference_hosts_us") or []
    if pace["basis"] == "reference" and hosts:
        text += (f" ({len(hosts)} hosts, {min(hosts):.1f}-{max(hosts):.1f})" if len(hosts) > 1 else " (1 host)")
    if pace.get("stand_in") and pace["basis"] in ("reference", "paced"):
        text += ", another engine's standing in"
    return text if short else f"host: {text}"


def _host_key(pace: dict[str, Any]) -> tuple:
    return tuple(sorted((ph, v["basis"], round(v["us_per_call"], 1)) for ph, v in (pace.get("by_phase") or {}).items()))


def host_order_note(items: list[tuple[str, dict[str, Any] | None, bool, float | None]]) -> str | None:
    """Where GPU rows assume different hosts and one of them is predicted host-bound, the note that their order
    follows the host assumed, not the GPU. `items`: (row label, host_pace, host-bound, device ms a step or None)."""
    paced = [(label, pace, bound, dev) for label, pace, bound, dev in items if pace and pace.get("us_per_call")]
    groups: dict[tuple, list[str]] = {}
    for label, pace, _, _ in paced:
        groups.setdefault(_host_key(pace), []).append(label)
    if len(groups) < 2 or not any(bound for _, _, bound, _ in paced):
        return None
    said = {_host_key(pace): host_pace_text(pace, short=True) for _, pace, _, _ in paced}
    which = "; ".join(f"{', '.join(labels)}: {said[key]}" for key, labels in groups.items())
    device = [f"{label} {dev:,.1f}" for label, _, bound, dev in paced if bound and dev is not None]
    return ("host: these rows assume different hosts (a forward op call: " + which + "), and host-bound rows wait "
            "for theirs, so their order follows the host assumed, not the GPU. A GPU run's own GPU kind keeps its "
            "host's pace (at most what its device-bound phases left), another kind takes the catalog's reference "
            "host (gpu_host_us_per_op)" + (f"; the GPUs' own work a step (forward, backward, recompute, ms): "
                                          f"{', '.join(device)}" if device else ""))


def _device_ms(p: dict[str, Any]) -> float | None:
    bound = next((a["values"] for a in p.get("assumptions") or [] if a["kind"] == "host_bound_target"), None)
    return bound["device_ms"] if bound else None


def link_notes(preds: list[dict[str, Any]]) -> list[str]:
    """The links each catalog target's collectives were priced over (intra- and inter-node), once per distinct
    set, and that their datasheet bandwidth is taken as bus bandwidth: an upper bound, so comm is a lower bound."""
    said: dict[str, list[str]] = {}
    for p in preds:
        links = p.get("links")
        if not links or not links.get("intra_node"):
            continue
        intra = links["intra_node"]
        text = f"inside a node {intra['name']}, {intra['gbps_per_direction']:g} GB/s per direction per GPU"
        inter = links.get("inter_node")
        if inter:
            text += f"; between nodes {inter['name']}, {inter['gbps_per_direction']:g} GB/s"
            if links.get("inter_node_is_default"):
                others = {k: v for k, v in (links.get("node_templates_inter_node") or {}).items()
                          if v["key"] != inter["key"]}
                text += (" (the catalog's default_inter_node_link for a GPU named alone" + (
                    f"; its node template{'s' * (len(others) > 1)} "
                    + ", ".join(f"{k} use{'s' * (len(others) == 1)} {v['name']}" for k, v in others.items())
                    + ": --to that template for its network" if others else "") + ")")
        said.setdefault(text, []).append(f"{p['hardware']} x {p['world_size']}")
    if not said:
        return []
    per_rows = "; ".join(", ".join(rows) + ": " + text for text, rows in said.items())
    return ["links assumed, at their datasheet bandwidth taken as bus bandwidth (an upper bound: the comm times are "
            f"a lower bound): {per_rows}"]


def notes(result: dict[str, Any]) -> list[str]:
    src = result["source"]
    out = [
        f"source: {src['run_dir']} measured on {src['device']} x {src['world_size']} ({src['timer']} timer), "
        f"step {src['step_ms']:.1f} ms (slowest rank's median), peak memory "
        + (f"{src['peak_memory_bytes'] / GIB:.2f} GiB" if src.get("peak_memory_bytes") else "n/a")
        + ("" if src.get("recipe_origin") == "recipe.yaml" else f"; recipe rebuilt from its {src.get('recipe_origin')}"),
        "step ms: the step model (trainprof/projection/stepmodel.py) re-derives every measured phase for the "
        "target; each prediction's assumptions are listed in projection.json",
        "confidence: the step-time error scripts/bench_projection.py measured for that kind of change "
        "(validation.json: the mean absolute error, and the worst run's); 'unvalidated' when a kind of change was never checked against real runs (a CPU "
        "run projected to a GPU always is), 'low' when the source GPU was mostly idle (host-bound)",
        f"MFU: {MFU_CONVENTION}",
        "scaling eff.: predicted tokens/s at N GPUs over N/N0 x the predicted tokens/s at N0 GPUs of the same kind "
        "and settings (the 'vs' column): N0 = 1, or where the settings do not fit one GPU the fewest (a power of two) "
        "they fit; with ZeRO each of the N0 does a larger share of the optimizer step, so it can pass 100% (a row "
        "that does says which phases shrank per rank); n/a on a one-GPU row (the baseline)",
        "memory/GPU: trainprof plan's formulas for the target (plus what the source measured beyond them on the "
        "same machine); fits: under the catalog's memory capacity (on the source's machine: under "
        "train.memory_cap_gb, else its GPU's capacity less the CUDA context and allocator reserve plan counts)",
        "cost: price x GPUs / tokens/s, only from --price or a price file with source and date (never invented)",
        "host on a GPU: operator calls x a GPU host's time per call (the source's own where its GPU waited for it, "
        "else the catalog's gpu_host_us_per_op, measured on the reference profiles per engine and ZeRO-3 or not; "
        "which one, and any stand-in, is among the assumptions); for a traced GPU source, `trainprof replay SOURCE "
        "--to TARGET` replays its kernels from its host launches instead (its error: validation_gpu.json)",
    ]
    if src.get("unknown"):
        out.append("not recorded by the wrapped run, recipe defaults used: "
                   + "; ".join(f"{k} ({why})" for k, why in src["unknown"].items()))
    priced = {p["hardware"]: p["price"] for p in result["predictions"] if p.get("price")}
    for hardware, price in priced.items():
        given = "" if price["priced_as"] == hardware else f"given for its GPU {price['priced_as']}; "
        out.append(f"price of {hardware}: ${price['usd_per_gpu_hour']:g} per GPU-hour ({given}{price['source']}, "
                   f"{price['date']})")
    out += [*result.get("warnings", []), *_source_notes(result)]
    preds = result["predictions"]
    host = host_order_note([(f"{p['hardware']} x {p['world_size']}", p.get("host_pace"),
                             p.get("bound_by") == "host", _device_ms(p)) for p in preds])
    out += ([host] if host else []) + link_notes(preds)
    for p in preds:
        if p.get("fit_suggestion"):
            out.append(f"{p['hardware']} x {p['world_size']}: does not fit; would fit with "
                       f"{' '.join(p['fit_suggestion'])} (plan)")
        elif p.get("fits") is False and p["hardware"].startswith(THIS):
            out.append(f"{p['hardware']} x {p['world_size']}: does not fit ({_fmt_bytes(p['memory_per_rank_bytes'])} "
                       "GiB a rank predicted, over train.memory_cap_gb or, without it, the GPU's memory)")
        elif p.get("fits") is False:
            out.append(f"{p['hardware']} x {p['world_size']}: does not fit ({_fmt_bytes(p['memory_per_rank_bytes'])} "
                       f"GiB a GPU, plan){_fit_advice_text(p.get('fit_advice'))}")
        why_scaling = (p.get("reasons") or {}).get("scaling_efficiency")
        if why_scaling and p.get("tokens_per_s") and p["world_size"] > 1:
            out.append(f"{p['hardware']} x {p['world_size']}: scaling eff. n/a: {why_scaling}")
        if p.get("above_linear"):
            out.append(f"{p['hardware']} x {p['world_size']}: scaling eff. {p['scaling_efficiency']:.1%} against "
                       f"{p['scaling_base_gpus']} ('vs GPUs'): per rank {p['above_linear']}")
        host = p.get("host_memory_per_rank_bytes")
        if host:
            per_node = f" ({_fmt_bytes(host * p['gpus_per_node'])} GiB a node of {p['gpus_per_node']})" \
                if p["gpus_per_node"] > 1 else ""
            out.append(f"{p['hardware']} x {p['world_size']}: needs {_fmt_bytes(host)} GiB of host memory a GPU{per_node} "
                       "for what it offloads (plan); the catalog describes no node's host memory: 'fits' counts GPU "
                       "memory only")
        why = (p.get("reasons") or {}).get("step_ms")
        if why:
            out.append(f"{p['hardware']} x {p['world_size']}: step not predicted: {why}")
    return out


def _fit_advice_text(advice: dict[str, Any] | None) -> str:
    """What a target that does not fit was tried with (only settings the recipe rules accept), what they refuse,
    and whether more GPUs bring it under the capacity (they do not where a part is replicated on every GPU)."""
    if not advice:
        return ": a GPU with more memory or a smaller model"
    tried = ", ".join(f"{' '.join(t['overrides'])} ({_fmt_bytes(t['bytes'])})" for t in advice["tried"])
    text = f", nor with {tried}" if tried else ""
    if advice.get("refused"):
        reasons = dict.fromkeys(advice["refused"].values())
        text += f" (the recipe rules refuse the other settings tried: {'; '.join(reasons)})"
    more, cap = advice["more_gpus"], advice["capacity_bytes"]
    least = advice["least"]
    setting = f" with {' '.join(least['overrides'])}" if least["overrides"] else ""
    if more.get("gpus"):
        return (f"{text}: more GPUs ({_fmt_bytes(more['bytes'])} GiB a GPU at {more['gpus']:,}{setting}) or a "
                "smaller model")
    return (f"{text}; more GPUs do not bring it under {_fmt_bytes(cap)} GiB ({_fmt_bytes(more['bytes'])} GiB a GPU "
            f"at {more['tried_up_to']:,}{setting}: what is not partitioned stays on every GPU): a GPU with more "
            "memory or a smaller model")


def _source_notes(result: dict[str, Any]) -> list[str]:
    """What of the source carries into the rows: from a CPU run to a GPU, not its measured step; and where an
    as-measured row's MFU differs from the run's own (the FLOP convention)."""
    src, preds, out = result["source"], result["predictions"], []
    if _cpu_to_gpu(result):
        out.append(cpu_to_gpu_note(src))
    summary_mfu = src.get("mfu")
    for p in preds:
        if p.get("change_kinds") == ["none"] and p.get("mfu") and summary_mfu and abs(p["mfu"] - summary_mfu) >= 5e-4:
            out.append(f"{p['hardware']} x {p['world_size']} (as measured): MFU {p['mfu']:.1%} by PaLM's formula "
                       f"(every row's convention); the run's own summary says {summary_mfu:.1%}, from the FLOPs it "
                       f"counted (measured / analytic {src.get('measured_over_analytic') or 0:.3f}), on the same step")
    return out


def cpu_to_gpu_note(src: dict[str, Any]) -> str:
    """What a CPU source's GPU rows take from it (stepmodel / compute.rerated_phase): not its step time."""
    return ("from a CPU run to a GPU: the rows carry over the run's recipe and shapes, the operator calls it issued "
            "outside the decoder layers (the layers' are the GPU reference runs'), and its time outside the phases and "
            "its data wait, as measured; each GPU step is derived from the target's catalog rates for the model's "
            "GEMMs and memory traffic and a GPU reference host's time per call, not scaled from the measured CPU step "
            f"({src['step_ms']:,.1f} ms), which moves it only through those carried parts")


def label(targets: list[str], overrides: list[str]) -> str:
    """A folder-name label for one call: its targets and changes."""
    text = "_".join(targets) + ("_" + "_".join(overrides) if overrides else "")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text)[:80].strip("-") or "projection"


def new_projection_dir(run_dir: Path, targets: list[str], overrides: list[str]) -> Path:
    """<run dir>/projections/<UTC stamp>-<label>/, never one an earlier call wrote."""
    from trainprof.layout import new_run_dir

    return new_run_dir(run_dir / PROJECTIONS_DIR, label(targets, overrides), stamp_first=True)


def _document(result: dict[str, Any], *, title: str, command: str, header: list[str], cells: list[list[Any]],
              notes_: list[str]) -> dict[str, Any]:
    """projection.json: the result with what the run report lists (title, time, command, table, notes)."""
    return {**result, "title": title, "command": command,
            "created_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "table": {"columns": header, "rows": cells}, "notes": notes_}


def write_projection(result: dict[str, Any], out_dir: Path, *, title: str, command: str) -> list[Path]:
    """projection.json (with the generic `table` the run report lists), .md, .csv, .html and .png."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cols, table_rows = columns(result), rows(result)
    doc = _document(result, title=title, command=command, header=[c.header for c in cols],
                    cells=[[c.fmt(r.get(c.key)) for c in cols] for r in table_rows], notes_=notes(result))
    atomic_write_json(out_dir / PROJECTION_FILE, doc)
    image = None
    if any(p["tokens_per_s"] for p in result["predictions"]):
        image = plot_projection(result, out_dir / "projection.png").name
    numbers = ["world_size", "nodes", "gpus_per_node", "expected_error_pct", "expected_max_error_pct",
               "scaling_efficiency"]
    paths = write_tables(out_dir / "projection", table_rows, cols, title=title,
                         intro=[_intro(result), f"Command: `{command}`"], notes=doc["notes"], image=image,
                         csv=([c.key for c in cols] + numbers, table_rows))
    return [out_dir / "projection.json", *paths]


def plot_projection(result: dict[str, Any], path: Path) -> Path:
    """Tokens/s per prediction (bars), and the predicted phase split of each step (stacked bars)."""
    plt = pyplot()
    preds = [p for p in result["predictions"] if p["tokens_per_s"]]
    labels = [f"{p['hardware']}\nx{p['world_size']} {' '.join(p['overrides'])}".strip() for p in preds]
    fig, (ax1, ax2), rect = figure(plt, 2, width_in=12, plot_height_in=4.2, notes=[
        "Predicted by trainprof project from one measured run; error bars: the validated mean step error "
        "(none when not validated); grey bars: unvalidated or low confidence.", f"source: {result['source']['run_dir']}"])
    errs = [p["tokens_per_s"] * (p["expected_error_pct"] or 0) / 100 for p in preds]
    colors = ["#4c72b0" if p.get("confidence") == "validated" else "#bbbbbb" for p in preds]
    ax1.bar(range(len(preds)), [p["tokens_per_s"] for p in preds], yerr=errs, color=colors, capsize=3)
    ax1.set_xticks(range(len(preds)), labels, fontsize=7, rotation=30, ha="right")
    ax1.set_ylabel("predicted tokens/s (all GPUs)")
    bottom = [0.0] * len(preds)
    for phase in PHASES:
        vals = [(p["phases_ms"] or {}).get(phase, 0.0) for p in preds]
        if any(vals):
            ax2.bar(range(len(preds)), vals, bottom=bottom, label=phase)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax2.set_xticks(range(len(preds)), labels, fontsize=7, rotation=30, ha="right")
    ax2.set_ylabel("predicted ms per step, per rank")
    ax2.legend(fontsize=7)
    return save_figure(fig, path, rect)


def _cpu_to_gpu(result: dict[str, Any]) -> bool:
    return result["source"].get("device_type") == "cpu" and any(p.get("host_pace") for p in result["predictions"])


def _measured(result: dict[str, Any]) -> str:
    """The header's word on the source's step: a CPU run's is not what its GPU rows scale."""
    step = f"measured step {result['source']['step_ms']:.1f} ms"
    return f"{step} on its CPU; the GPU rows are derived, not scaled from it" if _cpu_to_gpu(result) else step


def _intro(result: dict[str, Any]) -> str:
    if _cpu_to_gpu(result):
        return ("Predicted from one measured CPU run: the GPU rows take its recipe, shapes and operator counts, not its "
                "step time (the notes say what carries over); every figure is a prediction with its confidence, not a "
                "measurement.")
    return "Predicted from one measured run; every figure is a prediction with its confidence, not a measurement."


def render_short(result: dict[str, Any]) -> str:
    """The table printed on stdout: the same columns as the files."""
    cols = columns(result)
    table = [[c.header for c in cols]] + [[c.fmt(r.get(c.key)) for c in cols] for r in rows(result)]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    src = result["source"]
    head = f"trainprof project: from {src['run_dir']} ({src['device']} x {src['world_size']}, {_measured(result)})"
    said = (": step not predicted:", "does not fit", "of host memory a GPU", "scaling eff. n/a:", "host: these rows",
            "links assumed", "(as measured): MFU", "from a CPU run to a GPU", "warning:", "('vs GPUs'): per rank")
    tail = [f"  {n}" for n in notes(result)[1:] if any(x in n for x in said)]
    return "\n".join([head, *lines, *tail])


# ---------------------------------------------------------------------------------------------
# --best and --table: the same folder layout, their own tables
# ---------------------------------------------------------------------------------------------

def _setting(row: dict[str, Any] | None) -> str:
    return "n/a" if row is None else f"{row['setting']} train.micro_batch_size={row['micro_batch']}"


def _host_memory(row: dict[str, Any], b: dict[str, Any]) -> str:
    """An offload setting's host memory, a GPU and a node (trainprof plan): 'fits' counts GPU memory only."""
    host = row.get("host_memory_per_rank_bytes")
    if not host:
        return ""
    per_node = b.get("gpus_per_node") or 1
    node = f", {_fmt_bytes(host * per_node)} GiB a node of {per_node}" if per_node > 1 else ""
    return f"; host memory {_fmt_bytes(host)} GiB a {b.get('unit', 'GPU')}{node}, plan"


def _none_found(b: dict[str, Any]) -> str:
    """Why a target's search found no setting to rank: what fits is not predicted, nothing fits (by how
    much), or the recipe rules refused every setting."""
    unpredicted = b.get("not_predicted") or []
    if unpredicted:
        first = unpredicted[0]
        return (f"n/a: only settings whose step is not predicted fit, e.g. {_setting(first)} "
                f"({_fmt_bytes(first['memory_per_rank_bytes'])} GiB{_host_memory(first, b)}; why: below)")
    least, capacity = b.get("least_memory_bytes"), b.get("capacity_bytes")
    if least is not None and capacity:
        return (f"n/a: nothing fits: the smallest setting plans {_fmt_bytes(least)} GiB a {b.get('unit', 'GPU')}, "
                f"over {int(100 * b['headroom'])}% of {_fmt_bytes(capacity)} GiB")
    if b.get("refused") and not b["tried"]:
        return "n/a: the recipe rules refuse every setting (notes)"
    return "n/a"


def best_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for b in result["best"]:
        top, cheap = b["best_throughput"], b["best_cost"]
        none_found = _none_found(b)
        out.append({
            "time_to_train_s": top and top["time_to_train_s"],
            "cost_to_train_usd": cheap and cheap["cost_to_train_usd"],
            "hardware": b["hardware"], "world_size": b["world_size"],
            "throughput_setting": _setting(top) + _host_memory(top, b) if top else none_found,
            "tokens_per_s": top and top["tokens_per_s"],
            "memory_per_rank_bytes": top and top["memory_per_rank_bytes"],
            "confidence_text": top and _with_host(top),
            "cost_setting": (_setting(cheap) + _host_memory(cheap, b) if cheap else "n/a" if not top  # the reason
                             else "n/a (no price: --price NAME=USD_PER_GPU_HOUR)"),            # is the cell's above
            "cost_per_million_tokens_usd": cheap and cheap["cost_per_million_tokens_usd"],
            "cost_confidence_text": cheap and _with_host(cheap),
            "runners_up": "; ".join(f"{_setting(r)}{_host_memory(r, b)}: {r['tokens_per_s']:,.0f} tokens/s"
                                    for r in b["runners_up_throughput"]),
            "tried": b["tried"]})
    return out


def _with_host(row: dict[str, Any]) -> str:
    """A search row's confidence with the host it assumes (which orders host-bound rows)."""
    host = host_pace_text(row.get("host_pace"))
    return "; ".join(x for x in (row.get("confidence_text"), host) if x)


BEST_COLUMNS = [
    Column("hardware", "hardware", fmt_text), Column("world_size", "GPUs", fmt_text),
    Column("throughput_setting", "most tokens/s: setting", fmt_text),
    Column("tokens_per_s", "tokens/s", fmt_num(0)), Column("memory_per_rank_bytes", "memory/GPU GiB", _fmt_bytes),
    Column("confidence_text", "confidence", fmt_text),
    Column("cost_setting", "lowest $/M tokens: setting", fmt_text),
    Column("cost_per_million_tokens_usd", "$ / M tokens", fmt_num(3)),
    Column("cost_confidence_text", "its confidence", fmt_text),
    Column("runners_up", "runners-up (tokens/s)", fmt_text), Column("tried", "settings predicted", fmt_text),
]


def best_columns(result: dict[str, Any]) -> list[Column]:
    """BEST_COLUMNS (counting ranks, not GPUs, on a CPU search), with the time to train (fastest setting) and
    its cost (cheapest) when tokens were given."""
    cols = BEST_COLUMNS if _best_unit(result) == "GPU" else [
        dataclasses.replace(c, header=c.header.replace("GPUs", "ranks").replace("/GPU", "/rank")) for c in BEST_COLUMNS]
    tokens = result.get("tokens")
    if not tokens:
        return cols
    name, per = duration_unit([(b["best_throughput"] or {}).get("time_to_train_s") for b in result["best"]])
    extra = [Column("time_to_train_s", f"most tokens/s: time to train {tokens:.3g} tokens ({name})", fmt_in(per))]
    if any(b["best_cost"] for b in result["best"]):
        extra.append(Column("cost_to_train_usd", f"lowest $/M tokens: cost of {tokens:.3g} tokens", _fmt_usd))
    return [*cols[:-2], *extra, *cols[-2:]]


def _best_unit(result: dict[str, Any]) -> str:
    """What a search's world sizes count: "GPU", or "rank" on a CPU."""
    return (result["best"][0].get("unit") if result["best"] else None) or "GPU"


def _best_notes(result: dict[str, Any]) -> list[str]:
    unit = _best_unit(result)
    out = [f"searched {result['searched']}; a setting fits when trainprof plan's memory per {unit} is at most "
           f"{int(100 * result['best'][0]['headroom']) if result['best'] else 90}% of the target's capacity",
           "each setting is one prediction of the step model (its confidence as in `trainprof project`)"]
    return out + _best_target_notes(result) + _best_host_note(result)


def _best_target_notes(result: dict[str, Any]) -> list[str]:
    """Why a target's search left settings out: refused by the recipe rules, or fitting but not predicted."""
    out = []
    for b in result["best"]:
        if b.get("refused"):
            out.append(f"{b['hardware']} x {b['world_size']}: refused by the recipe rules: {', '.join(b['refused'])}")
        by_reason: dict[str, list[str]] = {}
        for row in b.get("not_predicted") or []:
            by_reason.setdefault(row["reason"] or "no reason given", []).append(_setting(row))
        for reason, fitting in by_reason.items():
            out.append(f"{b['hardware']} x {b['world_size']}: fits but not predicted: {', '.join(fitting)}: {reason}")
    return out


def _best_host_note(result: dict[str, Any]) -> list[str]:
    """The host-order note over each target's fastest setting."""
    tops = [(f"{b['hardware']} x {b['world_size']}", b["best_throughput"]) for b in result["best"] if b["best_throughput"]]
    host = host_order_note([(label, top.get("host_pace"), top.get("bound_by") == "host", None) for label, top in tops])
    return [host] if host else []


def write_best(result: dict[str, Any], out_dir: Path, *, command: str) -> list[Path]:
    rows, cols = best_rows(result), best_columns(result)
    title = "Best settings per target"
    doc = _document(result, title=title, command=command, header=[c.header for c in cols],
                    cells=[[c.fmt(r.get(c.key)) for c in cols] for r in rows], notes_=_best_notes(result))
    atomic_write_json(out_dir / PROJECTION_FILE, doc)
    return [out_dir / "projection.json",
            *write_tables(out_dir / "best", rows, cols, title=title, intro=[f"Command: `{command}`"],
                          notes=doc["notes"])]


def render_best(result: dict[str, Any]) -> str:
    lines, tokens = [f"trainprof project --best: from {result['source']['run_dir']}"], result.get("tokens")
    unit, per = duration_unit([(b["best_throughput"] or {}).get("time_to_train_s") for b in result["best"]])
    for b, r in zip(result["best"], best_rows(result)):
        lines.append(f"{r['hardware']} x {r['world_size']}:")
        train = f", {fmt_in(per)(r['time_to_train_s'])} {unit} for {tokens:.3g} tokens" if r["time_to_train_s"] else ""
        tps = f"  ({r['tokens_per_s']:,.0f} tokens/s{train}, {r['confidence_text']})" if r["tokens_per_s"] else ""
        lines.append(f"  most tokens/s   {r['throughput_setting']}{tps}")
        cost = f"${r['cost_per_million_tokens_usd']:.3f} / M tokens" if r["cost_per_million_tokens_usd"] else ""
        if r["cost_to_train_usd"]:
            cost += f", {_fmt_usd(r['cost_to_train_usd'])} for {tokens:.3g} tokens"
        if r["cost_confidence_text"]:
            cost += f" ({r['cost_confidence_text']})"
        lines.append(f"  lowest $/M      {r['cost_setting']}  {cost}".rstrip())
        for i, runner in enumerate(b["runners_up_throughput"]):  # one a line: each setting pastes as overrides
            label = "runners-up" if i == 0 else ""
            lines.append(f"  {label:<15} {_setting(runner)}{_host_memory(runner, b)}  "
                         f"({runner['tokens_per_s']:,.0f} tokens/s)")
    return "\n".join(lines + [f"  {n}" for n in _best_target_notes(result) + _best_host_note(result)])


def _table_cell(cell: dict[str, Any], footnote: Callable[[str], str]) -> str:
    """A research-table cell; a figure that cannot be predicted is n/a with a footnote mark (its reason,
    often a sentence, is written once under the tables)."""
    mb = f"mb {cell.get('micro_batch')}{' (the search cap)' if cell.get('capped') else ''}"
    if cell.get("tokens_per_s") is None:
        why = footnote(cell.get("reason") or "no prediction")
        return f"{mb}, tokens/s n/a {why}" if cell.get("micro_batch") is not None else f"n/a {why}"
    said = cell.get("confidence") or ""
    bound = f", {cell['bound_by']}-bound" if cell.get("bound_by") else ""
    # each figure's confidence beside it, as a mark whose text is written once under the tables, with the host
    # it assumes (which orders host-bound cells)
    host = host_pace_text(cell.get("host_pace"))
    bound += f" {footnote('confidence: ' + (_without_bounds(said) or 'not stated') + (f'; {host}' if host else ''))}"
    if cell.get("micro_batch") is not None:
        return f"{mb}: {cell['tokens_per_s']:,.0f}{bound}"
    mem = f", {cell['memory_gib']:.1f} GiB" if cell.get("memory_gib") else ""
    fit = "" if cell.get("fits") is not False else ", does not fit"
    return f"{cell['tokens_per_s']:,.0f}{mem}{fit}{bound}"


TABLE_TITLES = {"table_iii": "Table III: pretraining, tokens/s (all GPUs) and memory per GPU, per method",
                "table_iv": "Table IV: the largest micro batch that fits (10% headroom) and tokens/s there",
                "table_ix": "Table IX: LoRA and QLoRA finetuning, tokens/s and memory per GPU"}


class _Footnotes:
    """Numbers each distinct reason once, in the order the cells first give it."""

    def __init__(self) -> None:
        self.reasons: dict[str, int] = {}

    def __call__(self, reason: str) -> str:
        return f"[{self.reasons.setdefault(reason, len(self.reasons) + 1)}]"

    def lines(self) -> list[str]:
        return [f"[{n}] {reason}" for reason, n in self.reasons.items()]


def _research_rows(result: dict[str, Any], key: str, footnote: _Footnotes) -> tuple[list[Column], list[dict[str, Any]]]:
    targets = result["targets"]
    cols = [Column("model", "model", fmt_text), Column("method", "method", fmt_text)] + \
        [Column(t, f"{t} x {result['world_size'][t]}", fmt_text) for t in targets]
    rows = [{"model": r["model"], "method": r["method"], **{t: _table_cell(r[t], footnote) for t in targets}}
            for r in result[key]]
    return cols, rows


def _without_bounds(confidence: str) -> str:
    """A cell's confidence less what bounds its step, which the cell says itself (`, host-bound`)."""
    return "; ".join(part for part in confidence.split("; ") if not part.startswith((HOST_BOUND_MARK, COMM_BOUND_MARK)))


def _research_host_note(result: dict[str, Any]) -> list[str]:
    """The host-order note over the research tables' cells, one item per target and distinct host assumed."""
    items = []
    for key in TABLE_TITLES:
        for r in result[key]:
            for t in result["targets"]:
                cell = r[t]
                items.append((t, cell.get("host_pace"), cell.get("bound_by") == "host", None))
    seen, unique = set(), []
    for label, pace, bound, dev in items:
        if pace and (label, _host_key(pace)) not in seen:
            seen.add((label, _host_key(pace)))
            unique.append((label, pace, any(b for lb, p, b, _ in items if lb == label and p and _host_key(p) ==
                                            _host_key(pace)), dev))
    note = host_order_note(unique)
    return [note] if note else []


def _research_notes(result: dict[str, Any], footnote: _Footnotes) -> list[str]:
    return [*_research_host_note(result), f"predicted from one run ({result['source']['run_dir']}) by trainprof's step model at "
            f"{' '.join(result['defaults'])}; the research measured these on real 8-GPU platforms "
            "(Zhang et al., arXiv 2311.03687): these cells are predictions, not its figures",
            "host-bound: the predicted step waits for the host's operator calls (more than the GPU's work), "
            "so a faster GPU does not shorten it",
            "comm-bound: exposed communication is more than half of the predicted step (the collectives outlast "
            "the compute they overlap), so faster links shorten it and a faster GPU does not",
            "[k] beside a figure: its confidence (the expected error of that kind of change, or why it is "
            "unvalidated); n/a [k]: why the figure is not predicted (a recipe rule refusing the combination, or a "
            "change the step model does not re-derive, e.g. 4-bit Adam states):", *footnote.lines()]


RESEARCH_CSV = ["model", "method", "hardware", "gpus", "micro_batch", "micro_batch_capped", "tokens_per_s",
                "memory_gib", "fits", "confidence", "reason"]


def _research_csv(result: dict[str, Any], key: str) -> tuple[list[str], list[dict[str, Any]]]:
    """A research table as a frame reads it: one row per model, method and target, its figures as numbers
    (the shown cells join them into text)."""
    rows = [{"model": r["model"], "method": r["method"], "hardware": t, "gpus": result["world_size"][t],
             "micro_batch_capped": r[t].get("capped"), **r[t]} for r in result[key] for t in result["targets"]]
    return RESEARCH_CSV, rows


def write_tables_doc(result: dict[str, Any], out_dir: Path, *, command: str) -> list[Path]:
    footnote = _Footnotes()
    tables = {key: _research_rows(result, key, footnote) for key in TABLE_TITLES}
    notes_ = _research_notes(result, footnote)
    paths: list[Path] = []
    md = ["# Zhang et al. (arXiv 2311.03687) tables, predicted", "", f"Command: `{command}`", ""]
    for key, title in TABLE_TITLES.items():
        cols, rows = tables[key]
        paths += write_tables(out_dir / key, rows, cols, title=title, notes=notes_, csv=_research_csv(result, key))
        md += [f"## {title}", "", "| " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * len(cols)]
        md += ["| " + " | ".join(str(r[c.key]).replace("|", "/") for c in cols) + " |" for r in rows] + [""]
    md += ["## How these figures were made", ""] + [f"- {n}" for n in notes_]
    from trainprof.io import atomic_write_text

    atomic_write_text(out_dir / "tables.md", "\n".join(md) + "\n")
    cols, rows = tables["table_iii"]
    doc = _document(result, title="Zhang et al. Table III, predicted (Tables IV and IX in tables.md)", command=command,
                    header=[c.header for c in cols], cells=[[r[c.key] for c in cols] for r in rows], notes_=notes_)
    atomic_write_json(out_dir / PROJECTION_FILE, doc)
    return [out_dir / "projection.json", out_dir / "tables.md", *paths]


def render_tables(result: dict[str, Any]) -> str:
    footnote, out = _Footnotes(), []
    for key, title in TABLE_TITLES.items():
        cols, rows = _research_rows(result, key, footnote)
        table = [[c.header for c in cols]] + [[str(r[c.key]) for c in cols] for r in rows]
        widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
        out += ["", title] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    return "\n".join(out + [""] + _research_notes(result, footnote))
