"""The phases a training step splits into: the keys of profile.json's steps[].phases_ms, in the order
every table, plot and diff shows them."""

from __future__ import annotations

PHASES = ("data_wait", "forward", "backward", "recompute", "optimizer", "comm_exposed", "other")
# a pipeline stage also waits for its neighbours (the bubble), shown before "other"
PIPELINE_PHASES = (*PHASES[:-1], "pipeline_bubble", PHASES[-1])
# what code marks with Profiler.phase(); exposed communication and the bubble are measured, not marked
REGION_PHASES = tuple(p for p in PHASES if p != "comm_exposed")
# a module's own time splits into these
MODULE_PHASES = ("forward", "backward", "recompute")
