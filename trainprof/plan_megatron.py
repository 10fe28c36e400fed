"""`trainprof plan` for engine.kind megatron: parameters per rank under tensor and pipeline parallelism,
Megatron's model-state bytes with and without its distributed optimizer, activations and the GPU total
per rank, every figure an estimate beside its formula.

Parameters per rank, exactly as megatron-core splits them (tests/test_megatron.py builds the split
models): tensor parallelism (t) divides every linear layer and the vocabulary of the embedding and the
output layer; norms are replicated; pipeline parallelism (p) gives each stage L/p decoder layers, the
embedding to the first stage, the final norm and output layer to the last.

Model states: Megatron-Core's distributed-optimizer guide gives bytes per parameter by parameter and
main-gradient dtype (d = data-parallel ranks): fp16 20 or 4 + 16/d, bf16 (fp32 main gradients) 18 or
6 + 12/d, fp32 16 or 8 + 8/d; the distributed optimizer divides the optimizer term (fp32 master weights,
Adam's two moments, and for fp16 an fp32 gradient copy) by d. Activations: Korthikanti et al. 2022 for a
GPT layer under tensor parallelism without sequence parallelism, eq. 2, s*b*h*(10 + 24/t + 5*a*s/(h*t));
the s x s term only where attention stores the scores (eager); selective recomputation drops it; full
recomputation keeps 2*s*b*h per layer plus one layer. Under 1F1B the first stage holds min(p, m) micro
batches of its L/p layers (Narayanan et al. 2021).
"""

from __future__ import annotations

from typing import Any

from trainprof.models import LlamaShape
from trainprof.recipe import Recipe

# (params, grads, optimizer) bytes per parameter by model.dtype, Megatron-Core developer guide,
# Distributed Optimizer: docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/dist_optimizer.html
MEGATRON_STATE_BYTES = {"fp16": (2, 2, 16), "bf16": (2, 4, 12), "fp32": (4, 4, 8)}
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def _row(gpu_bytes: float, source: str) -> dict[str, Any]:
    return {"gpu_bytes": int(gpu_bytes), "cpu_bytes": 0, "source": source}


