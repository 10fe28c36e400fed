"""GPU telemetry during measured steps: NVML (nvidia-ml-py) read by a background thread, aggregated per
step into profile.json `telemetry` (mean and max of each metric, and the sampling period).

What is read (profiler/nvml.py; each metric where the device supports it, the others listed with NVML's reason):
SM and memory clocks, board power, GPU temperature, GPU and memory utilization, PCIe transmit and receive
throughput, and NVLink data throughput over all links. Throughputs come from NVML's cumulative byte
counters, differenced between two samples.

Why a thread: NVML calls are ctypes calls, which release the GIL while the driver answers, so the
training thread only pays the Python around each read (tens of microseconds per sample). The thread
starts with the first measured step and its samples are assigned to steps by the host clock
(time.perf_counter_ns) of each step's begin and end.

It never fails a run: opening NVML, reading a metric or the thread itself may fail, and each failure
becomes `telemetry: null` with `telemetry_reason`, a metric listed under `unavailable`, or
`stopped_reason`, never an exception in the training loop.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Protocol

from trainprof.profiler.nvml import open_nvml

DEFAULT_PERIOD_MS = 50.0  # 2-10 samples in a 100-500 ms step; each read costs the sampler ~0.1 ms

# metric -> unit, written into the profile beside each figure
UNITS = {
    "sm_clock_mhz": "MHz", "mem_clock_mhz": "MHz", "power_w": "W", "temperature_c": "degC",
    "gpu_util_pct": "%", "mem_util_pct": "%", "pcie_tx_gbps": "GB/s", "pcie_rx_gbps": "GB/s",
    "nvlink_tx_gbps": "GB/s", "nvlink_rx_gbps": "GB/s",
}
METHOD = ("NVML (nvidia-ml-py) read by a background thread every period_ms while measured steps run; a "
          "sample belongs to the step whose host-clock window (time.perf_counter_ns at the step's begin and "
          "end) holds it; per step the mean and max over its samples; the summary is over the measured steps "
          "that carry no FLOP counting or operator tracing. Throughputs are NVML byte counters differenced "
          "between consecutive samples (1 GB = 1e9 bytes).")


class SampleSource(Protocol):
    """What the sampler reads: NVML on a GPU (NvmlSource); tests give it a source of their own."""

    description: str
    how: dict[str, str]  # metric -> how it is read (the metrics this source offers)
    unavailable: dict[str, str]  # metric -> why it is not read

    def read(self) -> dict[str, float | None]: ...

    def close(self) -> None: ...


@dataclass(slots=True, kw_only=True)
class Sample:
    t_ns: int  # host perf_counter_ns at the middle of the read
    read_ns: int  # how long the read took
    values: dict[str, float | None]


@dataclass(slots=True)
class Acc:
    """Running mean and max of one metric."""

    n: int = 0
    total: float = 0.0
    peak: float = float("-inf")

    def add(self, value: float) -> None:
        self.n += 1
        self.total += value
        self.peak = max(self.peak, value)

    def merge(self, other: Acc) -> None:
        self.n += other.n
        self.total += other.total
        self.peak = max(self.peak, other.peak)

    def figures(self) -> dict[str, float] | None:
        return {"mean": self.total / self.n, "max": self.peak} if self.n else None


@dataclass(slots=True, kw_only=True)
class StepStats:
    step: int
    samples: int
    metrics: dict[str, Acc] = field(default_factory=dict)
    counted: bool = True  # in the summary (not a FLOP-counting or traced step)


def window_stats(samples: Iterable[Sample], begin_ns: int, end_ns: int) -> tuple[int, dict[str, Acc]]:
    """Mean/max accumulators of the samples taken in [begin_ns, end_ns]; None values are skipped.

    Returns:
        (number of samples in the window, metric -> Acc)
    """
    count, accs = 0, {}
    for s in samples:
        if begin_ns <= s.t_ns <= end_ns:
            count += 1
            for name, value in s.values.items():
                if value is not None:
                    accs.setdefault(name, Acc()).add(value)
    return count, accs


class Sampler:
    """Reads `source` every `period_s` on a daemon thread; samples pile up in `samples` (a deque the
    training thread drains). A failing read ends the thread and sets `error`, nothing more."""

    def __init__(self, source: SampleSource, period_s: float) -> None:
        self.source, self.period_s = source, period_s
        self.samples: deque[Sample] = deque()
        self.error: str | None = None
        self.reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainprof-telemetry", daemon=True)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        if not self._thread.is_alive() and not self._stop.is_set():
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        now = time.perf_counter_ns
        next_ns = now()
        period_ns = int(self.period_s * 1e9)
        primed = False
        while not self._stop.is_set():
            t0 = now()
            try:
                values = self.source.read()
            except Exception as err:  # noqa: BLE001  telemetry never fails a run: it stops, with the reason
                self.error = f"sampling stopped after {self.reads} reads: {type(err).__name__}: {err}"
                return
            t1 = now()
            self.reads += 1
            if primed:  # the first read only primes: a counter's first rate spans back to the source's opening
                self.samples.append(Sample(t_ns=(t0 + t1) // 2, read_ns=t1 - t0, values=values))
            primed = True
            next_ns += period_ns
            wait_ns = next_ns - now()
            if wait_ns < 0:  # the read took longer than the period: go on from now, no burst of reads
                next_ns, wait_ns = now(), 0
            self._stop.wait(wait_ns / 1e9)


class StepTelemetry:
    """The Profiler's telemetry: a Sampler started on the first measured step, its samples folded into
    per-step mean and max when each step ends (so memory does not grow with the run).

    Args:
        source: what to read (NvmlSource on a GPU).
        period_ms: the sampling period asked for.
    """

    def __init__(self, source: SampleSource, period_ms: float) -> None:
        self.source, self.period_ms = source, period_ms
        self.sampler = Sampler(source, period_ms / 1e3)
        self.steps: list[StepStats] = []
        self._gaps_ns: deque[int] = deque(maxlen=4096)  # between consecutive samples: the real period
        self._read_ns: deque[int] = deque(maxlen=4096)
        self._last_t: int | None = None
        self._closed = False

    def step_begins(self) -> int:
        """Call as a measured step begins; returns its host-clock begin (perf_counter_ns)."""
        begin = time.perf_counter_ns()  # before the thread starts: its first sample is inside the step
        if not self._closed:
            self.sampler.start()
        return begin

    def step_ends(self, step: int, begin_ns: int, end_ns: int, *, counted: bool = True) -> None:
        """Fold the samples taken up to `end_ns` into this step (those since `begin_ns`) and drop them."""
        taken = []
        samples = self.sampler.samples
        while samples and samples[0].t_ns <= end_ns:
            s = samples.popleft()
            taken.append(s)
            if self._last_t is not None:
                self._gaps_ns.append(s.t_ns - self._last_t)
            self._last_t = s.t_ns
            self._read_ns.append(s.read_ns)
        count, accs = window_stats(taken, begin_ns, end_ns)
        self.steps.append(StepStats(step=step, samples=count, metrics=accs, counted=counted))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sampler.stop()
        try:
            self.source.close()
        except Exception:  # noqa: BLE001  a failing NVML shutdown changes nothing already measured
            pass

    def block(self) -> dict[str, Any]:
        """The profile.json `telemetry` block."""
        total: dict[str, Acc] = {}
        for st in self.steps:
            if st.counted:
                for name, acc in st.metrics.items():
                    total.setdefault(name, Acc()).merge(acc)
        return {
            "source": self.source.description,
            "method": METHOD,
            "period_ms": self.period_ms,
            "measured_period_ms": statistics.median(self._gaps_ns) / 1e6 if self._gaps_ns else None,
            "read_ms": statistics.median(self._read_ns) / 1e6 if self._read_ns else None,
            "metrics": {name: {"unit": UNITS.get(name, ""), "how": how} for name, how in self.source.how.items()},
            "unavailable": dict(self.source.unavailable),
            "stopped_reason": self.sampler.error,
            "summary": {name: {**acc.figures(), "samples": acc.n, "unit": UNITS.get(name, "")}
                        for name, acc in total.items() if acc.n},
            "steps": [{"step": st.step, "samples": st.samples, "counted": st.counted,
                       "metrics": {name: acc.figures() for name, acc in st.metrics.items() if acc.n}}
                      for st in self.steps],
        }


def telemetry_fields(telemetry: StepTelemetry | None, reason: str | None) -> dict[str, Any]:
    """`telemetry` and `telemetry_reason` for a profile: the block, or null with the reason. Building the
    block cannot fail the run either."""
    if telemetry is None:
        return {"telemetry": None, "telemetry_reason": reason}
    try:
        block = telemetry.block()
    except Exception as err:  # noqa: BLE001
        return {"telemetry": None,
                "telemetry_reason": f"telemetry could not be summarised: {type(err).__name__}: {err}"}
    if not any(st.samples for st in telemetry.steps):
        return {"telemetry": None, "telemetry_reason": (
            f"no sample fell inside a measured step (period {telemetry.period_ms:g} ms"
            + (f"; {block['stopped_reason']}" if block["stopped_reason"] else "") + ")")}
    return {"telemetry": block, "telemetry_reason": None}


def open_step_telemetry(device: Any, period_ms: float | None) -> tuple[StepTelemetry | None, str | None]:
    """The Profiler's telemetry for `device`, or (None, the reason): off, not a GPU, no NVML."""
    if not period_ms or period_ms <= 0:
        return None, "telemetry is off (profile.telemetry_period_ms is 0)"
    source, reason = open_nvml(device)
    if source is None:
        return None, reason
    return StepTelemetry(source, period_ms), None
