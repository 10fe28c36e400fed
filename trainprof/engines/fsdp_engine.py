"""PyTorch FSDP2 engine (`torch.distributed.fsdp.fully_shard`), laid out as torchtitan does it: one
`fully_shard` per decoder layer, then one on the root (embedding, final norm, LM head), AdamW over the
sharded (DTensor) parameters.

Recipe keys: `engine.reshard_after_forward` (the decoder layers' fully_shard calls): true frees each
layer's gathered parameters after its forward and all-gathers them again in backward (ZeRO-3-like); false
keeps them to the end of backward (ZeRO-2-like: one all-gather per group and step). The root is left to
FSDP2's own rule (`reshard_after_forward=None`: kept after forward, as torchtitan does, since backward
needs it first), so it is gathered once per forward and backward either way. Gradients are reduce-scattered per
group (every micro batch, as FSDP2 does by default). `model.dtype` bf16 is a MixedPrecisionPolicy
(param_dtype bf16 for the all-gathers and compute, reduce_dtype fp32 for the reduce-scatters, fp32
sharded parameters, torchtitan's defaults); fp32 runs without one. `engine.offload=optimizer+params` is
FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer states on the host; the optimizer
step runs there). LoRA: the frozen base stays in the model dtype, the adapters train.
"""

from __future__ import annotations

from typing import Any

import torch

from trainprof.distributed import DistContext
from trainprof.engines.optim import build_adamw, param_groups
from trainprof.models import build_model, torch_dtype
from trainprof.recipe import Recipe


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers (peft-wrapped or not), in order."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]


def fsdp_kwargs(recipe: Recipe, device: torch.device) -> dict[str, Any]:
    """The keyword arguments of the decoder layers' fully_shard calls for a recipe (the root's are these
    without reshard_after_forward)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    dtype = torch_dtype(recipe.model.dtype)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if recipe.engine.offload == "optimizer+params" \
        else OffloadPolicy()
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    return {"mesh": mesh, "mp_policy": mp, "offload_policy": offload,
            "reshard_after_forward": recipe.engine.reshard_after_forward}


class FSDPEngine:
    name = "fsdp"

    def __init__(self, recipe: Recipe, ctx: DistContext) -> None:
        from torch.distributed.fsdp import fully_shard

        self.recipe = recipe
        self.grad_accum = recipe.train.grad_accum
        self.device = ctx.device
        model = build_model(recipe, device=ctx.device)  # model.compile compiles each layer here, before sharding
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()  # fp32 sharded parameters; the MixedPrecisionPolicy computes in bf16
        kwargs = fsdp_kwargs(recipe, ctx.device)
        layers = decoder_layers(model)
        for layer in layers:
            fully_shard(layer, **kwargs)
        kwargs.pop("reshard_after_forward")  # the root: FSDP2's default keeps it gathered for backward
        fully_shard(model, **kwargs)
        self.module = self.loop_module = model
        groups = param_groups(model, recipe.optimizer.weight_decay)
        self.params = [p for g in groups for p in g["params"]]
        self.optimizer = build_adamw(groups, recipe.optimizer)
        self.micro = 0
        self.config: dict[str, Any] = {
            "library": "torch.distributed.fsdp.fully_shard (FSDP2)",
            "fully_shard": [f"{len(layers)} decoder layers", "root (kept gathered after forward: FSDP2's default)"],
            "reshard_after_forward": recipe.engine.reshard_after_forward,
            "param_dtype": None if recipe.model.dtype == "fp32" else recipe.model.dtype,
            "reduce_dtype": None if recipe.model.dtype == "fp32" else "fp32",
            "cpu_offload": recipe.engine.offload == "optimizer+params",
            "world_size": ctx.world_size,
        }

    def is_boundary(self) -> bool:
        return (self.micro + 1) % self.grad_accum == 0

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        return self.module(**batch).loss

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum).backward()

    def step(self) -> None:
        boundary = self.is_boundary()
        self.micro += 1
        if not boundary:
            return
        if self.recipe.optimizer.grad_clip > 0:
            clip_sharded_grads(self.params, self.recipe.optimizer.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def clip_sharded_grads(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm of FSDP2's sharded parameters: each rank's squared norm of its
    shards, summed with one all_reduce (shards are disjoint, padding is zero), as the pipeline engine
    clips across stages; returns the total norm."""
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads, norm_type=2.0) if grads else torch.zeros(())
    squared = local.float().pow(2)
    torch.distributed.all_reduce(squared)
    total = squared.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
    return total
