"""The facts of the machine a run ran on: library versions, device, world size, memory meter."""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import os
import platform
import re
import resource
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # torch is imported where it is used: `trainprof report` should not pay for it
    import torch



def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def host_cpu() -> str:
    """The host CPU's model name (/proc/cpuinfo on Linux), else what platform knows."""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def last_level_cache_bytes(default: int = 256 << 20) -> int:
    """The size of cpu0's largest cache as Linux lists it (sysfs), else `default`."""
    units = {"": 0, "K": 10, "M": 20, "G": 30}
    sizes = [int(m[1]) << units[m[2]] for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")
             if (m := re.fullmatch(r"(\d+)([KMG]?)", f.read_text().strip()))]
    return max(sizes, default=default)


def collect_env(device: torch.device, world_size: int) -> dict[str, Any]:
    """The `env` block of profile.json."""
    import torch

    env = {
        "torch": torch.__version__,
        "deepspeed": _version("deepspeed"),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "bitsandbytes": _version("bitsandbytes"),
        "trainprof": _version("trainprof"),
        "python": platform.python_version(),
        "device": device_name(device),
        "device_type": device.type,
        "cpu_threads": torch.get_num_threads(),
        "host_cpu": host_cpu(),
        "world_size": world_size,
        "timer": "cuda_event" if device.type == "cuda" else "host",
        "memory_meter": memory_meter(device),
        "host_allocator": host_allocator(),
    }
    if device.type == "cuda":  # the capacity the advisor's memory-headroom rule needs
        env["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return env


def memory_meter(device: torch.device) -> str:
    """What `peak_memory_bytes` measures on this device."""
    if device.type == "cuda":
        return "cuda_allocator_peak: torch.cuda.max_memory_allocated, reset every step"
    return (
        "cpu_process_peak_rss: VmHWM (/proc/self/status) of this rank's process, a lifetime high-water mark "
        "including Python, libraries and the data loader (not reset per step; started again once an operator "
        "trace's processing, the profiler's own memory, is done)"
    )


# Peaks folded in by whoever reset the device's peak counter mid-window (the profiler resets it at
# every phase start); peak_memory_bytes reports the max of these and the counter, so a reset never
# hides a peak from the window the runner measures.
_folded_peak = 0


def _ru_maxrss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


# Linux reports ru_maxrss as the larger of VmHWM and the peak of the image this process had before exec,
# which is the whole spawning process's when a big one (a pytest worker, a notebook) forked it. That
# floor is at most ru_maxrss at this import; above it, ru_maxrss is VmHWM, read in one syscall.
_SPAWN_FLOOR = _ru_maxrss()


def cpu_peak_rss_bytes() -> int:
    """This process's peak resident set since it started or since /proc/self/clear_refs last reset it."""
    peak = _ru_maxrss()
    if peak > _SPAWN_FLOOR:
        return peak
    hwm = vm_hwm_bytes()
    return peak if hwm is None else hwm


def _raw_peak(device: torch.device) -> int:
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return cpu_peak_rss_bytes()


VMHWM = re.compile(rb"VmHWM:\s+(\d+) kB")
VMRSS = re.compile(rb"VmRSS:\s+(\d+) kB")
_status: tuple[int, int] | None = None  # (pid, fd): a forked child reopens, its own /proc/self


def proc_status_bytes(field: re.Pattern[bytes]) -> int | None:
    """A kB field of /proc/self/status (VMHWM, VMRSS) in bytes, None off Linux: one pread on a kept fd."""
    global _status
    try:
        if _status is None or _status[0] != os.getpid():
            _status = (os.getpid(), os.open("/proc/self/status", os.O_RDONLY))
        match = field.search(os.pread(_status[1], 8192, 0))
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def vm_hwm_bytes() -> int | None:
    """This process's peak resident set (VmHWM in /proc/self/status), None off Linux. Unlike ru_maxrss,
    which Linux carries over exec from the process that spawned this one, it counts this program only."""
    return proc_status_bytes(VMHWM)


def reset_peak_memory(device: torch.device) -> None:
    """Start a measurement window: one step on GPU; on CPU the window is the process lifetime."""
    import torch

    global _folded_peak
    if device.type == "cuda":
        _folded_peak = 0
        torch.cuda.reset_peak_memory_stats(device)


def fold_peak_memory(device: torch.device) -> None:
    """Call right before resetting the device's peak counter (CUDA peak stats, or /proc/self/clear_refs
    on CPU, which also resets ru_maxrss) so that the runner's window keeps its peak."""
    global _folded_peak
    _folded_peak = max(_folded_peak, _raw_peak(device))


def peak_memory_bytes(device: torch.device) -> int:
    """The peak of the current window (see reset_peak_memory), whatever was reset inside it."""
    return max(_raw_peak(device), _folded_peak)


def progress_interval() -> float:
    """Seconds between a progress bar's redraws: a terminal's every 0.1 s (each overwrites the last); a log's,
    where every redraw stays (stderr not a terminal), every 30 s."""
    import sys

    return 0.1 if sys.stderr.isatty() else 30.0


def quiet_library_noise() -> None:
    """Hide library messages the user cannot act on and that bury trainprof's output: the
    deprecation warnings DeepSpeed's own calls into torch.distributed raise on every collective,
    transformers' renamed-method warnings, bitsandbytes' notice that its optional hub-downloaded
    CPU kernel is absent (it falls back to its built-in kernel), and torchao's failures to load its
    CUDA/Python-3.10 extension libraries, which its quantized optimizers do not use."""
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*(gradient|activation)_checkpointing.* is deprecated",
                            category=FutureWarning)
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    logging.getLogger("torchao").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".* does not implement _stable_hash_for_caching", category=UserWarning)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's register_constant() notice


