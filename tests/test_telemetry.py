"""GPU telemetry (trainprof/profiler/telemetry.py) and the GPU busy share (trainprof/analysis/gpu_busy.py).

On this CPU machine NVML cannot run: the tests assert the null-plus-reason paths a CPU (or a machine without
the NVML library) takes, and the sampler's thread and per-step aggregation with a sample source of their
own (a counter, not NVML). The GPU test at the end reads the real NVML on a CUDA machine."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from trainprof.analysis.gpu_busy import gpu_busy_fields, phase_busy
from trainprof.io import read_profile
from trainprof.profiler import Profiler
from trainprof.profiler.schema import validate_profile
from trainprof.profiler.nvml import open_nvml
from trainprof.profiler.telemetry import Sample, StepTelemetry, open_step_telemetry, telemetry_fields, window_stats

from conftest import REPO


class CountingSource:
    """A sample source that needs no GPU: read i gives sm_clock_mhz = i, power_w = 100 + i, and a metric
    that is None on odd reads (as a counter-derived rate is on its first read)."""

    description = "test counter source"
    how = {"sm_clock_mhz": "read index", "power_w": "100 + read index", "pcie_tx_gbps": "None on odd reads"}

    def __init__(self, fail_after: int | None = None) -> None:
        self.unavailable = {"nvlink_tx_gbps": "no NVLink in this source"}
        self.reads, self.fail_after, self.closed = 0, fail_after, False
        self.threads: set[str] = set()

    def read(self) -> dict[str, float | None]:
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise RuntimeError("device fell off the bus")
        self.threads.add(threading.current_thread().name)
        i = self.reads
        self.reads += 1
        return {"sm_clock_mhz": float(i), "power_w": 100.0 + i, "pcie_tx_gbps": None if i % 2 else 2.0 * i}

    def close(self) -> None:
        self.closed = True


def test_window_stats_mean_and_max_of_the_samples_inside_the_window():
    samples = [Sample(t_ns=t, read_ns=1, values={"a": v, "b": None if t == 20 else 1.0})
               for t, v in ((5, 100.0), (10, 1.0), (20, 3.0), (30, 8.0), (41, 50.0))]
    count, accs = window_stats(samples, 10, 30)
    assert count == 3
    assert accs["a"].figures() == {"mean": 4.0, "max": 8.0}
    assert accs["b"].figures() == {"mean": 1.0, "max": 1.0} and accs["b"].n == 2  # None is skipped, not zero
    assert window_stats(samples, 11, 19) == (0, {})


def test_sampler_thread_aggregates_per_step_and_skips_uncounted_steps():
    source = CountingSource()
    tele = StepTelemetry(source, period_ms=5.0)
    windows = []
    for step, counted in ((0, True), (1, False), (2, True)):
        begin = tele.step_begins()
        time.sleep(0.06)
        end = time.perf_counter_ns()
        tele.step_ends(step, begin, end, counted=counted)
        windows.append((begin, end))
        time.sleep(0.02)  # between steps: samples here belong to no step
    tele.close()
    assert source.closed and not tele.sampler.running
    assert source.threads == {"trainprof-telemetry"}  # read on the sampler's own thread, not this one
    block = tele.block()
    assert [s["step"] for s in block["steps"]] == [0, 1, 2]
    for st, (begin, end) in zip(block["steps"], windows):
        # at most one sample per period of the step's real window (a loaded machine stretches the 60 ms
        # sleep), and some: the sampler ran while the step did
        assert 3 <= st["samples"] <= (end - begin) / 5e6 + 1, (st, (end - begin) / 1e6)
        clock = st["metrics"]["sm_clock_mhz"]
        # read indices rise by one per sample: within a step the max is the last index, the mean below it
        assert clock["max"] >= clock["mean"] + 0.9 * (st["samples"] - 1) / 2
        assert st["metrics"]["power_w"]["max"] == clock["max"] + 100
    # the summary is over the counted steps (0 and 2) only
    counted = [s for s in block["steps"] if s["counted"]]
    assert block["summary"]["sm_clock_mhz"]["samples"] == sum(s["samples"] for s in counted)
    assert block["summary"]["sm_clock_mhz"]["max"] == block["steps"][2]["metrics"]["sm_clock_mhz"]["max"]
    expected_mean = (sum(s["metrics"]["sm_clock_mhz"]["mean"] * s["samples"] for s in counted)
                     / sum(s["samples"] for s in counted))
    assert block["summary"]["sm_clock_mhz"]["mean"] == pytest.approx(expected_mean)
    # pcie is None on odd reads: about half the samples carry it
    assert block["summary"]["pcie_tx_gbps"]["samples"] < block["summary"]["sm_clock_mhz"]["samples"]
    assert 4.0 <= block["measured_period_ms"] <= 30.0
    assert block["unavailable"] == {"nvlink_tx_gbps": "no NVLink in this source"}
    assert block["stopped_reason"] is None


def test_a_failing_source_stops_sampling_with_a_reason_and_never_raises():
    source = CountingSource(fail_after=3)
    tele = StepTelemetry(source, period_ms=2.0)
    begin = tele.step_begins()
    time.sleep(0.05)
    tele.step_ends(0, begin, time.perf_counter_ns())
    tele.close()
    fields = telemetry_fields(tele, None)
    assert fields["telemetry"]["stopped_reason"] == ("sampling stopped after 3 reads: RuntimeError: device fell "
                                                     "off the bus")
    assert fields["telemetry"]["steps"][0]["samples"] == 2  # the first read only primes the counters


def test_no_sample_in_any_step_is_null_with_the_reason():
    tele = StepTelemetry(CountingSource(fail_after=0), period_ms=1000.0)
    begin = tele.step_begins()
    tele.step_ends(0, begin, begin)
    tele.close()
    fields = telemetry_fields(tele, None)
    assert fields["telemetry"] is None
    assert "no sample fell inside a measured step" in fields["telemetry_reason"]
    assert "RuntimeError" in fields["telemetry_reason"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the path of a machine without a GPU")
def test_nvml_without_a_gpu_is_null_with_nvml_s_own_reason():
    source, reason = open_nvml("cuda")  # what a CUDA device would ask for, on a machine with no NVML library
    assert source is None
    assert reason.startswith("NVML could not start: NVMLError") or reason.startswith("nvidia-ml-py is not installed")
    tele, reason = open_step_telemetry("cpu", 50.0)
    assert tele is None and reason.startswith("the device is cpu")
    assert open_step_telemetry("cuda", 0) == (None, "telemetry is off (profile.telemetry_period_ms is 0)")


def _tiny_loop(prof: Profiler, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        with prof.step():
            model(torch.randn(4, 8)).pow(2).mean().backward()
            time.sleep(0.03)  # a step long enough for several samples
            opt.step()
            opt.zero_grad()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_profiler_on_cpu_writes_telemetry_and_gpu_busy_null_with_reasons():
    model, opt = _model()
    with Profiler(model, optimizer=opt, warmup_steps=1) as prof:
        _tiny_loop(prof, model, opt, 3)
    result = prof.result()
    validate_profile(result)
    assert result["telemetry"] is None and result["telemetry_reason"].startswith("the device is cpu")
    assert result["gpu_busy"] is None and result["gpu_busy_reason"].startswith("the device is cpu")


def test_profiler_folds_samples_into_its_measured_steps(tmp_path):
    """The Profiler's step() drives the telemetry: warm-up steps get none, measured steps get theirs under
    the profile's step numbers, the traced steps are left out of the summary; the reports show it."""
    from trainprof.report.run_report import write_reports, write_run_files
    from trainprof.report.summary import render_summary
    from trainprof.report.tensorboard import scalar_series

    model, opt = _model()
    source = CountingSource()
    with Profiler(model, optimizer=opt, warmup_steps=2, ops=True, ops_steps=1, flops=False) as prof:
        prof.telemetry, prof.telemetry_reason = StepTelemetry(source, period_ms=5.0), None
        _tiny_loop(prof, model, opt, 6)
    assert source.closed  # close() stopped the thread and closed the source
    result = prof.result()
    validate_profile(result)
    block = result["telemetry"]
    assert [s["step"] for s in block["steps"]] == [s["step"] for s in result["steps"] if not s["warmup"]]
    traced = [s["step"] for s in result["steps"] if "ops" in s["instrumented"]]
    assert traced and all(not s["counted"] for s in block["steps"] if s["step"] in traced)
    assert all(s["samples"] >= 2 for s in block["steps"])
    assert block["summary"]["sm_clock_mhz"]["samples"] == sum(s["samples"] for s in block["steps"] if s["counted"])
    write_run_files(result, tmp_path)
    text = (tmp_path / "summary.md").read_text()
    assert "## GPU busy and telemetry" in text and "| sm_clock_mhz | MHz |" in text
    assert "nvlink_tx_gbps: no NVLink in this source" in text
    assert "GPU busy per phase" in text and "the device is cpu" in text
    assert render_summary(result, tmp_path) == text
    html = (tmp_path / "report.html").read_text()
    assert 'id="fig-telemetry"' in html and 'id="telemetry-table"' in html
    series = scalar_series(result)
    assert [x for x, _ in series["telemetry/sm_clock_mhz_max"]] == [s["step"] for s in block["steps"]]
    assert write_reports(tmp_path)["html"].is_file()


