"""Plain PyTorch training loops profiled without edits (`trainprof.wrap`): a script that builds an
nn.Module (DDP-wrapped, torch.compile'd or FSDP2-sharded alike) and a torch.optim optimizer and loops
forward, backward, `optimizer.step()`, through no framework that wrap patches.

Finding the loop: until the first optimizer step, torch's global hooks watch every module call and
every optimizer step. A module whose forward runs while no other module's forward is in progress is
one of the loop's roots (what the loop calls). At the first optimizer step, the root holding most of
the stepped optimizer's parameters is the model; it and that optimizer are profiled as any loop
trainprof does not drive (integrations/loop.py), and the global hooks go (they cost a Python call on
every module's forward). That first step is not profiled, as if a warm-up: the next forward begins the
first profiled step, and wrap's --warmup-steps count from there. Left alone: a script that another
integration profiles (DeepSpeed, HF Trainer, Lightning, Accelerate all make their session before the
first step), one that profiles the model with trainprof.Profiler itself, and one whose first stepped
optimizer holds no parameter of a called module.

Data wait: every torch DataLoader iterator's fetch is timed (`_BaseDataLoaderIter.__next__`, patched
when the run attaches, so the iterator a loop made before its first step is timed too). Loss: the model
output's loss where it has one (an HF model given labels), else the scalar that `backward()` ran on
(divided by the accumulation steps, where the loop divides it).
"""

from __future__ import annotations

import functools
import re
import sys
import warnings
from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data.dataloader import _BaseDataLoaderIter

from trainprof.integrations.deepspeed import _loss_of
from trainprof.integrations.loop import LoopRun, patch_method
from trainprof.integrations.session import ProfileSession