@contextlib.contextmanager
def native_chatter_to(log: Path | None, prefixes: tuple[str, ...] = ("USDT:",)) -> Iterator[None]:
    """Inside the block, keep native libraries' chatter off the terminal: file descriptor 2 goes to a
    temp file; afterwards lines starting with one of `prefixes` are appended to `log` (dropped when it
    is None) and every other line is written back to stderr, so real errors still show.

    Kineto prints `USDT: ... profiler_start` / `profiler_stop` lines from C++ when torch.profiler
    starts and stops, which breaks the progress bar; its own log level hides errors with them."""
    import os
    import sys
    import tempfile

    marks = tuple(p.encode() for p in prefixes)
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            lines = tmp.read().splitlines(keepends=True)
            chatter = b"".join(line for line in lines if line.startswith(marks))
            kept = b"".join(line for line in lines if not line.startswith(marks))
            if chatter and log is not None:
                log.parent.mkdir(parents=True, exist_ok=True)
                with open(log, "ab") as f:
                    f.write(chatter)
            if kept:
                os.write(2, kept)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
_TRIM_THRESHOLD_MAX = 2**31 - 1  # mallopt takes an int
_SYSTEM_DETAIL = "the C library's defaults (glibc: free memory above 128 KiB goes back to the system)"
_host_allocator: dict[str, Any] = {"mode": "system", "detail": _SYSTEM_DETAIL}


