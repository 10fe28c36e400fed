"""Replaying a traced GPU step: its host's launch timeline against its kernels, with either side made
faster or slower (a what-if, and the host/device half of a trace-replay predictor such as Lumos,
MLSys'25).

From one Kineto trace (`*.pt.trace.json[.gz]`) the step is rebuilt as the host issued it: the CUDA
runtime and driver calls of all host threads in the order they were made (the main thread waits while
the autograd thread runs backward, so their calls form one sequence), the host's own work being the
gaps between calls. Each call's kernels, copies and memsets run on their stream in order, no earlier
than the call plus the trace's launch latency. Synchronizing calls (stream, device and event
synchronize; a copy to host memory) wait for the device. Scaling the host gaps and the device
durations and replaying says where the step goes: a host-bound step speeds up with its host, a
device-bound one with its GPU. Not modelled: dependencies between streams other than through
synchronizing calls, host work that depends on the device's results beyond those calls, and a launch
that blocked on a full launch queue (its wait counts as host work, so a device-bound trace's host is
overstated).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from trainprof.analysis.gpu_busy import DEVICE_CATEGORIES, union_us
from trainprof.analysis.trace import STEP_MARKER, iter_events
from trainprof.hardware import Target, matmul_ratio_key

HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")
# calls after which the host holds until the device has finished what came before
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cuEventSynchronize")


@dataclasses.dataclass(frozen=True, slots=True)
class HostCall:
    name: str
    ts: float  # us, the trace's clock
    dur: float
    correlation: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceOp:
    name: str
    category: str  # kernel | gpu_memcpy | gpu_memset
    ts: float
    dur: float
    stream: int
    correlation: int | None


@dataclasses.dataclass(frozen=True, slots=True)
class TracedStep:
    """One ProfilerStep of a trace: its window on the host and what ran in it."""

    step: int
    start: float  # us
    end: float  # the step marker's end on the host
    calls: list[HostCall]
    ops: dict[int, list[DeviceOp]]  # correlation -> the device work that call issued
    launch_latency_us: float  # median (op start - its call's start) over ops issued to an idle stream

    @property
    def measured_ms(self) -> float:
        """The step as traced: until the host left the step marker or the device finished its work,
        whichever came later."""
        last = max((op.ts + op.dur for ops in self.ops.values() for op in ops), default=self.end)
        return (max(self.end, last) - self.start) / 1e3


@dataclasses.dataclass(frozen=True, slots=True)
class Replayed:
    step_ms: float
    host_ms: float  # when the host finished issuing the step
    device_busy_ms: float  # the union of the device work


def load_steps(path: str | Path) -> list[TracedStep]:
    """The trace's ProfilerStep windows (host-side markers), each with its runtime calls and device work."""
    markers, calls, ops = [], [], []
    for ev in iter_events(path):
        if ev.get("ph") != "X":
            continue
        cat, args = ev.get("cat") or "", ev.get("args") or {}
        if cat == "user_annotation" and (m := STEP_MARKER.match(ev.get("name", ""))):
            markers.append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), int(m.group(1))))
        elif cat in HOST_CATEGORIES:
            calls.append(HostCall(ev.get("name", ""), float(ev["ts"]), float(ev.get("dur", 0.0)), args.get("correlation")))
        elif cat in DEVICE_CATEGORIES:
            ops.append(DeviceOp(ev.get("name", ""), cat, float(ev["ts"]), float(ev.get("dur", 0.0)),
                                int(args.get("stream", 0)), args.get("correlation")))
    calls.sort(key=lambda c: c.ts)
    by_corr: dict[int, list[DeviceOp]] = defaultdict(list)
    for op in sorted(ops, key=lambda o: o.ts):
        by_corr[op.correlation].append(op)
    starts = [c.ts for c in calls]
    out = []
    for start, end, step in sorted(markers):
        window = calls[bisect.bisect_left(starts, start):bisect.bisect_right(starts, end)]
        issued = {c.correlation: by_corr[c.correlation] for c in window if c.correlation in by_corr}
        out.append(TracedStep(step, start, end, window, issued, _launch_latency(window, issued)))
    return out


def _launch_latency(calls: list[HostCall], issued: dict[int, list[DeviceOp]]) -> float:
    """Median µs from a call to its first op's start, over ops whose stream was idle when the call was
    made (a queued op's lag is the queue's, not the launch's)."""
    busy_until: dict[int, float] = defaultdict(lambda: float("-inf"))
    lags = []
    for call in calls:
        for op in issued.get(call.correlation, []):
            if busy_until[op.stream] <= call.ts:
                lags.append(op.ts - call.ts)
            busy_until[op.stream] = max(busy_until[op.stream], op.ts + op.dur)
    return max(statistics.median(lags), 0.0) if lags else 0.0


