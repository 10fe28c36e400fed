"""The state of processes a test started or expects gone (psutil)."""

from __future__ import annotations

import time

import psutil


def descendants_alive(pids: list[int]) -> list[int]:
    """Those of `pids` still running: gone and zombie processes (exited, not yet reaped) are not."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_for_status(proc: psutil.Process, status: str, timeout: float = 5.0) -> str:
    """`proc`'s status once it is `status`, or at `timeout` (a signal's effect is not immediate)."""
    deadline = time.monotonic() + timeout
    while proc.status() != status and time.monotonic() < deadline:
        time.sleep(0.02)
    return proc.status()
