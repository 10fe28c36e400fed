"""The resumable state of a sweep (or a max-batch search, or a scaling run): one JSON file, rewritten
atomically whenever a cell changes status, so a crash or Ctrl-C never loses a finished cell.

    {schema_version, kind, name, created, updated, meta {...},
     cells: {<cell key>: {key, id, label, overrides, nproc, nnodes, world_size, fingerprint,
                         status: running | done | failed | interrupted,
                         started, finished, attempts, run_dir, log, values, methods, null_reasons,
                         failure: null | {kind, rank, signal, type, message, peak_memory_bytes, ...},
                         partial: null | {steps, reason, source, values, methods, null_reasons},
                         earlier_attempts: null | [{attempt, dir, status, partial}]}}}

`values` are a finished cell's figures only; a failed or interrupted cell's measured steps are in
`partial`, and an earlier attempt's dir is kept (moved aside), never deleted.

A cell is run again when it is missing, was `running` (the sweep died under it) or `interrupted`;
`failed` only on request (retry_failed); `done` never.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import json
from pathlib import Path
from typing import Any

from trainprof.errors import UserError
from trainprof.io import atomic_write_json

SCHEMA_VERSION = 1
FINISHED = ("done", "failed")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class SweepState:
    """The state file of one output dir."""

    def __init__(self, path: str | Path, *, kind: str, name: str, meta: dict[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.path.parent / ".lock", "w")  # held until this process exits
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"another trainprof process is using '{self.path.parent}'; wait for it or pass "
                            "another --out dir") from None
        self.doc: dict[str, Any]
        if self.path.is_file():
            try:
                self.doc = json.loads(self.path.read_text())
            except ValueError as err:
                raise UserError(f"state file '{self.path}' is not valid JSON ({err}); move it away to start over") from None
            if self.doc.get("kind") != kind:
                raise UserError(f"'{self.path.parent}' holds a {self.doc.get('kind')} state, not a {kind}; "
                                "pass another --out dir")
        else:
            self.doc = {"schema_version": SCHEMA_VERSION, "kind": kind, "name": name, "created": now(), "cells": {}}
        self.doc["meta"] = {**self.doc.get("meta", {}), **(meta or {})}
        self.save()

    @property
    def cells(self) -> dict[str, dict[str, Any]]:
        return self.doc["cells"]

    def get(self, key: str) -> dict[str, Any] | None:
        return self.cells.get(key)

    def should_run(self, key: str, *, retry_failed: bool = False) -> bool:
        rec = self.cells.get(key)
        if rec is None or rec["status"] not in FINISHED:
            return True
        return rec["status"] == "failed" and retry_failed

    def update(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        """Merge `record` into the cell's entry and rewrite the file atomically."""
        rec = self.cells.setdefault(key, {"key": key, "attempts": 0})
        rec.update(record)
        self.save()
        return rec

    def save(self) -> None:
        self.doc["updated"] = now()
        atomic_write_json(self.path, self.doc)