def replay(step: TracedStep, *, host_scale: float = 1.0,
           device_scale: Callable[[DeviceOp], float] = lambda op: 1.0) -> Replayed:
    """The step rebuilt with the host's own work x `host_scale` and each device op's duration x
    `device_scale(op)` (module docstring)."""
    t = 0.0  # the host's new clock, us from the step's start
    prev_end = step.start  # where the host was on the trace's clock
    stream_end: dict[int, float] = defaultdict(float)
    device_end, intervals = 0.0, []
    for call in step.calls:
        t += max(call.ts - prev_end, 0.0) * host_scale
        issued = step.ops.get(call.correlation, [])
        if call.name in SYNC_CALLS:
            t = max(t, device_end)
        else:
            launch = t
            t += call.dur * host_scale
            for op in issued:
                begin = max(launch + step.launch_latency_us, stream_end[op.stream])
                end = begin + op.dur * device_scale(op)
                stream_end[op.stream] = end
                device_end = max(device_end, end)
                intervals.append((begin, end))
                if op.category == "gpu_memcpy" and "toH" in op.name:  # a copy to host memory holds the host
                    t = max(t, end)
        prev_end = max(prev_end, call.ts + call.dur)
    t += max(step.end - prev_end, 0.0) * host_scale
    return Replayed(step_ms=max(t, device_end) / 1e3, host_ms=t / 1e3, device_busy_ms=union_us(intervals) / 1e3)


def untraced_pace(step: TracedStep, untraced_ms: float, *, rel: float = 0.005) -> float:
    """The factor on the traced host's own work (replay's host_scale) at which it issues the step's work within
    `untraced_ms`, the run's median untraced step. That step holds all of the untraced host's issuing, so the
    untraced host is at least this fast: a floor replayed at this pace is an upper bound. 1.0 where the traced
    host already fits (tracing's inflation is then not known); the waits at synchronizing calls are not scaled.

    Args:
        step: the traced step.
        untraced_ms: the run's median untraced step (profile.json summary.step_ms.median).
        rel: how close to `untraced_ms` the replayed host must come.

    Returns:
        The factor, in (0, 1]; where it stops short of `rel`, the one on the slow side; 1.0 where even a host
        of no cost would overrun `untraced_ms` (the replay then cannot place it).
    """
    def over(scale: float) -> float:  # how far the host at this scale overruns the untraced step, ms
        return replay(step, host_scale=scale).host_ms - untraced_ms

    lo, hi = 0.0, 1.0
    at_lo, at_hi = over(lo), over(hi)
    if at_hi <= 0 or at_lo >= 0:  # fits already, or the waits for the device alone overrun it
        return 1.0
    kept = 0  # which end stayed last time: the Illinois variant of regula falsi halves its weight if it stays again
    for _ in range(12):
        scale = hi - at_hi * (hi - lo) / (at_hi - at_lo)
        at = over(scale)
        if abs(at) <= rel * untraced_ms:
            return scale
        if at > 0:
            hi, at_hi = scale, at
            at_lo, kept = (at_lo / 2 if kept == -1 else at_lo), -1
        else:
            lo, at_lo = scale, at
            at_hi, kept = (at_hi / 2 if kept == 1 else at_hi), 1
    return hi


# kernels bound by the tensor cores (GEMMs, fused attention) by their names on Hopper and Ampere: cuBLAS's
# nvjet and cutlass/xmma kernels, cuDNN's and FlashAttention's attention; every other kernel, copy on the
# device and memset is taken as bound by memory bandwidth
COMPUTE_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|wgmma|cublas|sdpa|flash|fmha", re.IGNORECASE)
HOST_COPY = re.compile(r"HtoD|DtoH|HtoP|PtoH")  # host <-> device copies: the host link's


@dataclasses.dataclass(frozen=True, slots=True)
class DeviceRates:
    """How one device's work is re-timed on another: duration factors by what bounds it."""

    compute: float  # source matmul rate / target's (MAMF where both have one, else bf16 dense peak)
    memory: float  # source memory bandwidth / target's
    source: str  # where the factors come from

    def __call__(self, op: DeviceOp) -> float:
        if op.category == "gpu_memcpy" and HOST_COPY.search(op.name):
            return 1.0
        return self.compute if op.category == "kernel" and COMPUTE_KERNEL.search(op.name) else self.memory


