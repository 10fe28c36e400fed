"""Collectives: each torch.distributed call with its bytes, total and exposed time and the module that
issued it, for gloo (CPU) and NCCL (GPU), without a synchronize per op.

Mechanism: while the Profiler is open, the public collective functions of `torch.distributed` (both
the `torch.distributed` and `torch.distributed.distributed_c10d` names) and the function references
DeepSpeed's communication backend caches (`cdb.all_gather_function`, `cdb.reduce_scatter_function`)
are replaced by timing wrappers; `close()` puts the originals back. Object collectives are not wrapped:
the tensor collectives they call inside are. Libraries in `CACHED_REFERENCE_LIBRARIES` (megatron-core)
keep module-level references to collectives taken at their import (`dist_reduce_scatter_func =
torch.distributed.reduce_scatter_tensor`) and to `_coalescing_manager`: those references are replaced
too. Collectives issued inside a coalescing manager only queue and run when it exits, so they are one
record (the summed bytes, the first call's op and module) timed from entering the manager to leaving it
(a synchronous manager waits for them there; an asynchronous one's later wait is not seen). DDP's forward
collectives run in C++ behind two Python calls, which are wrapped too: `dist._broadcast_coalesced` (its buffer
broadcast at every forward, recorded as a `broadcast` of the buffers' bytes) and `Reducer._rebuild_buckets` (the
bucket-order broadcast of its second forward, op `ddp_rebuild_buckets`). Any other library that imported a
function by name before the Profiler opened (`from torch.distributed import all_reduce`) and DDP's gradient
all-reduces (unless `Profiler.watch_ddp` routes them through `all_reduce`) are not seen.

Overlap assumption (what "exposed" means):
  * host timer (CPU, gloo): a synchronous collective blocks the calling thread for its whole duration,
    so all of it is exposed; for an async op only the time the thread blocks in `Work.wait()` is
    exposed, and the total runs from issue to gloo's completion callback.
  * CUDA events (GPU, NCCL): stamps go on the compute stream, so a synchronous op's exposed time is
    how long the compute stream waited for NCCL; an async op's exposed time is the compute-stream
    stall across `Work.wait()`; its total is NCCL's own measurement (`Work._get_duration()`, needs
    TORCH_NCCL_ENABLE_TIMING=1) or null.

Bytes are the collective's size S as nccl-tests counts it (all_reduce: the buffer; all_gather: the
gathered output; reduce_scatter: the input); bandwidth is computed in analysis/bandwidth.py.
Point-to-point ops (send, recv, isend, irecv: what torch.distributed.pipelining's stages call) also
record their peer's global rank, so a pipeline stage can tell activations from gradients.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from trainprof.profiler.log import CommRecord, StepLog


@dataclass(frozen=True)
class CollectiveSpec:
    size_arg: str | None  # parameter holding the tensor(s) whose bytes are the nccl-tests size S
    times_group: bool  # S = that tensor's bytes x group size (gather/scatter of one part per rank)
    always_async: bool = False
    recorded_as: str | None = None  # the op name records carry (None: the function's name)
    params: tuple[str, ...] | None = None  # a C++ binding's parameters in order (it has no Python signature)


SPECS: dict[str, CollectiveSpec] = {
    "all_reduce": CollectiveSpec("tensor", False),
    "all_reduce_coalesced": CollectiveSpec("tensors", False),
    "all_gather": CollectiveSpec("tensor_list", False),
    "all_gather_into_tensor": CollectiveSpec("output_tensor", False),
    "all_gather_single": CollectiveSpec("output_tensor", False),  # the torch 2.13 name of the op above (FSDP2 calls it)
    "_all_gather_base": CollectiveSpec("output_tensor", False),
    "all_gather_coalesced": CollectiveSpec("output_tensor_lists", False),
    "reduce_scatter": CollectiveSpec("input_list", False),
    "reduce_scatter_tensor": CollectiveSpec("input", False),
    "reduce_scatter_single": CollectiveSpec("input", False),  # the torch 2.13 name of the op above (FSDP2 calls it)
    "_reduce_scatter_base": CollectiveSpec("input", False),
    "all_to_all": CollectiveSpec("input_tensor_list", False),
    "all_to_all_single": CollectiveSpec("input", False),
    "broadcast": CollectiveSpec("tensor", False),
    "reduce": CollectiveSpec("tensor", False),
    "gather": CollectiveSpec("tensor", True),
    "scatter": CollectiveSpec("tensor", True),
    "send": CollectiveSpec("tensor", False),
    "recv": CollectiveSpec("tensor", False),
    "isend": CollectiveSpec("tensor", False, always_async=True),
    "irecv": CollectiveSpec("tensor", False, always_async=True),
    "barrier": CollectiveSpec(None, False),
    # DDP's buffer sync at every forward (broadcast_buffers=True): a C++ binding that broadcasts the buffers
    # from one rank of process_group in buckets and waits for them; DDP calls it as `dist._broadcast_coalesced`.
    "_broadcast_coalesced": CollectiveSpec("tensors", False, recorded_as="broadcast",
                                           params=("process_group", "tensors", "buffer_size", "group_src")),
}


# Module-name prefixes of libraries whose modules hold their own references to torch.distributed
# collectives (see the module docstring): megatron-core's gradient buffers, tensor-parallel mappings and
# layers all do.
CACHED_REFERENCE_LIBRARIES = ("megatron.core.",)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


class TimedWork:
    """Stands in for an async op's c10d Work: times the blocking `wait()`, delegates everything else."""

    __slots__ = ("_work", "_rec", "_now")

    def __init__(self, work: Any, rec: CommRecord, now: Callable[[], Any]) -> None:
        self._work = work
        self._rec = rec
        self._now = now

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        t0 = self._now()
        out = self._work.wait(*args, **kwargs)
        self._rec.waits.append((t0, self._now()))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommTracer:
    """Wraps torch.distributed collectives while open; records into the StepLog during active steps.

    Args:
        log: the step record.
        now: the timer's stamp function.
        current_module: returns (module index, phase) of the innermost open module call.
        host_timer: True when stamps are host times (completion callbacks can stamp async ops).
    """

    def __init__(self, log: StepLog, now: Callable[[], Any], current_module: Callable[[], tuple[int, Any]],
                 host_timer: bool) -> None:
        self.log = log
        self.now = now
        self.current_module = current_module
        self.host_timer = host_timer
        self._local = threading.local()
        self._patched: list[tuple[Any, str, Any]] = []
        if not dist.is_available():
            return
        wrappers: dict[int, Any] = {}
        for name in SPECS:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue
            wrapper = self._wrap(name, original)
            wrappers[id(original)] = wrapper
            for namespace in (c10d, dist):
                if getattr(namespace, name, None) is original:
                    self._patch(namespace, name, wrapper)
        ds_comm = sys.modules.get("deepspeed.comm.comm")
        cdb = getattr(ds_comm, "cdb", None)
        for attr in ("all_gather_function", "reduce_scatter_function"):
            cached = getattr(cdb, attr, None)
            if cached is not None and id(cached) in wrappers:
                self._patch(cdb, attr, wrappers[id(cached)])
        coalescing = getattr(c10d, "_coalescing_manager", None)
        if coalescing is not None:
            wrappers[id(coalescing)] = self._wrap_coalescing(coalescing)
        self._patch_cached_references(wrappers)
        reducer = getattr(dist, "Reducer", None)  # DDP's C++ gradient reducer
        if reducer is not None and hasattr(reducer, "_rebuild_buckets"):
            self._patch(reducer, "_rebuild_buckets", self._wrap_bucket_rebuild(reducer._rebuild_buckets))

    def _patch_cached_references(self, wrappers: dict[int, Any]) -> None:
        """Replace the module-level references to collectives that CACHED_REFERENCE_LIBRARIES keep."""
        for name, module in list(sys.modules.items()):
            if module is None or not name.startswith(CACHED_REFERENCE_LIBRARIES):
                continue
            for attr, value in list(vars(module).items()):
                wrapper = wrappers.get(id(value))
                if wrapper is not None:
                    self._patch(module, attr, wrapper)

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def close(self) -> None:
        """Put every original function back (in reverse order)."""
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def _wrap(self, op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = SPECS[op]
        params = list(spec.params or inspect.signature(fn).parameters)
        recorded_as = spec.recorded_as or op
        group_arg = "process_group" if "process_group" in params else "group"

        def position(name: str | None) -> int | None:
            return params.index(name) if name in params else None

        i_size, i_group, i_async = position(spec.size_arg), position(group_arg), position("async_op")
        peer_args = [(position(name), name, name.startswith("group_")) for name in ("dst", "src", "group_dst", "group_src")
                     if name in params]
        local = self._local

        def get(args: tuple, kwargs: dict, i: int | None, name: str | None) -> Any:
            if i is not None and i < len(args):
                return args[i]
            return kwargs.get(name) if name else None

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            log = self.log
            if not log.active or getattr(local, "depth", 0):
                return fn(*args, **kwargs)  # outside recorded steps, or called by another collective
            is_async = spec.always_async or bool(get(args, kwargs, i_async, "async_op"))
            group = get(args, kwargs, i_group, group_arg)
            n = dist.get_world_size(group) if dist.is_initialized() else 1
            nbytes = _nbytes(get(args, kwargs, i_size, spec.size_arg)) * (n if spec.times_group else 1)
            mi, _ = self.current_module()
            rec = CommRecord(op=recorded_as, nbytes=nbytes, group_size=n, module=mi, is_async=is_async,
                             issue=self.now())
            for i, name, in_group in peer_args:
                peer = get(args, kwargs, i, name)
                if peer is not None:
                    rec.peer = dist.get_global_rank(group, peer) if in_group and group is not None else peer
                    break
            local.depth = 1
            try:
                out = fn(*args, **kwargs)
            finally:
                local.depth = 0
            rec.ret = self.now()
            queued = getattr(local, "coalesced", None)
            if queued is not None:  # inside a coalescing manager: it runs, and is recorded, at the exit
                queued.append(rec)
                return out
            log.comms.append(rec)
            if not is_async or out is None:
                return out
            if self.host_timer:
                try:
                    out.get_future().add_done_callback(functools.partial(self._done, rec))
                except (RuntimeError, AttributeError):
                    pass  # backend without futures: total ends at the last wait
            else:
                rec.work = out
            return TimedWork(out, rec, self.now)

        wrapper.__trainprof_original__ = fn  # type: ignore[attr-defined]
        return wrapper

    def _wrap_coalescing(self, manager: Callable[..., Any]) -> Callable[..., Any]:
        """torch.distributed._coalescing_manager as one record: the collectives issued inside it queue,
        and run (a synchronous manager also waits for them) when it exits."""
        local = self._local

        @contextlib.contextmanager
        def wrapper(group: Any = None, device: Any = None, async_ops: bool = False) -> Any:
            if not self.log.active or getattr(local, "depth", 0) or getattr(local, "coalesced", None) is not None:
                with manager(group, device, async_ops) as cm:
                    yield cm
                return
            local.coalesced = []
            issue = self.now()
            try:
                with manager(group, device, async_ops) as cm:
                    yield cm
            finally:
                queued, local.coalesced = local.coalesced, None
            if queued:
                first = queued[0]
                self.log.comms.append(CommRecord(
                    op=first.op, nbytes=sum(r.nbytes for r in queued), group_size=first.group_size,
                    module=first.module, is_async=async_ops, issue=issue, ret=self.now()))

        wrapper.__trainprof_original__ = manager  # type: ignore[attr-defined]
        return wrapper

    def _wrap_bucket_rebuild(self, rebuild: Callable[[Any], bool]) -> Callable[[Any], bool]:
        """DDP's `reducer._rebuild_buckets()` (its forward after the first backward): when it rebuilds, rank 0
        broadcasts the new bucket order and every rank waits for it in C++, so this is where a rank first waits
        for a slower peer. Recorded as op `ddp_rebuild_buckets`, bytes 0 (a few int32 a parameter, not known here)."""
        local = self._local

        @functools.wraps(rebuild)
        def wrapper(reducer: Any) -> bool:
            if not self.log.active or getattr(local, "depth", 0):
                return rebuild(reducer)
            mi, _ = self.current_module()
            issue = self.now()
            rebuilt = rebuild(reducer)
            if rebuilt:  # otherwise nothing was sent
                n = dist.get_world_size() if dist.is_initialized() else 1
                self.log.comms.append(CommRecord(op="ddp_rebuild_buckets", nbytes=0, group_size=n, module=mi,
                                                 is_async=False, issue=issue, ret=self.now()))
            return rebuilt

        wrapper.__trainprof_original__ = rebuild  # type: ignore[attr-defined]
        return wrapper

    def _done(self, rec: CommRecord, _future: Any) -> None:
        rec.done = self.now()


def comm_total_ms(rec: CommRecord, issue: float, ret: float, waits: list[tuple[float, float]],
                  done: float | None) -> float | None:
    """Issue-to-completion time of one collective, in ms.

    Args:
        rec: the record (for async ops on GPU, its Work holds NCCL's own duration).
        issue, ret, waits, done: its stamps resolved to ms.
    Returns:
        ms, or None when the completion time cannot be known (async NCCL op without
        TORCH_NCCL_ENABLE_TIMING=1).
    """
    if not rec.is_async:
        return ret - issue
    if done is not None:
        return done - issue
    if rec.work is not None:
        try:
            duration = float(rec.work._get_duration())
            return duration if duration >= 0 else None
        except (RuntimeError, AttributeError):
            return None
    if waits:
        return max(w[1] for w in waits) - issue
    return ret - issue