def test_gpu_busy_of_the_checked_in_h100_runs():
    """The busy share from a CUDA profile's operator table (device self time over the phase's median)."""
    doc = read_profile(REPO / "profiles" / "h100-llama1b_zero3_sdpa-torch")
    rows, reason = phase_busy(doc)
    assert reason is None
    step = rows[0]
    assert step.phase == "step" and step.wall_ms == doc["summary"]["step_ms"]["median"]
    assert step.device_ms == pytest.approx(sum(r["self_ms"] for r in doc["ops"]))  # one traced step
    assert round(step.busy_frac, 2) == 0.59
    by_phase = {r.phase: r for r in rows[1:]}
    assert by_phase["optimizer"].busy_frac > by_phase["forward"].busy_frac  # the optimizer is one fused launch train
    assert sum(r.device_ms for r in rows[1:]) == pytest.approx(step.device_ms)
    without_ops = {**doc, "ops": [], "ops_info": {"enabled": False, "steps": []}}
    assert gpu_busy_fields(without_ops) == {"gpu_busy": None, "gpu_busy_reason": phase_busy(without_ops)[1]}
    assert "profile.ops=true" in phase_busy(without_ops)[1]


@pytest.mark.gpu
def test_nvml_telemetry_on_a_real_gpu():
    """On a CUDA machine: the real NVML, sampled during real GPU work; figures within physical bounds."""
    tele, reason = open_step_telemetry("cuda", 20.0)
    assert tele is not None, reason
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    try:
        for step in range(3):
            begin = tele.step_begins()
            for _ in range(2000):  # about 0.3 s of matmuls a step: NVML's utilization averages 1/6 to 1 s
                x = (x @ x).clamp_(-1, 1)
            torch.cuda.synchronize()
            tele.step_ends(step, begin, time.perf_counter_ns())
    finally:
        tele.close()
    block = tele.block()
    s = block["summary"]
    assert 100 <= s["sm_clock_mhz"]["mean"] <= 3000 and s["sm_clock_mhz"]["max"] <= 3000
    assert 10 <= s["power_w"]["mean"] <= 1500
    assert 10 <= s["temperature_c"]["mean"] <= 100
    assert s["gpu_util_pct"]["max"] > 50  # the matmuls kept it busy
    assert all(st["samples"] >= 1 for st in block["steps"])
    assert block["stopped_reason"] is None


