"""`trainprof project` called in the test's process, as the projection tests read it."""

from __future__ import annotations

import contextlib
import io
import json

# the plan's memory against a real run's peak (issue 24's goal)
MEMORY_TOLERANCE = 0.10
# 4 of a run's steps are warm-up or instrumented; 16 leave the medians of 12 (each step is ~0.1 s)
STEPS = "train.steps=16"  # as in conftest's QUICKSTART_2RANK, the source


def project(*args: str) -> dict:
    """`trainprof project ... --json` in this process: the printed JSON."""
    from trainprof.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["project", *args, "--json"])
    assert rc == 0, out.getvalue()[-2000:]
    return json.loads(out.getvalue())


def kinds(pred: dict) -> dict[str, dict]:
    """A prediction's assumptions by kind (their values)."""
    return {a["kind"]: a["values"] for a in pred["assumptions"]}
