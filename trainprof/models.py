"""Model building: meta device, random init or a local checkpoint, LoRA and 4-bit.

Shapes live in trainprof.shapes (the name -> shape map) and are resolved by trainprof.recipe
(resolve_shape, re-exported here); data flows recipe -> models, never back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainprof.recipe import resolve_shape  # noqa: F401  (re-exported: shapes are resolved by the recipe)
from trainprof.shapes import SHAPES, LlamaShape  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    import torch

    from trainprof.recipe import Recipe


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


def recomputes(model: Any) -> bool:
    """Whether HF gradient checkpointing is on for `model`: `is_activation_checkpointing` since
    transformers 5 (where the old `is_gradient_checkpointing` warns as deprecated), else the old name."""
    flag = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") \
        else "is_gradient_checkpointing"
    return bool(getattr(model, flag, False))


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
    if m.compile and not meta:
        compile_decoder_layers(model)
    return model


def compile_decoder_layers(model: torch.nn.Module) -> list[str]:
    """torch.compile each decoder layer in place (`layer.compile()`, inductor), as torchtitan compiles each
    transformer block: one graph serves every layer (parameters are graph inputs), module names and
    parameter names stay as they were, and the engine (DDP, FSDP2, DeepSpeed) wraps the model as usual.
    Compilation happens on the first forward. Returns the compiled layers' names."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    names = []
    for name, module in model.named_modules():
        if isinstance(module, LlamaDecoderLayer):
            module.compile()
            names.append(name)
    return names


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
    # peft keeps adapters in fp32 on a 16-bit base; ZeRO-3 partitions the adapters as zero.Init creates them,
    # in the model dtype, and needs all trainable parameters in one dtype (it keeps fp32 masters itself)
    zero3 = recipe.engine.kind == "deepspeed" and recipe.engine.zero_stage == 3
    return get_peft_model(model, cfg, autocast_adapter_dtype=not zero3)


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
