"""Plain PyTorch engine: one process or DDP, AdamW (fp32 or torchao 8/4-bit states), torch.autocast
mixed precision.

Trainable parameters are kept in fp32 and the forward runs under autocast in the recipe's dtype
(PyTorch AMP); a frozen base (LoRA/QLoRA) stays in the recipe's dtype. fp16 uses a GradScaler.
"""

from __future__ import annotations

from typing import Any

import torch

from trainprof.distributed import DistContext
from trainprof.engines.optim import build_adamw, param_groups
from trainprof.models import build_model, torch_dtype
from trainprof.recipe import Recipe


class TorchEngine:
    name = "torch"

    def __init__(self, recipe: Recipe, ctx: DistContext) -> None:
        self.recipe = recipe
        self.grad_accum = recipe.train.grad_accum
        self.dtype = torch_dtype(recipe.model.dtype)
        self.device = ctx.device
        model = build_model(recipe, device=ctx.device)
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()
        self.module = model
        self.model: torch.nn.Module = model
        if ctx.distributed:
            self.model = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None
            )
        self.loop_module = self.model
        groups = param_groups(model, recipe.optimizer.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = build_adamw(groups, recipe.optimizer)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=recipe.model.dtype == "fp16")
        self.micro = 0
        self.config: dict[str, Any] = {
            "ddp": ctx.distributed,
            "autocast_dtype": None if recipe.model.dtype == "fp32" else recipe.model.dtype,
            "grad_scaler": recipe.model.dtype == "fp16",
        }

    def is_boundary(self) -> bool:
        return (self.micro + 1) % self.grad_accum == 0

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            # what DDP.no_sync() sets: all-reduce gradients only on the last micro batch
            self.model.require_backward_grad_sync = self.is_boundary()
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            return self.model(**batch).loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss / self.grad_accum).backward()

    def step(self) -> None:
        boundary = self.is_boundary()
        self.micro += 1
        if not boundary:
            return
        clip = self.recipe.optimizer.grad_clip
        if clip > 0:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
