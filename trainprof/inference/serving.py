"""The model as `trainprof infer` serves it (built as for training, LoRA merged, eval mode, KV cache on), the
facts a report needs to say what was measured, and the device figures its utilizations are measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainprof.env import device_name
from trainprof.hardware import dense_peak, memory_bandwidth
from trainprof.profiler.result import compute_dtype
from trainprof.recipe import Recipe, resolve_shape, shape_label
from trainprof.shapes import DIM_KEYS


def load_inference_model(recipe: Recipe, device: torch.device) -> torch.nn.Module:
    """The recipe's model for serving: built as for training, LoRA adapters merged into the base weights
    (peft merge_and_unload), eval mode, KV cache on."""
    from trainprof.models import build_model

    torch.manual_seed(recipe.train.seed)
    model = build_model(recipe, device=device)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.eval()
    model.config.use_cache = True
    model.generation_config.use_cache = True
    return model


def model_facts(recipe: Recipe, model: torch.nn.Module) -> dict[str, Any]:
    """inference.json's `model`: what was served, read from the built model where it can say (dtype,
    attention implementation, parameters) and from the recipe for its name, shape and adapters."""
    shape = resolve_shape(recipe.model)
    lora = recipe.task.lora
    return {
        "name": shape_label(recipe.model),
        "checkpoint": recipe.model.checkpoint,
        **{k: getattr(shape, k) for k in DIM_KEYS},
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": _dtype_name(next(model.parameters()).dtype),
        "attention": getattr(model.config, "_attn_implementation", None) or recipe.model.attention,
        "task": recipe.task.kind,
        # adapters are merged whenever the task trains them (load_inference_model); none remain as modules
        "lora": {"r": lora.r, "alpha": lora.alpha, "target_modules": list(lora.target_modules), "merged": True}
        if recipe.task.kind == "lora" else None,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, str(dtype))


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights a decode step reads: every parameter except the input embedding, of which a
    step gathers only one row per sequence."""
    emb = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in emb)


@dataclass(slots=True, kw_only=True)
class ServingDevice:
    """The device a model is served on and the figures its utilizations are measured against."""

    device: torch.device
    peak: dict[str, Any] | None  # dense peak for the model's dtype (profiles/accelerators.yaml), or None
    peak_reason: str
    bandwidth: dict[str, Any] | None  # memory bandwidth, or None
    bandwidth_reason: str
    weight_bytes: int  # what a decode step reads besides the KV cache

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device) -> ServingDevice:
        name = device_name(device)
        peak, peak_reason = dense_peak(name, device.type, compute_dtype(model))
        bandwidth, bandwidth_reason = memory_bandwidth(name, device.type)
        return cls(device=device, peak=peak, peak_reason=peak_reason, bandwidth=bandwidth,
                   bandwidth_reason=bandwidth_reason, weight_bytes=_weight_bytes(model))
