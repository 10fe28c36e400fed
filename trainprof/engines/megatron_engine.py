"""Megatron engine: megatron-core's GPTModel (trainprof.megatron_model) under its own
DistributedDataParallel, distributed optimizer and forward-backward schedule, on CUDA.

One optimizer step is one `forward_backward_func` call over train.grad_accum micro batches (Megatron's
1F1B schedule when engine.pipeline_parallel > 1, a plain loop otherwise; its `finalize_model_grads`
then reduces the gradients across data-parallel ranks: a reduce-scatter into each rank's shard with the
distributed optimizer, an all-reduce without) and one `optimizer.step()` (clipping, Adam on the fp32
master shard, and with the distributed optimizer the all-gather of the updated parameters). The runner
calls `train_step(batches, prof)`, as for the pipeline engine.

Overlap of gradient reduction and parameter gathering with compute is off (Megatron-LM's defaults), so
every collective is a synchronous call the profiler times as exposed. Mixed precision as Megatron-LM
runs it: 16-bit parameters, fp32 main gradients (bf16: gradients reduced in fp32), fp32 master weights
and Adam states in the optimizer; fp16 with dynamic loss scaling.

The ranks of one model replica (tensor_parallel x pipeline_parallel of them) read the same samples:
`data_rank` / `data_world_size` are the data-parallel rank and size, which the loader splits by.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
from typing import Any, Iterator

import torch

from trainprof.distributed import DistContext
from trainprof.recipe import Recipe


def _join_process_group(ctx: DistContext) -> None:
    """megatron-core needs torch.distributed even on one GPU: torchrun's group when there is one, else a
    group of one on an in-process store (no port to pick)."""
    dist = torch.distributed
    if dist.is_initialized():
        return
    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


class MegatronEngine:
    """megatron-core training on this rank; `train_step` runs one optimizer step (all micro batches)."""

    name = "megatron"

    def __init__(self, recipe: Recipe, ctx: DistContext) -> None:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from trainprof.megatron_model import build_megatron_model

        e, t = recipe.engine, recipe.train
        self.recipe = recipe
        self.device = ctx.device
        _join_process_group(ctx)
        parallel_state.initialize_model_parallel(e.tensor_parallel, e.pipeline_parallel)
        model_parallel_cuda_manual_seed(t.seed)  # Megatron's CUDA RNG tracker: initialisation and dropout forks
        self.module = build_megatron_model(recipe)
        self.loop_module = self.module  # the DDP wrapper's forward only calls it
        self.ddp, self.optimizer = _wrap_for_training(self.module, recipe)
        self.forward_backward = _forward_backward_func()
        self.data_rank = parallel_state.get_data_parallel_rank()
        self.data_world_size = parallel_state.get_data_parallel_world_size()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.config: dict[str, Any] = {
            "library": f"megatron-core {importlib.metadata.version('megatron-core')}",
            "tensor_parallel": e.tensor_parallel,
            "pipeline_parallel": e.pipeline_parallel,
            "data_parallel": self.data_world_size,
            "distributed_optimizer": e.distributed_optimizer is not False,
            "recompute": self.module.config.recompute_granularity,
            "core_attention": type(self.module.decoder.layers[0].self_attention.core_attention).__name__
            if len(self.module.decoder.layers) else None,
            "layer_spec": "megatron.core.models.gpt.gpt_layer_specs.get_gpt_layer_local_spec",
            # torch's AdamW without Transformer Engine or Apex (megatron-core warns), else their FusedAdam
            "adam": f"{type(self.optimizer.optimizer).__module__}.{type(self.optimizer.optimizer).__qualname__}",
            "grad_reduce_in_fp32": self.ddp.ddp_config.grad_reduce_in_fp32,
            "overlap_grad_reduce": False,
            "overlap_param_gather": False,
            "micro_batches": t.grad_accum,
            "module_names": "Megatron's module names mapped onto HF Llama's (trainprof.megatron_names.MEGATRON_TO_HF)",
        }

    def train_step(self, batches: Iterator[dict[str, torch.Tensor]], prof: Any = None) -> float | None:
        """One optimizer step over grad_accum micro batches; the mean micro-batch loss on the last pipeline
        stage, None on the others. With a Profiler, the schedule's own code between forward and backward
        (and the gradient reduction after the last backward) is "other", the optimizer step "optimizer"."""
        phase = prof.phase if prof is not None else (lambda label: contextlib.nullcontext())
        t, seq_len = self.recipe.train, self.recipe.data.seq_len
        step = functools.partial(self._forward_step, prof=prof)
        with phase("other"):
            stored = self.forward_backward(
                forward_step_func=step, data_iterator=batches, model=self.ddp, num_microbatches=t.grad_accum,
                seq_length=seq_len, micro_batch_size=t.micro_batch_size, decoder_seq_length=seq_len,
                forward_only=False,
            )
        with phase("optimizer"):
            self.optimizer.step()
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
        losses = [d["loss"] for d in stored] if self.last_stage else []
        if prof is not None:
            for loss in losses:
                prof.record(loss=loss)
        return float(torch.stack(losses).float().mean()) if losses else None

    def _forward_step(self, data_iterator: Iterator[dict[str, torch.Tensor]], model: Any, prof: Any = None):
        """Megatron's forward_step_func: one micro batch through the model, and its loss function."""
        batch = next(data_iterator)
        ids = batch["input_ids"].to(self.device, non_blocking=True)
        if prof is not None:
            prof.record(tokens=ids.numel())
        # Megatron's labels are the next tokens (Hugging Face shifts inside the model): the last
        # position has none and is masked out, so the loss averages the same b x (s - 1) tokens.
        labels = torch.roll(batch["labels"].to(self.device, non_blocking=True), shifts=-1, dims=1)
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
        loss_mask[:, -1] = 0
        positions = torch.arange(ids.size(1), device=self.device).unsqueeze(0).expand_as(ids)
        output = model(ids, positions, None, labels=labels)  # causal mask built inside; per-token loss [b, s]
        return output, functools.partial(_masked_mean_loss, loss_mask)

    def is_boundary(self) -> bool:
        return True  # train_step runs whole optimizer steps


