"""`TrainprofCallback` for Lightning (`lightning.pytorch`, or the older `pytorch_lightning`): one
optimizer step (all its `accumulate_grad_batches` micro batches) is one profiled step. Lightning runs
forward and backward inside `optimizer.step(closure)`, so the optimizer's step() is not hooked (its
states are still measured): the optimizer phase runs from `on_before_optimizer_step` (the closure is
done) to `on_before_zero_grad` (or the end of the batch). Time between batches (the dataloader's next())
is data wait; Lightning's own code inside a step is "other". A LightningModule that holds an HF model
is profiled as that model (see `profiled_model`), as the HF Trainer's callback profiles it.

    trainer = L.Trainer(max_steps=100, callbacks=[TrainprofCallback(output_dir="runs")])
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from trainprof.integrations.session import DEFAULT_MODULE_DEPTH, DEFAULT_WARMUP_STEPS, ProfileSession


# trainer.fit(torch.compile(module)): Lightning's `from_compiled` replaces the module's training_step by a compiled
# one, a region that is no module call: trainprof cannot time it from outside, and hooks inside it are traced by dynamo
WHOLE_MODULE_COMPILED = (
    "its LightningModule was torch.compile'd whole (trainer.fit(torch.compile(module))), so Lightning runs its "
    "training_step compiled and trainprof's module hooks would run inside the compiled graph (dynamo would recompile "
    "it on every call); compile the model it holds instead (self.model = torch.compile(self.model)), which trainprof "
    "times as one compiled region")


class TrainprofCallback(Callback):
    """Profile a Lightning Trainer's optimizer steps; the run dir is written in `on_train_end` (on
    every rank: a collective; rank 0 writes profile.json, tables, report and TensorBoard scalars).

    Args:
        output_dir: run dirs go to <output_dir>/<name>-<UTC timestamp>/ (default $TRAINPROF_OUTPUT_DIR or runs/).
        name: run name (default "lightning").
        warmup_steps: leading optimizer steps not measured.
        module_depth: deepest module level timed (0 = `profiled_model(pl_module)`).
        ops: trace operators on the first measured step (ops.csv, and a trace for `trainprof tb`).
        session: an existing session to drive (what `trainprof.wrap` passes).
    """

    def __init__(self, output_dir: str | Path | None = None, *, name: str = "lightning",
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, module_depth: int = DEFAULT_MODULE_DEPTH,
                 ops: bool = False, session: ProfileSession | None = None) -> None:
        self.session = session or ProfileSession(output_dir, name=name, warmup_steps=warmup_steps,
                                                 module_depth=module_depth, framework="lightning", ops=ops)
        self.run_dir: Path | None = None
        self._optimizer_phase = None
        self._stepped = False
        self._batch_end = None  # stamp of the last micro batch's end inside a step

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        import torch

        if getattr(pl_module, "_compiler_ctx", None) is not None:
            print(f"trainprof: this Lightning run is not profiled: {WHOLE_MODULE_COMPILED}", file=sys.stderr)
            return
        optimizers = trainer.optimizers
        optimizer = optimizers[0] if len(optimizers) == 1 else list(optimizers)  # several: states of all
        # optimizer.step(closure) holds forward and backward: its step is not timed, its states are measured
        self.session.attach(profiled_model(pl_module), optimizer, time_optimizer=False)
        ddp = getattr(trainer.strategy, "model", None)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and self.session.prof.hooks is not None:
            self.session.prof.watch_ddp(ddp)  # DDP's gradient all-reduces through torch.distributed: recorded
        self.session.engine_config = {
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            "strategy": type(trainer.strategy).__name__,
            "precision": str(trainer.precision),
            "world_size": trainer.world_size,
        }

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.session.in_step:  # a later micro batch: its fetch was data wait
            if self._batch_end is not None:
                self.session.mark_data_wait(self._batch_end)
        else:
            self.session.begin_step()
        self._stepped = False
        self.session.record(tokens=_tokens_of_batch(batch))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.session.in_step and self._optimizer_phase is None:
            self._optimizer_phase = self.session.phase("optimizer")
            self._optimizer_phase.__enter__()
        self._stepped = True

    def on_before_zero_grad(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._close_optimizer_phase()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.session.record(loss=_step_loss(trainer, pl_module, outputs))
        self._close_optimizer_phase()
        if self._stepped:
            self.session.end_step()
            self._batch_end = None
        else:
            self._batch_end = self.session.now()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close_optimizer_phase()
        self.run_dir = self.session.finish_at_end()

    def _close_optimizer_phase(self) -> None:
        if self._optimizer_phase is not None:
            phase, self._optimizer_phase = self._optimizer_phase, None
            phase.__exit__(None, None, None)


def profiled_model(pl_module: Any) -> Any:
    """The module profiled as depth 0: the model the LightningModule holds, else the LightningModule.

    It holds one when exactly one direct child holds parameters, that child holds all of them (the
    LightningModule has none of its own) and it has a `config` (an HF PreTrainedModel, a peft or
    torch.compile wrapper of one): then module names, module depth, analytic FLOPs and `trainprof
    project` read as for the same model under the HF Trainer, and training_step's code around the call
    is "other". Any other layout (a frozen teacher beside the student, a head outside the backbone, a
    ModuleList the LightningModule loops over) keeps the LightningModule as depth 0.
    """
    holders = [child for child in pl_module.children() if next(child.parameters(), None) is not None]
    if len(holders) != 1 or next(pl_module.parameters(recurse=False), None) is not None:
        return pl_module
    (model,) = holders
    return model if getattr(model, "config", None) is not None else pl_module


def _step_loss(trainer: Any, pl_module: Any, outputs: Any) -> Any:
    """A micro batch's loss as training_step returned it (None when it returned none), read from the
    batch's outputs: the loss `on_before_backward` sees is AMP's scaled one. Under automatic optimization
    Lightning divides it by `accumulate_grad_batches`: multiplied back, so the mean over the step's micro
    batches is the step's loss (as the HF callback undoes the Trainer's division)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if loss is None or not pl_module.automatic_optimization:
        return loss
    return loss.detach() * trainer.accumulate_grad_batches


def _tokens_of_batch(batch: Any) -> int | None:
    """Tokens in a batch: its `input_ids` (a dict or object field), or the batch itself when it is an
    integer tensor of token ids, or the first such tensor of a tuple; None when none is found."""
    import torch

    if isinstance(batch, dict):
        batch = batch.get("input_ids")
    elif isinstance(batch, (list, tuple)) and batch:
        batch = batch[0]
    elif hasattr(batch, "input_ids"):
        batch = batch.input_ids
    if isinstance(batch, torch.Tensor) and not batch.is_floating_point():
        return int(batch.numel())
    return None
