"""HF Accelerate scripts profiled without edits: `Accelerator.prepare` is patched (by `trainprof.wrap`) so
that the model and optimizer it returns are profiled, one optimizer step (all its `accumulate` micro
batches) being one profiled step.

Steps are marked as in any loop trainprof does not drive (integrations/loop.py, `LoopRun`): the inner
torch optimizer's step says the update ran (AcceleratedOptimizer skips it on accumulating micro batches),
and the step ends at the next batch fetched from a prepared DataLoader, else at the next forward, else
at its last region when the script ends first; a forward with grad disabled (evaluation) begins no step.
Accelerate's own code inside a step is the "other" phase; DDP's gradient all-reduce is recorded.

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

from trainprof.integrations.deepspeed import engine_session_for
from trainprof.integrations.loop import LoopRun, patch_method
from trainprof.integrations.session import ProfileSession

OWNED_MARK = "_trainprof_owner"  # set on an Accelerator that another integration (the HF Trainer) profiles


class AccelerateRun(LoopRun):
    """The profiled training of one Accelerator: collects what `prepare` returned and drives a session
    (integrations/loop.py)."""

    def __init__(self, session: ProfileSession) -> None:
        super().__init__(session)
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
            engine = engine_session_for(self.model, keep_driving=True)
            if engine is not None:  # the DeepSpeed plugin: the engine's own session profiles it
                engine.name, engine.framework = self.session.name, "accelerate+deepspeed"
                engine.loop_code_as_other = True  # Accelerate's code around the engine's calls is "other"
                return
            self.attach(self.model, self.optimizer, self.config)


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

    undo = [patch_method(accelerate.Accelerator, "prepare", lambda original: _reporting_prepare(original, make_run))]
    for cls in (data_loader.DataLoaderShard, data_loader.DataLoaderDispatcher):
        undo.append(patch_method(cls, "__iter__", _timed_iter))
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