def test_trace_device_time_sums_and_unites_the_device_intervals(tmp_path):
    """trace_device_time on a small Kineto-shaped trace: two overlapping kernels on two streams, a memcpy,
    a host op that must not count, and the ProfilerStep marker."""
    import gzip

    from trainprof.analysis.gpu_busy import trace_device_time

    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#4", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 500},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 100, "dur": 300, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "nccl", "ts": 200, "dur": 400, "args": {"stream": 20}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 700, "dur": 50},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 800},
    ]
    path = tmp_path / "rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)
    t = trace_device_time(path)
    assert t.steps == [4] and t.step_ms == 1.0
    assert t.by_category == {"kernel": 0.7, "gpu_memcpy": 0.05}
    assert t.device_ms == pytest.approx(0.75)
    assert t.union_ms == pytest.approx(0.55)  # 100-600 and 700-750


def test_the_evidence_check_of_telemetry_rejects_an_impossible_reading():
    """tests/helpers/evidence.check_telemetry, which the kept GPU runs go through, on a block of plausible
    readings and on one with a 5 kW board."""
    from helpers.evidence import check_telemetry

    class Plausible(CountingSource):
        def read(self):
            i = self.reads
            self.reads += 1
            return {"sm_clock_mhz": 1980.0 - i, "power_w": self.watts + i, "pcie_tx_gbps": 1.5}

    for watts, sane in ((650.0, True), (5000.0, False)):
        source = Plausible()
        source.watts = watts
        tele = StepTelemetry(source, period_ms=5.0)
        begin = tele.step_begins()
        time.sleep(0.04)
        tele.step_ends(0, begin, time.perf_counter_ns())
        tele.close()
        if sane:
            check_telemetry(tele.block())
        else:
            with pytest.raises(AssertionError, match="power_w"):
                check_telemetry(tele.block())


def test_report_of_a_checked_in_h100_run_shows_its_gpu_busy_share(tmp_path):
    """A profile written before `gpu_busy` existed: the report computes the share from its operator table,
    and names the telemetry as absent, with the reason."""
    import shutil

    from trainprof.report.run_report import write_reports
    from trainprof.report.summary import render_summary

    run = tmp_path / "h100"
    shutil.copytree(REPO / "profiles" / "h100-llama1b_zero3_sdpa-torch", run)
    html = write_reports(run, scalars=False)["html"].read_text()
    assert '<table id="gpu-busy-table">' in html
    assert "58.6%" in html  # the step: 117.3 ms of device time in a 200.1 ms step
    assert "not available: GPU telemetry" in html and "predates GPU telemetry" in html
    md = render_summary(read_profile(run), run)
    assert "| step | 200.12 | 117.26 | 58.6% | 41.4% |" in md
