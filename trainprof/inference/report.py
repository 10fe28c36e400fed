"""inference.md, a self-contained inference.html (with the throughput-latency curve), ops.csv and
TensorBoard scalars from an inference.json document; and the short table `trainprof infer` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.inference.checks import ENGINE_NOT_USED
from trainprof.io import atomic_write_text
from trainprof.layout import tb_run_dir
from trainprof.report.document import (Document, Facts, Figure, Missing, Para, Table, render_csv, render_html,
                                      render_markdown)
from trainprof.report.plots import png_bytes, pyplot
from trainprof.report.sections import compile_text, hardware_text, machine_load_text

MIB = 2**20
TOP_OPS = 20


def throughput_latency_plot(results: list[dict[str, Any]]) -> bytes:
    """Output tokens/s against median end-to-end latency, one point per batch size (the serving studies'
    throughput-latency figure), and TTFT / TPOT medians over batch size."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    x = [r["e2el_ms"]["p50"] for r in results]
    y = [r["output_tokens_per_s"] for r in results]
    left.plot(x, y, marker="o", color="#4c78a8")
    for r, xi, yi in zip(results, x, y):
        left.annotate(f"batch {r['batch_size']}", (xi, yi), textcoords="offset points", xytext=(5, -12), fontsize=8)
    left.set_xlabel("E2EL p50 (ms)")
    left.set_ylabel("output tokens/s")
    left.set_title("throughput vs latency")
    left.grid(alpha=0.3)
    batches = [r["batch_size"] for r in results]
    right.plot(batches, [r["ttft_ms"]["p50"] for r in results], marker="o", label="TTFT p50", color="#f58518")
    right.plot(batches, [(r["tpot_ms"] or {}).get("p50") for r in results], marker="s", label="TPOT p50",
               color="#54a24b")
    right.set_xscale("log", base=2)
    right.set_yscale("log")
    right.set_xlabel("batch size")
    right.set_ylabel("ms")
    right.set_title("latency vs batch size")
    right.legend()
    right.grid(alpha=0.3)
    fig.tight_layout()
    return png_bytes(fig)