class PlainLoopRun(LoopRun):
    """A LoopRun that also times DataLoader fetches and takes the loss from `backward()` where the
    model's output has none (a plain loop computes its loss outside the model)."""

    def __init__(self, session: ProfileSession) -> None:
        super().__init__(session)
        self._output_loss = False  # the latest forward's output carried the loss
        self.undo: list[Callable[[], None]] = []

    def attach(self, model: torch.nn.Module, optimizer: Any, config: dict[str, Any]) -> None:
        # beneath the Profiler's own wrapper of torch.autograd.backward, so that each undo finds its own on top
        self.undo.append(self._record_backward_loss())
        super().attach(model, optimizer, config)
        self.undo.append(patch_method(_BaseDataLoaderIter, "__next__", self._timed_next))

    def close(self) -> None:
        """Undo the patches, newest first (after the session's Profiler has closed)."""
        while self.undo:
            self.undo.pop()()

    def _on_output(self, module: Any, args: Any, output: Any) -> None:
        if self.evaluating:
            return
        loss = _loss_of(output)
        self._output_loss = loss is not None
        self.session.record(loss=loss)

    def _timed_next(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def __next__(iterator: Any) -> Any:
            if self.session.finished:
                return original(iterator)
            return self.timed_fetch(lambda: original(iterator))

        return __next__

    def _record_backward_loss(self) -> Callable[[], None]:
        """Wrap `torch.autograd.backward` (what `loss.backward()` calls) to record its scalar as the
        micro batch's loss; returns the undo."""
        original = torch.autograd.backward

        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._output_loss and isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
                self.session.record(loss=tensors)
            return original(tensors, *args, **kwargs)

        torch.autograd.backward = backward

        def undo() -> None:
            if torch.autograd.backward is backward:
                torch.autograd.backward = original

        return undo


class PlainLoopWatch:
    """The global hooks that find a plain loop's model and optimizer at its first optimizer step.

    Args:
        make_session: a new session, made only when a loop is found (framework "torch").
        claimed: whether another integration already profiles this script.
        leave_alone: called when the model carries the script's own trainprof.Profiler (after a line on stderr).
    """

    def __init__(self, make_session: Callable[[], ProfileSession], claimed: Callable[[], bool],
                 leave_alone: Callable[[], None] = lambda: None) -> None:
        self.make_session, self.claimed, self.leave_alone = make_session, claimed, leave_alone
        self.roots: dict[int, torch.nn.Module] = {}  # id -> module, in the order first called
        self.depth = 0  # module forwards in progress
        self.decided = False
        self.run: PlainLoopRun | None = None
        self._pre_handle = register_module_forward_pre_hook(self._pre)
        self._post_handle = register_module_forward_hook(self._post, always_call=True)
        self._step_handle = register_optimizer_step_post_hook(self._stepped)
        self._loud = _quiet_compile_warning()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if self.decided or self.claimed():
            self._remove_hooks()
            return
        if self.depth == 0:
            self.roots.setdefault(id(module), module)
        self.depth += 1

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.depth = max(0, self.depth - 1)

    def _stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.decided:
            return
        self.decided = True  # the optimizer's hooks are being iterated: the next module forward removes them
        self._post_handle.remove()
        roots, self.roots = list(self.roots.values()), {}
        if self.claimed():
            return
        model = model_of(roots, optimizer)
        if model is None:
            return
        if profiled_by_the_script(model):
            print("trainprof wrap: the script profiles its model with trainprof.Profiler itself; wrap adds none",
                  file=sys.stderr)
            self.leave_alone()
            return
        self.run = PlainLoopRun(self.make_session())
        self.run.attach(model, optimizer, {"world_size": _world_size()})
        self.run.stepped = True  # this step's update ran: the next batch or forward goes on from it
        self.run.session.updates_unprofiled = 1  # this one, which found the loop

    def _remove_hooks(self) -> None:
        for handle in (self._pre_handle, self._post_handle, self._step_handle):
            handle.remove()
        self.roots = {}
        self._loud()

    def close(self) -> None:
        """Remove the global hooks and what the run patched (idempotent)."""
        self.decided = True
        self._remove_hooks()
        if self.run is not None:
            self.run.close()


def model_of(roots: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> torch.nn.Module | None:
    """The root holding most of the optimizer's parameters (by elements; the first called on a tie), or
    None when no root holds any."""
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    best, most = None, 0
    for root in roots:
        held = sum(p.numel() for p in root.parameters() if id(p) in stepped)
        if held > most:
            best, most = root, held
    return best


def profiled_by_the_script(model: torch.nn.Module) -> bool:
    """Whether a trainprof.Profiler of the script's own is on `model` (two would time each other's hooks)."""
    from trainprof.profiler.hooks import ModuleHooks

    for hook in model._forward_pre_hooks.values():
        if isinstance(getattr(getattr(hook, "func", hook), "__self__", None), ModuleHooks):
            return True
    return False


COMPILE_WARNING = "Using `torch.compile(module)` when there are global hooks on modules"


def _quiet_compile_warning() -> Callable[[], None]:
    """Silence the warning a torch.compile'd module gives while global module hooks exist (that they fire
    once more, for its wrapper): true of the watch's hooks and handled (the wrapper is the root), so not
    the script's news. Returns the undo, which leaves the warning to global hooks of the script's own."""
    warnings.filterwarnings("ignore", message=re.escape(COMPILE_WARNING), category=UserWarning)
    entry = warnings.filters[0]

    def undo() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
            getattr(warnings, "_filters_mutated", lambda: None)()  # the warnings cache, as filterwarnings does

    return undo


def _world_size() -> int:
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    return torch.distributed.get_world_size() if dist else 1


def watch_plain_loop(make_session: Callable[[], ProfileSession], claimed: Callable[[], bool],
                     leave_alone: Callable[[], None]) -> Callable[[], None]:
    """Install the global hooks that find and profile a plain loop (see the module docstring and
    PlainLoopWatch's arguments); returns a callable that removes them and restores what the run patched."""
    return PlainLoopWatch(make_session, claimed, leave_alone).close
