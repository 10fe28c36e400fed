"""inference.md, a self-contained inference.html (with the throughput-latency curve), ops.csv and
TensorBoard scalars from an inference.json document; and the short table `trainprof infer` prints."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainprof.io import atomic_write_text
from trainprof.layout import tb_run_dir
from trainprof.report.document import (Document, Facts, Figure, Missing, Para, Table, render_csv, render_html,
                                      render_markdown)
from trainprof.report.plots import png_bytes, pyplot
from trainprof.report.sections import compile_text

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
    # on CPU the peak is the process's high-water mark so far, not the batch size's own (run.peak_memory_window)
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
           f"(prompt {s['prompt_len']}, {s['new_tokens']} new tokens), as vLLM's benchmark_serving defines them; "
           f"timer: {doc['method']['timer'].split(';')[0]}; KV cache: the StaticCache's key/value bytes")
    return frame.to_string(index=False, float_format=lambda v: f"{v:,.2f}", na_rep="n/a") + "\n" + how


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
    subtitle = (f"{env['device']} ({env['device_type']}), prompt {s['prompt_len']} tokens, {s['new_tokens']} new "
                f"tokens, {s['requests']} measured calls per batch size after {s['warmup']} warm-up")
    if doc.get("partial"):
        subtitle += f"; PARTIAL: {doc.get('partial_reason')}"
    d = Document(f"Inference profile: {run_name}", subtitle)
    sec = d.section("Serving metrics", id="metrics")
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
    sec.blocks.append(Facts([("generate", s.get("generate", "not recorded")), ("compile", _compile_fact(doc)),
                             ("KV cache", method["kv_cache_bytes"]), ("peak memory", method["peak_memory_bytes"]),
                             ("prefill MFU", method["prefill_mfu"]), ("decode bandwidth", method["decode_bandwidth"])]))

    sec = d.section("Prefill and decode per module", id="modules")
    sec.blocks.append(Para(method["modules"]))
    crows = [[r["batch_size"], r["closure"]["request_ms"], r["closure"]["top_level_ms"], r["closure"]["unattributed_ms"],
              r["closure"]["unattributed_frac"]] for r in doc["results"]]
    sec.blocks.append(Table(["batch", "request ms", "top-level modules ms", "unattributed ms", "unattributed frac"],
                            crows, method=first["closure"]["note"], id="tbl-closure"))
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
        orows = [[o["name"], o["module"], o["phase"], o["calls"], o["self_ms"], o["self_ms_per_token"]]
                 for o in ops["rows"][:TOP_OPS]]
        sec.blocks.append(Table(["op", "module", "phase", "calls", "self ms", "decode self ms per token"], orows,
                                method=f"one generate call at batch size {ops['batch_size']} under torch.profiler, "
                                       f"{ops['self_time']}; all rows in ops.csv; trace in tb/ "
                                       f"({', '.join(ops['trace_files'])})", id="tbl-ops"))
    return d


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
