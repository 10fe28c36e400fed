"""DeepSpeed engines profiled without touching the loop: `instrument_engine` wraps an engine's
forward / backward / step so that forward, backward (ZeRO's post-backward reduction included) and
optimizer are phases and one optimizer step (all its gradient-accumulation micro steps) is one profiled
step. The loop's own time between an engine.step() and the next forward (where a loop fetches its
next batch) is data wait; an evaluation forward (grad disabled) is no step's work. `patch_initialize`
instruments every engine `deepspeed.initialize` returns."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from trainprof.integrations.session import ProfileSession


def instrument_engine(engine: Any, session: ProfileSession, *, drive_steps: bool = True) -> Callable[[], None]:
    """Profile a DeepSpeedEngine through `session` (attached to engine.module).

    Args:
        engine: what deepspeed.initialize returned first.
        session: the session to attach and drive.
        drive_steps: the engine's first forward after an optimizer step begins a profiled step and the
            step() at the gradient-accumulation boundary ends it. False when a framework callback (HF
            Trainer) marks the steps itself: only the backward / optimizer phases are added.
    Returns:
        A callable that restores the engine's methods.
    """
    session.attach(engine.module, engine.optimizer)
    session.engine_config = _json_config(engine)
    originals = {name: getattr(engine, name) for name in ("forward", "backward", "step")}
    state: dict[str, Any] = {"drive": drive_steps, "micro_end": None}
    engine._trainprof_session = session
    engine._trainprof_state = state

    @functools.wraps(originals["forward"])
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # an evaluation forward: no training step's work, nor its tokens
            out = originals["forward"](*args, **kwargs)
            if state["drive"]:
                session.not_data_wait()  # nor the next step's data wait
            return out
        if state["drive"]:
            if session.in_step and state["micro_end"] is not None:
                session.mark_data_wait(state["micro_end"])  # the loop fetched this micro batch
            state["micro_end"] = None
            session.begin_step()  # no-op inside a step (later micro batches)
        with session.phase("forward"):  # the engine's own forward work around the module's
            out = originals["forward"](*args, **kwargs)
            if state["drive"]:
                session.record(loss=_loss_of(out), tokens=_tokens_of(args, kwargs))
        return out

    @functools.wraps(originals["backward"])
    def backward(*args: Any, **kwargs: Any) -> Any:
        with session.phase("backward"):
            return originals["backward"](*args, **kwargs)

    @functools.wraps(originals["step"])
    def step(*args: Any, **kwargs: Any) -> Any:
        with session.phase("optimizer"):
            boundary = engine.is_gradient_accumulation_boundary()  # before step(): it advances micro_steps
            out = originals["step"](*args, **kwargs)
        if boundary and state["drive"]:
            session.end_step()
        elif state["drive"]:
            state["micro_end"] = session.last_stamp()  # where the optimizer region closed
        return out

    engine.forward, engine.backward, engine.step = forward, backward, step

    def undo() -> None:
        for name, fn in originals.items():
            setattr(engine, name, fn)

    return undo


def engine_session_for(module: Any, *, keep_driving: bool = False) -> ProfileSession | None:
    """The session of an instrumented engine whose module is `module` (None if there is none). Unless
    `keep_driving`, the session stops driving steps: the caller (a framework callback) marks them."""
    for engine, session in list(_INSTRUMENTED):
        if module is not None and (engine.module is module or engine is module):
            engine._trainprof_state["drive"] = keep_driving
            return session
    return None


_INSTRUMENTED: list[tuple[Any, ProfileSession]] = []  # filled by patch_initialize at run time


def patch_initialize(make_session: Callable[[], ProfileSession], sessions: list[ProfileSession]) -> Callable[[], None]:
    """Make `deepspeed.initialize` instrument each engine it returns with a new session (appended to
    `sessions`, which the caller finishes). Returns a callable that restores deepspeed.initialize."""
    import deepspeed

    original = deepspeed.initialize

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        engine = out[0] if isinstance(out, tuple) else out
        if not hasattr(engine, "_trainprof_session"):
            session = make_session()
            instrument_engine(engine, session)
            sessions.append(session)
            _INSTRUMENTED.append((engine, session))
        return out

    deepspeed.initialize = initialize

    def undo() -> None:
        if deepspeed.initialize is initialize:
            deepspeed.initialize = original

    return undo


def _json_config(engine: Any) -> dict[str, Any] | None:
    import json

    cfg = getattr(getattr(engine, "_config", None), "_param_dict", None)
    try:
        return json.loads(json.dumps(cfg, default=str)) if cfg is not None else None
    except (TypeError, ValueError):
        return None


def _loss_of(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _tokens_of(args: tuple, kwargs: dict) -> int | None:
    import torch

    for value in (kwargs.get("input_ids"), *(args[:1])):
        if isinstance(value, dict):
            value = value.get("input_ids")
        if isinstance(value, torch.Tensor):
            return int(value.numel())
    return None
