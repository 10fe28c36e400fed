"""The machine as the pytest-xdist workers share it: tests that assert on measured durations hold it
alone, the others share it (flock on files of the test session, as the workers are processes)."""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive flock on `path` for the duration of the block."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class MachineLock:
    """A readers-writer lock over the machine: `held(alone)` around a whole test (alone for one marked
    `timed`), `alone()` inside a sharing test for a while (to make a run a timed test may measure).
    Whoever waits to be alone holds the turnstile, which every new holder passes first: tests that
    share the machine finish, and none starts, until the waiting one has had its turn."""

    def __init__(self, directory: Path) -> None:
        self.turnstile = directory / "turnstile.lock"
        self.machine = open(directory / "machine.lock", "a")  # noqa: SIM115  held for the session
        self.alone_now = False
        self.holding = False

    def _take(self, alone: bool) -> None:
        with file_lock(self.turnstile):
            fcntl.flock(self.machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        self.alone_now, self.holding = alone, True

    def _release(self) -> None:
        fcntl.flock(self.machine, fcntl.LOCK_UN)
        self.holding = False

    @contextlib.contextmanager
    def held(self, alone: bool):
        self._take(alone)
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def alone(self):
        """Alone for the block. A sharing holder lets go first: two sharing holders that both waited to
        be alone while still sharing would wait for each other for ever."""
        if not self.holding or self.alone_now:
            yield
            return
        self._release()
        self._take(alone=True)
        try:
            yield
        finally:
            self._release()
            self._take(alone=False)
