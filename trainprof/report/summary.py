"""summary.md and the CSV tables (modules.csv, ops.csv, comm.csv) of a profile.

The headline table is the one Zhang et al. (arXiv 2311.03687) printed for Llama2-7B: time per step of the embedding,
the decoder layers, attention, MLP, norms, the LM head and the optimizer, split into forward, backward
and recompute, followed by the phase breakdown and its closure.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any, Callable

from trainprof.io import atomic_write_text
from trainprof.report.pipeline import pipeline_summary_lines
from trainprof.report.rundir import report_phases

MODULE_COLUMNS = ("name", "type", "depth", "calls", "forward_ms", "backward_ms", "recompute_ms", "self_forward_ms",
                  "self_backward_ms", "self_recompute_ms", "comm_ms", "comm_exposed_ms", "self_comm_ms", "flops",
                  "params", "params_trainable", "params_local")
OP_COLUMNS = ("name", "module", "phase", "calls", "self_ms", "self_cpu_ms", "flops")
COMM_COLUMNS = ("op", "phase", "group_size", "calls", "bytes", "total_ms", "exposed_ms", "algbw_gbps", "busbw_gbps")

# Zhang et al.'s (arXiv 2311.03687) Llama2-7B rows: (label, which modules belong to it)
CATEGORIES: list[tuple[str, Callable[[dict[str, Any]], bool]]] = [
    ("embedding", lambda m: m["type"] == "Embedding" or m["name"].endswith("embed_tokens")),
    ("decoder layers", lambda m: m["type"].endswith("DecoderLayer")),
    ("attention", lambda m: m["type"].endswith("Attention")),
    ("MLP", lambda m: m["type"].endswith("MLP")),
    ("norms", lambda m: m["type"].endswith(("RMSNorm", "LayerNorm"))),
    ("head", lambda m: m["name"].endswith("lm_head")),
]


def _csv(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in columns})
    return buf.getvalue()


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _pct(x: float | None, total: float | None) -> str:
    return "n/a" if x is None or not total else f"{100 * x / total:.1f}%"


def _bytes(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:,.1f} MiB"


def category_rows(profile: dict[str, Any]) -> list[dict[str, Any]]:
    """The Llama2-7B table rows: per category, summed forward/backward/recompute ms per step."""
    modules = profile["modules"]
    rows = []
    for label, match in CATEGORIES:
        members = [m for m in modules if match(m)]
        # keep only outermost matches (a norm inside a norm wrapper is counted once)
        names = {m["name"] for m in members}
        members = [m for m in members if not any(m["name"].startswith(n + ".") for n in names if n)]
        if not members:
            rows.append({"label": label, "modules": 0, "forward_ms": None, "backward_ms": None,
                         "recompute_ms": None, "optimizer_ms": None})
            continue
        rows.append({"label": label, "modules": len(members),
                     "forward_ms": sum(m["forward_ms"] for m in members),
                     "backward_ms": sum(m["backward_ms"] for m in members),
                     "recompute_ms": sum(m["recompute_ms"] for m in members), "optimizer_ms": None})
    rows.append({"label": "optimizer", "modules": None, "forward_ms": None, "backward_ms": None,
                 "recompute_ms": None, "optimizer_ms": profile["summary"]["phases_ms"]["optimizer"]})
    return rows


def render_markdown(profile: dict[str, Any]) -> str:
    """summary.md for a merged (or single-rank) profile."""
    s, env, meas = profile["summary"], profile["env"], profile.get("measurement", {})
    step = s["step_ms"]["median"]
    from trainprof.report.advisor import advise, markdown_lines

    lines = ["# trainprof profile", "", "## What to change", "", *markdown_lines(advise(profile)), "",
             "## Measurements", ""]
    lines.append(f"- device: {env.get('device')} x {env.get('world_size')} ranks; timer: {env.get('timer')} "
                 f"({env.get('timer_description', '')})")
    lines.append(f"- step ms (min / median / max): {_ms(s['step_ms']['min'])} / {_ms(step)} / "
                 f"{_ms(s['step_ms']['max'])} over {s['steps_used']} steps ({s.get('steps_used_description', '')})")
    if s.get("tokens_per_s"):
        lines.append(f"- tokens/s: {s['tokens_per_s']:,.0f} ({s.get('tokens_per_s_scope', 'this rank')})")
    frac, frac_max = s.get("unattributed_frac"), s.get("unattributed_frac_max")
    frac_txt = "n/a" if frac is None else f"{100 * frac:.2f}%"
    frac_max_txt = "n/a" if frac_max is None else f"{100 * frac_max:.2f}%"
    lines.append(f"- closure: unattributed {_ms(s.get('unattributed_ms'))} ms per step "
                 f"({frac_txt} median, {frac_max_txt} max)")
    if s.get("achieved_tflops") is not None:
        mfu = "n/a" if s.get("mfu") is None else f"{100 * s['mfu']:.1f}%"
        lines.append(f"- FLOPs/step {s['flops_per_step']:.3e}; achieved {s['achieved_tflops']:.3f} TFLOP/s; MFU {mfu}"
                     + (f" ({s['mfu_reason']})" if s.get("mfu") is None else f" (peak: {s['peak']['source']})"))
        if s.get("measured_over_analytic") is not None:
            lines.append(f"- model FLOPs measured / analytic (PaLM 6N+12LHQT): {s['measured_over_analytic']:.3f}")
    if profile.get("straggler"):
        st = profile["straggler"]
        lines.append(f"- straggler: rank {st['rank']} is {100 * st['slower_by_frac']:.1f}% slower ({st['metric']})")
    if (profile.get("compile") or {}).get("compiled"):
        lines.append(f"- compiled: {compile_text(profile)}")
    lines += ["", "## Where a step goes (per step, median)", "",
              "| part | modules | forward ms | backward ms | recompute ms | optimizer ms | share of step |",
              "|---|---|---|---|---|---|---|"]
    for r in category_rows(profile):
        total = sum(v for v in (r["forward_ms"], r["backward_ms"], r["recompute_ms"], r["optimizer_ms"]) if v)
        count = "" if r["modules"] is None else (str(r["modules"]) if r["modules"] else "not profiled at this depth")
        lines.append(f"| {r['label']} | {count} | {_ms(r['forward_ms'])} | {_ms(r['backward_ms'])} | "
                     f"{_ms(r['recompute_ms'])} | {_ms(r['optimizer_ms'])} | {_pct(total, step)} |")
    lines += ["", "## Phases (per step, median)", "", "| phase | ms | share |", "|---|---|---|"]
    for phase in report_phases(profile):
        v = s["phases_ms"].get(phase)
        lines.append(f"| {phase} | {_ms(v)} | {_pct(v, step)} |")
    lines.append(f"| unattributed | {_ms(s.get('unattributed_ms'))} | {_pct(s.get('unattributed_ms'), step)} |")
    lines += pipeline_summary_lines(profile)
    if s.get("across_ranks"):
        lines += ["", "## Ranks", "", "| rank | step ms | busy ms | comm_exposed ms |", "|---|---|---|---|"]
        for r in profile["ranks"]:
            lines.append(f"| {r['rank']} | {_ms(r['step_ms_median'])} | {_ms(r.get('busy_ms_median'))} | "
                         f"{_ms(r['phases_ms']['comm_exposed'])} |")
    mods = sorted(profile["modules"], key=lambda m: -(m["forward_ms"] + m["backward_ms"] + m["recompute_ms"]))
    lines += ["", "## Modules (top 15 by forward + backward + recompute)", "",
              "| module | type | calls | fwd ms | bwd ms | recompute ms | self fwd | self bwd | comm ms | params |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for m in mods[:15]:
        name = (m["name"] or "(model)") + (f" [stage {m['stage']}]" if "stage" in m else "")
        lines.append(f"| {name} | {m['type']} | {m['calls']} | {_ms(m['forward_ms'])} | "
                     f"{_ms(m['backward_ms'])} | {_ms(m['recompute_ms'])} | {_ms(m['self_forward_ms'])} | "
                     f"{_ms(m['self_backward_ms'])} | {_ms(m['comm_ms'])} | {m['params']:,} |")
    if profile["comm"]:
        lines += ["", "## Collectives (per step, median)", "",
                  "| op | phase | calls | MiB | total ms | exposed ms | busbw GB/s |", "|---|---|---|---|---|---|---|"]
        for c in profile["comm"]:
            bw = "n/a" if c["busbw_gbps"] is None else f"{c['busbw_gbps']:.3f}"
            lines.append(f"| {c['op']} | {c['phase']} | {c['calls']} | {c['bytes'] / 2**20:.2f} | "
                         f"{_ms(c['total_ms'])} | {_ms(c['exposed_ms'])} | {bw} |")
    if profile["ops"]:
        lines += ["", "## Operators (top 15 by self time, traced steps)", "",
                  "| op | module | phase | calls | self ms |", "|---|---|---|---|---|"]
        for o in profile["ops"][:15]:
            lines.append(f"| {o['name']} | {o['module'] if o['module'] is not None else '-'} | {o['phase']} | "
                         f"{o['calls']} | {_ms(o['self_ms'])} |")
        cost = profile.get("ops_info", {}).get("cost_frac")
        if cost is not None:
            lines.append(f"\nOperator tracing made its steps {100 * cost:.1f}% slower (those steps are excluded above).")
    peaks = s.get("peak_memory_bytes", {})
    lines += ["", "## Memory", "",
              f"- peak per phase: forward {_bytes(peaks.get('forward'))}, backward {_bytes(peaks.get('backward'))}, "
              f"optimizer {_bytes(peaks.get('optimizer'))} ({s.get('peak_memory_method')})"]
    if "activation_bytes" in s:
        lines.append(f"- activations saved for backward: {_bytes(s['activation_bytes'])} ("
                     f"{s.get('activation_bytes_method') or s.get('activation_bytes_reason')})")
    state = profile.get("model_state_bytes")
    if state:
        lines.append(f"- model states on rank {profile.get('steps_rank', 0)}: {model_states_text(state)}")
    lines += ["", "## How this was measured", ""]
    for key, text in meas.items():
        lines.append(f"- {key}: {text}")
    if s.get("flops_convention"):
        lines.append(f"- flops: {s['flops_convention']}")
    return "\n".join(lines) + "\n"


def write_report(profile: dict[str, Any], run_dir: str | Path) -> None:
    """Write modules.csv, ops.csv, comm.csv and summary.md next to profile.json.

    Args:
        profile: the merged profile.
        run_dir: the run directory.
    """
    run_dir = Path(run_dir)
    atomic_write_text(run_dir / "modules.csv", _csv(profile["modules"], MODULE_COLUMNS))
    atomic_write_text(run_dir / "ops.csv", _csv(profile["ops"], OP_COLUMNS))
    atomic_write_text(run_dir / "comm.csv", _csv(profile["comm"], COMM_COLUMNS))
    atomic_write_text(run_dir / "summary.md", render_markdown(profile))


def compile_text(profile: dict[str, Any]) -> str:
    """Whether the model ran torch.compile'd, its regions, the module granularity and dynamo's evidence."""
    c = profile.get("compile") or {}
    if not c.get("compiled"):
        return "not compiled (eager); modules timed per module"
    regions = c.get("regions") or []
    shown = ", ".join(r or "(model)" for r in regions[:3]) + (f" and {len(regions) - 3} more" if len(regions) > 3 else "")
    text = (f"torch.compile, {len(regions)} compiled region(s) ({shown}); modules timed per compiled region, "
            f"{c.get('modules_inside_regions', 0)} modules inside them have no own times")
    measured = ((c.get("dynamo") or {}).get("during_measured_steps")) or {}
    total = ((c.get("dynamo") or {}).get("total")) or {}
    if total:
        text += (f"; dynamo: {total['graphs_captured']} graph(s) captured, {total['graph_breaks']} graph break(s), "
                 f"{measured.get('frames_converted', 'n/a')} frame(s) (re)compiled during measured steps")
    return text


def model_states_text(state: dict[str, Any]) -> str:
    """Model-state bytes of one rank in words, with the share of optimizer states held quantized."""
    text = (f"params {_bytes(state['params'])}, grads {_bytes(state['grads'])}, optimizer states "
            f"{_bytes(state['optimizer_states'])}, fp32 master {_bytes(state['master_params'])}")
    elements, quantized = state.get("optimizer_state_elements"), state.get("optimizer_state_quantized_elements")
    if elements and quantized:
        text += f" ({100 * quantized / elements:.1f}% of optimizer-state elements block-quantized)"
    return text