def apply_host_allocator(device: torch.device, mode: str) -> dict[str, Any]:
    """`cache` on a CPU run: glibc's malloc keeps the memory the process frees (no trimming, and every
    block from its heap, none from a fresh mmap), as a GPU's caching allocator keeps device memory. With
    glibc's defaults a step's large tensors (a model's logits) are returned to the system when freed and
    page-faulted in again by the next step: a cost that comes and goes with the allocator's dynamic
    thresholds and the tensors' sizes rather than with the model's work. The price is the one a GPU's
    reserved memory pays: freed blocks the heap cannot reuse for a larger tensor stay resident, so the
    peak RSS is higher. `system` or a GPU run leaves the defaults.
    Returns what this process now runs with (also what collect_env records)."""
    import ctypes

    global _host_allocator
    if mode != "cache" or device.type != "cpu" or _host_allocator["mode"] == "cache":
        return _host_allocator
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_MAX, 0) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_MAX) == 1
    except (OSError, AttributeError) as err:  # not glibc (macOS, musl)
        _host_allocator = {"mode": "system", "detail": f"{_SYSTEM_DETAIL}; cache not applied: {err}"}
        return _host_allocator
    if ok:
        _host_allocator = {"mode": "cache", "detail": (
            f"glibc mallopt: M_MMAP_MAX 0, M_TRIM_THRESHOLD {_TRIM_THRESHOLD_MAX} B: freed memory is kept "
            "for the next step; peak RSS includes the freed blocks the heap keeps")}
    return _host_allocator


def forget_profiler_memory() -> None:
    """On a CPU run, after work that is the profiler's and not the step's (an operator trace turned into
    its file and rows, then freed): hand the freed blocks back to the system (glibc's malloc_trim; under
    `cache` they would stay resident and count in every later step's peak RSS), and start the peak
    window again from what is resident now, so that the processing's own high-water mark is not read as
    a step's."""
    import ctypes
    import gc

    global _folded_peak
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _folded_peak = 0
    except OSError:  # not Linux, or not writable: the window keeps the processing's peak
        pass


def host_allocator() -> dict[str, Any]:
    """What this process's host allocator runs with: {mode: cache|system, detail}."""
    return dict(_host_allocator)


def apply_memory_cap(device: torch.device, cap_gb: float | None) -> None:
    """On GPU, cap the caching allocator so going past `cap_gb` raises a real CUDA OOM."""
    import torch

    if cap_gb is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gb * 2**30 / total), device)


class MemoryCapExceeded(MemoryError):
    """The CPU cap train.memory_cap_gb was passed. Carries the peak that passed it: the failure is recorded
    after the profiler has closed, by when the peak window may have been reset (profiler/memory.py).
    `every_rank`: all ranks of the process group raised it together, so each can wait for the others to
    say so before exiting (torchrun stops the survivors as soon as one rank exits)."""

    def __init__(self, message: str, *, peak_bytes: int, every_rank: bool = False) -> None:
        super().__init__(message)
        self.peak_bytes = peak_bytes
        self.every_rank = every_rank


def check_memory_cap(device: torch.device, cap_gb: float | None, *, before_steps: bool = False) -> None:
    """On CPU, raise MemoryCapExceeded once this process's peak RSS passes `cap_gb` (checked between
    steps, so a step can overshoot before it is caught). `before_steps`: the check once the model is
    built, whose overshoot is the process's own baseline, which no smaller batch lowers; the ranks of a
    process group decide it together (one all-reduce), so all of them fail, each in its own line."""
    if cap_gb is None or device.type == "cuda":
        return
    peak = peak_memory_bytes(device)
    cap = f"train.memory_cap_gb={cap_gb} ({cap_gb * 1024:,.1f} MiB)"
    if before_steps:
        largest, together = _largest_over_ranks(peak)
        if largest <= cap_gb * 2**30:
            return
        whose = ("this rank's peak RSS once the model is built is already "
                 f"{peak / 2**20:,.1f} MiB (Python, libraries, model and optimizer), over {cap}")
        if peak <= cap_gb * 2**30:
            whose = (f"another rank's peak RSS once the model is built is already {largest / 2**20:,.1f} MiB, "
                     f"over {cap} (this rank's: {peak / 2**20:,.1f} MiB)")
        raise MemoryCapExceeded(
            f"out of memory before the first step: {whose}; raise train.memory_cap_gb above "
            f"{math.ceil(largest / 2**30 * 10) / 10:.1f} plus what a step needs",
            peak_bytes=peak, every_rank=together)
    over = peak - cap_gb * 2**30
    if over <= 0:
        return
    # MiB, and by how much: two figures rounded alike can print the same
    by = f"{over / 2**20:,.1f} MiB" if over >= 2**20 / 10 else f"{over / 2**10:,.0f} KiB"
    raise MemoryCapExceeded(
        f"out of memory: peak RSS {peak / 2**20:,.1f} MiB exceeds {cap} by {by} (CPU cap, checked after each step)",
        peak_bytes=peak)