def layout(recipe: Recipe, world_size: int) -> dict[str, int]:
    """{tensor_parallel, pipeline_parallel, data_parallel} for `world_size` ranks (check_world_size has
    checked that tensor x pipeline divides it)."""
    tp, pp = recipe.engine.tensor_parallel, recipe.engine.pipeline_parallel
    return {"tensor_parallel": tp, "pipeline_parallel": pp, "data_parallel": world_size // (tp * pp)}


def stage_params(shape: LlamaShape, tp: int, pp: int) -> list[int]:
    """Parameters one tensor-parallel rank of each pipeline stage holds (megatron-core's split)."""
    h, kv_width, i = shape.hidden_size, shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    # linear_qkv h x (h + 2 kv), linear_proj h x h, linear_fc1 h x 2I (SwiGLU), linear_fc2 I x h: split by t;
    # the two RMSNorm weights are replicated
    layer = (h * (h + 2 * kv_width) + h * h + 3 * h * i) // tp + 2 * h
    vocab_rows = shape.vocab_size // tp * h
    stages = []
    for s in range(pp):
        n = shape.num_layers // pp * layer
        n += vocab_rows if s == 0 else 0  # embedding
        n += vocab_rows + h if s == pp - 1 else 0  # output layer + final norm
        stages.append(n)
    return stages


def _states(recipe: Recipe, params: int, dp: int) -> dict[str, Any]:
    """Model-state rows (params, grads, optimizer, total) for a rank holding `params` parameters."""
    dtype, distributed = recipe.model.dtype, recipe.engine.distributed_optimizer is not False
    param_b, grad_b, opt_b = MEGATRON_STATE_BYTES[dtype]
    opt_rank = params * opt_b / (dp if distributed else 1)
    split = f"/{dp} (distributed optimizer)" if distributed else "replicated (no distributed optimizer)"
    rows = {
        "params": _row(params * param_b, f"{param_b} B/param on this rank's shard and stage"),
        "grads": _row(params * grad_b, f"{grad_b} B/param main gradients (Megatron DDP buffer), not sharded"),
        "optimizer": _row(opt_rank, f"{opt_b} B/param fp32 master + Adam moments"
                                    f"{' + fp32 gradient copy' if dtype == 'fp16' else ''}; {split}"),
    }
    rows["total"] = _row(sum(r["gpu_bytes"] for r in rows.values()),
                         "sum of params, grads and optimizer states (Megatron-Core distributed optimizer guide)")
    return rows


def recompute_mode(recipe: Recipe) -> str:
    """"none", "full" (model.recompute) or "selective" (with engine.megatron_recompute=selective)."""
    if not recipe.model.recompute:
        return "none"
    return recipe.engine.megatron_recompute or "full"


def _layer_activations(recipe: Recipe, shape: LlamaShape, tp: int, mode: str) -> tuple[float, str]:
    """Bytes one decoder layer keeps for backward per micro batch under recompute `mode`, and the formula."""
    s, b, h, a = recipe.data.seq_len, recipe.train.micro_batch_size, shape.hidden_size, shape.num_heads
    scale = ACT_BYTES[recipe.model.dtype] / 2  # the paper counts 16-bit activations
    if mode == "full":
        return scale * 2 * s * b * h, "2*s*b*h (layer input; Korthikanti 2022 sec. 5)"
    scores = recipe.model.attention == "eager" and mode == "none"
    per_layer = scale * s * b * h * (10 + 24 / tp + (5 * a * s / (h * tp) if scores else 0))
    why = {"selective": "selective recompute re-runs the core attention",
           "none": "eager stores the s x s scores" if scores else "SDPA never stores the s x s scores"}[mode]
    return per_layer, f"s*b*h*(10 + 24/t{' + 5*a*s/(h*t)' if scores else ''}) (Korthikanti 2022 eq. 2; {why})"


def megatron_plan(recipe: Recipe, shape: LlamaShape, world_size: int) -> dict[str, Any]:
    """The plan's `megatron` block: layout, parameters per stage, model states and activations per rank
    of the fullest stage (the one with the largest GPU total)."""
    lay = layout(recipe, world_size)
    tp, pp, dp = lay["tensor_parallel"], lay["pipeline_parallel"], lay["data_parallel"]
    per_stage = stage_params(shape, tp, pp)
    mode = recompute_mode(recipe)
    layer, layer_src = _layer_activations(recipe, shape, tp, mode)
    rerun = _layer_activations(recipe, shape, tp, "none")[0] if mode == "full" else 0  # the layer re-running
    s, b = recipe.data.seq_len, recipe.train.micro_batch_size
    logits = s * b * (shape.vocab_size // tp) * (ACT_BYTES[recipe.model.dtype] + 4)  # + fp32 copy in the loss
    states = [_states(recipe, params, dp) for params in per_stage]
    acts = []
    for stage in range(pp):
        in_flight = min(pp - stage, recipe.train.grad_accum)  # 1F1B: stage s runs p - s warm-up forwards
        acts.append(in_flight * (shape.num_layers // pp) * layer + rerun + (logits if stage == pp - 1 else 0))
    totals = [st["total"]["gpu_bytes"] + act for st, act in zip(states, acts)]
    top = max(range(pp), key=totals.__getitem__)
    act_src = f"{min(pp - top, recipe.train.grad_accum)} micro batch(es) in flight x L/p layers x per_layer"
    act_src += " + one layer re-running without recompute" if rerun else ""
    act_src += " + logits s*b*V/t*(B + 4)" if top == pp - 1 else ""
    return {
        "layout": lay,
        "stage_params": per_stage,
        "fullest_stage": top,
        "per_rank": states[top],
        "activations": {
            "per_layer": {"value": int(layer), "unit": "bytes", "source": layer_src},
            "stage": {"value": int(acts[top]), "unit": "bytes", "source": act_src},
        },
        "gpu_total_per_rank": {"value": int(totals[top]), "unit": "bytes",
                               "source": f"stage {top} (the fullest): Megatron model states + activations"},
    }


def render_megatron(block: dict[str, Any]) -> list[str]:
    """Plain-text lines for the plan's megatron block."""
    lay, act = block["layout"], block["activations"]
    gib = 2**30
    lines = ["", f"Megatron layout: tensor {lay['tensor_parallel']} x pipeline {lay['pipeline_parallel']} x data "
                 f"{lay['data_parallel']}; parameters per rank by stage: "
                 + ", ".join(f"{n:,}" for n in block["stage_params"])]
    lines.append(f"  activations per layer {act['per_layer']['value'] / gib:,.3f} GiB  {act['per_layer']['source']}")
    lines.append(f"  activations, stage {block['fullest_stage']}  {act['stage']['value'] / gib:,.2f} GiB  "
                 f"{act['stage']['source']}")
    return lines
