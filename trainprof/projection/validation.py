"""How far to trust a prediction: the error the validation measured for its kinds of change
(validation.json from scripts/bench_projection.py on CPU; validation_gpu.json from the GPU program),
and a confidence label for the table: validated, or why not."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

VALIDATION_FILE = Path(__file__).with_name("validation.json")
# cross-accelerator checks made on lent GPUs (scripts/gpu_check.sh), kept apart from the CPU bench's table
GPU_VALIDATION_FILE = Path(__file__).with_name("validation_gpu.json")


HOST_BOUND_MARK = "predicted host-bound"  # a GPU target's host calls outlast its device work (stepmodel)
COMM_BOUND_MARK = "predicted comm-bound"  # exposed communication is most of the predicted step
COMM_BOUND_SHARE = 0.5
# a CPU source's time outside the phases (and its data wait) carried to a GPU as measured: past this share of
# the predicted step the row says so, since nothing re-rates it for the GPU
CARRIED_SHARE = 0.1


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Confidence:
    """What the table shows beside a prediction: `label` (measured | validated | unvalidated | low), a short `why`
    for the table cell and the full `reason`."""

    label: str
    expected_error_pct: float | None  # the validation's mean absolute step error for these kinds of change
    max_error_pct: float | None = None  # and its largest, over `cases` runs
    cases: int | None = None
    why: str
    reason: str
    marks: tuple[str, ...] = ()  # what the cell says whatever the label, e.g. "predicted host-bound"
    # what outweighs the validated error on this row (probed on a busy machine): said before it, where read first
    leading: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return "; ".join((*self.leading, self._label_text(), *self.marks))

    def error_text(self) -> str:
        """The validated error as a reader should weigh it: a mean, with the worst case beside it (a mean alone
        read as a bound: ±2.8% on a row whose kind was once 15.5% off)."""
        mean = f"±{self.expected_error_pct:.1f}%"
        if self.cases == 1:
            return f"{mean} (1 run)"
        if self.max_error_pct is None or self.max_error_pct <= self.expected_error_pct:
            return mean
        return f"{mean} mean, {self.max_error_pct:.1f}% max" + (f" over {self.cases} runs" if self.cases else "")

    def _label_text(self) -> str:
        if self.label == "validated":
            return self.error_text()
        if self.label == "measured":
            return "as measured"
        err = f" (validated: {self.error_text()})" if self.expected_error_pct is not None else ""
        return f"{self.label}: {self.why}{err}"


def gpu_validation() -> dict[str, Any]:
    """validation_gpu.json, or {} where the GPU program has not written one."""
    return json.loads(GPU_VALIDATION_FILE.read_text()) if GPU_VALIDATION_FILE.is_file() else {}


def load_validation() -> dict[str, Any] | None:
    """The CPU bench's table (validation.json), its kinds under `by_kind`, with the GPU checks' kinds
    (validation_gpu.json) under `by_kind_gpu`: each vouches only for sources of its own device type."""
    doc = json.loads(VALIDATION_FILE.read_text()) if VALIDATION_FILE.is_file() else None
    gpu = gpu_validation()
    if gpu:
        kinds = {k: {**v, "file": GPU_VALIDATION_FILE.name, "measured_on": gpu["measured_on"]}
                 for k, v in gpu["by_kind"].items()}
        doc = {**(doc or {}), "by_kind_gpu": kinds}
    return doc


def _for_source(validation: dict[str, Any] | None, source_device: str) -> dict[str, Any] | None:
    """The validated kinds that speak for a source of this device type: validation_gpu.json's for a GPU
    source, the CPU bench's otherwise."""
    if validation is None:
        return None
    return {**validation, "by_kind": validation.get("by_kind_gpu" if source_device == "cuda" else "by_kind") or {}}


def expected_error(kinds: list[str], validation: dict[str, Any] | None,
                   host_bound: bool = False) -> tuple[dict[str, Any] | None, str]:
    """The validation entry with the largest mean absolute error among the kinds of change ({step_mape_pct,
    step_max_pct, cases}), or None with the reason. For a host-bound source a kind's `<kind>_host_bound`
    entry, where the table has one, speaks instead."""
    if validation is None:
        return None, "no validation table (run scripts/bench_projection.py --write)"
    by_kind = dict(validation.get("by_kind", {}))
    if host_bound:
        by_kind.update({k: by_kind[f"{k}_host_bound"] for k in kinds if f"{k}_host_bound" in by_kind})
    missing = [k for k in kinds if k not in by_kind]
    if missing:
        return None, (f"not validated for {', '.join(missing)} changes"
                      + ("; a CPU run projected to an accelerator is not validated (GPU-to-GPU predictions are, "
                         f"as 'hardware_gpu' in {GPU_VALIDATION_FILE.name})" if "hardware" in missing else ""))
    worst = max((by_kind[k] for k in kinds), key=lambda entry: entry["step_mape_pct"])
    where = [f"{by_kind[k].get('file', VALIDATION_FILE.name)} ({by_kind[k].get('measured_on') or validation.get('measured_on', '?')})"
             for k in kinds]
    return worst, f"largest step-time MAPE among {', '.join(kinds)}: " + "; ".join(dict.fromkeys(where))