def _largest_over_ranks(value: int) -> tuple[int, bool]:
    """(the largest `value` over the ranks of the default process group, whether the ranks took part): a
    CPU all-reduce, which gloo serves; `value` itself outside a process group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value, False
    largest = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item()), True


def threads_when_launched(ranks: int, one_process: int) -> tuple[int, str]:
    """(intra-op threads, why) of each rank of `trainprof run --nproc N` on this machine: OMP_NUM_THREADS where
    set; else torchrun's default of 1 where it starts several ranks; else torch's default in one process."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given), f"OMP_NUM_THREADS={given}"
    if ranks > 1:
        return 1, f"torchrun sets OMP_NUM_THREADS=1 for each of its {ranks} processes where it is unset"
    return one_process, "one process without torchrun: torch's default"


def allowed_cores() -> list[int]:
    """The CPU cores this process may run on (its affinity; every core where the platform has none)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def cpu_slots() -> dict[str, Any]:
    """What this rank may run on: its host, torch's intra-op threads and the cores it is allowed (affinity)."""
    import socket

    import torch

    return {"host": socket.gethostname(), "threads": torch.get_num_threads(), "cores": allowed_cores()}


def cpu_oversubscription(slots: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first host whose ranks run more threads than the cores they may use (cpu_slots of every rank),
    as {host, ranks, threads, cores}; None when every host has a core per thread. Oversubscribed ranks
    wait for a core inside their compute, which then reads as slow collectives and stragglers."""
    by_host: dict[str, list[dict[str, Any]]] = {}
    for s in slots:
        by_host.setdefault(s["host"], []).append(s)
    for host, mine in by_host.items():
        threads = sum(s["threads"] for s in mine)
        cores = len(set().union(*(s["cores"] for s in mine)))
        if threads > cores:
            return {"host": host, "ranks": len(mine), "threads": threads, "cores": cores,
                    "how": "ranks on the host x torch intra-op threads per rank, against the cores in the "
                           "union of their CPU affinity (os.sched_getaffinity)"}
    return None


def oversubscription_warning(ranks: int, threads_per_rank: int, cores: int) -> str | None:
    """The one-line launch warning where `ranks` x `threads_per_rank` exceed `cores`, else None."""
    if ranks * threads_per_rank <= cores:
        return None
    return (f"trainprof: warning: {ranks} rank(s) x {threads_per_rank} thread(s) each need "
            f"{ranks * threads_per_rank} cores but this process may use {cores}: ranks will wait for cores and "
            f"step times will read as communication and stragglers; use --nproc {max(1, cores // threads_per_rank)}"
            " or fewer (recorded in profile.json env.oversubscribed)")


def load_average() -> float | None:
    """The host's 1-minute load average (os.getloadavg; None where the platform has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_load(at_start: float | None) -> dict[str, Any] | None:
    """env.machine_load: the load average when the profiler attached and now, against the host's cores. Over
    the cores, runnable threads waited for a CPU: this run's times include other work's share of the machine."""
    end = load_average()
    if at_start is None or end is None:
        return None
    cores = len(allowed_cores())
    return {"start": at_start, "end": end, "cores": cores, "busy": max(at_start, end) > cores,
            "how": "the host's 1-minute load average (os.getloadavg) when the profiler attached and when the "
                   "profile was made, against the cores this process may use; this run's own ranks count in it"}
