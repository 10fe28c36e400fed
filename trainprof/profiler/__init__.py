"""The hook-based step profiler: module x phase, operators, optimizer, communication, data wait, memory
and FLOPs per optimizer step. Users call `Profiler` (see core.py); the other modules are its parts."""

from trainprof.profiler.core import Profiler

__all__ = ["Profiler"]
