"""The GPU's side of a run in the reports: how busy the GPU was per phase (profile.json `gpu_busy`) and its
NVML telemetry (`telemetry`), for summary.md, report.html and TensorBoard. Off a GPU each part says why
it is absent (the profile's `*_reason`)."""

from __future__ import annotations

from typing import Any

from trainprof.analysis.gpu_busy import gpu_busy_fields
from trainprof.report import plots
from trainprof.report.document import Document, Figure, Missing, Para, Table

PLOTS_DIR = "report_plots"
# the metrics in the order a reader scans them; any other metric a source offers follows
METRIC_ORDER = ("sm_clock_mhz", "mem_clock_mhz", "power_w", "temperature_c", "gpu_util_pct", "mem_util_pct",
                "pcie_tx_gbps", "pcie_rx_gbps", "nvlink_tx_gbps", "nvlink_rx_gbps")


def busy_of(profile: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """The profile's `gpu_busy` block and reason; for a profile written before the block existed, computed
    from its operator table the same way."""
    fields = profile if "gpu_busy" in profile else gpu_busy_fields(profile)
    return fields.get("gpu_busy"), fields.get("gpu_busy_reason")


def telemetry_of(profile: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    block = profile.get("telemetry")
    if block:
        return block, ""
    return None, profile.get("telemetry_reason") or "this profile predates GPU telemetry (no `telemetry` block)"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _metrics(block: dict[str, Any]) -> list[str]:
    names = list(block.get("summary") or {})
    return [m for m in METRIC_ORDER if m in names] + [m for m in names if m not in METRIC_ORDER]


def busy_rows(busy: dict[str, Any]) -> list[list[Any]]:
    """[phase, phase ms, device ms, busy %, idle %]: the step first, then each phase."""
    entries = [("step", busy["step"]), *busy["phases"].items()]
    return [[name, e["wall_ms"], e["device_ms"], _pct(e["busy_frac"]) + (" (capped)" if e.get("capped") else ""),
             _pct(e["idle_frac"])] for name, e in entries]


def _ms_text(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


def gpu_section(doc: Document, run: Any) -> None:
    """report.html / report.md: GPU busy per phase, then the telemetry plot and table."""
    p = run.profile or {}
    sec = doc.section("GPU busy and telemetry", id="gpu")
    device_type = (p.get("env") or {}).get("device_type")
    if device_type != "cuda" and not p.get("telemetry"):  # not missing from the run: it had no GPU
        sec.blocks.append(Para(f"This run ran on {device_type or 'a device not recorded'}: the GPU's busy share per "
                               "phase and its NVML telemetry exist for CUDA runs only."))
        return
    busy, reason = busy_of(p)
    if busy is None:
        sec.blocks.append(Missing("GPU busy per phase", reason or "not recorded"))
    else:
        sec.blocks.append(Table(["phase", "ms per step (median)", "GPU device ms (traced step)", "busy", "idle"],
                                busy_rows(busy), method=busy["method"], id="gpu-busy-table",
                                numeric=[False, True, True, True, True]))
    block, why = telemetry_of(p)
    if block is None:
        sec.blocks.append(Missing("GPU telemetry", why))
        return
    names = _metrics(block)
    steps = block.get("steps") or []
    panels = {n: {k: [((st["metrics"].get(n) or {}).get(k)) for st in steps] for k in ("mean", "max")} for n in names}
    units = {n: block["summary"][n]["unit"] for n in names}
    if names and steps:
        sec.blocks.append(Figure(plots.telemetry_lines([st["step"] for st in steps], panels, units),
                                 "NVML telemetry per measured step: mean (line) and max (triangles) of the samples "
                                 "taken during the step", f"{PLOTS_DIR}/telemetry.png", id="fig-telemetry"))
    sec.blocks.append(Table(["metric", "unit", "mean", "max", "samples", "how it is read"],
                            [[n, units[n], block["summary"][n]["mean"], block["summary"][n]["max"],
                              block["summary"][n]["samples"], block["metrics"].get(n, {}).get("how", "")]
                             for n in names],
                            method=f"{block['source']}; sampling period {block['period_ms']:g} ms asked, "
                                   f"{_ms_text(block.get('measured_period_ms'))} measured; {block['method']}",
                            id="telemetry-table", numeric=[False, False, True, True, True, False]))
    gone = dict(block.get("unavailable") or {})
    if block.get("stopped_reason"):
        gone["sampling"] = block["stopped_reason"]
    if gone:
        sec.blocks.append(Para("Not read: " + "; ".join(f"{k}: {v}" for k, v in gone.items()) + "."))


def telemetry_series(profile: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard series: telemetry/<metric>_mean and _max per measured step."""
    block, _ = telemetry_of(profile)
    series: dict[str, list[tuple[int, float]]] = {}
    for st in (block or {}).get("steps") or []:
        for name, fig in (st.get("metrics") or {}).items():
            if fig is None:
                continue
            for key in ("mean", "max"):
                series.setdefault(f"telemetry/{name}_{key}", []).append((int(st["step"]), float(fig[key])))
    return series
