"""`LoopRun`: one profiled training loop that trainprof does not drive, given its model and optimizer
(Accelerate's prepared pair, or what `trainprof.wrap` found in a plain PyTorch loop).

What marks a step: the torch optimizer's step (a step post hook) says the step's update ran; the step
then ends where the loop goes on: at the next batch fetch that the run times (so `scheduler.step()` and
`zero_grad()` after the update stay in the step), or at the next forward of the model; when the script
ends first, at its last region (the update, or `zero_grad` after it), so the script's tail is no step's.
The next forward begins the next step; the time between (the batch fetch) is data wait, and a later
micro batch's fetch inside a step is data wait too. The loop's own code inside a step is the "other"
phase. DDP's gradient all-reduce is recorded (the Profiler's `watch_ddp`).

Evaluation: a forward with grad disabled (`torch.no_grad()`, `inference_mode`) trains nothing. It ends a
step whose update ran, as any forward does, but begins none, and its loss and tokens are not recorded;
between two steps its time is the next step's data wait (the time since the last step ended), inside a
step its module times are forward.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from trainprof.integrations.deepspeed import _loss_of
from trainprof.integrations.session import ProfileSession


class LoopRun:
    """Drives a session from hooks on one model and its optimizer: one optimizer step (all its micro
    batches) is one profiled step."""

    def __init__(self, session: ProfileSession) -> None:
        self.session = session
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None
        self.stepped = False  # the current step's optimizer update ran
        self.fetch: tuple[Any, Any] | None = None  # (start, end) stamps of the last batch fetch
        self.evaluating = False  # the model's forward in progress runs with grad disabled

    def attach(self, model: torch.nn.Module, optimizer: Any, config: dict[str, Any]) -> None:
        """Profile `model` (the module the loop calls) and `optimizer` (a torch optimizer, or a wrapper
        of one in `.optimizer`); `config` goes to profile.json's engine.config."""
        self.model, self.optimizer = model, optimizer
        self.session.attach(model, optimizer)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel) and self.session.prof.hooks is not None:
            if not getattr(model, "_comm_hooks", None):  # DDP takes one comm hook: a script's own is kept
                self.session.prof.watch_ddp(model)
        inner = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer wraps the torch one
        inner.register_step_post_hook(self._on_update)
        model.register_forward_pre_hook(self._on_forward, prepend=True)
        model.register_forward_hook(self._on_output)
        self.session.engine_config = {**config, "model": type(model).__name__,
                                      "optimizer": type(optimizer).__name__}

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
        self.evaluating = not torch.is_grad_enabled()
        if not self.session.in_step:
            if not self.evaluating:
                self.session.begin_step()
        elif self.fetch is not None:  # a later micro batch of the step: its fetch was data wait
            self.session.mark_data_wait(self.fetch[0])
        self.fetch = None

    def _on_output(self, module: Any, args: Any, output: Any) -> None:
        if not self.evaluating:  # an evaluation forward's tokens the Profiler's hooks did not count either
            self.session.record(loss=_loss_of(output))

    def timed_fetch(self, fetch: Callable[[], Any]) -> Any:
        """`fetch()` (the loop's next batch), stamped: the step whose update ran is over, and a later
        micro batch's fetch is the step's data wait. StopIteration passes through."""
        if self.session.prof is not None:
            self._step_over()  # the loop went on to its next batch: the step whose update ran is over
        start = self.session.now()
        batch = fetch()
        self.fetch = (start, self.session.now()) if start is not None else None
        return batch

    def timed_batches(self, batches: Any) -> Iterator[Any]:
        """Yield the batches of `batches`, each fetch stamped (`timed_fetch`)."""
        it = iter(batches)
        while True:
            try:
                batch = self.timed_fetch(lambda: next(it))
            except StopIteration:
                return
            yield batch


def patch_method(owner: type, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace `owner.name` (defined on `owner` itself) by `wrap(original)`; returns a callable that puts
    the original back, unless something replaced the wrapper since."""
    original = owner.__dict__[name]
    wrapped = wrap(original)
    setattr(owner, name, wrapped)

    def undo() -> None:
        if owner.__dict__.get(name) is wrapped:
            setattr(owner, name, original)

    return undo
