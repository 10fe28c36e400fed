"""The parameter tensors of a recipe's model, from its shape alone: how many elements each holds, which
train, and which DeepSpeed ZeRO-3 keeps persistent. The engines' collectives are derived from it (what
ZeRO gathers and reduces, what DDP buckets), so a change of model size changes them as it should.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainprof.recipe import DEEPSPEED_ZERO_DEFAULTS

ZERO3_PERSISTENCE_THRESHOLD = DEEPSPEED_ZERO_DEFAULTS["stage3_param_persistence_threshold"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Tensor:
    numel: int
    in_layer: bool  # a decoder layer's (its count scales with the depth)
    trains: bool


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Census:
    """Every parameter tensor of the model, in module order, and its decoder-layer count."""

    tensors: tuple[Tensor, ...]
    layers: int

    @property
    def total(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def trainable(self) -> int:
        return sum(t.numel for t in self.tensors if t.trains)

    def persistent(self, threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> list[Tensor]:
        return [t for t in self.tensors if t.numel <= threshold]

    def partitioned(self, threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> list[Tensor]:
        return [t for t in self.tensors if t.numel > threshold]


def census(recipe: Any) -> Census:
    """The parameter tensors of the recipe's model (Llama2: untied embedding and LM head, no biases;
    LoRA adds A (r x in) and B (out x r) per targeted linear, and freezes the rest)."""
    from trainprof.models import resolve_shape

    shape = resolve_shape(recipe.model)
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    kv = shape.num_kv_heads * shape.head_dim
    lora = recipe.task.kind in ("lora", "qlora")
    linears = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
               "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    layer: list[Tensor] = []
    for name, (fan_in, fan_out) in linears.items():
        layer.append(Tensor(numel=fan_in * fan_out, in_layer=True, trains=not lora))
        if lora and name in recipe.task.lora.target_modules:
            r = recipe.task.lora.r
            layer += [Tensor(numel=r * fan_in, in_layer=True, trains=True),
                      Tensor(numel=fan_out * r, in_layer=True, trains=True)]
    layer += [Tensor(numel=h, in_layer=True, trains=not lora)] * 2  # input and post-attention RMSNorm
    embed = Tensor(numel=v * h, in_layer=False, trains=not lora)
    tail = [Tensor(numel=h, in_layer=False, trains=not lora), Tensor(numel=v * h, in_layer=False, trains=not lora)]
    return Census(tensors=(embed, *(layer * shape.num_layers), *tail), layers=shape.num_layers)


def trainable_tensors(c: Census) -> int:
    """The parameter tensors the optimizer steps (an optimizer's per-tensor host calls scale with them)."""
    return sum(1 for t in c.tensors if t.trains)


def zero3_settings(recipe: Any) -> dict[str, int]:
    """The recipe's ZeRO-3 settings that decide its collectives (DeepSpeed's defaults where unset)."""
    zero = {**DEEPSPEED_ZERO_DEFAULTS, **((recipe.deepspeed or {}).get("zero_optimization") or {})}
    return {
        "persistence_threshold": int(zero["stage3_param_persistence_threshold"]),
        "max_reuse_distance": int(zero["stage3_max_reuse_distance"]),
        "reduce_bucket": int(zero["reduce_bucket_size"]),
    }


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Zero3Traffic:
    """What DeepSpeed ZeRO-3 moves per micro batch and per step for one census and settings."""

    gather_calls: int  # partitioned parameters fetched in a forward (one call each)
    gather_elements: int
    regathered_in_backward: bool  # released after forward (the model exceeds the reuse distance)
    scatter_calls: int  # gradient reduce-scatters per micro batch (one per reduce bucket)
    scatter_elements: int
    persistent_calls: int  # persistent parameters all-gathered after the step, one call each
    persistent_elements: int


def zero3_traffic(c: Census, settings: dict[str, int]) -> Zero3Traffic:
    part = c.partitioned(settings["persistence_threshold"])
    pers = c.persistent(settings["persistence_threshold"])
    trainable = c.trainable
    return Zero3Traffic(
        gather_calls=len(part), gather_elements=sum(t.numel for t in part),
        regathered_in_backward=c.total > settings["max_reuse_distance"],
        scatter_calls=max(1, math.ceil(trainable / settings["reduce_bucket"])) if trainable else 0,
        scatter_elements=trainable,
        persistent_calls=len(pers), persistent_elements=sum(t.numel for t in pers))
