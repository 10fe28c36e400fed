"""DeepSpeed engine: ZeRO stages 0-3, CPU offload, bf16/fp16, built from the recipe plus the
verbatim `deepspeed:` section (keys the recipe sets are rejected at validation)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from trainprof.distributed import DistContext
from trainprof.engines.cpu_info import ask_once
from trainprof.engines.optim import param_groups, quantized_adamw
from trainprof.models import build_model
from trainprof.recipe import Recipe


def deepspeed_config(recipe: Recipe, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config dict for a recipe (documented keys:
    https://www.deepspeed.ai/docs/config-json/)."""
    t, e, o = recipe.train, recipe.engine, recipe.optimizer
    cfg: dict[str, Any] = copy.deepcopy(recipe.deepspeed)
    cfg.update(
        train_micro_batch_size_per_gpu=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum,
        train_batch_size=t.micro_batch_size * t.grad_accum * world_size,
        gradient_clipping=o.grad_clip,
    )
    if o.state_bits == 32:
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": o.lr, "betas": list(o.betas), "eps": o.eps, "weight_decay": o.weight_decay},
        }
    else:  # a torchao client optimizer (trainprof.engines.optim), which ZeRO wraps like any torch one
        cfg["zero_allow_untested_optimizer"] = True
    cfg.setdefault("steps_per_print", 10**9)  # trainprof prints its own progress
    cfg.setdefault("wall_clock_breakdown", False)
    zero = cfg.setdefault("zero_optimization", {})
    zero["stage"] = e.zero_stage
    if e.offload in ("optimizer", "optimizer+params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if e.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if recipe.model.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif recipe.model.dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return cfg


class DeepSpeedEngine:
    name = "deepspeed"

    def __init__(self, recipe: Recipe, ctx: DistContext) -> None:
        import deepspeed
        import transformers.models.llama.modeling_llama  # noqa: F401  (import before zero.Init patches tensor creation)

        ask_once()  # DeepSpeed's CPU op builders ask py-cpuinfo twice per engine, a second each
        self.config = deepspeed_config(recipe, ctx.world_size)
        if recipe.engine.zero_stage == 3:
            # Partition parameters as they are created, so no rank ever holds the whole model.
            with deepspeed.zero.Init(config_dict_or_path=self.config):
                model = build_model(recipe, device=ctx.device)
        else:
            model = build_model(recipe, device=ctx.device)
        groups = param_groups(model, recipe.optimizer.weight_decay)
        client = quantized_adamw(groups, recipe.optimizer) if recipe.optimizer.state_bits != 32 else None
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, optimizer=client, config=self.config
        )
        self.module = self.engine.module
        self.loop_module = self.module  # the DeepSpeed engine's own forward is bookkeeping around it

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(self.engine.device, non_blocking=True) for k, v in batch.items()}
        return self.engine(**batch).loss

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # scales by 1/gradient_accumulation_steps itself

    def step(self) -> None:
        self.engine.step()

    def is_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()
