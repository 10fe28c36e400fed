"""Interval arithmetic for step timelines: unions with fast overlap queries, and a priority sweep that
labels every instant of a step with exactly one phase."""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence


class IntervalSet:
    """The union of intervals, kept sorted and disjoint, with prefix sums for O(log n) overlap queries.

    Args:
        intervals: (start, end) pairs in any order; empty or reversed ones are dropped.
    """

    def __init__(self, intervals: Iterable[tuple[float, float]]) -> None:
        merged: list[list[float]] = []
        for a, b in sorted((a, b) for a, b in intervals if b > a):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.starts = [a for a, _ in merged]
        self.ends = [b for _, b in merged]
        self.cum = [0.0]
        for a, b in merged:
            self.cum.append(self.cum[-1] + b - a)

    @property
    def total(self) -> float:
        return self.cum[-1]

    def overlap(self, a: float, b: float) -> float:
        """Length of [a, b] covered by the set."""
        if b <= a or not self.starts:
            return 0.0
        i = bisect.bisect_right(self.ends, a)
        j = bisect.bisect_left(self.starts, b)
        if i >= j:
            return 0.0
        covered = self.cum[j] - self.cum[i]
        covered -= max(0.0, a - self.starts[i])
        covered -= max(0.0, self.ends[j - 1] - b)
        return max(0.0, covered)


def label_timeline(intervals: Sequence[tuple[float, float, str]], priority: dict[str, int], start: float,
                   end: float) -> list[tuple[float, float, str]]:
    """Split [start, end] into segments, each labeled with the highest-priority label whose intervals
    cover it; uncovered time gets no segment.

    Args:
        intervals: (t0, t1, label); labels missing from `priority` are ignored.
        priority: label -> rank, higher wins.
        start, end: the window to label (intervals are clipped to it).
    Returns:
        Sorted, disjoint (t0, t1, label) segments; adjacent segments with one label are merged.
    """
    by_label: dict[str, list[tuple[float, float]]] = {}
    for a, b, label in intervals:
        if label in priority:
            by_label.setdefault(label, []).append((max(a, start), min(b, end)))
    points: list[tuple[float, int, str]] = []
    for label, spans in by_label.items():  # each label's union first: nested module windows collapse
        union = IntervalSet(spans)
        for a, b in zip(union.starts, union.ends):
            points.append((a, 1, label))
            points.append((b, -1, label))
    points.sort(key=lambda p: (p[0], p[1]))
    active: dict[str, int] = {}
    segments: list[tuple[float, float, str]] = []
    prev = None
    for t, delta, label in points:
        if prev is not None and t > prev and active:
            top = max(active, key=priority.__getitem__)
            if segments and segments[-1][2] == top and segments[-1][1] == prev:
                segments[-1] = (segments[-1][0], t, top)
            else:
                segments.append((prev, t, top))
        count = active.get(label, 0) + delta
        if count:
            active[label] = count
        else:
            active.pop(label, None)
        prev = t
    return segments


def label_at(segments: list[tuple[float, float, str]], t: float) -> str | None:
    """The label of the segment containing time t (None when t is in no segment)."""
    i = bisect.bisect_right([s[0] for s in segments], t) - 1
    if i >= 0 and segments[i][0] <= t < segments[i][1]:
        return segments[i][2]
    return None
