"""Plan a recipe without training: parameters, per-rank memory, activations, FLOPs and tokens per step.

`estimate_plan(recipe, world_size)` builds the model on the meta device (nothing is allocated, so
llama2-70b plans in well under a second once torch and transformers are imported) and returns a
JSON-serialisable dict in which every figure is an estimate with a `source` string naming the
formula or call it came from. `render_plan(plan)` turns that dict into a plain-text table.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainprof.models import LlamaShape, build_model, count_params, logical_numel, resolve_shape
from trainprof.plan_memory import (CUDA_CONTEXT_BYTES, DTYPE_BYTES, SavedTensors, gpu_memory, quiet_deepspeed,
                                   render_gpu_memory, render_resident_memory, tensor_bytes)
from trainprof.recipe import Recipe

PLAN_SCHEMA_VERSION = 1
GIB = 2**30
# DeepSpeed's estimators want a node layout; plans assume HGX/DGX-style nodes of up to 8 GPUs.
GPUS_PER_NODE = 8
# DeepSpeed's estimators' default safety margin on their figures.
DEEPSPEED_BUFFER_FACTOR = 1.5
# bitsandbytes / QLoRA (Dettmers et al. 2023, sec. 3): 64 weights per first-level block, and with
# double quantization 256 first-level (8-bit) constants per second-level fp32 constant.
QLORA_BLOCKSIZE = 64
QLORA_BLOCKSIZE2 = 256


def _figure(value: int | float | None, source: str, unit: str) -> dict[str, Any]:
    return {"value": value, "unit": unit, "source": source}


def _memory(gpu_bytes: int, cpu_bytes: int, source: str) -> dict[str, Any]:
    return {"gpu_bytes": int(gpu_bytes), "cpu_bytes": int(cpu_bytes), "source": source}


# ---------------------------------------------------------------------------------------------
# Parameters: counted on the meta model, and analytically from the shape as a cross-check
# ---------------------------------------------------------------------------------------------

def _linear_dims(shape: LlamaShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each decoder linear layer, for LoRA's r*(in + out) per adapter."""
    h, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    i = shape.intermediate_size
    return {
        "q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }


def analytic_params(shape: LlamaShape, recipe: Recipe) -> dict[str, int]:
    """Parameter counts from the shape alone (untied lm_head, no biases, as in Llama2).

    Args:
        shape: the resolved model shape.
        recipe: used for the task kind and LoRA rank/targets.
    Returns:
        {"total", "trainable"}: LoRA adapters included in total, as peft adds them.
    """
    dims = _linear_dims(shape)
    per_layer = sum(i * o for i, o in dims.values()) + 2 * shape.hidden_size  # 7 linears + 2 RMSNorms
    base = 2 * shape.vocab_size * shape.hidden_size + shape.num_layers * per_layer + shape.hidden_size
    if recipe.task.kind == "pretrain":
        return {"total": base, "trainable": base}
    lo = recipe.task.lora
    # LoRA (Hu et al. 2021): A is r x in, B is out x r, per targeted linear per layer.
    adapters = shape.num_layers * sum(lo.r * sum(dims[name]) for name in lo.target_modules)
    return {"total": base + adapters, "trainable": adapters}


ANALYTIC_PARAMS_SOURCE = (
    "2*V*h (embed + untied lm_head) + L*(2*h^2 + 2*h*kv*d + 3*h*I + 2*h) + h; LoRA: L*sum r*(in+out)"
)


def _meta_census(recipe: Recipe) -> dict[str, Any]:
    """The census of the recipe's model built on the meta device, cached by what decides it (the model's
    dims and dtype, the task, the optimizer's groups): a projection's search plans many variants of one
    model, and each build of a 70B meta model takes about a second."""
    import json

    key = json.dumps([dataclasses.asdict(recipe.model) | {"attention": "sdpa", "recompute": False, "compile": False},
                      dataclasses.asdict(recipe.task), recipe.optimizer.weight_decay], sort_keys=True, default=str)
    return _census_cached(key, recipe)


_CENSUS_CACHE: dict[str, dict[str, Any]] = {}


def _census_cached(key: str, recipe: Recipe) -> dict[str, Any]:
    if key not in _CENSUS_CACHE:
        # Parameter shapes depend on neither the attention kernel nor recomputation; building with sdpa
        # works without flash-attn installed (flash2 recipes plan on a laptop).
        meta_model = dataclasses.replace(recipe.model, attention="sdpa", recompute=False)
        _CENSUS_CACHE[key] = _census(build_model(dataclasses.replace(recipe, model=meta_model), meta=True), recipe)
    return _CENSUS_CACHE[key]


def _census(model: Any, recipe: Recipe) -> dict[str, Any]:
    """What the memory and FLOP formulas need from the meta model, in logical elements."""
    counts = count_params(model)
    embedding = model.get_input_embeddings().weight.numel()
    layer_params = sum(p.numel() for name, p in model.named_parameters() if ".layers." in f".{name}")
    quantized: list[int] = []
    if recipe.task.kind == "qlora":
        import bitsandbytes as bnb

        quantized = [m.weight.numel() for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    # DeepSpeed's model_to_params convention: the largest parameter count held directly by one module
    # (its data_ptr de-duplication cannot work on meta tensors; Llama2 shares no parameters).
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    from trainprof.engines.optim import param_groups

    groups = param_groups(model, recipe.optimizer.weight_decay)
    embedding_weight = model.get_input_embeddings().weight
    return {
        "total": counts["total"],
        "trainable": counts["trainable"],
        "embedding": embedding,
        "layer_params": layer_params,
        "quantized_numels": quantized,
        "largest_layer": largest_layer,
        # what ZeRO's buffers and partitions are cut from: each module's own parameters in registration
        # order (HF Llama registers in forward order, but for the tiny norms), and the optimizer's
        # param groups (the engines' own split) of the trainable ones
        "module_numels": [[logical_numel(p) for p in m.parameters(recurse=False)] for m in model.modules()],
        "group_numels": [[logical_numel(p) for p in g["params"]] for g in groups],
        # trainable weights that go through a matmul (autocast casts them); an embedding lookup does not
        "matmul_trainable": sum(p.numel() for g in groups for p in g["params"]
                                if p.dim() >= 2 and p is not embedding_weight),
    }


def quantized_4bit_bytes(numel: int, *, double_quant: bool) -> int:
    """Bytes of one 4-bit quantized weight tensor with its quantization constants.

    Args:
        numel: logical elements of the weight.
        double_quant: 8-bit first-level constants plus fp32 second-level ones (else fp32 absmax).
    Returns:
        Bytes, per-tensor lookup tables (the 16-value NF4 code, under 1.2 KB) not included.
    """
    # QLoRA (Dettmers et al. 2023, sec. 3): 4-bit data is numel/2 bytes; one absmax per block of 64
    # weights, fp32 (32/64 = 0.5 bit/param) or, with double quantization, 8-bit per block plus one fp32
    # per 256 blocks (8/64 + 32/(64*256) = 0.127 bit/param).
    blocks = math.ceil(numel / QLORA_BLOCKSIZE)
    constants = blocks + 4 * math.ceil(blocks / QLORA_BLOCKSIZE2) if double_quant else 4 * blocks
    return math.ceil(numel / 2) + constants


# ---------------------------------------------------------------------------------------------
# Model states per rank: ZeRO accounting
# ---------------------------------------------------------------------------------------------


def _state_bytes(recipe: Recipe, census: dict[str, Any]) -> tuple[float, float, float, str]:
    """Bytes per trainable parameter for (params, grads, optimizer states) and the convention used."""
    param_b, grad_b, opt_b, convention = _fp32_state_bytes(recipe, census)
    bits = recipe.optimizer.state_bits
    if bits == 32:
        return param_b, grad_b, opt_b, convention
    from trainprof.engines.optim import TORCHAO_BLOCK_SIZE, TORCHAO_MIN_NUMEL

    block = TORCHAO_BLOCK_SIZE[bits]
    moment = bits / 8 + 4 / block  # codes + one fp32 scale per block
    opt_b = opt_b - 8 + 2 * moment  # every convention above holds the two moments in fp32
    return param_b, grad_b, opt_b, (
        f"{convention}; but the two Adam moments are torchao {bits}-bit block-quantized: {bits / 8:g} B + one "
        f"fp32 scale per {block} elements each ({2 * moment:g} B/param), assuming every state tensor qualifies "
        f"(>= {TORCHAO_MIN_NUMEL} elements, a multiple of {block}); the run measures the real bytes"
    )


def _fp32_state_bytes(recipe: Recipe, census: dict[str, Any]) -> tuple[float, float, float, str]:
    if recipe.model.dtype == "fp32":
        return 4, 4, 8, "fp32 Adam: 4 B params + 4 B grads + 8 B momentum/variance (no master copy; K=8)"
    if recipe.engine.kind == "deepspeed":
        return 2, 2, 12, (
            "mixed-precision Adam (ZeRO paper sec. 3.1): 2 B 16-bit params + 2 B grads + K=12 B fp32 "
            "master/momentum/variance; DeepSpeed casts every float param, LoRA adapters too, to 16-bit"
        )
    # trainprof's torch engine keeps trainable parameters in fp32 and runs the forward under autocast
    return 4, 4, 8, (
        f"torch engine, PyTorch AMP: trainable params kept in fp32 under {recipe.model.dtype} autocast: 4 B params "
        "+ 4 B grads + 8 B momentum/variance (no separate master copy; K=8)"
    )


def _model_states(recipe: Recipe, census: dict[str, Any], world_size: int) -> dict[str, Any]:
    stage, offload, n = recipe.engine.zero_stage, recipe.engine.offload, world_size
    param_b, grad_b, opt_b, convention = _state_bytes(recipe, census)
    trainable = census["trainable"]
    quantized = sum(census["quantized_numels"])
    frozen_dense = census["total"] - trainable - quantized  # frozen base kept in the model dtype
    quant = recipe.task.quant
    quantized_bytes = sum(
        quantized_4bit_bytes(q, double_quant=quant.double_quant) for q in census["quantized_numels"])
    param_bytes = trainable * param_b + frozen_dense * DTYPE_BYTES[recipe.model.dtype] + quantized_bytes

    # ZeRO (Rajbhandari et al. 2020), sec. 3.1 and 5: per rank, mixed-precision Adam holds
    # 2*Psi (params) + 2*Psi (grads) + K*Psi (optimizer, K=12) bytes; stage 1 (P_os) divides the
    # optimizer term by N_d, stage 2 (P_os+g) also the grads, stage 3 (P_os+g+p) also the params.
    # Frozen (LoRA base) params hold only the params term; only trainable params have grads/states.
    params_rank = math.ceil(param_bytes / (n if stage >= 3 else 1))
    grads_rank = math.ceil(trainable * grad_b / (n if stage >= 2 else 1))
    opt_rank = math.ceil(trainable * opt_b / (n if stage >= 1 else 1))

    split = {0: "replicated", 1: "replicated", 2: "replicated", 3: f"/{n} (ZeRO-3)"}
    per = "param" if trainable == census["total"] else "trainable param"
    param_src = f"{param_b:g} B/{per}"
    if trainable != census["total"]:
        param_src += f" + frozen base {DTYPE_BYTES[recipe.model.dtype]} B/param"
    if quantized:
        dq = "double-quant constants" if quant.double_quant else "fp32 absmax per 64"
        param_src += f", 4-bit linears 0.5 B/param + {dq} (QLoRA sec. 3)"
    params_on_cpu = offload == "optimizer+params"
    rows = {
        "params": _memory(
            0 if params_on_cpu else params_rank, params_rank if params_on_cpu else 0,
            f"{param_src}; {split[stage]}" + ("; offloaded to CPU" if params_on_cpu else ""),
        ),
        "grads": _memory(
            grads_rank, 0,
            f"{grad_b:g} B/{per}; " + (f"/{n} (ZeRO-{stage})" if stage >= 2 else "replicated"),
        ),
        "optimizer": _memory(
            0 if offload != "none" else opt_rank, opt_rank if offload != "none" else 0,
            f"{opt_b:g} B/{per}; " + (f"/{n} (ZeRO-{stage})" if stage >= 1 else "replicated")
            + ("; offloaded to CPU" if offload != "none" else ""),
        ),
    }
    rows["total"] = _memory(
        sum(r["gpu_bytes"] for r in rows.values()), sum(r["cpu_bytes"] for r in rows.values()),
        "sum of params, grads and optimizer states (ZeRO paper accounting)",
    )
    return {"convention": convention, "per_rank": rows}


def _fsdp_model_states(recipe: Recipe, census: dict[str, Any], world_size: int) -> dict[str, Any]:
    """Model states per rank under FSDP2 (engine.kind fsdp, trainprof's FSDPEngine): every parameter,
    gradient and optimizer state is sharded 1/N (fully_shard per decoder layer and on the root); trainable
    parameters are fp32 shards that a MixedPrecisionPolicy gathers in the model dtype, a frozen LoRA base
    stays in the model dtype. The gathered (unsharded) parameters are transient: with
    reshard_after_forward the root's (gathered from its forward to the end of backward: the engine leaves it to
    FSDP2's rule) plus two layers' (the one running and the one prefetched), without it every group's, held
    from forward to the end of backward."""
    n, e = world_size, recipe.engine
    trainable, dtype_b = census["trainable"], DTYPE_BYTES[recipe.model.dtype]
    frozen = census["total"] - trainable
    layers = max(resolve_shape(recipe.model).num_layers, 1)
    root = census["total"] - census["layer_params"]
    held = root + min(2, layers) * census["layer_params"] // layers if e.reshard_after_forward else census["total"]
    on_cpu = e.offload == "optimizer+params"
    sharded = f"/{n} (FSDP2 fully_shard)" + ("; CPUOffloadPolicy: on the host" if on_cpu else "")

    def row(nbytes: float, source: str) -> dict[str, Any]:
        return _memory(0 if on_cpu else math.ceil(nbytes), math.ceil(nbytes) if on_cpu else 0, source)

    rows = {
        "params": row((4 * trainable + dtype_b * frozen) / n, f"4 B/trainable param (fp32 shard) + {dtype_b} B/frozen "
                                                             f"param; {sharded}"),
        "grads": row(4 * trainable / n, f"4 B/trainable param (fp32, reduce_dtype); {sharded}"),
        "optimizer": row(8 * trainable / n, f"8 B/trainable param (AdamW momentum + variance, fp32); {sharded}"),
        "gathered": _memory(dtype_b * held, 0, (
            f"{dtype_b} B/param all-gathered in {recipe.model.dtype}: " + (
                "root + 2 decoder layers at a time (reshard_after_forward true)" if e.reshard_after_forward
                else "every group from forward to the end of backward (reshard_after_forward false)"))),
    }
    rows["total"] = _memory(sum(r["gpu_bytes"] for r in rows.values()), sum(r["cpu_bytes"] for r in rows.values()),
                            "sum of params, grads, optimizer states and gathered parameters")
    return {"convention": "FSDP2: fp32 sharded parameters and Adam states, gradients reduce-scattered in fp32 "
                          "(torchtitan's MixedPrecisionPolicy); the gathered row is transient", "per_rank": rows}


def _node_layout(world_size: int) -> tuple[int, int]:
    """(gpus_per_node, nodes) for DeepSpeed's estimator: one node up to 8 ranks, else nodes of 8."""
    if world_size <= GPUS_PER_NODE or world_size % GPUS_PER_NODE:
        return world_size, 1
    return GPUS_PER_NODE, world_size // GPUS_PER_NODE


def _deepspeed_estimate(recipe: Recipe, census: dict[str, Any], world_size: int) -> dict[str, Any]:
    """DeepSpeed's own model-state estimate, for pretraining under ZeRO-2/3 (its estimators' scope)."""
    stage, offload = recipe.engine.zero_stage, recipe.engine.offload
    if recipe.engine.kind != "deepspeed" or recipe.task.kind != "pretrain" or stage not in (2, 3):
        return {"applicable": False,
                "reason": "DeepSpeed ships estimators for full-model ZeRO-2/3 training only"}
    gpus_per_node, nodes = _node_layout(world_size)
    with quiet_deepspeed():
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    common = dict(total_params=census["total"], num_gpus_per_node=gpus_per_node, num_nodes=nodes,
                  cpu_offload=offload != "none", additional_buffer_factor=DEEPSPEED_BUFFER_FACTOR)
    if stage == 2:
        cpu, gpu = estimate_zero2_model_states_mem_needs(**common)
        call = "stage_1_and_2.estimate_zero2_model_states_mem_needs"
    else:
        # zero_init=True: trainprof's DeepSpeed engine builds ZeRO-3 models inside deepspeed.zero.Init.
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            largest_layer_params=census["largest_layer"], cpu_offload_params=offload == "optimizer+params",
            zero_init=True, **common,
        )
        call = "stage3.estimate_zero3_model_states_mem_needs (zero_init=True, + 4 B * largest layer)"
    return {
        "applicable": True,
        "gpu_bytes_per_gpu": int(gpu),
        "cpu_bytes_per_node": int(cpu),
        "layout": {"gpus_per_node": gpus_per_node, "nodes": nodes},
        "source": f"deepspeed.runtime.zero.{call}: its 18 B/param (adds a 4 B fp32 grad copy) per GPU; "
                  f"CPU figure is per node and includes additional_buffer_factor {DEEPSPEED_BUFFER_FACTOR}",
    }


# ---------------------------------------------------------------------------------------------
# Activations, FLOPs, tokens
# ---------------------------------------------------------------------------------------------


def fp32_residual(recipe: Recipe) -> bool:
    """Whether the forward runs under PyTorch AMP on fp32 weights with an fp32 residual stream: trainprof's
    torch engine (and its pipeline stages) keeps trainable params in fp32 and autocasts to the 16-bit
    dtype, so a pretrained model's embedding output and residual additions stay fp32. A LoRA base stays
    in the recipe's dtype, and so does its residual stream."""
    return recipe.engine.kind == "torch" and recipe.model.dtype != "fp32" and recipe.task.kind == "pretrain"


def hf_saved_tensors(recipe: Recipe, shape: LlamaShape) -> SavedTensors:
    """The tensors transformers' Llama saves for backward, as torch saved_tensors_hooks count them on CPU
    (tests/test_plan.py checks the sums, plain and under autocast)."""
    s, b, h = recipe.data.seq_len, recipe.train.micro_batch_size, shape.hidden_size
    act_b, amp, sbh = DTYPE_BYTES[recipe.model.dtype], fp32_residual(recipe), s * b * h
    eager = recipe.model.attention == "eager"
    # eager's repeat_kv copies k and v out to all heads; sdpa and flash2 take grouped k, v as they are
    kv_width = h if eager else shape.num_kv_heads * shape.head_dim
    # Per RMSNorm an fp32 input copy and the normed tensor (4 + B); then in B bytes the q/k/v input, q,
    # k, v, the attention output, the MLP input and four I-wide SwiGLU tensors. Under AMP the normed
    # tensor stays fp32 and three more h-wide B-byte tensors are saved (the casts feeding the linears).
    norms = [(4, 4 * sbh)] if amp else [(2, 4 * sbh), (2, act_b * sbh)]
    layer = norms + [(7 if amp else 4, act_b * sbh), (2, act_b * s * b * kv_width),
                     (4, act_b * s * b * shape.intermediate_size)]
    if eager:  # the fp32 softmax and its B-byte copy (one tensor when B is 4)
        scores = shape.num_heads * s * s * b
        layer += [(1, 4 * scores)] + ([(1, act_b * scores)] if act_b != 4 else [])
    head = [(2, 4 * sbh), (1, act_b * sbh)] if amp else [(1, 4 * sbh), (2, act_b * sbh)]  # final norm + lm_head input
    # HF ForCausalLMLoss: logits in the model dtype (kept in the output), an fp32 upcast, and
    # cross_entropy's fp32 log-softmax saved for backward
    n_logits = s * b * shape.vocab_size
    logits = [(1, act_b * n_logits)] + ([(1, 4 * n_logits)] if act_b != 4 else []) + [(1, 4 * n_logits)]
    # as backward starts, log_softmax's backward holds nll_loss's fp32 gradient, its saved fp32 output and
    # the fp32 gradient it makes, all at once (the 16-bit logits are no longer referenced)
    return SavedTensors(layer=layer, head=head, logits=logits, loss_backward=[(3, 4 * n_logits)],
                        layer_input=(4 if amp else act_b) * sbh)


def _hf_source(recipe: Recipe) -> str:
    act_b, eager = DTYPE_BYTES[recipe.model.dtype], recipe.model.attention == "eager"
    kv = "1" if eager else "kv/a"
    if fp32_residual(recipe):
        src = f"L*s*b*h*(2*(4+4) + B*(7 + 2*{kv} + 4*I/h))"
        head, how = " + s*b*h*(2*4+B)", f"; PyTorch AMP on fp32 weights: fp32 norm outputs, B-byte casts (B={act_b})"
    else:
        src, head, how = f"L*s*b*h*(2*(4+B) + B*(4 + 2*{kv} + 4*I/h))", " + s*b*h*(4+2B)", f", B={act_b}"
    soft_b = 4 + (act_b if act_b != 4 else 0)
    return src + (f" + L*{soft_b}*a*s^2*b" if eager else "") + head + how


def _activations(recipe: Recipe, shape: LlamaShape, saved: SavedTensors) -> dict[str, Any]:
    s, b = recipe.data.seq_len, recipe.train.micro_batch_size
    h, a, layers = shape.hidden_size, shape.num_heads, shape.num_layers
    act_b = DTYPE_BYTES[recipe.model.dtype]
    eager = recipe.model.attention == "eager"
    attn_src = "" if eager else "; no s x s term: sdpa/flash2 kernels never store the scores"

    # Korthikanti et al. 2022, eq. 1: s*b*h*(34 + 5*a*s/h) bytes per layer for 16-bit activations
    # (GPT layer: 4h GeLU MLP, dropout); 5*a*s^2*b is the stored s x s scores/softmax/dropout, which
    # memory-efficient kernels (sdpa, flash2) never materialise: they recompute it blockwise in backward.
    scale = act_b / 2
    paper_layer = scale * (34 * s * b * h + (5 * a * s * s * b if eager else 0))
    paper_src = "s*b*h*(34 + 5*a*s/h)" if eager else "s*b*h*34"
    paper_src += ", x2 for fp32" if act_b == 4 else ""

    hf_layer, hf_head = tensor_bytes(saved.layer), tensor_bytes(saved.head)
    # Korthikanti et al. 2022, sec. 5: full recomputation keeps only each layer's input, 2*s*b*h
    # (16-bit), plus one layer's full activations while that layer is recomputed in backward.
    keep = saved.layer_input * layers
    residual_b = saved.layer_input // (s * b * h)
    logit_b = tensor_bytes(saved.logits) // (s * b * shape.vocab_size)
    return {
        "used": "full_recompute" if recipe.model.recompute else "no_recompute",
        "korthikanti": {
            "no_recompute": _figure(
                int(layers * paper_layer), f"L*{paper_src} (Korthikanti 2022 eq. 1{attn_src})", "bytes"),
            "full_recompute": _figure(
                int(layers * act_b * s * b * h + paper_layer),
                f"L*2*s*b*h + one layer's {paper_src} (Korthikanti 2022 sec. 5)", "bytes"),
        },
        "hf_llama": {
            "no_recompute": _figure(layers * hf_layer + hf_head,
                                    f"{_hf_source(recipe)}: tensors HF Llama saves for backward{attn_src}", "bytes"),
            "full_recompute": _figure(
                keep + hf_layer + hf_head, f"L*{residual_b}*s*b*h layer inputs + one layer + final norm (HF count)",
                "bytes"),
        },
        "logits_loss": _figure(tensor_bytes(saved.logits),
                               f"s*b*V*{logit_b}: logits + fp32 upcast + fp32 log-softmax (HF loss)", "bytes"),
        "micro_batch_size": b,
        "seq_len": s,
    }


def _flops(recipe: Recipe, shape: LlamaShape, census: dict[str, Any], tokens_per_step: int) -> dict[str, Any]:
    layers, heads, head_dim, seq = shape.num_layers, shape.num_heads, shape.head_dim, recipe.data.seq_len
    n = census["total"] - census["embedding"]  # the input embedding is a lookup; lm_head is a matmul
    attention = 12 * layers * heads * head_dim * seq
    # PaLM (Chowdhery et al. 2022), appendix B: 6N + 12*L*H*Q*T FLOPs per token (fwd + bwd, no recompute)
    palm = 6 * n + attention
    out: dict[str, Any] = {
        "non_embedding_params": _figure(
            n, "total params minus the input embedding (lm_head kept: untied matmul)", "params"),
        "per_token_6n": _figure(palm, "PaLM app. B: 6N + 12*L*H*Q*T, N = params in matmuls (all but the input "
                                      "embedding; an untied LM head counts)", "flop"),
        "per_step_6n": _figure(palm * tokens_per_step, "per_token_6n * tokens_per_step (all ranks)", "flop"),
        "convention": "per_token_6n is the PaLM model-FLOP convention used for MFU",
    }
    if recipe.task.kind != "pretrain":
        trainable = census["trainable"]
        # Frozen base: forward 2N + input-gradient backward 2N (no weight gradients); adapters 6 per
        # param; the attention matmuls keep their full 12*L*H*Q*T.
        frozen = 4 * (n - trainable) + 6 * trainable + attention
        out["per_token_frozen_base"] = _figure(
            frozen, "4*N_frozen + 6*N_trainable + 12*L*H*Q*T (no weight grads for the frozen base)", "flop")
        out["per_step_frozen_base"] = _figure(
            frozen * tokens_per_step, "per_token_frozen_base * tokens_per_step", "flop")
        out["convention"] = ("per_token_6n: PaLM convention as if every param trained (comparable MFU); "
                             "per_token_frozen_base: the work a LoRA step actually does")
    if recipe.model.recompute:
        # Full recomputation re-runs every decoder layer's forward once more: 2*N_layers + 4*L*H*Q*T.
        extra = 2 * census["layer_params"] + attention // 3
        out["recompute_extra_per_token"] = _figure(
            extra, "2*N_layers + 4*L*H*Q*T: one more decoder forward (hardware FLOPs, not in MFU)", "flop")
    return out


def _startup_note(recipe: Recipe, total_params: int) -> str:
    """What building the model costs each process before the engine partitions it."""
    e = recipe.engine
    if e.kind == "megatron":
        return "Start-up: each rank builds and initialises only its tensor/pipeline shard, on its GPU."
    if e.kind == "deepspeed" and e.zero_stage == 3 and recipe.model.checkpoint is None:
        return ("Start-up: ZeRO-3 builds the model inside deepspeed.zero.Init, so each process only ever "
                "holds its partition of the parameters.")
    if recipe.task.kind == "qlora":
        return ("Start-up: QLoRA builds the model on the meta device and materialises and quantizes it one "
                "module at a time (a checkpoint is loaded 4-bit by transformers), so no process holds the "
                "whole 16-bit model.")
    full = DTYPE_BYTES[recipe.model.dtype] * total_params
    return (f"Start-up: every process builds the whole model in {recipe.model.dtype} before the engine sees "
            f"it: about {full / GIB:,.1f} GiB per process.")


HF_COUNT_NOTE = ("Korthikanti et al.'s eq. 1 is for a GPT layer (4h GeLU MLP, dropout); the HF Llama count adds "
                 "SwiGLU's I-wide tensors and fp32 RMSNorm copies, matches autograd's saved tensors on CPU within 3% "
                 "(tests/test_plan.py) and is the one summed into the GPU total.")


def _params_block(census: dict[str, Any], analytic: dict[str, int]) -> dict[str, Any]:
    return {
        "total": _figure(census["total"], "count_params(build_model(recipe, meta=True))", "params"),
        "trainable": _figure(census["trainable"], "count_params(build_model(recipe, meta=True))", "params"),
        "analytic_total": _figure(analytic["total"], ANALYTIC_PARAMS_SOURCE, "params"),
        "analytic_trainable": _figure(analytic["trainable"], ANALYTIC_PARAMS_SOURCE, "params"),
        "analytic_matches": analytic == {"total": census["total"], "trainable": census["trainable"]},
    }


def _notes(recipe: Recipe, census: dict[str, Any]) -> list[str]:
    engine = recipe.engine
    notes = [
        "All figures are analytic estimates, not measurements; run the recipe to measure.",
        "GPU total: the allocated peak (the larger of the forward/backward turn and the optimizer step, summing "
        "the gpu_memory rows live then) + the allocator's block rounding + the CUDA context. Not modelled: NCCL's "
        "own buffers (multi-GPU), cuBLAS/attention workspaces, fragmentation beyond block rounding.",
        HF_COUNT_NOTE,
        _startup_note(recipe, census["total"]),
    ]
    if recipe.task.kind != "pretrain":
        notes.append("LoRA/QLoRA activations are an upper bound: frozen linears need not save their inputs.")
    if engine.kind == "deepspeed" and engine.zero_stage == 0 and recipe.model.dtype == "bf16":
        notes.append("DeepSpeed bf16 at stage 0 uses BF16_Optimizer, which partitions fp32 master/optimizer "
                     "states like stage 1 and adds a 4 B/param fp32 gradient buffer; the figure shown is the "
                     "unpartitioned ZeRO-paper baseline.")
    if engine.offload != "none" and engine.kind == "deepspeed":
        notes.append("ZeRO-Offload also streams gradients to host memory; the GPU gradient row is an upper bound.")
    if engine.kind == "fsdp":
        notes.append("FSDP2: the gathered parameters are the model dtype's unsharded groups live at once; the "
                     "all-gather and reduce-scatter staging buffers (a group's size each, while its collective "
                     "runs) are not modelled.")
    if recipe.optimizer.state_bits != 32:
        notes.append(f"DeepSpeed's estimator assumes fp32 Adam states; the optimizer row counts the "
                     f"{recipe.optimizer.state_bits}-bit ones.")
    return notes


def estimate_plan(recipe: Recipe, world_size: int, *, device: str = "cuda") -> dict[str, Any]:
    """What a recipe would take per rank and per step, without training.

    Args:
        recipe: a validated recipe.
        world_size: data-parallel ranks (GPUs) the recipe would run on.
        device: "cuda" or "cpu", the device the run would take; the figures are the same, the text shows
            the GPU totals or the resident set a CPU run's peak RSS is compared with.
    Returns:
        A JSON-serialisable dict; every figure is an estimate with a `source` string beside it.
    """
    if world_size < 1:
        raise ValueError(f"world_size {world_size} must be >= 1; pass the number of data-parallel ranks")
    shape = resolve_shape(recipe.model)
    census = _meta_census(recipe)
    analytic = analytic_params(shape, recipe)
    train, engine = recipe.train, recipe.engine
    # a pipeline's stages share their samples, and so do Megatron's tensor x pipeline parallel ranks
    data_parallel = 1 if engine.pipeline_stages > 1 else world_size // (engine.tensor_parallel * engine.pipeline_parallel)
    tokens_per_step = train.micro_batch_size * train.grad_accum * recipe.data.seq_len * data_parallel
    states = (_fsdp_model_states if engine.kind == "fsdp" else _model_states)(recipe, census, world_size)
    saved = hf_saved_tensors(recipe, shape)
    activations = _activations(recipe, shape, saved)
    memory = gpu_memory(recipe, world_size, census, states["per_rank"], activations, saved, shape.num_layers)
    notes = _notes(recipe, census)
    model = recipe.model
    pipeline = None
    if engine.pipeline_stages > 1:
        from trainprof.plan_pipeline import pipeline_plan

        pipeline = pipeline_plan(recipe, shape, census, states["per_rank"]["total"]["gpu_bytes"]
                                 + states["per_rank"]["total"]["cpu_bytes"], activations,
                                 head_bytes=tensor_bytes(saved.head), process_bytes=CUDA_CONTEXT_BYTES)
        notes.append(f"Pipeline: {engine.pipeline_stages} stages, one per rank and no data parallelism; the per-rank "
                     "rows above are the unsplit model's, the 'pipeline' rows are per stage.")
    plan = {
        "schema_version": PLAN_SCHEMA_VERSION,
        "estimate": True,
        "recipe": {
            "model": model.name, "task": recipe.task.kind, "dtype": model.dtype, "attention": model.attention,
            "recompute": model.recompute, "engine": engine.kind, "zero_stage": engine.zero_stage,
            "offload": engine.offload, "seq_len": recipe.data.seq_len,
            "micro_batch_size": train.micro_batch_size, "grad_accum": train.grad_accum,
            "pipeline_stages": engine.pipeline_stages, "pipeline_schedule": engine.pipeline_schedule,
            "reshard_after_forward": engine.reshard_after_forward, "compile": model.compile,
        },
        "world_size": world_size,
        "device": device,
        "shape": {**dataclasses.asdict(shape), "head_dim": shape.head_dim},
        "params": _params_block(census, analytic),
        "model_states": {**states, "deepspeed_estimator": _deepspeed_estimate(recipe, census, world_size)},
        "activations": activations,
        "gpu_memory": memory,
        "gpu_allocated_per_rank": {
            **_figure(memory["allocated_peak"]["gpu_bytes"], memory["allocated_peak"]["source"], "bytes"),
            "rows": memory["allocated_peak"]["rows"], "phase": memory["allocated_peak"]["phase"]},
        "resident_per_rank": {
            **_figure(memory["resident_peak"]["bytes"], memory["resident_peak"]["source"], "bytes"),
            "rows": memory["resident_peak"]["rows"], "phase": memory["resident_peak"]["phase"]},
        "gpu_total_per_rank": {
            **_figure(memory["device_total"]["gpu_bytes"],
                      "gpu_memory.device_total: allocated peak (the larger of gpu_memory.peaks: "
                      f"{' + '.join(memory['allocated_peak']['rows'])}) + allocator_rounding + cuda_context", "bytes"),
            "rows": memory["device_total"]["rows"]},
        "tokens_per_step": _figure(tokens_per_step, "micro_batch_size * grad_accum * seq_len * data-parallel ranks (1 for a pipeline)", "tokens"),
        "flops": _flops(recipe, shape, census, tokens_per_step),
        "notes": notes,
        **({"pipeline": pipeline} if pipeline is not None else {}),
    }
    if engine.kind == "megatron":
        _apply_megatron(plan, recipe, shape, world_size)
    return plan


def _apply_megatron(plan: dict[str, Any], recipe: Recipe, shape: LlamaShape, world_size: int) -> None:
    """Megatron's accounting in place of the generic one: its split of the parameters over tensor and
    pipeline ranks, its model-state bytes, Korthikanti's activations with tensor parallelism
    (trainprof/plan_megatron.py), and selective recomputation's extra FLOPs."""
    from trainprof.plan_megatron import megatron_plan, recompute_mode

    block = megatron_plan(recipe, shape, world_size)
    plan["megatron"] = block
    plan["recipe"].update(block["layout"], distributed_optimizer=recipe.engine.distributed_optimizer is not False,
                          recompute_mode=recompute_mode(recipe))
    plan["model_states"].update(per_rank=block["per_rank"], convention=(
        "Megatron mixed precision (Megatron-Core distributed optimizer guide): 16-bit params, main gradients "
        "(fp32 for bf16), fp32 master weights + Adam moments; per rank of the fullest pipeline stage"))
    plan["activations"]["used"] = None  # the HF Llama counts stay for reference; Megatron's are in `megatron`
    plan["gpu_total_per_rank"] = plan["gpu_allocated_per_rank"] = block["gpu_total_per_rank"]
    if recompute_mode(recipe) == "selective":
        attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * recipe.data.seq_len
        plan["flops"]["recompute_extra_per_token"] = _figure(
            attention, "4*L*H*Q*T: the core attention's forward once more (selective recompute)", "flop")
    plan["notes"].remove(HF_COUNT_NOTE)
    plan["notes"].append("Megatron: per-rank rows hold this rank's tensor-parallel shard of the fullest pipeline "
                         "stage; parameter totals above are the whole model's (the same as the HF Llama's). The GPU "
                         "total sums Korthikanti et al.'s eq. 2 activations (a GPT layer under tensor parallelism), "
                         "not the HF Llama count shown for reference.")


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f}"


