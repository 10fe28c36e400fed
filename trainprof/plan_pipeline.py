"""`trainprof plan` for pipeline stages (engine.pipeline_stages > 1): memory per stage, the analytic
bubble and the point-to-point volume, all estimates with their formulas.

Per stage: its decoder layers (the engine's split, engine.pipeline_layers or even), the embedding on
the first stage, the final norm and LM head on the last. Model states scale the unsplit model's
per-rank bytes (trainprof.plan, no ZeRO: the pipeline engine keeps fp32 master weights with AdamW)
by the stage's share of the parameters. Activations: the HF Llama count per layer and micro batch
(trainprof.plan._activations) times the micro batches a stage holds at its peak: GPipe keeps all m
(every forward runs before the first backward); 1F1B keeps min(p - s, m) on stage s (Narayanan et al.
2021, PipeDream-Flush: the first stage runs p warm-up forwards).
"""

from __future__ import annotations

from typing import Any

from trainprof.analysis.pipeline import ANALYTIC_FORMULA, boundary_bytes, gpipe_bubble_fraction, p2p_bytes_per_step
from trainprof.engines.stages import stage_layer_ranges
from trainprof.models import LlamaShape
from trainprof.recipe import Recipe


def in_flight_micro_batches(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """Micro batches whose activations stage `stage` holds at its peak (see the module docstring)."""
    return micro_batches if schedule == "gpipe" else min(stages - stage, micro_batches)


def pipeline_plan(recipe: Recipe, shape: LlamaShape, census: dict[str, Any], states_total_bytes: int,
                  activations: dict[str, Any], *, head_bytes: int, process_bytes: int) -> dict[str, Any]:
    """The plan's `pipeline` block.

    Args:
        recipe: a validated recipe with engine.pipeline_stages > 1.
        shape: the resolved shape.
        census: trainprof.plan._census of the meta model (total, embedding, layer_params).
        states_total_bytes: the unsplit model's model-state bytes on one rank (no sharding).
        activations: trainprof.plan._activations (hf_llama per micro batch, logits_loss).
        head_bytes: what the final norm and LM-head input save per micro batch (trainprof.plan.hf_saved_tensors).
        process_bytes: what every stage's process holds outside the allocator (the CUDA context).
    """
    e, t = recipe.engine, recipe.train
    p, m = e.pipeline_stages, t.grad_accum
    s, b, h, layers = recipe.data.seq_len, t.micro_batch_size, shape.hidden_size, shape.num_layers
    per_layer = census["layer_params"] // layers
    lm_head = shape.vocab_size * h  # untied
    norm = h
    used = activations["used"]
    act_all = activations["hf_llama"][used]["value"]
    head_act = head_bytes
    act_per_layer = (act_all - head_act) / layers
    logits = activations["logits_loss"]["value"]
    bytes_per_param = states_total_bytes / census["total"]
    rows = []
    for stage, rng in enumerate(stage_layer_ranges(layers, p, e.pipeline_layers)):
        first, last = stage == 0, stage == p - 1
        params = len(rng) * per_layer + (census["embedding"] if first else 0) + ((lm_head + norm) if last else 0)
        held = in_flight_micro_batches(e.pipeline_schedule, stage, p, m)
        act = held * (len(rng) * act_per_layer + ((head_act + logits) if last else 0))
        states = int(params * bytes_per_param)
        rows.append({"stage": stage, "layers": [rng.start, rng.stop], "params": params,
                     "model_states_bytes": states, "in_flight_micro_batches": held,
                     "activations_bytes": int(act), "cuda_context_bytes": process_bytes,
                     "gpu_total_bytes": int(states + act + process_bytes)})
    boundary = boundary_bytes(b, s, h)
    return {
        "stages": rows,
        "schedule": e.pipeline_schedule,
        "micro_batches": m,
        "bubble_frac_analytic": gpipe_bubble_fraction(p, m),
        "bubble_source": ANALYTIC_FORMULA + "; 1F1B idles as long as GPipe",
        "p2p_bytes_per_step_per_boundary": p2p_bytes_per_step(m, boundary),
        "p2p_source": (f"m x micro_batch_size x seq_len x hidden x 4 B each way per stage boundary (fp32 residual "
                       f"stream: the pipeline engine keeps fp32 master weights under autocast); {p - 1} boundaries"),
        "sources": {
            "params": "layers x params per decoder layer + embedding (first stage) + final norm and LM head (last)",
            "model_states_bytes": "params x the unsplit model's model-state bytes per param (no ZeRO with pipeline)",
            "activations_bytes": (f"in-flight micro batches x (layers x HF Llama activations per layer ({used}) + "
                                  "final norm, logits and loss on the last stage); GPipe holds all m micro batches, "
                                  "1F1B min(p - s, m) on stage s"),
            "cuda_context_bytes": "each stage's process: gpu_memory.rows.cuda_context",
            "gpu_total_bytes": ("model states + activations + the CUDA context; the per-rank gpu_memory rows "
                                "(autocast copies, AdamW's temporary, allocator rounding) are the unsplit model's"),
        },
    }


def render_pipeline(plan_pipeline: dict[str, Any]) -> list[str]:
    """Plain-text lines for `trainprof plan`."""
    gib = 2**30
    pp = plan_pipeline
    lines = ["", f"{'Pipeline stages':<30}{'layers':>8}{'params':>14}{'states GiB':>12}{'act GiB':>10}"
                 f"{'in flight':>10}{'GPU GiB':>10}"]
    for r in pp["stages"]:
        span = f"{r['layers'][0]}-{r['layers'][1] - 1}"
        lines.append(f"  stage {r['stage']:<22}{span:>8}{r['params']:>14,}"
                     f"{r['model_states_bytes'] / gib:>12.3f}{r['activations_bytes'] / gib:>10.3f}"
                     f"{r['in_flight_micro_batches']:>10}{r['gpu_total_bytes'] / gib:>10.3f}")
    for key, src in pp["sources"].items():
        lines.append(f"  {key}: {src}")
    p2p = pp["p2p_bytes_per_step_per_boundary"]
    lines += [f"  bubble (analytic, {pp['schedule']}, m={pp['micro_batches']}): {100 * pp['bubble_frac_analytic']:.1f}% "
              f"({pp['bubble_source']})",
              f"  p2p per step per boundary: activations {p2p['activations'] / 2**20:,.2f} MiB, gradients "
              f"{p2p['gradients'] / 2**20:,.2f} MiB ({pp['p2p_source']})"]
    return lines