def device_rates(source: Target, target: Target) -> DeviceRates:
    """The target's catalog figures against the source's: GEMM and attention kernels by the matmul rate
    (MAMF over MAMF where both have one, else the bf16 dense peak, as `trainprof project` carries it), the
    rest by memory bandwidth; host copies unchanged (the catalog holds no host-link figure per GPU).

    Raises:
        ValueError: a catalog entry lacks the matmul figure or memory_gbps.
    """
    matmul = matmul_ratio_key(source, target)
    figures = {}
    for key in (matmul, "memory_gbps"):
        a, b = source.figure(key), target.figure(key)
        if not a or not b:
            raise ValueError(f"hardware '{source.key if not a else target.key}' has no {key} in the catalog")
        figures[key] = a / b
    basis = "MAMF (measured)" if matmul == "mamf_bf16_tflops" else "bf16 dense peak (datasheet)"
    return DeviceRates(compute=figures[matmul], memory=figures["memory_gbps"],
                       source=f"catalog figures, {source.key} -> {target.key}: {basis} for GEMM and attention "
                              "kernels, datasheet memory bandwidth for the rest, host copies unchanged")


@dataclasses.dataclass(frozen=True, slots=True)
class CrossDevice:
    step_ms: float  # the source run's measured step x (target.step_ms / source.step_ms)
    source: Replayed  # the traced step replayed as it ran
    target: Replayed  # the same with its device work re-timed (and its host scaled)
    rates: DeviceRates


def cross_device(step: TracedStep, measured_step_ms: float, rates: DeviceRates, *,
                 host_scale: float = 1.0, pace: float = 1.0) -> CrossDevice:
    """The traced step replayed with its device work re-timed for another GPU (the host as fast as the
    source's unless host_scale says otherwise). The ratio of the two replays is carried onto the measured
    (untraced) step, since tracing slows the host and a traced step is longer than a measured one. `pace`
    scales the host's own work in both replays: 1.0 the traced host (the replay cases' basis), below it the
    untraced host's (`untraced_pace`)."""
    same, other = replay(step, host_scale=pace), replay(step, host_scale=pace * host_scale, device_scale=rates)
    return CrossDevice(step_ms=measured_step_ms * other.step_ms / same.step_ms, source=same, target=other, rates=rates)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReplayConfidence:
    """How far a --to prediction was found off: this run's own replay case, else the cases of its GPU pair
    (other runs), else none (`label` "measured", "pair" or "unvalidated"); from validation_gpu.json replay_cases."""

    label: str
    source_gpu: str
    target_gpu: str
    errors_pct: tuple[float, ...] = ()  # step errors of the cases that speak for it: this run's one, or the pair's
    predicted_ms: float | None = None  # this run's case: the replay's prediction and the target run's measured step
    measured_ms: float | None = None
    measured_run: str | None = None
    validated_gpus: tuple[str, ...] = ()  # the GPUs the cases ran between

    @property
    def text(self) -> str:
        where = "validation_gpu.json replay_cases, docs/projection.md"
        pair = f"{self.source_gpu} -> {self.target_gpu}"
        if self.label == "measured":
            return (f"replay's measured error on this run -> {self.target_gpu}: {self.errors_pct[0]:+.1f}% (predicted "
                    f"{self.predicted_ms:.1f} ms against {self.measured_ms:.1f} ms measured by {self.measured_run}; "
                    f"{where})")
        if self.label == "pair":
            mean = statistics.mean(abs(e) for e in self.errors_pct)
            return (f"not validated on this run; replay {pair} measured on {len(self.errors_pct)} other runs: "
                    f"{min(self.errors_pct):+.1f}% to {max(self.errors_pct):+.1f}%, mean |error| {mean:.1f}% ({where})")
        checked = " and ".join(self.validated_gpus) or "no GPUs"
        return f"unvalidated: {pair} never validated (replay was checked between {checked} only; {where})"


def replay_confidence(cases: list[dict], source_run: str | None, source_gpu: str,
                      target_gpu: str) -> ReplayConfidence:
    """The confidence of replaying `source_run` (its profiles/ folder name) from `source_gpu` to `target_gpu`
    (catalog keys), from replay cases ({source, target, hardware, predicted_step_ms, measured_step_ms,
    step_error_pct}: validation_gpu.json). A case's source GPU is the hardware of the case run the other way."""
    hardware_of = {c["source"]: c["hardware"] for c in cases}
    gpus = tuple(sorted({c["hardware"] for c in cases}))
    base = {"source_gpu": source_gpu, "target_gpu": target_gpu, "validated_gpus": gpus}
    own = next((c for c in cases if c["source"] == source_run and c["hardware"] == target_gpu), None)
    if own is not None:
        return ReplayConfidence(label="measured", errors_pct=(own["step_error_pct"],),
                                predicted_ms=own["predicted_step_ms"], measured_ms=own["measured_step_ms"],
                                measured_run=own["target"], **base)
    pair = [c["step_error_pct"] for c in cases
            if c["hardware"] == target_gpu and hardware_of.get(c["target"]) == source_gpu]
    if pair and source_gpu != target_gpu:
        return ReplayConfidence(label="pair", errors_pct=tuple(pair), **base)
    return ReplayConfidence(label="unvalidated", **base)
