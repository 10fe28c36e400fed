"""Llama2 shapes and model building: meta device, random init or a local checkpoint, LoRA and 4-bit.

Shapes are a plain list turned into a name -> shape map (`SHAPES`); the real Llama2 shapes come from
the released config.json files of meta-llama/Llama-2-{7b,13b,70b}-hf (Touvron et al. 2023, table 1).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from trainprof.recipe import ModelConfig, Recipe


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 32000
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


_SHAPE_LIST: list[dict[str, Any]] = [
    # Llama-2-7b-hf config.json
    dict(name="llama2-7b", hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32),
    # Llama-2-13b-hf config.json
    dict(name="llama2-13b", hidden_size=5120, intermediate_size=13824, num_layers=40, num_heads=40, num_kv_heads=40),
    # Llama-2-70b-hf config.json: grouped-query attention with 8 key/value heads
    dict(name="llama2-70b", hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8),
    # ~1.1B Llama2-shaped model for single-GPU checks (TinyLlama-1.1B dims, multi-head attention)
    dict(name="llama2-1b", hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32, num_kv_heads=32,
         max_position_embeddings=2048),
    # CPU shapes: same architecture, small enough for tests and laptops
    dict(name="llama2-tiny", hidden_size=128, intermediate_size=352, num_layers=2, num_heads=4, num_kv_heads=4,
         vocab_size=1024, max_position_embeddings=1024),
    dict(name="llama2-small", hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8, num_kv_heads=8,
         vocab_size=8192, max_position_embeddings=2048),
]
SHAPES: dict[str, LlamaShape] = {s["name"]: LlamaShape(**s) for s in _SHAPE_LIST}

_DIM_KEYS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size",
             "max_position_embeddings")


def resolve_shape(cfg: ModelConfig) -> LlamaShape:
    """The shape a model config asks for: a checkpoint's config.json, else a named shape with explicit
    dims laid over it. Raises RecipeError for missing or inconsistent dims."""
    from trainprof.recipe import RecipeError

    if cfg.checkpoint is not None:
        base = _shape_from_checkpoint(cfg.checkpoint)
    elif cfg.name == "custom":
        missing = [k for k in _DIM_KEYS[:5] if getattr(cfg, k) is None]
        if missing:
            raise RecipeError(
                f"recipe key 'model.{missing[0]}' is required when model.name is 'custom'; set every dim "
                f"({', '.join(_DIM_KEYS[:5])}) or pick a named shape"
            )
        base = LlamaShape(name="custom", **{k: getattr(cfg, k) for k in _DIM_KEYS[:5]})
    else:
        base = SHAPES[cfg.name]
    explicit = {k: getattr(cfg, k) for k in _DIM_KEYS if getattr(cfg, k) is not None}
    shape = dataclasses.replace(base, **explicit)
    for key in _DIM_KEYS:
        if getattr(shape, key) < 1:
            raise RecipeError(f"recipe key 'model.{key}': {getattr(shape, key)} must be >= 1")
    if shape.hidden_size % shape.num_heads:
        raise RecipeError(
            f"recipe key 'model.num_heads': {shape.num_heads} does not divide hidden_size {shape.hidden_size}"
        )
    if shape.num_heads % shape.num_kv_heads:
        raise RecipeError(
            f"recipe key 'model.num_kv_heads': {shape.num_kv_heads} does not divide num_heads {shape.num_heads}"
        )
    return shape


def _shape_from_checkpoint(path: str) -> LlamaShape:
    import json
    from pathlib import Path

    cfg = json.loads((Path(path) / "config.json").read_text())
    return LlamaShape(
        name=Path(path).name,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        vocab_size=cfg["vocab_size"],
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
    )


TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, TORCH_DTYPES[name])


def llama_config(recipe: Recipe):
    """The transformers LlamaConfig for a recipe (attention implementation included)."""
    from transformers import LlamaConfig

    shape = resolve_shape(recipe.model)
    return LlamaConfig(
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        vocab_size=shape.vocab_size,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=shape.rms_norm_eps,
        attn_implementation=_attn_impl(recipe.model.attention),
        use_cache=False,
        tie_word_embeddings=False,
    )


def _attn_impl(attention: str) -> str:
    return {"eager": "eager", "sdpa": "sdpa", "flash2": "flash_attention_2"}[attention]


def build_model(recipe: Recipe, *, device: str | torch.device = "cpu", meta: bool = False) -> torch.nn.Module:
    """Build the recipe's model: on the meta device (no memory, for planning), from random init with
    the recipe's seed already set by the caller, or from the local checkpoint. LoRA adapters and 4-bit
    base weights are applied per the task; recomputation is switched on as requested."""
    import torch
    from transformers import LlamaForCausalLM

    m, task = recipe.model, recipe.task
    dtype = torch_dtype(m.dtype)
    qlora = task.kind == "qlora"
    if m.checkpoint is not None and not meta:
        model = LlamaForCausalLM.from_pretrained(
            m.checkpoint, dtype=dtype, local_files_only=True, attn_implementation=_attn_impl(m.attention),
            quantization_config=bnb_config(recipe) if qlora else None,
            device_map={"": torch.device(device)} if qlora else None,
        )
        model.config.use_cache = False
    elif meta or qlora:
        with torch.device("meta"):
            model = LlamaForCausalLM._from_config(llama_config(recipe), dtype=dtype)
        if qlora:
            quantize_4bit(model, recipe, device=device, meta=meta)
    else:
        # created in the training dtype (not fp32, then cast): half the start-up memory at bf16
        with torch.device(device):
            model = LlamaForCausalLM._from_config(llama_config(recipe), dtype=dtype)
    if task.kind in ("lora", "qlora"):
        model = add_lora(model, recipe)
    if m.recompute:
        # use_reentrant=False: the non-reentrant checkpoint works with frozen inputs (LoRA) and
        # re-runs the forward inside backward, which the profiler attributes to `recompute`.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # from_pretrained returns eval mode, which would switch LoRA dropout off
    return model


def bnb_config(recipe: Recipe):
    """transformers' BitsAndBytesConfig for loading a checkpoint in 4 bits (lm_head stays 16-bit)."""
    from transformers import BitsAndBytesConfig

    q = recipe.task.quant
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.quant_type,
        bnb_4bit_use_double_quant=q.double_quant,
        bnb_4bit_compute_dtype=torch_dtype(q.compute_dtype),
    )