def _engine_line(plan: dict[str, Any]) -> str:
    r = plan["recipe"]
    batch = f"seq_len {r['seq_len']}, micro batch {r['micro_batch_size']}, grad accum {r['grad_accum']}"
    if r["engine"] == "megatron":
        return (f"  megatron tensor {r['tensor_parallel']} x pipeline {r['pipeline_parallel']} x data "
                f"{r['data_parallel']} ({plan['world_size']} ranks), distributed optimizer "
                f"{'on' if r['distributed_optimizer'] else 'off'}, recompute {r['recompute_mode']}, {batch}")
    sharding = (f"FSDP2 reshard_after_forward {r['reshard_after_forward']}" if r["engine"] == "fsdp"
                else f"ZeRO-{r['zero_stage']}")
    return (f"  {r['engine']} {sharding}, offload {r['offload']}, {plan['world_size']} data-parallel "
            f"ranks, {batch}")


def render_plan(plan: dict[str, Any]) -> str:
    """A plain-text table of a plan for the terminal.

    Args:
        plan: the dict from `estimate_plan`.
    Returns:
        Lines joined with newlines; sizes in GiB (2^30 bytes).
    """
    r, p, ms, act = plan["recipe"], plan["params"], plan["model_states"], plan["activations"]
    cpu = plan.get("device") == "cpu"  # plans saved before the key was added are GPU plans
    # on a CPU run the "device" is the process's own memory, and offloaded states live beside it
    device_gib, host_gib = ("GiB", "host GiB") if cpu else ("GPU GiB", "CPU GiB")
    lines = [
        f"Plan (estimates, no training): {r['model']} {r['task']}, {r['dtype']}, attention {r['attention']}, "
        f"recompute {'on' if r['recompute'] else 'off'}",
        _engine_line(plan),
        "",
        f"{'Parameters':<30}{'count':>16}  source",
    ]
    for key, label in (("total", "total"), ("trainable", "trainable"), ("analytic_total", "analytic total"),
                       ("analytic_trainable", "analytic trainable")):
        lines.append(f"  {label:<28}{p[key]['value']:>16,}  {p[key]['source']}")
    lines.append(f"  {'analytic matches model':<28}{'yes' if p['analytic_matches'] else 'NO':>16}")

    lines += ["", f"{'Model states per rank':<30}{device_gib:>10}{host_gib:>10}  source"]
    for key in [k for k in ms["per_rank"] if k != "total"] + ["total"]:
        row = ms["per_rank"][key]
        lines.append(f"  {key:<28}{_gib(row['gpu_bytes']):>10}{_gib(row['cpu_bytes']):>10}  {row['source']}")
    lines.append(f"  convention: {ms['convention']}")
    ds = ms["deepspeed_estimator"]
    if ds["applicable"]:
        lines.append(f"  {'DeepSpeed estimator':<28}{_gib(ds['gpu_bytes_per_gpu']):>10}"
                     f"{_gib(ds['cpu_bytes_per_node']):>10}  {ds['source']}")
    else:
        lines.append(f"  DeepSpeed estimator: n/a ({ds['reason']})")

    lines += ["", f"{'Activations per rank':<30}{device_gib:>10}  source"]
    for key, label in (("no_recompute", "no recompute"), ("full_recompute", "full recompute")):
        for family, who in (("korthikanti", "paper"), ("hf_llama", "HF count")):
            mark = " *" if act["used"] == key and family == "hf_llama" else ""
            fig = act[family][key]
            lines.append(f"  {f'{label}, {who}{mark}':<28}{_gib(fig['value']):>10}  {fig['source']}")
    star = " *" if act["used"] is not None else ""  # Megatron plans sum their own activations instead
    lines.append(f"  {'logits + loss' + star:<28}{_gib(act['logits_loss']['value']):>10}  {act['logits_loss']['source']}")
    if plan.get("megatron"):
        total = plan["gpu_total_per_rank"]
        lines.append(f"{'GPU total per rank':<30}{_gib(total['value']):>10}  {total['source']}")
    else:
        lines.append("  (* the rows gpu_memory sums below)")
        lines += (render_resident_memory if cpu else render_gpu_memory)(plan["gpu_memory"])

    fl = plan["flops"]
    lines += ["", f"{'Compute':<30}{'value':>16}  source"]
    tps = plan["tokens_per_step"]
    lines.append(f"  {'tokens per optimizer step':<28}{tps['value']:>16,}  {tps['source']}")
    for key, label in (("per_token_6n", "FLOPs/token (6N)"), ("per_step_6n", "FLOPs/step (6N)"),
                       ("per_token_frozen_base", "FLOPs/token (frozen base)"),
                       ("per_step_frozen_base", "FLOPs/step (frozen base)"),
                       ("recompute_extra_per_token", "recompute extra FLOPs/token")):
        if key in fl:
            lines.append(f"  {label:<28}{fl[key]['value']:>16.3e}  {fl[key]['source']}")
    lines.append(f"  convention: {fl['convention']}")
    if plan.get("pipeline"):
        from trainprof.plan_pipeline import render_pipeline

        lines += render_pipeline(plan["pipeline"])
    if plan.get("megatron"):
        from trainprof.plan_megatron import render_megatron

        lines += render_megatron(plan["megatron"])
    lines += ["", "Notes"] + [f"  - {n}" for n in plan["notes"]]
    return "\n".join(lines)
