"""The profiler's journal: what a rank recorded, one JSON line per finished step, appended and flushed
as the run goes, so that a rank killed without running any handler (SIGKILL, the kernel's OOM killer,
a lost node) still leaves the module x phase breakdown of its finished steps.

Steps are written at most once per `interval_s` (default 1 s), several at once: serializing a step
costs ~3x as much right after it as in a loop over several (the step's tensor work has evicted the
encoder from the caches), and that cost lands in the run's time. A step longer than the interval is
written as it ends; a kill loses at most the last interval's steps (the runner's
rank<N>.partial.json, written as a step ends, still has their wall time and loss); `Profiler.close`
writes what waits.

    profile.rank<N>.journal.jsonl
      {"kind": "header", ...}   the facts read from the live process once, after the first step
      {"kind": "facts", ...}    FLOP counts, activation and gradient bytes, operator rows, when they change
      {"kind": "step", ...}     one recorded step: its StepRecord fields and its timeline (events and
                                collectives in ms), analysed on replay as the live profiler analyses it

A flushed line is in the kernel's page cache and survives the process; a line cut short by the kill
is skipped on replay. `replay` rebuilds the rank document (what profile.rank<N>.json holds) through
the same composition as a live rank, marked partial; `recover_journals` does that for every rank of a
run dir that left a journal and no profile (`trainprof report` calls it). A rank that writes its
profile, finished or partial, removes its journal.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

from trainprof.analysis.aggregate import StepRecord, StepTimeline, complete_step
from trainprof.analysis.breakdown import CommEvent
from trainprof.analysis.pipeline import PipelineInfo
from trainprof.analysis.records import ModuleInfo

JOURNAL_VERSION = 2  # 2: steps carry their timeline, not their breakdown
JOURNAL_GLOB = "profile.rank*.journal.jsonl"
JOURNAL_INTERVAL_S = 1.0  # the most time between two writes (see the module docstring)


def journal_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"profile.rank{rank}.journal.jsonl"


class Journal:
    """Appends a profiler's records to its journal file (opened on the first write).

    Args:
        path: the journal file.
        interval_s: the most time between two writes; 0 writes every step as it ends.
    """

    def __init__(self, path: str | Path, interval_s: float = JOURNAL_INTERVAL_S) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self._file: TextIO | None = None
        self._facts: tuple[Any, ...] | None = None
        self._ops_written = 0
        self._waiting: list[tuple[StepRecord, StepTimeline]] = []  # steps not written yet
        self._written_at = 0.0  # time.monotonic() of the last write

    def step_ended(self, prof: Any) -> None:
        """`prof` (a Profiler) finished a step: keep it, and write what waits when the last write is
        `interval_s` old (or none was made yet)."""
        if prof.last_step is not None:
            self._waiting.append(prof.last_step)
        if self._file is None or time.monotonic() - self._written_at >= self.interval_s:
            self.write(prof)

    def flush(self, prof: Any) -> None:
        """Write the steps that wait, if any (the profiler closes)."""
        if self._waiting:
            self.write(prof)

    def write(self, prof: Any) -> None:
        """Append the steps that wait, and `prof`'s facts when they changed; one write and one flush."""
        lines = []
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115  open for the run's lifetime
            lines.append(_header(prof))
        facts = (id(prof.flops), prof.activation_bytes, prof.grads_bytes, len(prof.ops_rows))
        if facts != self._facts:
            lines.append({"kind": "facts", "flops": _flops_json(prof.flops), "activation_bytes": prof.activation_bytes,
                          "grads_bytes": prof.grads_bytes, "new_ops_rows": prof.ops_rows[self._ops_written:]})
            self._facts, self._ops_written = facts, len(prof.ops_rows)
        lines.extend({"kind": "step", **_step_json(*step)} for step in self._waiting)
        self._waiting.clear()
        self._file.write("".join(json.dumps(line, separators=(",", ":"), default=str) + "\n" for line in lines))
        self._file.flush()
        self._written_at = time.monotonic()

    def discard(self) -> None:
        """The rank wrote its profile: the journal is redundant."""
        self._waiting.clear()
        if self._file is not None:
            self._file.close()
            self._file = None
        self.path.unlink(missing_ok=True)


