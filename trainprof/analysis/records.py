"""The record format shared by the profiler (which writes it) and the analysis (which reads it): module
descriptions and the events of a step's timeline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Event codes. Module events, subject = the module's index:
F_OPEN, F_CLOSE = 0, 1  # forward call of a module (pre / post forward hook)
R_OPEN, R_CLOSE = 2, 3  # forward call re-run inside backward: activation recomputation
B_OPEN, B_CLOSE = 4, 5  # backward of one module call (see profiler/hooks.py for how begin and end are found)
# Phase regions, subject = the label (a profile.json phase name):
REGION_OPEN, REGION_CLOSE = 6, 7
# Pipeline micro-batch actions, subject = (kind, micro batch), kind forward | backward:
ACTION_OPEN, ACTION_CLOSE = 8, 9

RANGE_PREFIX = "trainprof::"  # the profiler's record_function ranges: trainprof::<phase>[::<module>]
# How tables, TensorBoard tags and trace ranges name the model itself (named_modules() gives it ""): not
# "<model>", which reads as a twin of a Hugging Face model's own `model` submodule
ROOT_LABEL = "<whole model>"
LEGACY_ROOT_LABELS = ("<model>",)  # what traces recorded before this name called it


def module_label(name: str) -> str:
    """A module's name as tables and trace ranges show it."""
    return name or ROOT_LABEL


MODULE_OPEN = {F_OPEN: "forward", R_OPEN: "recompute", B_OPEN: "backward"}
MODULE_CLOSE = {F_CLOSE: "forward", R_CLOSE: "recompute", B_CLOSE: "backward"}


@dataclass(slots=True)
class Event:
    """One point of a step's timeline, as the analysis reads it (the profiler's log keeps the points as
    columns, see profiler/log.py). Built positionally (`Event(F_OPEN, mi, t)`): the analysis makes one per
    point of every step, and a keyword call costs twice as much."""

    code: int  # what happened: one of the codes above
    subject: Any  # what it happened to: a module index, a region label or a pipeline action (see the codes)
    at: float  # ms since the step began


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleInfo:
    """One profiled module, as `profiler.hooks.describe_modules` found it."""

    index: int
    name: str  # as in named_modules(); "" is the model itself
    type: str
    depth: int  # 0 = the model passed to the Profiler
    parent: int  # index of the parent module, -1 for the model
    params: int  # logical elements, children included (ZeRO-3: full ds_numel; 4-bit: unpacked count)
    params_trainable: int
    params_local: int  # elements this rank stores (a ZeRO-3 shard; packed 4-bit storage)
