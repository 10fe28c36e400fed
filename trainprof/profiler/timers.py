"""Timestamps for the step profiler: CUDA events on GPU (resolved once per step), a monotonic host clock
on CPU.

Every hook asks the timer for a stamp with `now()`; stamps are opaque (an int of nanoseconds on the
host, a recorded `torch.cuda.Event` on GPU). At the end of a step `resolve()` turns all of them into
milliseconds since the step's first stamp. The CUDA path never synchronizes inside the step: it waits
once, on the step's last event, and then reads every elapsed time.
"""

from __future__ import annotations

import time
from typing import Any, Protocol, Sequence

import torch


class Timer(Protocol):
    kind: str  # "host" | "cuda_event": written to profile.json env.timer

    def now(self) -> Any: ...

    def resolve(self, origin: Any, stamps: Sequence[Any]) -> list[float]: ...

    def release(self) -> None: ...


class HostTimer:
    """`time.perf_counter_ns` (CLOCK_MONOTONIC): what the host thread saw. On CPU training that is what
    the compute took, since every op runs synchronously on the calling thread (or its intra-op pool)."""

    kind = "host"
    description = "host monotonic clock (time.perf_counter_ns) on the thread that runs the hooks"

    # the C function itself, not a method wrapping it: one Python frame less per stamp (hooks stamp often)
    now = staticmethod(time.perf_counter_ns)

    def resolve(self, origin: int, stamps: Sequence[int]) -> list[float]:
        """Args: origin: the step's first stamp; stamps: stamps from `now()`.
        Returns: milliseconds of each stamp after `origin`."""
        return [(s - origin) / 1e6 for s in stamps]  # divided, not multiplied by 1e-6: exact round trip to ns

    def release(self) -> None:
        pass


class CudaEventTimer:
    """CUDA events recorded on the current stream of the thread that runs the hook (the autograd
    engine sets the op's stream in backward). Durations are GPU timeline durations; a host-side wait
    (data loading) shows up only where the GPU ran dry."""

    kind = "cuda_event"
    description = ("CUDA events on the current stream, resolved after one synchronize at step end "
                   "(no synchronize per module)")

    def __init__(self) -> None:
        self._pool: list[torch.cuda.Event] = []
        self._used: list[torch.cuda.Event] = []

    def now(self) -> torch.cuda.Event:
        ev = self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)
        ev.record()
        self._used.append(ev)
        return ev

    def resolve(self, origin: torch.cuda.Event, stamps: Sequence[torch.cuda.Event]) -> list[float]:
        """Args: origin: the step's first event; stamps: events from `now()`.
        Returns: milliseconds of each event after `origin` (one synchronize, on the last event)."""
        last = self._used[-1] if self._used else origin
        last.synchronize()
        return [origin.elapsed_time(s) for s in stamps]

    def release(self) -> None:
        """Return this step's events to the pool (call after `resolve`)."""
        self._pool.extend(self._used)
        self._used.clear()


def make_timer(device: torch.device | str | None = None) -> HostTimer | CudaEventTimer:
    """The timer for a device: CUDA events for a CUDA device, the host clock otherwise.

    Args:
        device: where the model computes; None picks CUDA when available.
    Returns:
        A timer whose `kind` is written to profile.json.
    """
    if device is None:
        use_cuda = torch.cuda.is_available()
    else:
        use_cuda = torch.device(device).type == "cuda"
    return CudaEventTimer() if use_cuda else HostTimer()
