"""`ProfileSession`: the Profiler lifecycle shared by the callbacks, the DeepSpeed instrumentation and
`python -m trainprof.wrap`: attach to a model, mark optimizer steps from outside a loop, and write the
usual run dir (profile.json, tables, report, TensorBoard scalars) as a collective on every rank."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

DEFAULT_WARMUP_STEPS = 1  # the first optimizer step builds caches and allocates optimizer states
DEFAULT_MODULE_DEPTH = 4  # as profile.module_depth: attention, MLP and norms of a Llama


def default_output_dir() -> str:
    return os.environ.get("TRAINPROF_OUTPUT_DIR", "runs")


class ProfileSession:
    """One profiled run of a model trained by someone else's loop.

    Args:
        output_dir: run dirs go to <output_dir>/<name>-<UTC timestamp>/ (default $TRAINPROF_OUTPUT_DIR or runs/).
        name: run name (default "run").
        warmup_steps: leading optimizer steps not measured (the last one counts FLOPs).
        module_depth: deepest module level timed (0 = the model given to attach()).
        framework: what drives the loop ("hf", "lightning", "deepspeed"); goes to profile["engine"].
        loop_code_as_other: mark the whole step as an "other" region under the model phases, so the
            framework's own code between them (gradient clipping, LR scheduler, callbacks, logging) is
            the "other" phase rather than unattributed.
        ops: trace operators (torch.profiler) on the first measured step: ops.csv, and a Kineto trace in
            the run dir's tb/<run name>/ for TensorBoard's PyTorch Profiler tab (`trainprof tb RUN_DIR`).
    """

    def __init__(self, output_dir: str | Path | None = None, *, name: str = "run",
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, module_depth: int = DEFAULT_MODULE_DEPTH,
                 framework: str = "custom", loop_code_as_other: bool = True, ops: bool = False) -> None:
        self.output_dir = Path(output_dir if output_dir is not None else default_output_dir())
        self.name = name
        self.warmup_steps = warmup_steps
        self.module_depth = module_depth
        self.framework = framework
        self.loop_code_as_other = loop_code_as_other
        self.ops = ops
        self._trace_staging: Path | None = None  # traces are written before the run dir exists (made at the end)
        self.prof = None
        self.model = None
        self.engine_config: dict[str, Any] | None = None
        self.run_dir: Path | None = None
        self._step_cm = None
        self._other_cm = None
        self._last_end = None  # timer stamp of the previous step's end: the next step's data wait starts there
        self.updates = 0  # optimizer steps whose update ran (end_step calls)
        self.updates_unprofiled = 0  # steps the script ran before a step could begin (a plain loop's first)
        self.open_step_updated = False  # set by an integration that ends a step only when the loop goes on
        self.finished = False
        self._reserved: Path | None = None  # rank 0's run dir, made at attach under several ranks (see _reserve_run_dir)

    # -- attaching and steps -----------------------------------------------------------------------

    def attach(self, model: Any, optimizer: Any = None, *, time_optimizer: bool = True,
               **profiler_kwargs: Any) -> None:
        """Create the Profiler on `model` (the module the loop calls); once per session.

        Args:
            model: the module to profile (depth 0).
            optimizer: its optimizer; its states count in the model-state bytes.
            time_optimizer: time a torch optimizer's step() and zero_grad() as the optimizer phase. False
                where step() holds more than the update (Lightning runs forward and backward inside
                `optimizer.step(closure)`): the caller marks the phase, the states are still measured.
            profiler_kwargs: any Profiler keyword, applied last.
        """
        from trainprof.profiler import Profiler

        if self.prof is not None:
            return
        inner = model.module if hasattr(model, "module") and hasattr(model, "no_sync") else model
        wrapper_levels = 1 if inner is not model else 0
        wrapper_levels += 2 if hasattr(inner, "get_base_model") else 0  # peft
        kwargs: dict[str, Any] = dict(module_depth=self.module_depth + wrapper_levels,
                                      warmup_steps=self.warmup_steps)
        if self.ops:
            import tempfile

            self._trace_staging = Path(tempfile.mkdtemp(prefix="trainprof-traces-"))
            kwargs.update(ops=True, trace_dir=self._trace_staging)
        kwargs.update(profiler_kwargs)
        self.model = model
        self.prof = Profiler(model, optimizer, time_optimizer=time_optimizer, **kwargs)
        self._reserve_run_dir()

    @property
    def in_step(self) -> bool:
        return self._step_cm is not None

    def begin_step(self) -> None:
        """An optimizer step starts. The time since the previous step ended is its data wait (the
        framework fetched the next batch there) and the step's start."""
        if self.prof is None or self._step_cm is not None or self.finished:
            return
        if self._last_end is not None:
            self.prof._pending_fetch = (self._last_end, self.prof.timer.now())
        self._step_cm = self.prof.step()
        self._step_cm.__enter__()
        if self.loop_code_as_other:
            self._other_cm = self.prof.phase("other")
            self._other_cm.__enter__()

    def end_step(self) -> None:
        """The optimizer step (all its micro batches) is over: its update ran."""
        if self._step_cm is None:
            return
        self.updates += 1
        self._close_step()

    def _close_step(self, *, at: Any = None) -> None:
        """Close the open step now, or at `at` (an earlier stamp of this step: where its work ended)."""
        if at is not None:
            self.prof.end_step_at(at)
        if self._other_cm is not None:
            self._other_cm.__exit__(None, None, None)
            self._other_cm = None
        cm, self._step_cm = self._step_cm, None
        self.open_step_updated = False
        cm.__exit__(None, None, None)
        self._last_end = self.prof.timer.now()  # a CUDA event recorded after release() lives until the next step

    def not_data_wait(self) -> None:
        """Between steps, work that is not the next batch's fetch (an evaluation forward) ended now: the next
        step's data wait starts here, not where the last step ended."""
        if self.prof is not None and self._step_cm is None and self._last_end is not None:
            self._last_end = self.prof.timer.now()

    def mark_data_wait(self, start: Any) -> None:
        """Inside a step, the time from `start` (a `self.prof.timer.now()` stamp) to now is data wait:
        the framework fetched a later micro batch there."""
        if self.prof is None or not self.prof.log.active:
            return
        from trainprof.profiler.log import REGION_CLOSE, REGION_OPEN

        self.prof.log.mark(REGION_OPEN, "data_wait", start)
        self.prof.log.mark(REGION_CLOSE, "data_wait", self.prof.timer.now())

    def last_stamp(self) -> Any:
        """The stamp of the step's latest region event (now, when there is none)."""
        if self.prof is not None and self.prof.log.active and self.prof.log.stamps:
            return self.prof.log.stamps[-1]
        return self.now()

    def now(self) -> Any:
        return self.prof.timer.now() if self.prof is not None else None

    def phase(self, label: str):
        import contextlib

        return self.prof.phase(label) if self.prof is not None else contextlib.nullcontext()

    def record(self, *, loss: Any = None, tokens: int | None = None) -> None:
        if self.prof is not None and self._step_cm is not None:
            self.prof.record(loss=loss, tokens=tokens)

    # -- the run dir -------------------------------------------------------------------------------

    def finish(self, *, partial_reason: str | None = None) -> Path | None:
        """Close the profiler and write the run dir. A collective when torch.distributed is
        initialized: call it on every rank while the process group is alive. Returns the run dir
        (None when nothing was attached, it already ran or nothing could be written).

        Args:
            partial_reason: why the run stopped before the loop ended (the script raised, a signal);
                the profile is then marked partial, as `trainprof run` marks a rank that stopped early.
        """
        if self.prof is None or self.finished:
            return None
        prof = self.prof
        updates = self._stop()
        try:
            return self._write(prof, updates, partial_reason)
        finally:
            self.drop_trace_staging()

    def _stop(self) -> int:
        """Close the open step and the profiler; returns the optimizer steps seen."""
        prof = self.prof
        open_updated = self.in_step and self.open_step_updated  # a step its integration ends lazily (Accelerate)
        updates = self.updates + open_updated
        no_update = self.in_step and not open_updated  # cut short, or a forward after the last update
        recorded = len(prof.steps)
        if self.in_step:
            # a step whose update ran ends where its last region (the update, zero_grad) did: what the script
            # did after its loop (saving, logging, DataLoader workers shutting down) is no step's time
            self._close_step(at=self.last_stamp() if open_updated else None)
        if no_update and len(prof.steps) > recorded:
            prof.discard_last_step()  # no update ran in it: not a step
        self.finished = True
        prof.close()
        return updates

    def finish_alone(self, partial_reason: str) -> Path | None:
        """After a failure under several ranks (another rank may never reach a collective): write this
        rank's finished steps to <run dir>/profile.rank<N>.partial.json, with no collective, in the run dir
        rank 0 made at attach (`trainprof report RUN_DIR` merges the ranks' files). Returns that file, or
        None (no rank-0 run dir known, no measured step)."""
        from trainprof.io import atomic_write_json

        if self.prof is None or self.finished:
            return None
        prof = self.prof
        self._stop()
        self.drop_trace_staging()
        run_dir = self._reserved if self._reserved is not None else _shared_run_dir(self.name)
        if run_dir is None or not any(not s.warmup for s in prof.steps):
            self._drop_reserved()
            return None
        doc = prof.rank_result()
        doc.update(partial=True, partial_reason=f"rank {prof.rank}: {partial_reason}")
        run_dir.mkdir(parents=True, exist_ok=True)  # rank 0 made it; a later run may have cleaned it
        out = run_dir / f"profile.rank{prof.rank}.partial.json"
        atomic_write_json(out, doc)
        return out

    def _reserve_run_dir(self) -> None:
        """Under several ranks, rank 0 makes the run dir now and leaves its path in the process group's
        store (a key, no collective), so that after a failure each rank can write its partial profile
        there alone (`finish_alone`). A normal finish uses it too."""
        from trainprof.layout import new_run_dir

        store = _default_store()
        if store is None or self.prof.rank != 0:
            return
        try:
            self._reserved = new_run_dir(self.output_dir, self.name)
            store.set(_run_dir_key(self.name), str(self._reserved))
        except OSError:
            return  # said at the end, where the run dir is made (_new_run_dir)
        except RuntimeError:
            return  # the store is unreachable: the other ranks cannot find it after a failure, rank 0 still can

    def _drop_reserved(self) -> None:
        """Remove the run dir made at attach if nothing went into it (no rank had a step to write)."""
        if self._reserved is not None:
            try:
                self._reserved.rmdir()
            except OSError:
                pass  # another rank wrote its file there

    def drop_trace_staging(self) -> None:
        """Remove the temporary dir the operator traces were written to (moved into the run dir by then, or
        never to be: a run that failed on several ranks writes no run dir)."""
        if self._trace_staging is not None:
            import shutil

            shutil.rmtree(self._trace_staging, ignore_errors=True)
            self._trace_staging = None

    def _write(self, prof: Any, updates: int, partial_reason: str | None) -> Path | None:
        import torch

        from trainprof.io import atomic_write_json
        from trainprof.report.run_report import write_run_files

        if updates == 0 or not any(not s.warmup for s in prof.steps):
            if prof.rank == 0:
                why = no_measured_step(updates, self.warmup_steps, unprofiled=self.updates_unprofiled)
                print(f"trainprof: no run dir written: {why}", file=sys.stderr)
                self._drop_reserved()
            return None
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.run_dir = self._new_run_dir(dist, prof.rank)
        profile = prof.result(engine={"kind": self.framework, "config": self.engine_config})  # a collective
        if self.run_dir is None:
            return None
        profile["partial"] = partial_reason is not None
        if partial_reason is not None:
            profile["partial_reason"] = partial_reason
        try:
            self._move_traces()
            if prof.rank == 0:
                write_run_files(profile, self.run_dir)
                print(self._done_line(profile), file=sys.stderr)
            atomic_write_json(self.run_dir / f"profile.rank{prof.rank}.json", prof.rank_result())
        finally:
            if dist:
                torch.distributed.barrier()
        return self.run_dir

    def _move_traces(self) -> None:
        """This rank's traces into the run dir's tb/<run name>/ (where TensorBoard lists them by run)."""
        import shutil

        from trainprof.layout import tb_run_dir

        if self._trace_staging is None or not self._trace_staging.is_dir():
            return
        target = tb_run_dir(self.run_dir)
        target.mkdir(parents=True, exist_ok=True)
        for f in self._trace_staging.iterdir():
            if not (target / f.name).exists():  # kineto.log: the first rank's is kept
                shutil.move(str(f), target / f.name)

    def _new_run_dir(self, dist: bool, rank: int) -> Path | None:
        """<output_dir>/<name>-<UTC timestamp>/, made on rank 0 and broadcast; None on every rank (and one
        line on rank 0) when it cannot be made, so no rank waits for a rank that gave up."""
        from trainprof.layout import new_run_dir

        box: list[Any] = [None]
        if rank == 0 and self._reserved is not None:
            box[0] = str(self._reserved)
        elif rank == 0:
            try:
                box[0] = str(new_run_dir(self.output_dir, self.name))
            except OSError as err:
                print(f"trainprof: profile not saved: cannot create a run dir in '{self.output_dir}' "
                      f"({err.strerror or err}); set TRAINPROF_OUTPUT_DIR (or output_dir=) to a writable "
                      "directory", file=sys.stderr)
        if dist:
            import torch

            torch.distributed.broadcast_object_list(box, src=0)
        return Path(box[0]) if box[0] is not None else None

    def _done_line(self, profile: dict[str, Any]) -> str:
        s = profile["summary"]
        measured = [st for st in profile["steps"] if not st.get("warmup")]
        used = sum(not st.get("instrumented") for st in measured) or len(measured)
        # a step slowed by FLOP counting or tracing is measured but left out of the medians (summary.md's count)
        medians = f" ({used} in the medians, {len(measured) - used} instrumented)" if used != len(measured) else ""
        partial = f" PARTIAL ({profile['partial_reason']})" if profile.get("partial") else ""
        return (f"trainprof: {self.framework} run profiled{partial}: {len(measured)} measured steps{medians}, "
                f"median step {s['step_ms']['median']:.1f} ms, unattributed "
                f"{100 * (s.get('unattributed_frac') or 0):.2f}%; run dir {self.run_dir}")

    def finish_at_end(self, *, partial_reason: str | None = None) -> Path | None:
        """`finish` for the end of someone else's training: a profile that cannot be saved is one line on
        stderr, never an exception out of the user's `train()` or script."""
        try:
            return self.finish(partial_reason=partial_reason)
        except Exception as err:  # noqa: BLE001  the training finished; its profile is what failed
            print(f"trainprof: profile not saved for the {self.framework} run ({type(err).__name__}: {err}); "
                  "the training itself is unaffected", file=sys.stderr)
            return None


