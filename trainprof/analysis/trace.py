"""Reading Kineto / Chrome traces (`*.pt.trace.json[.gz]`) as a stream: one event at a time, so a
multi-GB trace of a Llama-7B step is summarised in bounded memory.

Kineto writes one JSON object: metadata keys (schemaVersion, deviceProperties, distributedInfo, ...),
then `traceEvents` (a list that holds almost all of the bytes), then a few more keys. `iter_trace`
walks that object with `json.JSONDecoder.raw_decode` over a sliding text buffer: each top-level value
and each event is decoded on its own and then dropped. `summarize_trace` builds on it; nothing here
imports torch.
"""

from __future__ import annotations

import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterator

from trainprof.analysis.records import LEGACY_ROOT_LABELS, RANGE_PREFIX, ROOT_LABEL

TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz")
STEP_MARKER = re.compile(r"^ProfilerStep#(\d+)$")
CHUNK_CHARS = 1 << 20  # text read per refill; a value longer than this just takes several refills
MAX_VALUE_CHARS = 1 << 28  # one JSON value (an event, deviceProperties) larger than 256 MiB is an error
_WS = " \t\n\r"


class TraceFormatError(ValueError):
    """The file is not a Chrome trace JSON object (or is truncated)."""


def is_trace_file(path: str | Path) -> bool:
    return Path(path).name.endswith(TRACE_SUFFIXES)


def open_trace(path: str | Path) -> IO[str]:
    """The trace as text, gunzipped on the fly when it ends in .gz."""
    path = Path(path)
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


class _Stream:
    """A text buffer over a file that decodes one JSON value at a time."""

    def __init__(self, f: IO[str], name: str) -> None:
        self.f, self.name = f, name
        self.buf, self.pos, self.eof = "", 0, False
        self.consumed = 0  # characters dropped from the front of buf
        self.decoder = json.JSONDecoder()

    def _refill(self) -> bool:
        if self.eof:
            return False
        chunk = self.f.read(CHUNK_CHARS)
        if not chunk:
            self.eof = True
            return False
        if self.pos > len(self.buf) // 2:  # drop what was decoded
            self.consumed += self.pos
            self.buf, self.pos = self.buf[self.pos:], 0
        self.buf += chunk
        return True

    def error(self, what: str) -> TraceFormatError:
        return TraceFormatError(f"{self.name}: {what} at character {self.consumed + self.pos}")

    def peek(self) -> str:
        """The next non-blank character ('' at the end of the file), not consumed."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in _WS:
                self.pos += 1
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self._refill():
                return ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            got = self.peek() or "end of file"
            raise self.error(f"expected '{char}', found '{got}'")
        self.pos += 1

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                value, end = self.decoder.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as err:
                if len(self.buf) - self.pos > MAX_VALUE_CHARS or not self._refill():
                    raise self.error(f"invalid or truncated JSON ({err.msg})") from None
                continue
            # a number at the very end of the buffer may continue in the next chunk
            if end == len(self.buf) and not self.eof and self._refill():
                continue
            self.pos = end
            return value


def iter_trace(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Stream a trace file's top-level items.

    Args:
        path: a Chrome trace JSON file, optionally gzipped.
    Yields:
        ("event", event dict) for each element of traceEvents, in file order, and (key, value) for every
        other top-level key, in file order.
    Raises:
        TraceFormatError: the file is not a JSON object, is cut short, or (.gz) is not a complete gzip stream
            of UTF-8 text.
    """
    try:
        yield from _iter_trace(path)
    except (EOFError, gzip.BadGzipFile, zlib.error):
        raise TraceFormatError(f"{path}: the gzip stream is cut short or damaged") from None
    except UnicodeDecodeError as err:
        raise TraceFormatError(f"{path}: byte {err.start} of the text is not UTF-8") from None


def _iter_trace(path: str | Path) -> Iterator[tuple[str, Any]]:
    with open_trace(path) as f:
        s = _Stream(f, str(path))
        s.expect("{")
        if s.peek() == "}":
            return
        while True:
            key = s.value()
            if not isinstance(key, str):
                raise s.error("expected a key")
            s.expect(":")
            if key == "traceEvents" and s.peek() == "[":
                s.expect("[")
                if s.peek() == "]":
                    s.pos += 1
                else:
                    while True:
                        yield "event", s.value()
                        c = s.peek()
                        s.pos += 1
                        if c == "]":
                            break
                        if c != ",":
                            raise s.error(f"expected ',' or ']' in traceEvents, found '{c or 'end of file'}'")
            else:
                yield key, s.value()
            c = s.peek()
            s.pos += 1
            if c == "}":
                return
            if c != ",":
                raise s.error(f"expected ',' or '}}', found '{c or 'end of file'}'")


def iter_events(path: str | Path) -> Iterator[dict[str, Any]]:
    """Only the traceEvents of a trace, streamed."""
    for key, value in iter_trace(path):
        if key == "event":
            yield value


