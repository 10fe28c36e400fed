"""Assertions shared by the profiler tests: module times against the ledger, closure, schema."""

from __future__ import annotations

import contextlib
import logging
import statistics
import warnings
from collections.abc import Iterator
from typing import Any, Callable

import pytest

from helpers.synthetic import truth_ms

REL = 0.05  # module times within 5% (issue 3)
ABS_MS = 0.15  # where nothing ran, under this many ms
CLOSURE = 0.02  # unattributed at most 2% of the step


def module_rows_per_step(prof) -> tuple[list[dict[int, dict]], dict[str, int]]:
    """Per measured, uninstrumented step: the module rows (module_tree_step), and name -> index."""
    from trainprof.analysis.aggregate import module_tree_step

    infos = prof.hooks.modules
    steps = [s for s in prof.steps if not s.warmup and not s.instrumented]
    return [module_tree_step(infos, s.breakdown.modules) for s in steps], {m.name: m.index for m in infos}


def check_modules(rows: list[dict[int, dict]], index: dict[str, int], ledger: list, names: list[str],
                  rel: float = REL) -> None:
    """Each step's module forward / backward / recompute against that step's truth; the median
    relative error over steps must be within `rel` (a single preempted step is machine noise)."""
    assert len(rows) == len(ledger), (len(rows), len(ledger))
    for name in names:
        for phase in ("forward", "backward", "recompute"):
            errors, pairs = [], []
            for row, truth_step in zip(rows, ledger):
                measured = row[index[name]][f"{phase}_ms"]
                truth = truth_ms([truth_step], name, phase)
                errors.append(abs(measured - truth) / truth if truth else abs(measured) / ABS_MS * REL)
                pairs.append(f"{measured:.2f}/{truth:.2f}")
            median = statistics.median(errors)
            assert median <= rel, (f"{name or '(model)'} {phase}: median relative error {median:.3f} over steps "
                                   f"{[round(e, 3) for e in errors]} (measured/truth ms: {', '.join(pairs)})")


def check_closure(result: dict[str, Any]) -> None:
    """Phases + unattributed == wall exactly on every step. Unattributed, over the measured,
    uninstrumented steps: median <= 2% (the issue's bound) and none above 10%, a margin for a shared
    2-core CI machine that can preempt the loop between two phases for several ms (the FLOP-counting
    step runs every op through a dispatch mode and is excluded, as in the summaries)."""
    fracs = []
    for step in result["steps"]:
        assert abs(sum(step["phases_ms"].values()) + step["unattributed_ms"] - step["wall_ms"]) < 1e-6
        assert step["unattributed_ms"] >= -1e-6
        if not step["warmup"] and not step["instrumented"]:
            fracs.append(step["unattributed_ms"] / step["wall_ms"])
    assert fracs and statistics.median(fracs) <= CLOSURE, f"median unattributed {statistics.median(fracs):.4f}"
    assert max(fracs) <= 5 * CLOSURE, f"a step does not close: unattributed fractions {fracs}"
    assert result["summary"]["unattributed_frac"] <= CLOSURE


class NotJudged(AssertionError):
    """An attempt of a timing test that the machine left nothing to judge by: its noise measured too wide, or its
    pace changed between two runs that should agree. retry_on_noise retries it as it does a miss."""


class RetriedOnNoise(UserWarning):
    """A timing test's attempt that missed and was retried."""


def retry_on_noise(check: Callable[[], None], attempts: int = 3) -> None:
    """Run a timing test (training and its assertions) up to `attempts` times. A wrong attribution
    fails every attempt; a run that a loaded shared machine preempted at the wrong moment rarely fails
    twice in a row. The last failure is raised, with the earlier attempts' messages (one miss repeated
    is a wrong model; different misses are noise). Where every attempt was NotJudged the test is skipped
    with their reasons: a judged attempt that missed fails it."""
    misses: list[str] = []
    judged = False
    for attempt in range(attempts):
        try:
            check()
            return
        except AssertionError as miss:
            judged |= not isinstance(miss, NotJudged)
            misses.append(f"attempt {attempt + 1}: {str(miss).splitlines()[0] if str(miss) else 'failed'}")
            if attempt < attempts - 1:  # in the warnings summary: where a passing test spent its retries
                warnings.warn(misses[-1], RetriedOnNoise, stacklevel=2)
            elif not judged:
                pytest.skip("the machine left nothing to judge: " + "; ".join(misses))
            else:
                raise AssertionError("\n".join(misses)) from miss


@contextlib.contextmanager
def logged_by(logger: str) -> Iterator[list[str]]:
    """The messages `logger` (and its children) logs inside the block, whatever the handlers' levels."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(logger).addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger(logger).removeHandler(handler)
