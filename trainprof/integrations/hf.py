"""`TrainprofCallback` for the HuggingFace `transformers.Trainer`: one optimizer step (all its
gradient-accumulation micro batches) is one profiled step; the time between one step's end and the
next step's begin (where the Trainer fetches the step's batches) is data wait; the Trainer's own code
inside a step (gradient clipping, LR scheduler, callbacks) is the "other" phase. With the Trainer's
DeepSpeed integration under `python -m trainprof.wrap`, the engine's backward and step are phases too.
With `TrainingArguments(torch_compile=True)` the Trainer (through Accelerate) calls a torch.compile'd form
of its model: that is what is profiled, as compiled regions (profiler/compiled.py), not the model inside it.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[TrainprofCallback(output_dir="runs")])
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainprof.integrations.session import DEFAULT_MODULE_DEPTH, DEFAULT_WARMUP_STEPS, ProfileSession


class TrainprofCallback(TrainerCallback):
    """Profile a Trainer's optimizer steps; the run dir is written at the end of training (on every
    rank: a collective; rank 0 writes profile.json, tables, report and TensorBoard scalars).

    Args:
        output_dir: run dirs go to <output_dir>/<name>-<UTC timestamp>/ (default $TRAINPROF_OUTPUT_DIR or runs/).
        name: run name (default "hf-trainer").
        warmup_steps: leading optimizer steps not measured.
        module_depth: deepest module level timed (0 = the Trainer's model).
        ops: trace operators on the first measured step (ops.csv, and a trace for `trainprof tb`).
        session: an existing session to drive (what `trainprof.wrap` passes).
    """

    def __init__(self, output_dir: str | Path | None = None, *, name: str = "hf-trainer",
                 warmup_steps: int = DEFAULT_WARMUP_STEPS, module_depth: int = DEFAULT_MODULE_DEPTH,
                 ops: bool = False, session: ProfileSession | None = None) -> None:
        self.session = session or ProfileSession(output_dir, name=name, warmup_steps=warmup_steps,
                                                 module_depth=module_depth, framework="hf", ops=ops)
        self.run_dir: Path | None = None
        self._hook = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        from trainprof.integrations.deepspeed import engine_session_for

        engine_session = engine_session_for(model)
        if engine_session is not None:  # the Trainer built a DeepSpeed engine that trainprof.wrap instrumented
            engine_session.name, engine_session.framework = self.session.name, "hf+deepspeed"
            engine_session.loop_code_as_other = True
            self.session = engine_session
        else:
            model, why_not = model_the_trainer_calls(model, args)
            if model is None:
                print(f"trainprof: this HF Trainer's run is not profiled: {why_not}", file=sys.stderr)
                return
            self.session.attach(model, optimizer)
        self.session.engine_config = self.session.engine_config or {
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "per_device_train_batch_size": args.per_device_train_batch_size,
            "dataloader_num_workers": args.dataloader_num_workers,
            "dataloader_pin_memory": args.dataloader_pin_memory,
        }
        # the Trainer divides each micro batch's loss by the tokens of the whole step, summed over ranks when
        # average_tokens_across_devices (it multiplies the world size back in compute_loss): undo both
        ranks = args.world_size if getattr(args, "average_tokens_across_devices", False) and args.world_size > 1 else 1
        self._loss_scale = args.gradient_accumulation_steps * ranks
        self._hook = model.register_forward_hook(self._record_loss, with_kwargs=True)

    def _record_loss(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        from trainprof.integrations.deepspeed import _loss_of

        loss = _loss_of(output)
        if loss is not None and kwargs.get("num_items_in_batch") is not None:
            loss = loss.detach() * self._loss_scale  # the mean over micro batches is then the step's loss
        self.session.record(loss=loss)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.begin_step()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.session.end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.run_dir = self.session.finish_at_end()


def model_the_trainer_calls(model: Any, args: Any) -> tuple[Any, str | None]:
    """The module to profile as depth 0, or (None, why not). The Trainer's `model`, unless the Trainer runs it
    torch.compile'd (`TrainingArguments(torch_compile=True)`: Accelerate wraps it in `torch.compile`): then
    hooks on `model` would run inside the compiled graph (dynamo traces them and recompiles each call), so the
    wrapper the Trainer calls (its `model_wrapped`) is profiled, as compiled regions (profiler/compiled.py)."""
    from trainprof.profiler.compiled import CompiledModules

    wrapped = getattr(_calling_trainer(), "model_wrapped", None)
    if wrapped is None:
        if getattr(args, "torch_compile", False):
            return None, ("it runs its model torch.compile'd (TrainingArguments.torch_compile) and the compiled "
                          "module it calls was not found; hooks on the model would run inside the compiled graph")
        return model, None
    if wrapped is model or CompiledModules.find(model).compiled:  # not compiled, or by the script itself
        return model, None
    if not CompiledModules.find(wrapped).compiled:  # DDP, or no wrapper at all
        return model, None
    # torch.compile(model) (or of the DDP around it): one region; Accelerate's regional compilation
    # (ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION): a copy of the model whose blocks are compiled, each a region
    return wrapped, None


def _calling_trainer() -> Any:
    """The transformers.Trainer whose callback handler runs this callback (callbacks are given its model and
    optimizer, not the Trainer): the nearest Trainer method up the call stack."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            return owner
        frame = frame.f_back
    return None