def confidence(kinds: list[str], validation: dict[str, Any] | None, *, host_bound: bool,
               source_device: str = "cpu", gpus: tuple[str | None, str | None] | None = None) -> Confidence:
    """The label a buyer reads in the table: 'low' when the source GPU was host-bound (its step measures
    the host, not the GPU), 'unvalidated' when a kind of change was never checked against real runs from
    a source of that device type (a CPU run projected to a GPU always is; the CPU grid's errors do not
    vouch for a GPU source) or, for another GPU, between those two GPUs (`gpus`: the source's and the
    target's catalog keys; `hardware_gpu.between` lists the GPUs its pairs ran on), else 'validated'
    with the expected error."""
    if kinds == ["none"]:
        return Confidence(label="measured", expected_error_pct=0.0, why="", reason="no change: the measured step")
    validation = _for_source(validation, source_device)
    entry, why = expected_error(kinds, validation, host_bound)
    err = entry["step_mape_pct"] if entry else None
    spread = {"max_error_pct": entry.get("step_max_pct"), "cases": entry.get("cases")} if entry else {}
    if "hardware" in kinds:
        return Confidence(label="unvalidated", expected_error_pct=None, why="CPU run -> GPU",
                          reason="a CPU run projected to a GPU was never checked against a GPU run")
    between = (((validation or {}).get("by_kind") or {}).get("hardware_gpu") or {}).get("between")
    if "hardware_gpu" in kinds and gpus and between and not set(gpus) <= set(between):
        pair = " -> ".join(g or "a GPU not in the catalog" for g in gpus)
        return Confidence(label="low" if host_bound else "unvalidated", expected_error_pct=None,
                          why=f"{pair} never validated",
                          reason=f"GPU -> GPU predictions were checked between {' and '.join(between)} only "
                                 f"({GPU_VALIDATION_FILE.name}); {pair} was not")
    if host_bound:
        return Confidence(label="low", expected_error_pct=err, **spread, why="host-bound source",
                          reason="the source GPU was mostly idle (host-bound): its step measures the host; " + why)
    if err is None:
        missing = [k for k in kinds if k not in ((validation or {}).get("by_kind") or {})]
        source = " from a GPU run" if source_device == "cuda" else ""
        return Confidence(label="unvalidated", expected_error_pct=None,
                          why=f"{', '.join(missing) or 'no table'}{source}", reason=why)
    return Confidence(label="validated", expected_error_pct=err, **spread, why="", reason=why)


@functools.lru_cache(maxsize=8)
def cpu_to_gpu_task_error(task: str) -> str | None:
    """How far CPU -> GPU predictions of a finetuning task landed from the kept GPU runs of it
    (validation_gpu.json cpu_to_gpu_cases), e.g. "-50..-33% on 4 GPU runs"; None where none was run."""
    doc = gpu_validation()
    errors = [c["step_error_pct"] for c in doc.get("cpu_to_gpu_cases") or []
              if f"task.kind={task}" in c.get("overrides", []) and c.get("step_error_pct") is not None]
    if not errors:
        return None
    return f"{min(errors):+.0f}..{max(errors):+.0f}% on {len(errors)} GPU run{'s' * (len(errors) > 1)}"


@functools.lru_cache(maxsize=16)
def elementwise_share(accelerator: str | None = None) -> tuple[float, str]:
    """The share of a GPU's datasheet memory bandwidth that a model's non-GEMM operators reach, as measured
    on the lent GPUs (validation_gpu.json `elementwise`, scripts/gpu_validation.py), and its source: the
    accelerator's own where its runs measured it (catalog key), else the share over all of them; 1.0 (the
    roofline, optimistic) where no GPU run has measured it."""
    doc = gpu_validation()
    block = doc.get("elementwise")
    if not block:
        return 1.0, "no GPU run measured it: the roofline (optimistic)"
    own = (block.get("by_accelerator") or {}).get(accelerator or "")
    if own:
        err = own["held_out_error_pct"]
        return own["share"], (
            f"{own['share']:.3f} of {accelerator}'s datasheet bandwidth, measured on {', '.join(own['fit_on'])} "
            f"(profiles/); off by {err['mean']:.0f}% on average and {err['max']:.0f}% at most on its "
            f"{err['phases']} held-out phases ({GPU_VALIDATION_FILE.name})")
    err = block["held_out_error_pct"]
    return block["share_of_datasheet_bandwidth"], (
        f"{block['share_of_datasheet_bandwidth']:.3f} of the datasheet bandwidth, measured on "
        f"{', '.join(block['fit_on'])} (profiles/; not on this GPU); off by {err['mean']:.0f}% on average and "
        f"{err['max']:.0f}% at most on {err['phases']} held-out phases ({GPU_VALIDATION_FILE.name})")
