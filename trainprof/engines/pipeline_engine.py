"""Pipeline-parallel engine on torch.distributed.pipelining: one stage per rank, GPipe or 1F1B over
`train.grad_accum` micro batches, AdamW per stage with the gradient norm clipped over all stages.

Why torch.distributed.pipelining and not DeepSpeed's PipelineEngine: it has both schedules the recipe
offers (ScheduleGPipe, Schedule1F1B; DeepSpeed's TrainSchedule is 1F1B only), it runs the Hugging Face
Llama split by module (DeepSpeed needs the model rewritten as a flat LayerSpec list passing tuples),
and its point-to-point transfers are plain `torch.distributed.isend` / `irecv` calls, which the
profiler's communication wrappers already time (on gloo and NCCL alike).

One optimizer step is one `schedule.step()` over a batch of grad_accum x micro_batch_size samples:
the schedule splits it into grad_accum micro batches, averages the micro batches' gradients
(`scale_grads`), and the last stage returns each micro batch's loss. Every stage reads the same data
(there is no data parallelism across stages); the first stage uses the token ids, the last the labels.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from trainprof.distributed import DistContext
from trainprof.engines.optim import build_adamw, param_groups
from trainprof.engines.stages import LlamaStage
from trainprof.models import build_model, torch_dtype
from trainprof.recipe import Recipe


def _timed_stage_class():
    """PipelineStage whose per-micro-batch forward and backward are reported to a callback
    (the runner passes Profiler.pipeline_action); built lazily so importing this module stays cheap."""
    from torch.distributed.pipelining import PipelineStage

    class TimedPipelineStage(PipelineStage):
        action: Callable[[str, int], Any] | None = None

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if self.action is None:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            with self.action("forward", fwd_chunk_id):
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if self.action is None:
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
            with self.action("backward", bwd_chunk_id):
                return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    return TimedPipelineStage


def _loss_on_last_stage_only(*args: Any) -> torch.Tensor:
    raise RuntimeError("the pipeline loss runs on the last stage only")


class PipelineEngine:
    """One stage of a pipeline; `train_step` runs one optimizer step (all micro batches)."""

    name = "pipeline"

    def __init__(self, recipe: Recipe, ctx: DistContext) -> None:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

        e, t = recipe.engine, recipe.train
        self.recipe = recipe
        self.num_stages = e.pipeline_stages
        self.stage_index = ctx.rank  # one stage per rank: stage s runs on rank s
        self.grad_accum = t.grad_accum
        self.device = ctx.device
        self.group = torch.distributed.group.WORLD
        dtype = torch_dtype(recipe.model.dtype)
        full = build_model(recipe, device=ctx.device)  # every rank builds the whole model from the seed,
        for p in full.parameters():  # then keeps its part: the same weights as the unsplit model
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()  # fp32 master weights + autocast, as the torch engine
        self.module = LlamaStage(full, self.stage_index, self.num_stages, layers=e.pipeline_layers,
                                 autocast_dtype=None if dtype == torch.float32 else dtype)
        del full
        self.loop_module = self.module
        self.stage = _timed_stage_class()(self.module, self.stage_index, self.num_stages, ctx.device,
                                          group=self.group)
        schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[e.pipeline_schedule]
        # every rank passes a loss_fn: the schedule decides from it whether to run backward at all
        self.schedule = schedule_cls(self.stage, n_microbatches=t.grad_accum,
                                     loss_fn=self.module.loss if self.module.last else _loss_on_last_stage_only)
        groups = param_groups(self.module, recipe.optimizer.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = build_adamw(groups, recipe.optimizer)
        self.config: dict[str, Any] = {
            "library": "torch.distributed.pipelining",
            "schedule": type(self.schedule).__name__,
            "stages": self.num_stages,
            "stage": self.stage_index,
            "layers": [self.module.layer_range.start, self.module.layer_range.stop],
            "micro_batches": t.grad_accum,
            "micro_batch_size": t.micro_batch_size,
            "autocast_dtype": None if dtype == torch.float32 else recipe.model.dtype,
        }

    @property
    def prev_rank(self) -> int | None:
        return self.stage_index - 1 if self.stage_index > 0 else None

    @property
    def next_rank(self) -> int | None:
        return self.stage_index + 1 if self.stage_index < self.num_stages - 1 else None

    def set_action_callback(self, action: Callable[[str, int], Any] | None) -> None:
        """Report each micro batch's forward / backward as `with action(kind, micro_batch):`."""
        self.stage.action = action

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]], prof: Any = None) -> float | None:
        """One optimizer step over grad_accum micro batches; the mean micro-batch loss on the last
        stage, None on the others. With a Profiler the optimizer (clipping included) is its phase."""
        import contextlib

        micro = [next(batches) for _ in range(self.grad_accum)]
        ids = torch.cat([b["input_ids"] for b in micro]).to(self.device, non_blocking=True)
        labels = torch.cat([b["labels"] for b in micro]).to(self.device, non_blocking=True)
        losses: list[torch.Tensor] = []
        args = (ids,) if self.module.first else ()
        phase = prof.phase if prof is not None else (lambda label: contextlib.nullcontext())
        # the schedule's own code between micro-batch actions and transfers (building P2P ops, splitting
        # the batch, scaling gradients) is "other"; forward, backward and waits inside take precedence
        with phase("other"):
            if self.module.last:
                self.schedule.step(*args, target=labels, losses=losses)
            else:
                self.schedule.step(*args)
        if prof is not None:
            for b, loss in zip(micro, losses or [None] * len(micro)):
                prof.record(loss=loss, tokens=b["input_ids"].numel())
        with phase("optimizer"):
            self._clip_and_step()
        return float(torch.stack([x.detach() for x in losses]).float().mean()) if losses else None

    def _clip_and_step(self) -> None:
        clip = self.recipe.optimizer.grad_clip
        if clip > 0:
            # the global norm over all stages: each stage's squared norm, summed across the pipeline
            # (torchtitan clips the same way under pipeline parallelism)
            grads = [p.grad for p in self.params if p.grad is not None]
            local = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros((), device=self.device)
            squared = local.float().pow(2)
            torch.distributed.all_reduce(squared, group=self.group)
            total = squared.sqrt()
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, total)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def is_boundary(self) -> bool:
        return True