def _masked_mean_loss(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro batch's mean loss over its unmasked tokens (Megatron divides it by the micro batches)."""
    loss = (per_token.float().view(-1) * loss_mask.view(-1)).sum() / loss_mask.sum()
    return loss, {"loss": loss.detach().clone()}  # a copy: the schedule scales `loss` in place


def _wrap_for_training(model: torch.nn.Module, recipe: Recipe) -> tuple[Any, Any]:
    """Megatron's DistributedDataParallel around the model and its optimizer, wired into the model's
    config as Megatron-LM's training loop wires them (no_sync, gradient finalisation, loss scaling)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    m, o = recipe.model, recipe.optimizer
    distributed = recipe.engine.distributed_optimizer is not False  # null = on
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=m.dtype == "bf16",  # Megatron-LM accumulates and reduces bf16 gradients in fp32
        overlap_grad_reduce=False, overlap_param_gather=False, use_distributed_optimizer=distributed,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.betas[0],
        adam_beta2=o.betas[1], adam_eps=o.eps, clip_grad=o.grad_clip, bf16=m.dtype == "bf16",
        fp16=m.dtype == "fp16", params_dtype=model.config.params_dtype, use_distributed_optimizer=distributed,
    )
    chained = get_megatron_optimizer(opt_config, [ddp])
    # one dense optimizer here (no experts): hand it out itself, so the profiler reads its Adam states
    optimizer = chained.chained_optimizers[0] if len(chained.chained_optimizers) == 1 else chained
    # A constant learning rate; the scheduler sets each group's lr and weight decay (no decay on norms)
    # as Megatron-LM's does, and is not stepped again.
    OptimizerParamScheduler(optimizer, init_lr=o.lr, max_lr=o.lr, min_lr=o.lr, lr_warmup_steps=0, lr_decay_steps=1,
                            lr_decay_style="constant", start_wd=o.weight_decay, end_wd=o.weight_decay,
                            wd_incr_steps=1, wd_incr_style="constant")
    config = model.config
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return ddp, optimizer


def _forward_backward_func():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()
