"""Call wrappers the Profiler installs while it is open, each undone by the callable it returns:
`torch.autograd.backward` (so the whole backward call is a backward region) and a torch optimizer's
`step` / `zero_grad` (so the whole call, torch's own step wrapper included, is the optimizer phase)."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch

PhaseFn = Callable[[str], contextlib.AbstractContextManager[None]]


def wrap_autograd_backward(phase: PhaseFn, active: Callable[[], bool]) -> Callable[[], None]:
    """Make every `torch.autograd.backward` call (what `loss.backward()` runs) a "backward" region, so
    the engine's start (walking the graph) and its end count as backward, not as gaps.

    Args:
        phase: opens a phase region (Profiler._phase).
        active: whether a step is being recorded.
    Returns:
        A callable that restores the original (if nothing replaced the wrapper since).
    """
    original = torch.autograd.backward

    def backward(*args: Any, **kwargs: Any) -> Any:
        if not active():
            return original(*args, **kwargs)
        with phase("backward"):
            return original(*args, **kwargs)

    backward.__wrapped__ = original  # type: ignore[attr-defined]
    torch.autograd.backward = backward

    def undo() -> None:
        if torch.autograd.backward is backward:
            torch.autograd.backward = original

    return undo


def wrap_optimizer_method(optimizer: torch.optim.Optimizer, method: str, phase: PhaseFn,
                          active: Callable[[], bool]) -> Callable[[], None]:
    """Make `optimizer.<method>()` an "optimizer" region. It is installed as a bound method on the
    instance, so an LR scheduler created later can still wrap it (it needs `step.__func__`).

    Args:
        optimizer: a torch optimizer.
        method: "step" or "zero_grad".
        phase: opens a phase region.
        active: whether a step is being recorded (False after close: a pass-through).
    Returns:
        A callable that removes the wrapper; if something wrapped it since, it stays as a pass-through.
    """
    original = getattr(optimizer, method)
    state = {"on": True}

    def wrapper(opt: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if not (state["on"] and active()):
            return original(*args, **kwargs)
        with phase("optimizer"):
            return original(*args, **kwargs)

    if hasattr(original, "_wrapped_by_lr_sched"):  # an LR scheduler wrapped it first: keep its mark, or
        wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # it warns of a misordered step()
    bound = types.MethodType(wrapper, optimizer)
    setattr(optimizer, method, bound)

    def undo() -> None:
        state["on"] = False
        if optimizer.__dict__.get(method) is bound:
            del optimizer.__dict__[method]

    return undo
