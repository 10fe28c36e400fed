"""HF Accelerate scripts profiled without edits: `Accelerator.prepare` is patched (by `trainprof.wrap`) so
that the model and optimizer it returns are profiled, one optimizer step (all its `accumulate` micro
batches) being one profiled step.

What marks a step: the inner torch optimizer's step (a step post hook: AcceleratedOptimizer skips it
on accumulating micro batches) says the step's update ran; the step then ends where the loop goes on:
at the next batch fetched from a prepared DataLoader (so `scheduler.step()` and `zero_grad()` after
the update stay in the step), or at the next forward when the loop feeds its own batches, or when the
script ends. The next forward begins the next step; the time between (the batch fetch) is data wait, and
a later micro batch's fetch inside a step is data wait too. Accelerate's own code inside a step is the
"other" phase. DDP's gradient all-reduce is recorded (the Profiler's `watch_ddp`).

DeepSpeed plugin: Accelerate builds the engine with `deepspeed.initialize`, which `trainprof.wrap`
instruments (integrations/deepspeed.py: forward, backward and the engine's step are phases, the engine
marks the steps); that session is kept and named "accelerate+deepspeed". Accelerate's FSDP plugin only
applies to GPU-type distributed setups (on CPU it trains with DDP or alone), so on CPU it is profiled as
what it runs. An Accelerator that the HF Trainer owns is skipped: the Trainer callback profiles it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from trainprof.integrations.deepspeed import _loss_of, engine_session_for
from trainprof.integrations.session import ProfileSession

OWNED_MARK = "_trainprof_owner"  # set on an Accelerator that another integration (the HF Trainer) profiles


class AccelerateRun:
    """The profiled training of one Accelerator: collects what `prepare` returned and drives a session."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.stepped = False  # the current step's optimizer update ran
        self.fetch: tuple[Any, Any] | None = None  # (start, end) stamps of the last batch fetch
        self.config: dict[str, Any] = {}

    def prepared(self, accelerator: Any, objects: list[Any]) -> None:
        """Take note of one `prepare` call's outputs; attach once a model and an optimizer are known."""
        self.config = accelerator_config(accelerator)
        for obj in objects:
            if self.model is None and isinstance(obj, torch.nn.Module):
                self.model = obj
            elif self.optimizer is None and isinstance(obj, torch.optim.Optimizer):
                self.optimizer = obj
            elif isinstance(obj, torch.utils.data.DataLoader):
                obj._trainprof_run = self  # its class's __iter__, patched by patch_prepare, times its fetches
        if self.model is not None and self.optimizer is not None and self.session.prof is None:
            self._attach()

    def _attach(self) -> None:
        engine = engine_session_for(self.model, keep_driving=True)
        if engine is not None:  # the DeepSpeed plugin: the engine's own session profiles it
            engine.name, engine.framework = self.session.name, "accelerate+deepspeed"
            engine.loop_code_as_other = True  # Accelerate's code around the engine's calls is "other"
            return
        self.session.attach(self.model, self.optimizer)
        prof = self.session.prof
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) and prof.hooks is not None:
            prof.watch_ddp(self.model)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # AcceleratedOptimizer wraps the torch one
        inner.register_step_post_hook(self._on_update)
        self.model.register_forward_pre_hook(self._on_forward, prepend=True)
        self.model.register_forward_hook(self._on_output)
        self.session.engine_config = {**self.config, "model": type(self.model).__name__,
                                      "optimizer": type(self.optimizer).__name__}

    def _on_update(self, *args: Any) -> None:
        self.stepped = True
        self.session.open_step_updated = True  # a step still open when the script ends is a whole one

    def _step_over(self) -> None:
        """End the step whose update ran (the loop has gone on to the next batch)."""
        if self.stepped:
            self.stepped = False
            self.session.end_step()

    def _on_forward(self, module: Any, args: Any) -> None:
        self._step_over()
        if not self.session.in_step:
            self.session.begin_step()
        elif self.fetch is not None:  # a later micro batch of the step: its fetch was data wait
            self.session.mark_data_wait(self.fetch[0])
        self.fetch = None

    def _on_output(self, module: Any, args: Any, output: Any) -> None:
        self.session.record(loss=_loss_of(output))

    def timed_batches(self, batches: Any) -> Any:
        """Yield a prepared DataLoader's batches, stamping each fetch (see `patch_prepare`)."""
        it = iter(batches)
        while True:
            if self.session.prof is not None:
                self._step_over()  # the loop went on to its next batch: the step whose update ran is over
            start = self.session.now()
            try:
                batch = next(it)
            except StopIteration:
                return
            self.fetch = (start, self.session.now()) if start is not None else None
            yield batch


def accelerator_config(accelerator: Any) -> dict[str, Any]:
    """What the Accelerator was set up as: profile.json's engine.config for an Accelerate run."""
    state = getattr(accelerator, "state", None)
    return {
        "distributed_type": str(getattr(accelerator, "distributed_type", None)),
        "num_processes": getattr(accelerator, "num_processes", None),
        "gradient_accumulation_steps": getattr(accelerator, "gradient_accumulation_steps", None),
        "mixed_precision": getattr(state, "mixed_precision", None),
    }


def patch_prepare(accelerate: Any, make_run: Callable[[], AccelerateRun]) -> Callable[[], None]:
    """Make `Accelerator.prepare` report its outputs to one AccelerateRun per Accelerator (made by
    `make_run`), except for Accelerators marked as owned by another integration, and make the prepared
    DataLoaders (DataLoaderShard, DataLoaderDispatcher: `iter()` looks `__iter__` up on the class, and
    they hide theirs behind a `__class__` property) time their fetches for the run that prepared them.

    Args:
        accelerate: the `accelerate.accelerator` module.
        make_run: a new AccelerateRun (with its session).
    Returns:
        A callable that restores what was patched.
    """
    from accelerate import data_loader

    undo = [_patch(accelerate.Accelerator, "prepare", lambda original: _reporting_prepare(original, make_run))]
    for cls in (data_loader.DataLoaderShard, data_loader.DataLoaderDispatcher):
        undo.append(_patch(cls, "__iter__", _timed_iter))
    return lambda: [u() for u in reversed(undo)]


def _reporting_prepare(original: Callable[..., Any], make_run: Callable[[], AccelerateRun]) -> Callable[..., Any]:
    @functools.wraps(original)
    def prepare(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if getattr(self, OWNED_MARK, None) is None:
            run = self.__dict__.get("_trainprof_run")
            if run is None:
                run = self._trainprof_run = make_run()
            run.prepared(self, list(out) if isinstance(out, tuple) else [out])
        return out

    return prepare


def _timed_iter(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __iter__(self: Any) -> Any:
        run = self.__dict__.get("_trainprof_run")
        return original(self) if run is None else run.timed_batches(original(self))

    return __iter__


def _patch(owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    original = owner.__dict__[name]
    wrapped = wrap(original)
    setattr(owner, name, wrapped)

    def undo() -> None:
        if owner.__dict__.get(name) is wrapped:
            setattr(owner, name, original)

    return undo
