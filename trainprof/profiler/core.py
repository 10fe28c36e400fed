"""`Profiler`: the front class users and the runner call in a training loop. It owns the hooks, the
timer, the collective wrappers, memory and FLOP counting, and delegates analysis to trainprof.analysis.

    with Profiler(model, optimizer=opt) as prof:
        for batch in prof.wrap_loader(loader):
            with prof.step():                     # one optimizer step (all its micro batches)
                loss = model(**batch).loss
                loss.backward()
                opt.step(); opt.zero_grad()
    prof.result()                                 # the profile.json dict
    prof.save("runs/my-run")                      # profile.json; `trainprof report runs/my-run` renders it
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import torch

from trainprof.analysis.aggregate import StepRecord, StepTimeline, complete_step
from trainprof.analysis.breakdown import CommEvent
from trainprof.analysis.gpu_busy import gpu_busy_fields
from trainprof.analysis.pipeline import PipelineInfo
from trainprof.env import load_average
from trainprof.layout import tb_run_dir
from trainprof.models import count_params
from trainprof.phases import REGION_PHASES
from trainprof.profiler.comm import CommTracer, comm_total_ms
from trainprof.profiler.compiled import DynamoWatch, compile_block
from trainprof.profiler.flops import FlopCounter, analytic_flops, note_missing_analytic
from trainprof.profiler.fsdp import owned as fsdp_owned, param_groups as fsdp_param_groups, watch as watch_fsdp
from trainprof.profiler.hooks import ModuleHooks
from trainprof.profiler.journal import JOURNAL_INTERVAL_S, Journal, journal_path
from trainprof.profiler.log import ACTION_CLOSE, ACTION_OPEN, REGION_CLOSE, REGION_OPEN, StepLog
from trainprof.profiler.memory import PhaseMemory, SavedActivations, model_state_bytes
from trainprof.profiler.ops import OpTracer, range_names, region_range_name
from trainprof.profiler.patches import wrap_autograd_backward, wrap_optimizer_method
from trainprof.profiler.result import profile_env, rank_profile
from trainprof.profiler.telemetry import DEFAULT_PERIOD_MS, open_step_telemetry, telemetry_fields
from trainprof.profiler.timers import make_timer
from trainprof.profiler.workload import BatchShape, find_llama, workload

# Steps are analysed when `Profiler.steps` is read (at save, typically after training); a longer backlog
# is analysed at once, which bounds the memory the timelines hold (a few hundred kB per 100 steps).
ANALYSE_BACKLOG_STEPS = 256


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def megatron_profiler_kwargs(model: torch.nn.Module, recipe: Any) -> dict[str, Any]:
    """What profiling a Megatron GPTModel adds: its modules under the HF Llama's names, re-runs seen below
    module_depth (selective recomputation re-runs only the core attention), and the ranks of one model
    replica, which read the same samples (the merge counts their tokens once)."""
    from trainprof.megatron_names import hf_module_names

    e = recipe.engine
    return {"module_names": hf_module_names(model), "recompute_sentinels": recipe.model.recompute,
            "env": {"model_parallel_size": e.tensor_parallel * e.pipeline_parallel}}


class Profiler:
    """Hook-based step profiler: module x phase, operators, optimizer, communication, data wait,
    memory and FLOPs per optimizer step, with phases that add up to the step's wall time.

    Args:
        model: the module the loop calls (engine.module for DeepSpeed; the DDP wrapper for DDP; the peft
            wrapper for LoRA).
            Create the Profiler after deepspeed.initialize so its hooks wrap ZeRO-3's.
        optimizer: a torch optimizer (its step() and zero_grad() are timed as the optimizer phase) or
            any other object (e.g. a DeepSpeed ZeRO optimizer: wrap engine.step() in
            `prof.phase("optimizer")`), or a list of optimizers whose states all count (none timed);
            used for model-state bytes.
        time_optimizer: time a torch optimizer's step() and zero_grad() as the optimizer phase; False where
            step() holds more than the update (Lightning runs forward and backward inside
            `optimizer.step(closure)`) and the caller marks the phase: its states are still measured.
        module_depth: deepest module level timed (0 = the model itself; 4 = a Llama's attention, MLP and
            norms, as recipes and `trainprof wrap` time them).
        enabled: False installs nothing and records only step wall times.
        warmup_steps: leading `step()`s that are not measured (the last one counts FLOPs). 0 measures the
            first step too (compilation, optimizer-state allocation); a compiled model's recompilations
            are then counted from the second step.
        active_steps: measured steps after warm-up (None: every step).
        flops: count FLOPs on one step (the last warm-up step, else the first step, then flagged).
        ops: trace aten operators with torch.profiler on `ops_steps` measured steps.
        ops_steps: how many measured steps to trace at operator level (the schedule's active steps).
        trace_dir: where operator-level steps write Chrome/TensorBoard traces (None: not written).
        trace_wait, trace_warmup: torch.profiler schedule before the active steps: measured steps
            skipped, then steps traced and discarded (Kineto warm-up; flagged "trace_warmup").
        record_shapes: operator input shapes in the trace, and per-operator FLOPs (which need them).
        with_stack: Python stacks per operator in the trace.
        trace_gzip: write the trace as .pt.trace.json.gz.
        memory: measure peak memory per phase.
        comm: wrap torch.distributed collectives.
        module_names: native module name -> the name profiles show (the Megatron engine's modules take the
            HF Llama's names, trainprof.megatron_names); names not in it stay.
        recompute_sentinels: see ModuleHooks (None: ask the model whether it checkpoints activations).
        device: the compute device (default: the model's first parameter's device).
        rank, world_size: default from torch.distributed (or RANK/WORLD_SIZE).
        recipe, env: put into the result as `recipe` and merged into `env`.
        journal_dir: where profile.rank<N>.journal.jsonl goes (None: no journal; see profiler/journal.py).
        journal_interval_s: the most time between two journal writes (0: every step as it ends).
        telemetry_period_ms: NVML telemetry sampling period on a CUDA device (0 or None: off); see
            profiler/telemetry.py. Elsewhere `telemetry` is null with the reason.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, *, time_optimizer: bool = True,
                 module_depth: int = 4,
                 enabled: bool = True, warmup_steps: int = 0, active_steps: int | None = None,
                 flops: bool = True, ops: bool = False, ops_steps: int = 1,
                 trace_dir: str | Path | None = None, trace_wait: int = 0, trace_warmup: int = 0,
                 record_shapes: bool = True, with_stack: bool = False, trace_gzip: bool = False,
                 memory: bool = True, comm: bool = True,
                 device: torch.device | str | None = None, rank: int | None = None,
                 world_size: int | None = None, recipe: dict[str, Any] | None = None,
                 env: dict[str, Any] | None = None, journal_dir: str | Path | None = None,
                 journal_interval_s: float = JOURNAL_INTERVAL_S, module_names: Mapping[str, str] | None = None,
                 recompute_sentinels: bool | None = None,
                 telemetry_period_ms: float | None = DEFAULT_PERIOD_MS) -> None:
        self.model = model
        self.optimizer = optimizer
        self.module_depth = module_depth
        self.enabled = enabled
        self.warmup_steps = warmup_steps
        self.active_steps = active_steps
        self.count_flops = flops and enabled
        self.ops = ops and enabled
        self.ops_steps = ops_steps
        self.device = torch.device(device) if device is not None else _model_device(model)
        dist_rank, dist_world = _dist_rank_world()
        self.rank = dist_rank if rank is None else rank
        self.world_size = dist_world if world_size is None else world_size
        self.recipe = recipe
        self.extra_env = dict(env or {})
        self.load_at_start = load_average()  # env.machine_load: was the machine busy while this ran
        self.timer = make_timer(self.device)
        self.log = StepLog()
        self._steps: list[StepRecord] = []
        self._unanalysed: list[tuple[StepRecord, StepTimeline]] = []
        self.last_timeline: StepTimeline | None = None  # the newest step's, for the journal
        self._step_index = 0
        self._pending_fetch: tuple[Any, Any] | None = None
        self._regions: list[tuple[str, Any]] = []  # open phase regions: (label, record_function handle)
        self._step_loss: list[Any] = []
        self._step_tokens: int | None = None
        self.flops: dict[str, Any] | None = None
        self.ops_rows: list[list[dict[str, Any]]] = []
        self.grads_bytes: int | None = None
        self.flops_running = False  # False while the FLOP-counting step's optimizer phase runs uncounted
        self._flop_counter: FlopCounter | None = None  # set on the FLOP-counting step
        self._activations: SavedActivations | None = None  # activation bytes, on the FLOP-counting step
        self.activation_bytes: int | None = None
        self._seq_len: int | None = None
        self.pipeline: PipelineInfo | None = None  # set by watch_pipeline on a pipeline stage
        self.ddp = False  # set by watch_ddp: DDP waits for its all-reduces inside backward
        self._end_at: Any = None  # end_step_at: the open step's end, fixed before its block exits
        self._origin_unix_ns: int | None = None
        self._undo: list[Any] = []  # callables that remove the call wrappers
        self._closed = False
        self._saved_to: set[Path] = set()  # run dirs this Profiler saved to: saving again there updates its own files
        self.memory = PhaseMemory(self.device) if (memory and enabled) else None
        self.hooks: ModuleHooks | None = None
        self.dynamo: DynamoWatch | None = None  # a compiled model: dynamo's counters (profiler/compiled.py)
        self.comm: CommTracer | None = None
        self._op_tracer = OpTracer(cuda=self.device.type == "cuda", trace_dir=trace_dir, rank=self.rank,
                                   world_size=self.world_size, wait=trace_wait, warmup=trace_warmup,
                                   active=ops_steps, record_shapes=record_shapes, with_stack=with_stack,
                                   gzip=trace_gzip)
        # profile.rank<N>.journal.jsonl: finished steps appended as the run goes (a killed rank keeps them)
        self.journal = Journal(journal_path(journal_dir, self.rank), journal_interval_s) \
            if (journal_dir is not None and enabled) else None
        self.telemetry, self.telemetry_reason = open_step_telemetry(self.device, telemetry_period_ms) if enabled \
            else (None, "the profiler is disabled (profile.enabled false)")
        self.batch_shape: BatchShape | None = None  # the loop's micro batch, sequence and accumulation (workload)
        if not enabled:
            return
        self.hooks = ModuleHooks(model, module_depth, self.log, self.timer.now,
                                 on_root=self._on_root if self.memory else None,
                                 recompute_sentinels=recompute_sentinels)
        llama = find_llama(model)
        if llama is not None:
            self.batch_shape = BatchShape(llama, inside_compiled=self.hooks.compiled.inside, outer=model)
            self._undo.append(self.batch_shape.remove)  # what it saw stays readable
        if module_names:
            self.hooks.modules = [dataclasses.replace(m, name=module_names.get(m.name, m.name))
                                  for m in self.hooks.modules]
        self._range_names = range_names(self.hooks.modules)
        if self.hooks.compiled.compiled:
            self.dynamo = DynamoWatch()
            self.dynamo.mark("attached")
        self._comm_owner: list[int] = []  # module indices that own the collectives issued now (FSDP2)
        if comm:
            self.comm = CommTracer(self.log, self.timer.now, self._comm_module, host_timer=self.timer.kind == "host")
            if fsdp_param_groups(model):  # FSDP2: collectives belong to the module each group shards
                self._undo.append(watch_fsdp(model, {m.name: m.index for m in self.hooks.modules},
                                             lambda index: fsdp_owned(self._comm_owner, index)))
        active = self._recording
        self._undo.append(wrap_autograd_backward(self._phase, active))
        if time_optimizer and isinstance(optimizer, torch.optim.Optimizer):
            for method in ("step", "zero_grad"):
                self._undo.append(wrap_optimizer_method(optimizer, method, self._phase, active))

    @classmethod
    def for_recipe(cls, model: torch.nn.Module, optimizer: Any, recipe: Any, *,
                   run_dir: str | Path | None = None, **overrides: Any) -> Profiler:
        """The Profiler a recipe asks for: its `profile:` section and its warm-up / measured steps.

        `profile.module_depth` counts from the transformer (LlamaForCausalLM = 0): wrapper levels are
        added (DDP: 1, peft's PeftModel -> LoraModel: 2), so one depth means the same modules for every
        engine and task. Pass DDP itself (not .module), so DDP's own forward work (reducer bookkeeping;
        its buffer broadcast, recorded as a collective) lands in the forward phase, and call `watch_ddp`.
        Operator traces go to <run_dir>/tb when `profile.ops` is on. A Megatron recipe adds
        `megatron_profiler_kwargs`.

        Args:
            model: the module the loop calls (engine.module).
            optimizer: the engine's optimizer.
            recipe: a trainprof.recipe.Recipe.
            run_dir: the run directory (for traces and the journal, profile.rank<N>.journal.jsonl).
            overrides: any constructor keyword, applied last.
        """
        p, t = recipe.profile, recipe.train
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        wrapper_levels = (1 if inner is not model else 0)  # DDP -> module
        wrapper_levels += 2 if hasattr(inner, "get_base_model") else 0  # peft: PeftModel -> LoraModel -> model
        kwargs: dict[str, Any] = dict(
            module_depth=p.module_depth + wrapper_levels, enabled=p.enabled, ops=p.ops, ops_steps=p.ops_steps,
            warmup_steps=t.warmup_steps, active_steps=t.steps, recipe=recipe.to_dict(),
            trace_dir=tb_run_dir(run_dir) if (run_dir is not None and p.ops) else None,
            trace_wait=p.trace_wait, trace_warmup=p.trace_warmup, record_shapes=p.record_shapes,
            with_stack=p.with_stack, trace_gzip=p.trace_gzip, journal_dir=run_dir,
            telemetry_period_ms=p.telemetry_period_ms,
        )
        if recipe.engine.kind == "megatron":
            kwargs.update(megatron_profiler_kwargs(model, recipe))
        kwargs.update(overrides)
        return cls(model, optimizer, **kwargs)

    @property
    def steps(self) -> list[StepRecord]:
        """Every recorded step, analysed: steps recorded since the last read are analysed now (the
        hooks only stamp; the module x phase analysis of a step runs here, after it)."""
        self._analyse_waiting()
        return self._steps

    @property
    def waiting_steps(self) -> int:
        """Recorded steps not analysed yet (see `steps`)."""
        return len(self._unanalysed)

    @property
    def last_step(self) -> tuple[StepRecord, StepTimeline] | None:
        """The newest recorded step as it was kept, perhaps not analysed yet, with its timeline (the
        journal writes these)."""
        if not self._steps or self.last_timeline is None:
            return None
        return self._steps[-1], self.last_timeline

    def discard_last_step(self) -> None:
        """Forget the newest recorded step: one the loop never finished (cut short by an exception or a
        signal before its update), whose partial times would read as a step's."""
        if self._steps:
            record = self._steps.pop()
            self._unanalysed = [(r, t) for r, t in self._unanalysed if r is not record]

    def _analyse_waiting(self) -> None:
        if self._unanalysed:
            parents = [m.parent for m in self.hooks.modules] if self.hooks is not None else None
            for record, timeline in self._unanalysed:
                complete_step(record, timeline, parents)
            self._unanalysed.clear()

    def _recording(self) -> bool:
        return self.log.active and not self._closed

    def _may_record(self) -> bool:
        """Whether the current or a later step can still be recorded."""
        if self.log.active:
            return True
        if self._closed:
            return False
        return self.active_steps is None or self._step_index < self.warmup_steps + self.active_steps

    # -- context manager / lifetime ----------------------------------------------------------------

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and wrapper this Profiler added; results stay readable."""
        if self._closed:
            return
        self._closed = True
        self.log.active = False
        if self.dynamo is not None:
            self.dynamo.mark("end")
        if self.hooks is not None:
            self.hooks.close()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        if self.comm is not None:
            self.comm.close()
        if self.memory is not None:
            self.memory.close()
        if self.telemetry is not None:
            self.telemetry.close()
        rows = self._op_tracer.close()  # a schedule cut short by the end of training: write what it has
        if rows:
            self.ops_rows.extend(rows)
        if self.journal is not None:
            self.journal.flush(self)

    # -- the loop ----------------------------------------------------------------------------------

    def wrap_loader(self, loader: Iterable[Any]) -> Iterator[Any]:
        """Yield the loader's batches, timing each `next()` as data_wait (of the step it feeds)."""
        it = iter(loader)
        now = self.timer.now
        while True:
            if not self._may_record():  # past the measured steps: no stamps (CUDA events would pile up)
                try:
                    yield next(it)
                except StopIteration:
                    return
                continue
            t0 = now()
            traced = self._op_tracer.recording
            handle = torch.ops.profiler._record_function_enter_new(region_range_name("data_wait"), None) \
                if traced else None
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                if handle is not None:
                    torch.ops.profiler._record_function_exit._RecordFunction(handle)
            t1 = now()
            if self.log.active:
                self.log.mark(REGION_OPEN, "data_wait", t0)
                self.log.mark(REGION_CLOSE, "data_wait", t1)
            else:
                self._pending_fetch = (t0, t1)
            yield batch

    @contextlib.contextmanager
    def step(self) -> Iterator[Profiler]:
        """One optimizer step, all its micro batches included. A batch fetched through `wrap_loader`
        since the previous step counts as this step's data_wait and its start as the step's start."""
        index = self._step_index
        self._step_index += 1
        pending, self._pending_fetch = self._pending_fetch, None
        warm = index < self.warmup_steps
        measured = not warm and (self.active_steps is None or index - self.warmup_steps < self.active_steps)
        flops_step = (self.count_flops and self.flops is None and not self._closed
                      and index == max(self.warmup_steps - 1, 0))
        if self._closed or not (measured or flops_step):
            try:
                yield self
            finally:
                if self.batch_shape is not None:
                    self.batch_shape.step_ended()
            return
        if measured and self.dynamo is not None and (self.warmup_steps or index > 0):
            self.dynamo.mark("measured")  # with no warm-up, from the second step: the first one compiles
        ops_phase = None
        if self.ops and measured and not flops_step and self.hooks is not None:
            ops_phase = self._op_tracer.begin_step(index - self.warmup_steps, self._range_names,
                                                   [m.name for m in self.hooks.modules])
        traced = ops_phase in ("warmup", "active")
        log = self.log
        log.clear()
        self._step_loss, self._step_tokens = [], None
        if self.hooks is not None:
            self.hooks.reset_step()
        if self.memory is not None:
            self.memory.start_step()
        if traced:
            self.hooks.range_names = self._range_names
        counter = None
        if flops_step:
            self._activations = SavedActivations(self.model).__enter__()
            counter = self._flop_counter = FlopCounter(self._where)
            counter.__enter__()
            self.flops_running = True
        # the host-clock window that NVML samples are assigned by (measured steps only)
        telemetry_begin = self.telemetry.step_begins() if (self.telemetry is not None and measured) else None
        origin = pending[0] if pending is not None else self.timer.now()
        if self.pipeline is not None:  # places this rank's step beside the other stages' (analysis/pipeline.py)
            self._origin_unix_ns = time.time_ns() - (time.perf_counter_ns() - origin if self.timer.kind == "host" else 0)
        if pending is not None:
            log.mark(REGION_OPEN, "data_wait", pending[0])
            log.mark(REGION_CLOSE, "data_wait", pending[1])
        log.active = True
        try:
            yield self
        finally:
            end, self._end_at = self._now(), None
            end_ns = time.perf_counter_ns()
            log.active = False
            if self.hooks is not None:
                self.hooks.end_step()
            if counter is not None:
                if self.flops_running:  # else an optimizer phase left open by an exception holds it
                    counter.__exit__(None, None, None)
                self.flops_running = False
                self._flop_counter = None
                self._activations.__exit__(None, None, None)
            self._regions.clear()
            instrumented = []
            if flops_step:
                instrumented.append("flops")
            if ops_phase is not None:
                self.hooks.range_names = None
                rows = self._op_tracer.end_step(index - self.warmup_steps)
                if rows:
                    self.ops_rows.extend(rows)
                if traced:
                    instrumented.append("ops" if ops_phase == "active" else "trace_warmup")
            self._finish_step(index, origin, end, warm=not measured, instrumented=instrumented)
            if self.batch_shape is not None:
                self.batch_shape.step_ended()
            if telemetry_begin is not None:
                self.telemetry.step_ends(index - self.warmup_steps, telemetry_begin, end_ns, counted=not instrumented)
            if counter is not None:
                self._store_flops(counter)
                self.activation_bytes = self._activations.max_bytes
                self._activations = None
            if self.journal is not None:
                self.journal.step_ended(self)

    def end_step_at(self, stamp: Any) -> None:
        """End the open step at `stamp` (a timer stamp of this step: where its work ended) instead of when its
        `step()` block exits; regions still open close there too. An integration that learns only at the
        script's end that no more of the step follows uses it: what the script did after its loop (saving,
        logging, DataLoader workers shutting down) is no step's time."""
        if self.log.active:
            self._end_at = stamp

    def _now(self) -> Any:
        """The timer's stamp, or the step's end where end_step_at fixed it."""
        return self.timer.now() if self._end_at is None else self._end_at

    def watch_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Make DDP's gradient all-reduces visible: register DDP's own default Python hook
        (`allreduce_hook`: the same average, through `torch.distributed.all_reduce`, which the Profiler
        records). Call before the first backward; DDP cannot unregister a hook, so it stays after
        close() (same math, a little Python per bucket). DDP waits for these in C++ at the end of
        backward, so that wait shows as backward, not comm_exposed. DDP's forward collectives (buffer
        broadcast, bucket rebuild) are recorded without this call (profiler/comm.py)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp_model.register_comm_hook(None, default_hooks.allreduce_hook)
        self.ddp = True

    def watch_pipeline(self, *, stage: int, num_stages: int, schedule: str, micro_batches: int,
                       prev_rank: int | None, next_rank: int | None) -> None:
        """Profile this rank as one stage of a pipeline: point-to-point ops with `prev_rank` /
        `next_rank` become activation (forward) and gradient (backward) transfers, the time blocked in
        them the `pipeline_bubble` phase; `pipeline_action` marks each micro batch's forward and
        backward for the stage timeline. See trainprof/analysis/pipeline.py."""
        self.pipeline = PipelineInfo(stage=stage, num_stages=num_stages, schedule=schedule,
                                     micro_batches=micro_batches, prev_rank=prev_rank, next_rank=next_rank)

    @contextlib.contextmanager
    def pipeline_action(self, kind: str, micro_batch: int) -> Iterator[None]:
        """One micro batch's forward or backward on this stage: a phase region of that kind and an
        interval of the stage timeline."""
        log = self.log
        if not log.active:
            yield
            return
        log.mark(ACTION_OPEN, (kind, micro_batch), self.timer.now())
        self._region_open(kind)
        try:
            yield
        finally:
            self._region_close(kind)
            log.mark(ACTION_CLOSE, (kind, micro_batch), self.timer.now())
            if kind == "forward" and self._activations is not None:  # a schedule runs several before a backward
                self._activations.forward_done()

    def phase(self, label: str) -> contextlib.AbstractContextManager[None]:
        """Mark a region of the step as a phase: "optimizer" (e.g. around DeepSpeed's engine.step()),
        "backward" (around engine.backward(loss), so ZeRO's post-backward reduction counts as
        backward), "forward", "data_wait" or "other"."""
        if label not in REGION_PHASES:
            raise ValueError(f"phase '{label}' is not one of {', '.join(REGION_PHASES)}")
        return self._phase(label)

    @contextlib.contextmanager
    def _phase(self, label: str) -> Iterator[None]:
        self._region_open(label)
        try:
            yield
        finally:
            self._region_close(label)

    def record(self, *, loss: Any = None, tokens: int | None = None) -> None:
        """Report a micro batch's loss (tensor or float; averaged over the step) and tokens (summed).
        Without tokens, the profiler counts the `input_ids` elements the model saw."""
        if loss is not None:
            self._step_loss.append(loss.detach() if isinstance(loss, torch.Tensor) else float(loss))
        if tokens is not None:
            self._step_tokens = (self._step_tokens or 0) + int(tokens)

    # -- hook callbacks ----------------------------------------------------------------------------

    def _region_open(self, label: str) -> None:
        if not self.log.active:
            return
        if self.hooks is not None:
            if label == "backward":
                self.hooks.flush()  # a backward started inside a profiled forward (see hooks.flush)
            self.hooks.settle()  # e.g. a reentrant checkpoint's backward inside backward
        self.log.mark(REGION_OPEN, label, self.timer.now())
        if self.memory is not None:
            self.memory.begin(label)
        if label == "backward" and self._activations is not None:
            self._activations.backward_begins()
        if label == "optimizer" and self.flops_running:
            self.grads_bytes = max(self.grads_bytes or 0, model_state_bytes(self.model, self.optimizer)["grads"])
            # Adam is elementwise (0 FLOPs by the convention), and a dispatch mode around it would stop
            # torch.compile'd optimizers (torchao's quantized AdamW) from compiling: count outside it.
            self._flop_counter.__exit__(None, None, None)
            self.flops_running = False
        tracing = self.hooks is not None and self.hooks.range_names is not None
        handle = torch.ops.profiler._record_function_enter_new(region_range_name(label), None) if tracing else None
        self._regions.append((label, handle))

    def _region_close(self, label: str) -> None:
        if not self.log.active:
            return
        for i in range(len(self._regions) - 1, -1, -1):
            if self._regions[i][0] == label:
                _, handle = self._regions.pop(i)
                if handle is not None:
                    torch.ops.profiler._record_function_exit._RecordFunction(handle)
                break
        if label == "backward" and self._activations is not None:
            self._activations.backward_ends()
        if label == "optimizer" and self._flop_counter is not None and not self.flops_running:
            self._flop_counter.__enter__()
            self.flops_running = True
        if self.hooks is not None:
            self.hooks.settle()
        if self.memory is not None:  # before the stamp: on CPU its /proc read can block for ms (mmap lock)
            self.memory.end(label)
        self.log.mark(REGION_CLOSE, label, self._now())

    def _on_root(self, phase: str, begin: bool) -> None:
        if begin:
            self.memory.begin(phase)
        else:
            self.memory.end(phase)

    def _comm_module(self) -> tuple[int, str | None]:
        """The module a collective issued now belongs to: its FSDP2 group's module while one issues it,
        else the innermost open module (the comm tracer asks)."""
        if self._comm_owner:
            return self._comm_owner[-1], None
        return self.hooks.current()

    def _where(self) -> tuple[int, str]:
        mi, phase = self.hooks.current()
        if phase is None:
            if torch._C._current_graph_task_id() != -1:
                phase = "backward"
            elif self._regions:
                phase = self._regions[-1][0]
            else:
                phase = "other"
        return mi, phase

    # -- the end of a step: its stamps resolved and kept for the analysis ---------------------------

    def _finish_step(self, index: int, origin: Any, end: Any, *, warm: bool, instrumented: list[str]) -> None:
        log = self.log
        stamps: list[Any] = list(log.stamps)
        for c in log.comms:
            stamps.append(c.issue)
            stamps.append(c.ret)
            for a, b in c.waits:
                stamps.extend((a, b))
            if c.done is not None:
                stamps.append(c.done)
        stamps.append(end)
        resolved = self.timer.resolve(origin, stamps)
        points = len(log.stamps)
        ms = iter(resolved[points:])
        comms = []
        for c in log.comms:
            issue, ret = next(ms), next(ms)
            waits = [(next(ms), next(ms)) for _ in c.waits]
            done = next(ms) if c.done is not None else None
            event = CommEvent(op=c.op, nbytes=c.nbytes, group_size=c.group_size, module=c.module,
                              is_async=c.is_async, issue=issue, ret=ret, waits=waits,
                              total_ms=comm_total_ms(c, issue, ret, waits, done), peer=c.peer)
            role = self.pipeline.classify(c.op, c.peer) if self.pipeline is not None else None
            if role is not None:
                event.phase, event.exposed_as = role
            comms.append(event)
        wall_ms = next(ms)
        self.timer.release()
        # the losses as floats now: a loss tensor kept for later pins its allocation in the middle of the
        # step's freed activations, and on CPU glibc's heap then grows by megabytes a step (fragmentation)
        timeline = StepTimeline(codes=log.codes, subjects=log.subjects, ms=resolved[:points], comms=comms,
                                wall_ms=wall_ms, losses=[float(x) for x in self._step_loss],
                                origin_unix_ns=self._origin_unix_ns, pipelined=self.pipeline is not None)
        record = StepRecord(
            step=index - self.warmup_steps,
            breakdown=None,  # analysed when `steps` is read
            tokens=self._step_tokens if self._step_tokens is not None else (log.tokens_seen or None),
            memory=dict(self.memory.peaks) if self.memory is not None else {},
            instrumented=instrumented,
            warmup=warm,
        )
        self._steps.append(record)
        self._unanalysed.append((record, timeline))
        self.last_timeline = timeline
        if len(self._unanalysed) >= ANALYSE_BACKLOG_STEPS:
            self._analyse_waiting()
        self._seq_len = log.seq_len
        log.clear()

    def _store_flops(self, counter: FlopCounter) -> None:
        by_phase: dict[str, int] = {}
        for (_, phase), n in counter.counts.items():
            by_phase[phase] = by_phase.get(phase, 0) + n
        tokens = self._steps[-1].tokens if self._steps else None
        analytic = analytic_flops(self.model, self._seq_len)
        if analytic is not None and tokens:
            analytic["tokens_per_step"] = tokens
            analytic["flops_per_step"] = analytic["flops_per_token"] * tokens
        self.flops = {
            "total": int(sum(counter.counts.values())),
            "by_phase": by_phase,
            "counts": dict(counter.counts),
            "uncounted": dict(counter.uncounted),
            "analytic": analytic,
            "step": self._steps[-1].step if self._steps else None,
        }

    # -- results -----------------------------------------------------------------------------------

    def env(self) -> dict[str, Any]:
        """The `env` block: library versions, device, world size and the timer used."""
        return profile_env(self)

    def discard_journal(self) -> None:
        """This rank's profile is written (finished or partial): its journal is no longer needed."""
        if self.journal is not None:
            self.journal.discard()

    def rank_result(self) -> dict[str, Any]:
        """This rank's profile (what profile.rank<r>.json holds); no collective."""
        out = rank_profile(self)
        if out["compile"]["compiled"]:  # what the report's model parts need of the modules that have no rows
            out["compile"]["modules_inside"] = self.hooks.modules_inside_regions()
        dynamo = (out.get("compile") or {}).get("dynamo")
        if dynamo and not self.warmup_steps:
            dynamo["source"] += ("; with no warm-up step, during_measured_steps counts from the second measured step "
                                 "(the first one compiles)")
        if self.ops:
            out["ops_info"].update(self._op_tracer.info())
        out.update(telemetry_fields(self.telemetry, self.telemetry_reason))
        out.update(gpu_busy_fields(out))
        return out

    def result(self, *, recipe: dict[str, Any] | None = None, env: dict[str, Any] | None = None,
               engine: dict[str, Any] | None = None, params_of: torch.nn.Module | None = None) -> dict[str, Any]:
        """The profile.json dict. With several ranks this is a collective: every rank must call it,
        and every rank gets the merged profile.

        Args:
            recipe: the resolved recipe (overrides the constructor's).
            env: extra env fields (merged over the profiler's own).
            engine: what the loop ran under, {"kind": ..., "config": ...} (a runner's or an
                integration's); the workload of a run without a recipe reads its ZeRO stage and offload.
            params_of: the module whose parameters the profile counts (default: the profiled model;
                a pipeline stage's runner counts its whole stage).
        """
        from trainprof.analysis.merge import merge_ranks

        if recipe is not None:
            self.recipe = recipe
        if env is not None:
            self.extra_env.update(env)
        local = self.rank_result()
        if self.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * self.world_size
            torch.distributed.all_gather_object(gathered, local)
            merged = merge_ranks(gathered)
        else:
            merged = merge_ranks([local])
        merged["params"] = count_params(params_of if params_of is not None else self.model)
        note_missing_analytic(merged.setdefault("summary", {}), self.model, self._seq_len)
        if engine is not None:
            merged["engine"] = engine
        if self.recipe is None:  # a loop of the user's own: what `trainprof project` rebuilds a recipe from
            engine = engine or {}
            merged["workload"] = self.workload(engine.get("kind", "torch"), engine.get("config"))
        return merged

    def workload(self, framework: str = "torch", engine_config: dict[str, Any] | None = None) -> dict[str, Any]:
        """profile.json's `workload` (profiler/workload.py): the model, task, engine, batch shape and
        compilation this Profiler saw, as recipe keys. `framework` and `engine_config`: what the loop ran
        under (an integration's; "deepspeed" with its config reads the ZeRO stage and offload)."""
        return workload(self.model, framework=framework, engine_config=engine_config, shape=self.batch_shape,
                        compiled=compile_block(self.hooks.compiled if self.hooks is not None else None, self.dynamo))

    def save(self, run_dir: str | Path, *, recipe: dict[str, Any] | None = None,
             env: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write this rank's profile.rank<r>.json; rank 0 also writes the merged profile.json. A
        collective with several ranks. The renderings (summary.md, the CSV tables, report.md/html,
        TensorBoard scalars) are the report layer's: `trainprof report RUN_DIR`, or
        trainprof.report.run_report.write_run_files(profile, run_dir) in place of this call.

        Returns:
            The merged profile.
        """
        from trainprof.errors import UserError
        from trainprof.io import atomic_write_json

        run_dir = Path(run_dir)
        # another run's profile.json there would be replaced and its projections, calibration and traces
        # left beside this one: `trainprof report` would mix the two runs
        if (run_dir / "profile.json").exists() and run_dir.resolve() not in self._saved_to:
            raise UserError(f"'{run_dir}' already holds another run's profile.json; save to a new dir "
                            "(trainprof.layout.new_run_dir(parent, name) makes a timestamped one) or remove it first")
        run_dir.mkdir(parents=True, exist_ok=True)
        self._saved_to.add(run_dir.resolve())
        merged = self.result(recipe=recipe, env=env)
        atomic_write_json(run_dir / f"profile.rank{self.rank}.json", self.rank_result())
        self.discard_journal()
        if self.rank == 0:
            atomic_write_json(run_dir / "profile.json", merged)
        return merged