def summary_rows(doc: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    # on CPU the peak is the process's high-water mark so far, not the batch size's own (document.peak_memory_window)
    peak = "peak MiB" if doc["env"]["device_type"] == "cuda" else "peak RSS MiB (process so far)"
    cols = ["batch", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms", "ITL p99 ms", "E2EL p50 ms", "output tok/s",
            "req/s", "KV cache MiB", peak, "prefill TFLOP/s", "prefill MFU", "decode GB/s", "decode BW util"]
    rows = []
    for r in doc["results"]:
        rows.append([r["batch_size"], r["ttft_ms"]["p50"], (r["tpot_ms"] or {}).get("p50"),
                     (r["itl_ms"] or {}).get("p50"), (r["itl_ms"] or {}).get("p99"), r["e2el_ms"]["p50"],
                     r["output_tokens_per_s"], r["requests_per_s"], r["kv_cache_bytes"] / MIB,
                     r["peak_memory_bytes"] / MIB, r["prefill"]["achieved_tflops"], r["prefill"]["mfu"],
                     r["decode"]["achieved_gbps"], r["decode"]["bandwidth_utilization"]])
    return cols, rows


def stdout_table(doc: dict[str, Any]) -> str:
    """The few columns `trainprof infer` prints (pandas formatting)."""
    import pandas as pd

    cols, rows = summary_rows(doc)
    keep = ["batch", "TTFT p50 ms", "TPOT p50 ms", "ITL p99 ms", "E2EL p50 ms", "output tok/s", "req/s", "KV cache MiB"]
    frame = pd.DataFrame(rows, columns=cols)[keep]
    frame[keep[1:]] = frame[keep[1:]].astype(float)  # None (no TPOT or ITL with one new token) -> NaN -> n/a
    s = doc["settings"]
    how = (f"p50/p99 over {s['requests']} measured generate calls a batch size after {s['warmup']} warm-up "
           f"(prompt {s['prompt_len']}, {_tokens(s['new_tokens'])}), as vLLM's benchmark_serving defines them; "
           f"timer: {doc['method']['timer'].split(';')[0]}; KV cache: the StaticCache's key/value bytes")
    table = frame.to_string(index=False, float_format=lambda v: f"{v:,.2f}", na_rep="n/a") + "\n" + how
    warning = load_warning(doc)
    return table + (f"\n{warning}" if warning else "")


def load_warning(doc: dict[str, Any]) -> str | None:
    """One line when the machine had more runnable threads than cores while this measured, else None."""
    load = doc["env"].get("machine_load") or {}
    if not load.get("busy"):
        return None
    return (f"Warning: machine load: {machine_load_text(load)}; latencies that differ across batch sizes or runs "
            "may be the machine's, not the model's")


def model_text(doc: dict[str, Any]) -> str:
    """The model served: name and shape, parameters, dtype and attention as the built model ran them."""
    m = doc.get("model")
    if not m:
        r = doc["recipe"].get("model", {})
        return (f"{r.get('name', 'n/a')} ({r.get('dtype', '?')}, attention {r.get('attention', '?')}; shape not "
                "recorded)")
    heads = f"{m['num_heads']} heads ({m['num_kv_heads']} key/value)"
    return (f"{m['name']}: {m['num_layers']} layers, hidden {m['hidden_size']}, {heads}, intermediate "
            f"{m['intermediate_size']}, vocab {m['vocab_size']}; {m['params']:,} parameters, {m['dtype']}, attention "
            f"{m['attention']}" + (f", weights from {m['checkpoint']}" if m.get("checkpoint") else ", random init"))


def task_text(doc: dict[str, Any]) -> str:
    """The recipe's task as served: LoRA adapters merged into the base weights, or the model as built."""
    m = doc.get("model") or {}
    lora = m.get("lora")
    if lora:
        return (f"lora: adapters (r {lora['r']}, alpha {lora['alpha']}, on {', '.join(lora['target_modules'])}) "
                f"{'merged into the base weights (peft merge_and_unload)' if lora['merged'] else 'not merged'}")
    return str(m.get("task") or doc["recipe"].get("task", {}).get("kind", "n/a"))


def run_facts(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """What was measured, on what: the facts the training report's Run facts give, as they apply to serving."""
    env = doc["env"]
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "peft") if env.get(k))
    return [
        ("model", model_text(doc)),
        ("task", task_text(doc)),
        ("compile", _compile_fact(doc)),
        ("engine", ENGINE_NOT_USED),
        ("hardware", hardware_text(env)),
        ("cpu threads", f"{env.get('cpu_threads', 'not recorded')} (torch intra-op threads)"),
        ("machine load", machine_load_text(env.get("machine_load")) or "not recorded"),
        ("versions", versions or "not recorded"),
        ("timer", f"{env.get('timer', 'n/a')}: {doc['method']['timer']}"),
    ]


def _compile_fact(doc: dict[str, Any]) -> str:
    """Whether the decoder layers ran torch.compile'd (inference.json's `compile`, profile.json's block)."""
    if "compile" not in doc:  # written before inference.json said
        return f"not recorded (recipe model.compile {doc['recipe'].get('model', {}).get('compile', False)})"
    return compile_text(doc)


def _compiled_while_measured(results: list[dict[str, Any]]) -> list[str]:
    """Batch sizes whose measured calls dynamo compiled frames in, as 'batch B: N frame(s)'."""
    return [f"batch {r['batch_size']}: {r['compiles_during_measured_calls']} frame(s)" for r in results
            if r.get("compiles_during_measured_calls")]


def module_rows(modules: list[dict[str, Any]], new_tokens: int) -> tuple[list[str], list[list[Any]]]:
    """The module table: a module with no window (inside a compiled layer, or a container never called)
    reads n/a with the reason, not a measured 0; so does decode when one new token left no decode step."""
    reasons = any(m.get("not_timed") for m in modules)
    cols = ["module", "prefill ms", "decode ms per token"] + (["not timed because"] if reasons else [])
    rows = []
    for m in modules:
        why = m.get("not_timed")
        row = [m["name"], None, None] if why else [m["name"], m["prefill_ms"], m["decode_ms"] if new_tokens > 1
                                                   else None]
        rows.append(row + ([why or ""] if reasons else []))
    return cols, rows