def _default_store() -> Any:
    """The default process group's key-value store under several ranks, else None."""
    import torch

    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):  # a private helper: gone in some torch, or no store
        return None


def _run_dir_key(name: str) -> str:
    return f"trainprof/run_dir/{name}"


def _shared_run_dir(name: str) -> Path | None:
    """The run dir rank 0 made for the session `name` at attach, read from the store without waiting."""
    store = _default_store()
    key = _run_dir_key(name)
    try:
        return Path(store.get(key).decode()) if store is not None and store.check([key]) else None
    except (RuntimeError, ValueError):  # the store's host is gone
        return None


def no_measured_step(updates: int, warmup_steps: int, *, unprofiled: int = 0) -> str:
    """Why a session measured no step, in words.

    Args:
        updates: the optimizer steps the session saw (warm-up included).
        warmup_steps: the session's warm-up.
        unprofiled: optimizer steps the script ran before the session could profile one (a plain loop's
            first, which finds the loop).
    """
    seen = updates + unprofiled
    if seen == 0:
        return ("the optimizer was never stepped (trainprof profiles optimizer steps: call optimizer.step() in "
                "the loop)")
    which = (f"the first found the loop, {updates} warm-up" if unprofiled == 1 else
             f"{unprofiled} before profiling began, {updates} warm-up") if unprofiled else "all of them warm-up"
    return (f"no measured step: {seen} optimizer step(s) seen ({which}; warm-up {warmup_steps}): "
            "train longer or lower warmup_steps / --warmup-steps")