def _header(prof: Any) -> dict[str, Any]:
    from trainprof.profiler.result import profile_env, recorded_dtype, state_bytes

    return {
        "kind": "header", "journal_version": JOURNAL_VERSION, "pid": os.getpid(), "host": socket.gethostname(),
        "rank": prof.rank, "world_size": prof.world_size, "recipe": prof.recipe, "env": profile_env(prof),
        "state": state_bytes(prof), "device_type": prof.device.type, "dtype": recorded_dtype(prof),
        "timer": {"kind": prof.timer.kind, "description": prof.timer.description},
        "memory_method": prof.memory.method if prof.memory is not None else None,
        "modules": [dataclasses.asdict(m) for m in prof.hooks.modules] if prof.hooks is not None else None,
        "module_depth": prof.module_depth, "warmup_steps": prof.warmup_steps, "enabled": prof.enabled, "count_flops": prof.count_flops, "ops": prof.ops,
        "pipeline": dataclasses.asdict(prof.pipeline) if prof.pipeline is not None else None,
        "ddp": prof.ddp,
    }


def _flops_json(flops: dict[str, Any] | None) -> dict[str, Any] | None:
    """FLOP counts are keyed by (module index, phase): as [[module, phase, count], ...] in JSON."""
    if flops is None:
        return None
    return {**flops, "counts": [[m, ph, n] for (m, ph), n in flops["counts"].items()]}


def _flops_from_json(flops: dict[str, Any] | None) -> dict[str, Any] | None:
    if flops is None:
        return None
    return {**flops, "counts": {(m, ph): n for m, ph, n in flops["counts"]}}


def _ns(ms: float) -> int:
    """A stamp in ms as integer nanoseconds: ints are what JSON writes fast (a float's shortest repr costs
    ~0.4 us, and a step has hundreds of stamps); the host timer's stamps are whole ns, so this is exact."""
    return round(ms * 1e6)


def _step_json(record: StepRecord, timeline: StepTimeline) -> dict[str, Any]:
    out = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)
           if f.name not in ("breakdown", "loss", "pipeline")}
    out["timeline"] = {
        "codes": timeline.codes, "payloads": timeline.subjects,  # payloads: the points' subjects
        "ns": [round(t * 1e6) for t in timeline.ms],  # _ns inlined: a call per stamp cost a third of the append
        "wall_ns": _ns(timeline.wall_ms),
        "comms": [[c.op, c.nbytes, c.group_size, c.module, c.is_async, _ns(c.issue), _ns(c.ret),
                   [_ns(t) for w in c.waits for t in w], c.total_ms, c.peer, c.phase, c.exposed_as]
                  for c in timeline.comms],
        "losses": timeline.losses,
        "origin_unix_ns": timeline.origin_unix_ns, "pipelined": timeline.pipelined,
    }
    return out


def _step_record(line: dict[str, Any], parents: list[int] | None) -> StepRecord:
    t = line["timeline"]
    comms = []
    for op, nbytes, group_size, module, is_async, issue, ret, waits, total_ms, peer, phase, exposed_as in t["comms"]:
        comms.append(CommEvent(op=op, nbytes=nbytes, group_size=group_size, module=module, is_async=is_async,
                               issue=issue / 1e6, ret=ret / 1e6,
                               waits=[(waits[i] / 1e6, waits[i + 1] / 1e6) for i in range(0, len(waits), 2)],
                               total_ms=total_ms, peer=peer, phase=phase, exposed_as=exposed_as))
    timeline = StepTimeline(codes=t["codes"], subjects=t["payloads"], ms=[ns / 1e6 for ns in t["ns"]], comms=comms,
                            wall_ms=t["wall_ns"] / 1e6, losses=t["losses"], origin_unix_ns=t["origin_unix_ns"],
                            pipelined=t["pipelined"])
    fields = {f.name for f in dataclasses.fields(StepRecord)}
    record = StepRecord(**{k: v for k, v in line.items() if k in fields}, breakdown=None)
    complete_step(record, timeline, parents)
    return record