@dataclass
class TraceSummary:
    """What one trace file holds, from one streaming pass.

    Attributes:
        path: the file.
        bytes: its size on disk (compressed size for .gz).
        rank, world_size: from the trace's distributedInfo (None when absent).
        metadata: the top-level keys other than traceEvents (deviceProperties etc.), as written.
        events: number of trace events.
        by_category: events per `cat`.
        steps: ProfilerStep#N numbers, in order, with their durations in ms.
        ranges_ms: total duration per trainprof record_function range name (module x phase and phase
            ranges), summed over calls.
        ops_ms: inclusive duration per cpu_op name (children included), summed over calls.
        span_ms: first event start to last event end.
    """

    path: Path
    bytes: int
    rank: int | None = None
    world_size: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    events: int = 0
    by_category: dict[str, int] = field(default_factory=dict)
    steps: dict[int, float] = field(default_factory=dict)
    ranges_ms: dict[str, float] = field(default_factory=dict)
    ops_ms: dict[str, float] = field(default_factory=dict)
    span_ms: float = 0.0

    @property
    def bytes_per_step(self) -> float | None:
        return self.bytes / len(self.steps) if self.steps else None

    @property
    def distributed_info(self) -> dict[str, Any] | None:
        return self.metadata.get("distributedInfo")


def summarize_trace(path: str | Path) -> TraceSummary:
    """One streaming pass over a trace: size, rank, ProfilerStep markers, trainprof ranges, op totals.

    Args:
        path: a `*.pt.trace.json[.gz]` file.
    Returns:
        The summary; memory use does not grow with the number of events (only with distinct names).
    """
    path = Path(path)
    out = TraceSummary(path=path, bytes=path.stat().st_size)
    first, last = None, None
    for key, value in iter_trace(path):
        if key != "event":
            out.metadata[key] = value
            continue
        out.events += 1
        cat = value.get("cat") or ""
        out.by_category[cat] = out.by_category.get(cat, 0) + 1
        if value.get("ph") != "X":
            continue
        ts, dur = float(value.get("ts", 0.0)), float(value.get("dur", 0.0))
        first = ts if first is None else min(first, ts)
        last = ts + dur if last is None else max(last, ts + dur)
        name = value.get("name", "")
        if cat == "cpu_op":
            out.ops_ms[name] = out.ops_ms.get(name, 0.0) + dur / 1e3
        elif name.startswith(RANGE_PREFIX):
            out.ranges_ms[name] = out.ranges_ms.get(name, 0.0) + dur / 1e3
        else:
            m = STEP_MARKER.match(name)
            if m:
                out.steps[int(m.group(1))] = dur / 1e3
    info = out.distributed_info or {}
    out.rank = info.get("rank")
    out.world_size = info.get("world_size")
    out.span_ms = (last - first) / 1e3 if first is not None else 0.0
    return out


def parse_range_name(name: str) -> tuple[str, str | None] | None:
    """'trainprof::backward::model.layers.0.mlp' -> ('backward', 'model.layers.0.mlp');
    'trainprof::optimizer' -> ('optimizer', None); ROOT_LABEL (or a legacy label) is the root module
    (name '' in profile.json). None for other names."""
    if not name.startswith(RANGE_PREFIX):
        return None
    phase, _, module = name[len(RANGE_PREFIX):].partition("::")
    if not module:
        return phase, None
    return phase, "" if module == ROOT_LABEL or module in LEGACY_ROOT_LABELS else module


def find_traces(run_dir: str | Path) -> list[Path]:
    """The trace files of a run dir: tb/ (and one level of sub-dirs), sorted by name."""
    tb = Path(run_dir) / "tb"
    if not tb.is_dir():
        return []
    return sorted(p for p in [*tb.iterdir(), *tb.glob("*/*")] if p.is_file() and is_trace_file(p))


# torch.compile'd code runs as inductor's fused kernels inside these host ranges, not as aten ops: their
# self time is the compiled code's (kernels inside a compiled graph call; dynamo's guard check; AOT
# autograd's wrapper), kept as rows of their own so a compiled region's time shows in the table
COMPILED_RANGES = (
    ("## Call CompiledFxGraph", "inductor::compiled_graph"),
    ("TorchDynamo Cache Lookup", "dynamo::guard_check"),
    ("CompiledFunction", "torch_compile::runtime_wrapper"),  # and CompiledFunctionBackward
    ("Torch-Compiled Region", "torch_compile::runtime_wrapper"),
    ("AOTDispatcher Runtime Wrapper", "torch_compile::runtime_wrapper"),
)


def op_name(name: str) -> str | None:
    """The ops-table name of a profiler event: aten ops as they are, compiled-code ranges under one name
    each (see COMPILED_RANGES), None for anything else (modules, autograd bookkeeping)."""
    if name.startswith("aten::"):
        return name
    for prefix, row in COMPILED_RANGES:
        if name.startswith(prefix):
            return row
    return None