def quantize_4bit(model: torch.nn.Module, recipe: Recipe, *, device: str | torch.device, meta: bool) -> None:
    """Random-init a meta-built model one module at a time, replacing each decoder linear layer by a
    bitsandbytes Linear4bit (QLoRA: NF4/FP4, optional double quantization) as soon as it exists, so
    no process ever holds the whole 16-bit model (Llama2-70B: 129 GiB). With meta=True the 4-bit
    layers stay on the meta device (for planning). lm_head stays 16-bit, as in the QLoRA recipe."""
    import bitsandbytes as bnb
    import torch

    q = recipe.task.quant
    for name, module in list(model.named_modules()):
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if not meta and any(t.is_meta for t in own):
            module.to_empty(device=device, recurse=False)
            model._init_weights(module)  # the model's own init (normal(0, initializer_range), ones, RoPE)
        if not (isinstance(module, torch.nn.Linear) and ".layers." in f".{name}"):
            continue
        qlin = bnb.nn.Linear4bit(
            module.in_features,
            module.out_features,
            bias=module.bias is not None,
            compute_dtype=torch_dtype(q.compute_dtype),
            compress_statistics=q.double_quant,
            quant_type=q.quant_type,
            device="meta" if meta else None,
        )
        if not meta:
            # Params4bit quantizes when moved to a device (blockwise, blocksize 64)
            qlin.weight = bnb.nn.Params4bit(
                module.weight.data, requires_grad=False, compress_statistics=q.double_quant, quant_type=q.quant_type
            ).to(device)
            if module.bias is not None:
                qlin.bias = torch.nn.Parameter(module.bias.data, requires_grad=False)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, qlin)
    model.is_loaded_in_4bit = True  # read by peft's prepare_model_for_kbit_training


def add_lora(model: torch.nn.Module, recipe: Recipe) -> torch.nn.Module:
    """Wrap with peft LoRA adapters; only adapter weights stay trainable."""
    from peft import LoraConfig, get_peft_model

    lo = recipe.task.lora
    cfg = LoraConfig(
        r=lo.r,
        lora_alpha=lo.alpha,
        lora_dropout=lo.dropout,
        target_modules=list(lo.target_modules),
        task_type="CAUSAL_LM",
        bias="none",
    )
    if recipe.model.recompute:
        # gradient checkpointing on a frozen base needs inputs that require grad
        model.enable_input_require_grads()
    return get_peft_model(model, cfg)


def count_params(model: torch.nn.Module) -> dict[str, int]:
    """Total and trainable parameter counts as stored: a 4-bit Params4bit counts its logical
    (unpacked) elements, a ZeRO-3 partitioned parameter its full `ds_numel`."""
    total = trainable = 0
    for p in model.parameters():
        n = logical_numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return {"total": total, "trainable": trainable}


def logical_numel(p: torch.Tensor) -> int:
    if hasattr(p, "ds_numel"):  # DeepSpeed ZeRO-3 partitioned parameter
        return int(p.ds_numel)
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None:  # bitsandbytes 4-bit: two values per stored byte
        return int(quant_state.shape.numel())
    return p.numel()
