"""What a run not made from a recipe records for `trainprof project` (a loop of the user's own with
`trainprof.Profiler`, `trainprof wrap`, the HF / Lightning callbacks): the model's shape, dtype, attention,
recomputation and compilation, the task (LoRA or QLoRA adapters), the engine and its settings (DeepSpeed's
from its config; FSDP2 from the model's fully_shard groups), the micro batch, sequence length and gradient
accumulation, as recipe keys in profile.json's `workload`, and under `unknown` each key it could not read
and why. The compute dtype (model.dtype) is the FSDP2 groups' MixedPrecisionPolicy param_dtype where one is
set, else the autocast dtype where fp32 weights ran under autocast, else the weights'.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from trainprof.models import recomputes
from trainprof.profiler.fsdp import below_root as fsdp_below_root
from trainprof.profiler.fsdp import param_dtypes as fsdp_param_dtypes
from trainprof.profiler.fsdp import param_groups as fsdp_param_groups

ATTENTION = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash2"}
DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def find_llama(model: Any) -> Any | None:
    """The outermost module whose `config` has a decoder's shape (hidden size, layers, heads): the HF
    model inside a DeepSpeed engine, DDP, peft or a LightningModule."""
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if all(hasattr(cfg, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")):
            return module
    return None


class BatchShape:
    """A forward pre-hook on the HF model: the first call's (micro batch, sequence length) and the calls
    of the first step that counts (its micro batches: the gradient accumulation); and one on its input
    embedding: whether the first forward ran under autocast. That one is inside the forward, where
    Accelerate (and so the HF Trainer) enters autocast: it wraps the model's `forward` method.

    A hook inside a torch.compile'd region would be traced by dynamo, which breaks the graph there and
    keeps the broken graphs after the hooks are gone (profiler/compiled.py): where the HF model runs inside
    a compiled region its hook goes on `outer` (the torch.compile wrapper the loop calls), and an embedding
    inside one is not hooked (`autocast_unseen`)."""

    def __init__(self, model: Any, *, inside_compiled: set[int] = frozenset(), outer: Any = None) -> None:
        self.shape: tuple[int, int] | None = None
        self.autocast: str | None = None  # the 16-bit dtype the first forward ran under autocast (AMP), if any
        self.calls_in_step = 0
        self.grad_accum: int | None = None
        hooked = outer if id(model) in inside_compiled and outer is not None else model
        self._handle = hooked.register_forward_pre_hook(self._pre, with_kwargs=True)
        embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        self.autocast_unseen = embedding is not None and id(embedding) in inside_compiled
        self._embedding_handle = (embedding.register_forward_pre_hook(self._embedding_pre)
                                  if embedding is not None and not self.autocast_unseen else None)

    def _pre(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.shape is None and getattr(ids, "dim", lambda: 0)() == 2:
            self.shape = (int(ids.shape[0]), int(ids.shape[1]))
        self.calls_in_step += 1

    def _embedding_pre(self, module: Any, args: tuple) -> None:
        device = module.weight.device.type
        if torch.is_autocast_enabled(device):
            self.autocast = DTYPES.get(str(torch.get_autocast_dtype(device)))
        self._embedding_handle.remove()  # the first forward tells
        self._embedding_handle = None

    def step_ended(self) -> None:
        if self.grad_accum is None and self.calls_in_step:
            self.grad_accum = self.calls_in_step
        self.calls_in_step = 0

    def remove(self) -> None:
        for handle in (self._handle, self._embedding_handle):
            if handle is not None:
                handle.remove()


def _config_dtype(cfg: Any) -> Any:
    """The config's `dtype` (transformers >= 4.56, where reading `torch_dtype` logs a deprecation), else `torch_dtype`."""
    return getattr(cfg, "dtype" if "dtype" in vars(cfg) else "torch_dtype", None)


def _model_block(llama: Any, model: Any) -> dict[str, Any]:
    cfg = llama.config
    param = next(llama.parameters(), None)
    compute = _config_dtype(cfg) or (param.dtype if param is not None else None)
    return {
        "name": "custom", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_layers": cfg.num_hidden_layers, "num_heads": cfg.num_attention_heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "vocab_size": cfg.vocab_size, "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "dtype": DTYPES.get(str(compute), "bf16"),
        "attention": ATTENTION.get(getattr(cfg, "_attn_implementation", "sdpa") or "sdpa", "sdpa"),
        "recompute": recomputes(llama),
    }


def _task_block(model: Any) -> dict[str, Any]:
    peft_config = next((m.peft_config for m in model.modules() if hasattr(m, "peft_config")), None)
    if not peft_config:
        return {"kind": "pretrain"}
    cfg = next(iter(peft_config.values()))
    quantized = any(type(m).__name__ == "Linear4bit" for m in model.modules())
    return {"kind": "qlora" if quantized else "lora",
            "lora": {"r": cfg.r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
                     "target_modules": sorted(cfg.target_modules)}}


def _engine_block(framework: str, config: dict[str, Any] | None, model: Any) -> dict[str, Any]:
    """DeepSpeed's ZeRO stage and offload from its config; FSDP2 (fully_shard) from its parameter groups;
    anything else runs as PyTorch (DDP on ranks)."""
    if "deepspeed" not in framework:
        groups = fsdp_param_groups(model)
        if groups:
            return _fsdp_block(groups)
        return {"kind": "torch", "zero_stage": 0, "offload": "none"}
    zero = (config or {}).get("zero_optimization") or {}
    device = lambda key: ((zero.get(key) or {}).get("device") or "none")  # noqa: E731
    offload = "optimizer+params" if device("offload_param") == "cpu" else (
        "optimizer" if device("offload_optimizer") == "cpu" else "none")
    return {"kind": "deepspeed", "zero_stage": int(zero.get("stage", 0)), "offload": offload}


