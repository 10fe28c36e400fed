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
    """

    def __init__(self, output_dir: str | Path | None = None, *, name: str = "run",
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, module_depth: int = DEFAULT_MODULE_DEPTH,
                 framework: str = "custom", loop_code_as_other: bool = True) -> None:
        self.output_dir = Path(output_dir if output_dir is not None else default_output_dir())
        self.name = name
        self.warmup_steps = warmup_steps
        self.module_depth = module_depth
        self.framework = framework
        self.loop_code_as_other = loop_code_as_other
        self.prof = None
        self.model = None
        self.engine_config: dict[str, Any] | None = None
        self.run_dir: Path | None = None
        self._step_cm = None
        self._other_cm = None
        self._last_end = None  # timer stamp of the previous step's end: the next step's data wait starts there
        self.finished = False

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
        kwargs.update(profiler_kwargs)
        self.model = model
        self.prof = Profiler(model, optimizer, time_optimizer=time_optimizer, **kwargs)

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
        """The optimizer step (all its micro batches) is over."""
        if self._step_cm is None:
            return
        if self._other_cm is not None:
            self._other_cm.__exit__(None, None, None)
            self._other_cm = None
        cm, self._step_cm = self._step_cm, None
        cm.__exit__(None, None, None)
        self._last_end = self.prof.timer.now()  # a CUDA event recorded after release() lives until the next step

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

    def finish(self) -> Path | None:
        """Close the profiler and write the run dir. A collective when torch.distributed is
        initialized: call it on every rank while the process group is alive. Returns the run dir
        (None when nothing was attached or it already ran)."""
        import torch

        from trainprof.distributed import shared_run_dir
        from trainprof.env import memory_meter
        from trainprof.io import atomic_write_json
        from trainprof.report.run_report import write_run_files

        if self.prof is None or self.finished:
            return None
        self.end_step()
        self.finished = True
        prof = self.prof
        prof.close()
        if not any(not s.warmup for s in prof.steps):
            if prof.rank == 0:
                print(f"trainprof: no measured step ({len(prof.steps)} optimizer steps seen, "
                      f"{self.warmup_steps} warm-up): no run dir written", file=sys.stderr)
            return None
        dist = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.run_dir = shared_run_dir(self.output_dir, self.name)
        profile = prof.result(engine={"kind": self.framework, "config": self.engine_config})
        profile["partial"] = False
        profile["summary"]["memory_meter"] = memory_meter(prof.device)
        if prof.rank == 0:
            write_run_files(profile, self.run_dir)
            s = profile["summary"]
            measured = [st for st in profile["steps"] if not st.get("warmup")]
            used = sum(not st.get("instrumented") for st in measured) or len(measured)
            # a step slowed by FLOP counting or tracing is measured but left out of the medians (summary.md's count)
            medians = f" ({used} in the medians, {len(measured) - used} instrumented)" if used != len(measured) else ""
            print(f"trainprof: {self.framework} run profiled: {len(measured)} measured steps{medians}, "
                  f"median step {s['step_ms']['median']:.1f} ms, unattributed "
                  f"{100 * (s.get('unattributed_frac') or 0):.2f}%; run dir {self.run_dir}", file=sys.stderr)
        atomic_write_json(self.run_dir / f"profile.rank{prof.rank}.json", prof.rank_result())
        if dist:
            torch.distributed.barrier()
        return self.run_dir