def build_document(doc: dict[str, Any], run_name: str) -> Document:
    s, env, method = doc["settings"], doc["env"], doc["method"]
    m = doc.get("model") or doc["recipe"].get("model", {})
    subtitle = (f"{m.get('name', 'n/a')} {m.get('dtype', '?')}, attention {m.get('attention', '?')}, task "
                f"{m.get('task') or doc['recipe'].get('task', {}).get('kind', '?')} on {env['device']} "
                f"({env['device_type']}), prompt {s['prompt_len']} tokens, {_tokens(s['new_tokens'])}, "
                f"{s['requests']} measured calls per batch size after {s['warmup']} warm-up")
    if doc.get("partial"):
        subtitle += f"; PARTIAL: {doc.get('partial_reason')}"
    d = Document(f"Inference profile: {run_name}", subtitle)
    d.section("Run facts", id="facts").blocks.append(Facts(run_facts(doc)))
    sec = d.section("Serving metrics", id="metrics")
    if warning := load_warning(doc):  # beside the figures it slowed
        sec.blocks.append(Para(warning))
    measured = {r["batch_size"] for r in doc["results"]}
    unmeasured = [b for b in s["batch_sizes"] if b not in measured]
    if unmeasured:
        sec.blocks.append(Missing(f"batch sizes {', '.join(map(str, unmeasured))}",
                                  doc.get("partial_reason") or "not in the results"))
    if compiled := _compiled_while_measured(doc["results"]):
        sec.blocks.append(Para(f"Warning: dynamo compiled during the measured calls ({'; '.join(compiled)}): those "
                               "latencies include compilation; run with more --warmup."))
    cols, rows = summary_rows(doc)
    sec.blocks.append(Table(cols, rows, method=method["metrics"] + " Timer: " + method["timer"], id="tbl-metrics"))
    sec.blocks.append(Figure(throughput_latency_plot(doc["results"]),
                             "Left: output tokens/s against E2EL p50, one point per batch size. Right: TTFT and "
                             "TPOT medians over batch size.", "plots/throughput_latency.png", id="fig-throughput"))
    first = doc["results"][0]
    if first["prefill"]["mfu"] is None:
        sec.blocks.append(Missing("prefill MFU", first["prefill"]["mfu_reason"]))
    if first["decode"]["bandwidth_utilization"] is None:
        sec.blocks.append(Missing("decode bandwidth utilization", first["decode"]["bandwidth_reason"]))
    sec.blocks.append(Facts([("generate", s.get("generate", "not recorded")), ("KV cache", method["kv_cache_bytes"]),
                             ("peak memory", method["peak_memory_bytes"]), ("prefill MFU", method["prefill_mfu"]),
                             ("decode bandwidth", method["decode_bandwidth"])]))

    sec = d.section("Prefill and decode per module", id="modules")
    sec.blocks.append(Para(method["modules"]))
    sec.blocks.append(closure_table(doc["results"]))
    last = doc["results"][-1]
    mcols, mrows = module_rows(last["modules"], s["new_tokens"])
    sec.blocks.append(Table(mcols, mrows, method=f"batch size {last['batch_size']}; windows include children",
                            id="tbl-modules", numeric=[False, True, True, False][:len(mcols)]))

    sec = d.section("Operators", id="ops")
    ops = doc.get("ops")
    if not ops:
        why = doc.get("partial_reason") if doc.get("partial") else "run without --no-ops to trace one request"
        sec.blocks.append(Missing("operator breakdown", why))
    else:
        sec.blocks.append(Para(traced_call_text(ops)))
        orows = [[o["name"], o["module"], o["phase"], o["calls"], o["self_ms"], o["self_ms_per_token"]]
                 for o in ops["rows"][:TOP_OPS]]
        sec.blocks.append(Table(["op", "module", "phase", "calls", "self ms (traced)",
                                 "decode self ms per token (traced)"], orows,
                                method=f"measured under the tracer: one generate call at batch size "
                                       f"{ops['batch_size']} under torch.profiler, {ops['self_time']}; all rows in "
                                       f"ops.csv; trace in tb/ ({', '.join(ops['trace_files'])})", id="tbl-ops"))
    return d


def closure_table(results: list[dict[str, Any]]) -> Table:
    """Per batch size: the hooked call the module breakdown adds up to, beside the measured calls' E2EL p50
    it stands for (their ratio is what hooks and one call's noise did), and its unattributed time."""
    cols = ["batch", "hooked call ms", "E2EL p50 ms", "hooked / E2EL p50", "top-level modules ms",
            "unattributed ms", "unattributed frac of the hooked call"]
    rows = []
    for r in results:
        c = r["closure"]
        rows.append([r["batch_size"], c["request_ms"], c.get("e2el_p50_ms"), c.get("hooked_over_e2el"),
                     c["top_level_ms"], c["unattributed_ms"], c["unattributed_frac"]])
    how = ("The breakdown is of one generate call per batch size with the module hooks on (slower for them), not "
           "of the measured calls whose E2EL p50 is beside it: hooked / E2EL p50 is what the hooks' cost and the "
           "noise of a single call did to it. ")
    return Table(cols, rows, method=how + results[0]["closure"]["note"], id="tbl-closure")