def read_journal(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(header, the other lines in order); a last line cut short by the kill is dropped.

    Raises:
        ValueError: no header (the rank was killed before its first step ended) or an unknown version.
    """
    text = Path(path).read_text(encoding="utf-8")
    lines = []
    for raw in text.splitlines():
        try:
            lines.append(json.loads(raw))
        except json.JSONDecodeError:
            break  # the line being written when the process died; nothing after it was flushed
    if not lines or lines[0].get("kind") != "header":
        raise ValueError(f"{path} holds no complete header: the rank stopped before its first step ended")
    if lines[0].get("journal_version") != JOURNAL_VERSION:
        raise ValueError(f"{path} is journal version {lines[0].get('journal_version')}; this trainprof reads "
                         f"{JOURNAL_VERSION}")
    return lines[0], lines[1:]


def replay(path: str | Path) -> dict[str, Any]:
    """The rank document a journal records, marked partial (see the module docstring)."""
    from trainprof.profiler.result import compose_rank_profile, with_grads

    header, lines = read_journal(path)
    facts: dict[str, Any] = {"flops": None, "activation_bytes": None, "grads_bytes": None}
    ops_rows: list[Any] = []
    steps: list[StepRecord] = []
    modules = [ModuleInfo(**m) for m in header["modules"]] if header["modules"] is not None else None
    parents = [m.parent for m in modules] if modules is not None else None
    for line in lines:
        if line["kind"] == "facts":
            facts.update({k: line[k] for k in facts}, flops=_flops_from_json(line["flops"]))
            ops_rows.extend(line["new_ops_rows"])
        elif line["kind"] == "step":
            steps.append(_step_record(line, parents))
    recorded = SimpleNamespace(
        rank=header["rank"], world_size=header["world_size"], recipe=header["recipe"], steps=steps,
        hooks=SimpleNamespace(modules=modules) if modules is not None else None,
        timer=SimpleNamespace(**header["timer"]),
        memory=SimpleNamespace(method=header["memory_method"]) if header["memory_method"] else None,
        module_depth=header["module_depth"], warmup_steps=header.get("warmup_steps"), enabled=header["enabled"], count_flops=header["count_flops"],
        ops=header["ops"], ops_rows=ops_rows, **facts,
        pipeline=PipelineInfo(**header["pipeline"]) if header.get("pipeline") else None,
        ddp=header.get("ddp", False),
    )
    state = with_grads(header["state"], facts["grads_bytes"])
    doc = compose_rank_profile(recorded, env=header["env"], state=state, device_type=header["device_type"],
                               dtype=header["dtype"])
    measured = sum(1 for s in steps if not s.warmup)
    doc.update(partial=True, partial_reason=(
        f"rank {header['rank']} left no profile (killed with no chance to write one: SIGKILL, the OOM killer "
        f"or a lost node) after {measured} measured steps; rebuilt from its journal"))
    return doc


def _writer_alive(header: dict[str, Any]) -> bool:
    if header.get("host") != socket.gethostname():
        return False  # another machine's run, copied here: its ranks are not running here
    try:
        os.kill(int(header["pid"]), 0)
    except (ProcessLookupError, ValueError):
        return False
    except PermissionError:
        return True
    return True


def recover_journals(run_dir: str | Path) -> list[Path]:
    """Write profile.rank<N>.partial.json for each rank of `run_dir` that left a journal and no
    profile and whose process is gone; the journals stay (no data is lost). Returns the files written."""
    from trainprof.io import atomic_write_json

    run_dir = Path(run_dir)
    written = []
    for path in sorted(run_dir.glob(JOURNAL_GLOB)):
        rank = path.name[len("profile.rank"):-len(".journal.jsonl")]
        if (run_dir / f"profile.rank{rank}.json").exists() or (run_dir / f"profile.rank{rank}.partial.json").exists():
            continue
        try:
            header, _ = read_journal(path)
        except ValueError:
            continue  # killed before its first step ended: nothing to rebuild
        if _writer_alive(header):
            continue  # still running: `trainprof report` on a live run reads what is finished
        out = run_dir / f"profile.rank{rank}.partial.json"
        atomic_write_json(out, replay(path))
        written.append(out)
    return written
