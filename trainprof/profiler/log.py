"""The per-step record that hooks append to: module events, phase regions and collectives, each with a
timer stamp. Appending to the log is all a hook does on the hot path; the analysis runs when the
profiler's steps are read (after training, see Profiler.steps)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainprof.analysis.records import (  # noqa: F401  (re-exported for the hooks)
    ACTION_CLOSE,
    ACTION_OPEN,
    B_CLOSE,
    B_OPEN,
    F_CLOSE,
    F_OPEN,
    MODULE_CLOSE,
    MODULE_OPEN,
    R_CLOSE,
    R_OPEN,
    REGION_CLOSE,
    REGION_OPEN,
)


@dataclass(slots=True, kw_only=True)
class CommRecord:
    """One collective call as issued by this rank.

    Stamps: `issue` before the call, `ret` when it returned; `waits` the (begin, end) of every blocking
    `Work.wait()` on an async op; `done` when gloo reported completion (host timer only).
    """

    op: str
    nbytes: int  # nccl-tests "size" of the collective (see comm.py)
    group_size: int
    module: int  # innermost profiled module open when issued, -1 outside the model
    is_async: bool
    issue: Any
    ret: Any = None
    waits: list[tuple[Any, Any]] = field(default_factory=list)
    done: Any = None
    work: Any = None  # the c10d Work, kept on GPU to read its NCCL duration after the step
    peer: int | None = None  # point-to-point ops: the other rank (global)


@dataclass(slots=True, kw_only=True)
class StepLog:
    """What one step recorded. `active` gates every hook: outside recorded steps they return at once.

    The step's timeline is kept as three columns, its i-th point being (codes[i], subjects[i], stamps[i])
    (analysis.records.Event says what each holds): the hooks record four points on every module call, and
    three list appends cost less than building one tuple, let alone an object (docs/profiler.md, "Cost").
    The analysis reads the points as Events (StepTimeline.events), after training.
    """

    active: bool = False
    codes: list[int] = field(default_factory=list)  # what happened (analysis.records codes), in recording order
    subjects: list[Any] = field(default_factory=list)  # to what: a module index, a region label, a pipeline action
    stamps: list[Any] = field(default_factory=list)  # when: the timer's stamps
    comms: list[CommRecord] = field(default_factory=list)
    tokens_seen: int = 0  # input_ids elements in root forward calls with grad enabled (recompute excluded)
    seq_len: int | None = None

    def mark(self, code: int, subject: Any, stamp: Any) -> None:
        """Append one point (the module hooks append to the columns themselves: a call less per point)."""
        self.codes.append(code)
        self.subjects.append(subject)
        self.stamps.append(stamp)

    def clear(self) -> None:
        self.codes, self.subjects, self.stamps = [], [], []
        self.comms = []
        self.tokens_seen = 0
