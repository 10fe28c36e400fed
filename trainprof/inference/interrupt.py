"""What a `trainprof infer` run stopped by Ctrl-C or SIGTERM keeps: the batch sizes it finished, as an
inference.json marked partial (and its report), and inference.interrupted.json saying when it stopped.

SIGTERM (a scheduler's preemption, `kill`, a timeout) is raised as an interrupt like Ctrl-C, as
`trainprof sweep` does (sweep/runner.py), so the measurement loop unwinds and what it finished is
written; the command then exits 143 (SIGTERM) or 130 (Ctrl-C) after one line.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from trainprof.io import atomic_write_json
from trainprof.report.rundir import INFERENCE_INTERRUPTED as INTERRUPTED_FILE

EXIT_CODES = {"SIGTERM": 143, "SIGINT": 130}  # a shell's status for a process ended by the signal: 128 + its number


class Sigterm(KeyboardInterrupt):
    """SIGTERM, raised in the main thread where Ctrl-C raises KeyboardInterrupt."""


def _raise_sigterm(signum: int, frame: Any) -> None:
    raise Sigterm("SIGTERM")


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()  # only it can set signal handlers


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Within the block SIGTERM raises Sigterm (a KeyboardInterrupt); the handler before is restored after.
    Outside the main thread the block runs as it is."""
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(slots=True, kw_only=True)
class StoppedAt:
    """Where the measurement was when it was interrupted."""

    signal: str  # SIGTERM | SIGINT
    batch_sizes: list[int]  # all the run was asked for
    done: int  # how many of them finished
    stage: str  # "batch size" (measuring batch_sizes[done]) | "operator trace" (all batch sizes done)

    @classmethod
    def of(cls, err: KeyboardInterrupt, batch_sizes: list[int], done: int) -> StoppedAt:
        return cls(signal="SIGTERM" if isinstance(err, Sigterm) else "SIGINT", batch_sizes=batch_sizes, done=done,
                   stage="batch size" if done < len(batch_sizes) else "operator trace")

    @property
    def during(self) -> str:
        if self.stage == "operator trace":
            return "the operator trace (every batch size was measured)"
        return f"batch size {self.batch_sizes[self.done]} ({self.done + 1} of {len(self.batch_sizes)})"

    @property
    def reason(self) -> str:
        """One line for inference.json's partial_reason and the report."""
        missing = self.batch_sizes[self.done:]
        lost = f"; batch sizes {', '.join(map(str, missing))} not measured" if missing else "; no operator trace"
        return f"interrupted by {self.signal} during {self.during}{lost}"

    def record(self) -> dict[str, Any]:
        """inference.interrupted.json."""
        return {"kind": "interrupted", "signal": self.signal, "stopped_during": self.during, "stage": self.stage,
                "batch_size": self.batch_sizes[self.done] if self.stage == "batch size" else None,
                "batch_sizes": self.batch_sizes, "batch_sizes_done": self.batch_sizes[:self.done],
                "kept": "inference.json marked partial, with its report" if self.done else
                        "nothing measured: no batch size had finished"}


class InferInterrupted(KeyboardInterrupt):
    """The run was interrupted and kept what it finished; str() is the command's one line."""

    def __init__(self, message: str, signal_name: str) -> None:
        super().__init__(message)
        self.exit_code = EXIT_CODES[signal_name]


def keep_interrupted(run_dir: Path, stopped: StoppedAt, write_partial: Callable[[], None]) -> InferInterrupted:
    """Write inference.interrupted.json, then (when a batch size finished) `write_partial()`: the partial
    inference.json and its report. A second SIGTERM meanwhile is ignored, so it cannot cut them short.

    Returns:
        the exception to raise, its message naming what was kept where.
    """
    if _in_main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # sigterm_interrupts restores the handler after
    atomic_write_json(run_dir / INTERRUPTED_FILE, stopped.record())
    kept = INTERRUPTED_FILE
    if stopped.done:
        write_partial()
        done = ", ".join(map(str, stopped.batch_sizes[:stopped.done]))
        kept = f"inference.json, inference.md, inference.html (partial: batch sizes {done}) and {INTERRUPTED_FILE}"
    return InferInterrupted(f"infer interrupted by {stopped.signal} during {stopped.during}; kept in {run_dir}: "
                            f"{kept}", stopped.signal)