def traced_call_text(ops: dict[str, Any]) -> str:
    """The traced call's own total, against the untraced measurement (cost_frac), and what its operator self
    times add up to: the table's rows are parts of this call, not of the hooked call's module windows."""
    if "traced_e2el_ms" not in ops:
        return "Measured under the tracer; the traced call's own time was not recorded."
    by_phase = ", ".join(f"{phase} {ms:,.2f} ms" for phase, ms in ops["self_ms_by_phase"].items())
    return (f"Measured under the tracer: the traced call (batch size {ops['batch_size']}) took "
            f"{ops['traced_e2el_ms']:,.2f} ms (first token at {ops['traced_ttft_ms']:,.2f} ms) against E2EL p50 "
            f"{ops['untraced_e2el_p50_ms']:,.2f} ms (TTFT p50 {ops['untraced_ttft_p50_ms']:,.2f} ms) untraced: "
            f"cost_frac {100 * ops['cost_frac']:+.0f}% (traced E2EL / untraced E2EL p50 - 1). Its operators' self "
            f"times add up to {by_phase}; prefill's fall inside its first {ops['traced_ttft_ms']:,.2f} ms. They are "
            "that call's, under the tracer, and are not parts of the module windows above (another call, hooked).")


def write_tensorboard(doc: dict[str, Any], run_dir: Path) -> None:
    """Scalars next to the Kineto trace (<run_dir>/tb/<run name>/), x axis = batch size."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tb_run_dir(run_dir)), filename_suffix=".trainprof-infer")
    for r in doc["results"]:
        b = r["batch_size"]
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            for q, v in (r[key] or {}).items():
                writer.add_scalar(f"infer/{key}_{q}", v, b)
        writer.add_scalar("infer/output_tokens_per_s", r["output_tokens_per_s"], b)
        writer.add_scalar("infer/requests_per_s", r["requests_per_s"], b)
        writer.add_scalar("infer/kv_cache_mib", r["kv_cache_bytes"] / MIB, b)
        writer.add_scalar("infer/peak_memory_mib", r["peak_memory_bytes"] / MIB, b)
        if r["decode"]["achieved_gbps"] is not None:
            writer.add_scalar("infer/decode_gbps", r["decode"]["achieved_gbps"], b)
    writer.add_text("trainprof/how_measured", "\n\n".join(f"**{k}**: {v}" for k, v in doc["method"].items()), 0)
    writer.close()


def write_reports(doc: dict[str, Any], run_dir: str | Path) -> None:
    """inference.md (+ plots/), inference.html, ops.csv, modules.csv and tb/ scalars."""
    run_dir = Path(run_dir)
    d = build_document(doc, run_dir.name)
    for fig in d.figures():
        path = run_dir / fig.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(fig.png)
    atomic_write_text(run_dir / "inference.md", render_markdown(d))
    atomic_write_text(run_dir / "inference.html", render_html(d))
    if doc.get("ops"):
        o = doc["ops"]["rows"]
        atomic_write_text(run_dir / "ops.csv", render_csv(Table(
            ["name", "module", "phase", "calls", "self_ms", "self_ms_per_token"],
            [[r["name"], r["module"], r["phase"], r["calls"], r["self_ms"], r["self_ms_per_token"]] for r in o])))
    rows = [[r["batch_size"], m["name"], None if m.get("not_timed") else m["prefill_ms"],
             None if m.get("not_timed") else m["decode_ms"], m.get("not_timed")]
            for r in doc["results"] for m in r["modules"]]  # a module not timed: empty cells and why
    atomic_write_text(run_dir / "modules.csv", render_csv(Table(
        ["batch_size", "name", "prefill_ms", "decode_ms", "not_timed"], rows)))
    write_tensorboard(doc, run_dir)


def _tokens(n: int) -> str:
    return f"{n} new token{'' if n == 1 else 's'}"