def _fsdp_block(groups: list[tuple[str, Any]]) -> dict[str, Any]:
    """engine.kind fsdp with the settings of the groups below the root (a recipe's FSDP2 engine passes
    engine.reshard_after_forward to those and leaves the root to FSDP2's rule, as a script that does not
    set it on the root does): reshard_after_forward where each has its post-forward mesh (FSDP2 sets
    none where parameters stay gathered), CPUOffloadPolicy as offload."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    inner = fsdp_below_root(groups)
    reshard = all(getattr(g, "post_forward_mesh_info", None) is not None for g in inner)
    offload = any(isinstance(getattr(g, "offload_policy", None), CPUOffloadPolicy) for _, g in groups)
    return {"kind": "fsdp", "zero_stage": 0, "offload": "optimizer+params" if offload else "none",
            "reshard_after_forward": reshard}


def _mixed_precision_dtype(model: Any, unknown: dict[str, str]) -> str | None:
    """The compute dtype an FSDP2 MixedPrecisionPolicy sets: the param_dtype its groups below the root
    all-gather and compute in (FSDP2 casts the sharded parameters to it), None where no group sets one."""
    dtypes = fsdp_param_dtypes(model)
    if len(dtypes) > 1:
        shown = ", ".join(sorted(DTYPES.get(str(d), str(d)) for d in dtypes))
        unknown["model.dtype"] = (f"the FSDP2 groups' MixedPrecisionPolicy param_dtype differ ({shown}), where a "
                                  "recipe has one; the weights' dtype kept")
        return None
    return DTYPES.get(str(next(iter(dtypes)))) if dtypes else None


def _compile_key(compiled: dict[str, Any] | None, num_layers: int, unknown: dict[str, str]) -> bool:
    """model.compile from the profile's `compile` block: recipes compile each decoder layer; other regions
    (the whole model, a few layers) are taken as compiled too, and `unknown` says so."""
    if not (compiled or {}).get("compiled"):
        return False
    regions = compiled.get("regions") or []
    per_layer = len(regions) == num_layers and all(re.search(r"layers\.\d+$", r) for r in regions)
    if not per_layer:
        shown = ", ".join(regions[:3]) + (f" and {len(regions) - 3} more" if len(regions) > 3 else "")
        unknown["model.compile"] = (f"compiled regions ({shown or 'unnamed'}) are not the {num_layers} decoder "
                                    "layers a recipe's model.compile compiles; taken as model.compile=true")
    return True


def workload(model: Any, *, framework: str, engine_config: dict[str, Any] | None,
             shape: BatchShape | None, compiled: dict[str, Any] | None = None) -> dict[str, Any]:
    """The workload block of a wrapped run's profile (recipe keys, and `unknown` with reasons).

    Args:
        compiled: the profile's `compile` block (whether and where the model was torch.compiled).
    """
    unknown: dict[str, str] = {}
    out: dict[str, Any] = {"engine": _engine_block(framework, engine_config, model), "task": _task_block(model)}
    llama = find_llama(model)
    if llama is None:
        unknown["model"] = f"no module of {type(model).__name__} has a decoder config (hidden_size, layers, heads)"
    else:
        out["model"] = _model_block(llama, model)
        out["model"]["compile"] = _compile_key(compiled, out["model"]["num_layers"], unknown)
        if out["engine"]["kind"] == "fsdp":  # fp32 shards, compute in the MixedPrecisionPolicy's param_dtype
            out["model"]["dtype"] = _mixed_precision_dtype(model, unknown) or out["model"]["dtype"]
        amp = shape.autocast if shape is not None else None
        if shape is not None and shape.autocast_unseen and out["model"]["dtype"] == "fp32":
            unknown["model.dtype"] = ("fp32 weights; the input embedding runs inside a torch.compile'd region, "
                                      "where trainprof does not hook, so whether the forward ran under autocast "
                                      "(AMP) was not seen; fp32 kept")
        if amp and out["model"]["dtype"] == "fp32":  # fp32 weights, 16-bit compute
            if out["engine"]["kind"] == "torch":  # a torch-engine recipe in a 16-bit dtype is exactly that (AMP)
                out["model"]["dtype"] = amp
            else:
                engine = "DeepSpeed" if out["engine"]["kind"] == "deepspeed" else "FSDP2 without a param_dtype"
                unknown["model.dtype"] = (f"fp32 weights under autocast to {amp} inside {engine}, which recipes "
                                          "do not express; fp32 kept")
    if shape is not None and shape.shape is not None:
        out["train"] = {"micro_batch_size": shape.shape[0], "grad_accum": shape.grad_accum or 1}
        out["data"] = {"seq_len": shape.shape[1]}
        if shape.grad_accum is None:
            unknown["train.grad_accum"] = "no optimizer step finished while the forward was watched; 1 assumed"
    else:
        unknown["train.micro_batch_size"] = unknown["data.seq_len"] = (
            "the model's forward was never called with a 2-D input_ids")
    return {**out, "unknown": unknown}
