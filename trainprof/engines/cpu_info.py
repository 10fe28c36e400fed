"""py-cpuinfo's answer about this CPU, asked once per CPU instead of twice per DeepSpeed engine.

DeepSpeed's CPU op builders (FusedAdam, CPUAdam) ask `cpuinfo.get_cpu_info()` for their compiler flags
every time an engine is built, twice, and each answer costs about a second: py-cpuinfo queries the CPU
from a child interpreter. The answer depends only on the CPU, so it is kept in a file named after what
/proc/cpuinfo says of the CPU (vendor, model, flags, count) and read from there; where /proc/cpuinfo is
not there it is kept for the process only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from trainprof.io import atomic_write_json

_DESCRIBING = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def cpu_key() -> str | None:
    """A digest of what /proc/cpuinfo says of the CPU that py-cpuinfo would report; None off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    fields = [line for line in text.splitlines() if line.split(":")[0].strip() in _DESCRIBING]
    import cpuinfo

    described = "\n".join(sorted(set(fields))) + f"\ncount {os.cpu_count()}\npy-cpuinfo {cpuinfo.CPUINFO_VERSION_STRING}"
    return hashlib.sha1(described.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainprof"


def cached_cpu_info(ask: Any) -> dict[str, Any]:
    """`ask()`'s answer (py-cpuinfo's get_cpu_info), from this CPU's file when there is one; the file is
    written whole or not at all, and a cache that cannot be read or written is asked around."""
    key = cpu_key()
    path = cache_dir() / f"cpuinfo-{key}.json" if key else None
    if path is not None:
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
    info = ask()
    if path is not None:
        with contextlib.suppress(OSError):
            atomic_write_json(path, info)
    return info


def ask_once() -> None:
    """Make py-cpuinfo's get_cpu_info answer from cached_cpu_info (DeepSpeed imports it by name when it
    builds an op, so the module's attribute is what it calls). Idempotent; a no-op without py-cpuinfo."""
    try:
        import cpuinfo
    except ImportError:
        return
    if getattr(cpuinfo.get_cpu_info, "trainprof_cached", False):
        return
    ask = cpuinfo.get_cpu_info
    cached = functools.cache(lambda: cached_cpu_info(ask))

    @functools.wraps(ask)
    def get_cpu_info() -> dict[str, Any]:
        return dict(cached())

    get_cpu_info.trainprof_cached = True  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info
