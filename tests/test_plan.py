"""Tests for `trainprof plan`: every recipe plans, and the figures that can be checked are checked."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainprof.models import build_model, resolve_shape
from trainprof.plan import estimate_plan, quantized_4bit_bytes, render_plan
from trainprof.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict

REPO = Path(__file__).resolve().parents[1]
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make(name: str = "llama2-7b", kind: str = "pretrain", stage: int = 0, offload: str = "none",
         seq_len: int = 350, engine: str = "deepspeed", **model: Any) -> Recipe:
    """A validated recipe from the few keys these tests vary."""
    return recipe_from_dict({
        "model": {"name": name, **model},
        "task": {"kind": kind},
        "engine": {"kind": engine, "zero_stage": stage, "offload": offload},
        "data": {"seq_len": seq_len},
    })


def states(plan: dict[str, Any], row: str) -> tuple[int, int]:
    r = plan["model_states"]["per_rank"][row]
    return r["gpu_bytes"], r["cpu_bytes"]


def figures(node: Any) -> list[dict[str, Any]]:
    """Every figure dict in a plan: those with a value or GPU/CPU bytes."""
    found = []
    if isinstance(node, dict):
        if "value" in node or "gpu_bytes" in node or "gpu_bytes_per_gpu" in node:
            found.append(node)
        for child in node.values():
            found += figures(child)
    elif isinstance(node, list):
        for child in node:
            found += figures(child)
    return found


def check_plan(plan: dict[str, Any]) -> None:
    json.loads(json.dumps(plan))  # JSON-serialisable, round-trips
    assert plan["estimate"] is True
    assert plan["params"]["analytic_matches"], plan["params"]
    for fig in figures(plan):
        assert isinstance(fig.get("source"), str) and fig["source"], fig
    text = render_plan(plan)
    assert "estimates" in text and plan["recipe"]["model"] in text


# -- every recipe plans ----------------------------------------------------------------------------

RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.name for p in RECIPE_FILES])
def test_every_recipe_file_plans(path: Path) -> None:
    check_plan(estimate_plan(load_recipe(path), world_size=8))


CONSTRUCTED = [
    dict(name="llama2-tiny"),
    dict(name="llama2-7b", engine="torch"),
    dict(name="llama2-7b", stage=1),
    dict(name="llama2-7b", stage=2, seq_len=4096),
    dict(name="llama2-7b", stage=2, offload="optimizer"),
    dict(name="llama2-7b", stage=3, seq_len=4096, recompute=True),
    dict(name="llama2-7b", stage=3, offload="optimizer+params", attention="eager"),
    dict(name="llama2-7b", stage=2, dtype="fp32"),
    dict(name="llama2-7b", stage=2, attention="flash2"),  # plans without flash-attn installed
    dict(name="llama2-13b", stage=3),
    dict(name="llama2-13b", kind="lora", stage=2, recompute=True),
    dict(name="llama2-70b", stage=3, offload="optimizer", seq_len=4096),
    dict(name="llama2-7b", kind="lora"),
    dict(name="llama2-7b", kind="lora", stage=3, offload="optimizer+params"),
    dict(name="llama2-7b", kind="qlora", stage=2, offload="optimizer"),
    dict(name="llama2-70b", kind="qlora", recompute=True, seq_len=4096),
]


@pytest.mark.parametrize("keys", CONSTRUCTED, ids=[json.dumps(k) for k in CONSTRUCTED])
@pytest.mark.parametrize("world_size", [1, 8])
def test_constructed_recipes_plan(keys: dict[str, Any], world_size: int) -> None:
    check_plan(estimate_plan(make(**keys), world_size))


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size"):
        estimate_plan(make(name="llama2-tiny"), 0)


# -- parameters ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, total", [
    ("llama2-7b", 6_738_415_616), ("llama2-13b", 13_015_864_320), ("llama2-70b", 68_976_648_192),
])
def test_llama2_parameter_counts(name: str, total: int) -> None:
    params = estimate_plan(make(name=name), 1)["params"]
    assert params["total"]["value"] == params["analytic_total"]["value"] == total
    assert params["trainable"]["value"] == total


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_lora_trainable_params_match_peft_on_a_real_tiny_model(kind: str) -> None:
    recipe = recipe_from_dict({"model": {"name": "llama2-tiny", "dtype": "fp32"},
                               "task": {"kind": kind, "lora": {"r": 4, "target_modules": ALL_LINEARS}}})
    peft_trainable, _ = build_model(recipe).get_nb_trainable_parameters()
    params = estimate_plan(recipe, 1)["params"]
    assert params["trainable"]["value"] == params["analytic_trainable"]["value"] == peft_trainable


@pytest.mark.parametrize("double_quant", [True, False])
def test_qlora_4bit_bytes_match_bitsandbytes_tensors(double_quant: bool) -> None:
    import bitsandbytes as bnb

    recipe = recipe_from_dict({"model": {"name": "llama2-tiny", "dtype": "fp32"},
                               "task": {"kind": "qlora", "quant": {"double_quant": double_quant}}})
    measured = expected = 0
    for module in build_model(recipe).modules():
        if isinstance(module, bnb.nn.Linear4bit):
            w, qs = module.weight, module.weight.quant_state
            measured += w.untyped_storage().nbytes() + qs.absmax.nbytes
            if qs.nested:
                measured += qs.state2.absmax.nbytes
            expected += quantized_4bit_bytes(int(qs.shape.numel()), double_quant=double_quant)
    assert measured == expected > 0


# -- model states ----------------------------------------------------------------------------------


def test_zero3_model_states_shrink_as_one_over_world_size() -> None:
    small, large = (estimate_plan(make(stage=3), n) for n in (8, 64))
    for row in ("params", "grads", "optimizer", "total"):
        ratio = states(small, row)[0] / states(large, row)[0]
        assert ratio == pytest.approx(8, rel=1e-6), row


def test_zero2_keeps_params_whole_and_partitions_grads_and_optimizer() -> None:
    one, many = estimate_plan(make(stage=2), 1), estimate_plan(make(stage=2), 16)
    total = one["params"]["total"]["value"]
    assert states(one, "params") == states(many, "params") == (2 * total, 0)
    assert states(one, "grads")[0] == pytest.approx(16 * states(many, "grads")[0], rel=1e-6)
    assert states(one, "optimizer")[0] == 12 * total
    assert states(one, "optimizer")[0] == pytest.approx(16 * states(many, "optimizer")[0], rel=1e-6)


def test_a_frozen_head_never_holds_the_loss_and_zero2s_bucket_together() -> None:
    """LoRA/QLoRA at ZeRO-2: the first gradient (the bucket's allocation) comes after the loss's backward,
    so the forward/backward peak counts the larger of the two, where pretraining (whose LM head trains)
    counts both; QLoRA adds the largest base linear dequantized for its GEMM (h x I x 2 B). The H200's
    Llama2-7B LoRA peak held the bucket and no loss tensor (docs/memory.md)."""
    def rows(plan: dict[str, Any]) -> dict[str, int]:
        return {k: r["gpu_bytes"] for k, r in plan["gpu_memory"]["rows"].items()}

    def peak(plan: dict[str, Any]) -> int:
        return plan["gpu_memory"]["peaks"]["forward_backward"]["gpu_bytes"]

    pretrain, lora = (estimate_plan(make(kind=kind, stage=2), 1) for kind in ("pretrain", "lora"))
    assert rows(pretrain)["logits_loss"] > 0 and rows(lora)["logits_loss"] == 0
    assert rows(lora)["zero_reduce_bucket"] > rows(pretrain)["logits_loss"]
    assert peak(lora) == sum(rows(lora)[k] for k in ("params", "optimizer_states", "activations",
                                                       "zero_reduce_bucket"))
    qlora = estimate_plan(make(kind="qlora", stage=2), 1)
    shape = resolve_shape(make().model)
    assert rows(qlora)["qlora_dequantized_weight"] == shape.hidden_size * shape.intermediate_size * 2
    assert "qlora_dequantized_weight" not in rows(lora)
    # ZeRO-3's bucket is allocated once at start-up: the loss's tensors still add
    assert rows(estimate_plan(make(kind="lora", stage=3), 1))["logits_loss"] > 0


def test_zero1_partitions_only_optimizer_and_zero0_nothing() -> None:
    z0, z1 = estimate_plan(make(stage=0), 8), estimate_plan(make(stage=1), 8)
    total = z0["params"]["total"]["value"]
    assert states(z0, "total")[0] == 16 * total  # ZeRO paper: 2 + 2 + 12 bytes per param
    assert states(z1, "grads") == states(z0, "grads")
    assert states(z1, "optimizer")[0] == pytest.approx(12 * total / 8, abs=1)


@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128)])
def test_quantized_adam_states_shrink_only_the_moments(bits: int, block: int) -> None:
    fp32, quant = make(stage=2), make(stage=2)
    quant.optimizer.state_bits = bits
    a, b = estimate_plan(fp32, 8), estimate_plan(quant, 8)
    total = a["params"]["total"]["value"]
    # 4 B fp32 master stays; each moment is bits/8 B plus one fp32 scale per block (torchao)
    assert states(b, "optimizer")[0] == pytest.approx((4 + 2 * (bits / 8 + 4 / block)) * total / 8, abs=1)
    assert states(b, "params") == states(a, "params") and states(b, "grads") == states(a, "grads")
    assert f"torchao {bits}-bit" in b["model_states"]["convention"]


def test_optimizer_offload_moves_optimizer_states_to_cpu() -> None:
    on_gpu = estimate_plan(make(stage=2), 8)
    offloaded = estimate_plan(make(stage=2, offload="optimizer"), 8)
    assert states(offloaded, "optimizer") == (0, states(on_gpu, "optimizer")[0])
    assert states(offloaded, "params") == states(on_gpu, "params")
    assert states(offloaded, "total")[0] < states(on_gpu, "total")[0]


def test_param_offload_moves_params_to_cpu_too() -> None:
    on_gpu = estimate_plan(make(stage=3), 8)
    offloaded = estimate_plan(make(stage=3, offload="optimizer+params"), 8)
    assert states(offloaded, "params") == (0, states(on_gpu, "params")[0])
    assert states(offloaded, "optimizer") == (0, states(on_gpu, "optimizer")[0])
    assert states(offloaded, "total")[0] == states(on_gpu, "grads")[0]


def test_fp32_uses_4_4_8_bytes() -> None:
    plan = estimate_plan(make(stage=0, dtype="fp32"), 1)
    assert states(plan, "total")[0] == 16 * plan["params"]["total"]["value"]
    assert states(plan, "optimizer")[0] == 8 * plan["params"]["total"]["value"]


def test_lora_frozen_base_holds_params_only() -> None:
    plan = estimate_plan(make(kind="lora", stage=2), 1)
    total, trainable = plan["params"]["total"]["value"], plan["params"]["trainable"]["value"]
    assert states(plan, "params")[0] == 2 * total  # base and adapters in 16-bit
    assert states(plan, "grads")[0] == 2 * trainable
    assert states(plan, "optimizer")[0] == 12 * trainable


def test_qlora_base_is_about_half_a_byte_per_param() -> None:
    lora = estimate_plan(make(name="llama2-70b", kind="lora"), 1)
    qlora = estimate_plan(make(name="llama2-70b", kind="qlora"), 1)
    total = qlora["params"]["total"]["value"]
    qparams = states(qlora, "params")[0]
    assert 0.5 * total < qparams < 0.56 * total  # 4-bit + 0.127 bit constants + 16-bit embeddings
    assert qparams < states(lora, "params")[0] / 3.5


def test_deepspeed_estimator_is_beside_ours_for_pretrain_zero2_and_zero3() -> None:
    z2 = estimate_plan(make(stage=2), 8)
    total = z2["params"]["total"]["value"]
    ds = z2["model_states"]["deepspeed_estimator"]
    assert ds["applicable"] and ds["gpu_bytes_per_gpu"] == 2 * total + int(18 * total / 8)
    # DeepSpeed counts an extra 4 B/param fp32 gradient partition that the ZeRO paper's K=12 omits.
    assert ds["gpu_bytes_per_gpu"] - states(z2, "total")[0] == pytest.approx(4 * total / 8, abs=4)
    z3 = estimate_plan(make(stage=3), 8)["model_states"]["deepspeed_estimator"]
    assert z3["applicable"] and z3["gpu_bytes_per_gpu"] > states(estimate_plan(make(stage=3), 8), "total")[0]
    lora = estimate_plan(make(kind="lora", stage=2), 8)["model_states"]["deepspeed_estimator"]
    assert lora["applicable"] is False and lora["reason"]


# -- activations -----------------------------------------------------------------------------------


def activation(plan: dict[str, Any], family: str, mode: str) -> int:
    return plan["activations"][family][mode]["value"]


@pytest.mark.parametrize("family", ["korthikanti", "hf_llama"])
def test_recompute_lowers_activation_estimate(family: str) -> None:
    plain = estimate_plan(make(seq_len=4096), 1)
    recompute = estimate_plan(make(seq_len=4096, recompute=True), 1)
    assert activation(plain, family, "full_recompute") < activation(plain, family, "no_recompute") / 5
    assert plain["activations"]["used"] == "no_recompute"
    assert recompute["activations"]["used"] == "full_recompute"
    assert recompute["gpu_total_per_rank"]["value"] < plain["gpu_total_per_rank"]["value"]


@pytest.mark.parametrize("family", ["korthikanti", "hf_llama"])
def test_sdpa_is_lower_than_eager(family: str) -> None:
    sdpa = estimate_plan(make(seq_len=4096, attention="sdpa"), 1)
    eager = estimate_plan(make(seq_len=4096, attention="eager"), 1)
    flash2 = estimate_plan(make(seq_len=4096, attention="flash2"), 1)
    assert activation(sdpa, family, "no_recompute") < activation(eager, family, "no_recompute")
    assert activation(sdpa, family, "no_recompute") == activation(flash2, family, "no_recompute")


def test_korthikanti_eq1_figure() -> None:
    plan = estimate_plan(make(seq_len=4096, attention="eager"), 1)
    s, b, h, a, layers = 4096, 1, 4096, 32, 32
    assert activation(plan, "korthikanti", "no_recompute") == layers * s * b * h * (34 + 5 * a * s // h)


def saved_activation_bytes(recipe: Recipe, *, autocast: bool = False) -> int:
    """Bytes autograd saves for backward in one forward of a real model (parameters excluded).
    With `autocast`, as trainprof's torch engine runs it: fp32 weights under 16-bit autocast."""
    model = build_model(recipe)
    if autocast:
        for p in model.parameters():
            p.data = p.data.float()
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in param_storages:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, resolve_shape(recipe.model).vocab_size, (recipe.train.micro_batch_size, recipe.data.seq_len))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, labels=ids)
    return sum(saved.values())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_hf_llama_activation_count_matches_autograd(dtype: str, attention: str, kv_heads: int) -> None:
    recipe = recipe_from_dict({"model": {"name": "llama2-tiny", "dtype": dtype, "attention": attention,
                                         "num_kv_heads": kv_heads},
                               "data": {"seq_len": 256}, "train": {"micro_batch_size": 2}})
    plan = estimate_plan(recipe, 1)
    shape = resolve_shape(recipe.model)
    # autograd keeps only the fp32 log-softmax of the loss; the plan's logits row also counts the
    # model-dtype logits held in the output and the transient fp32 upcast.
    log_softmax = 2 * 256 * shape.vocab_size * 4
    expected = activation(plan, "hf_llama", "no_recompute") + log_softmax
    assert saved_activation_bytes(recipe) == pytest.approx(expected, rel=0.03)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_hf_llama_count_under_autocast_matches_autograd(attention: str, kv_heads: int) -> None:
    # the torch engine: fp32 weights, bf16 autocast; the residual stream and norm outputs stay fp32 and
    # autocast's weight copies are saved beside the activations
    recipe = recipe_from_dict({"model": {"name": "llama2-tiny", "dtype": "bf16", "attention": attention,
                                         "num_kv_heads": kv_heads},
                               "engine": {"kind": "torch", "zero_stage": 0},
                               "data": {"seq_len": 256}, "train": {"micro_batch_size": 2}})
    plan = estimate_plan(recipe, 1)
    copies = plan["gpu_memory"]["rows"]["autocast_weight_copies"]["gpu_bytes"]
    log_softmax = 2 * 256 * resolve_shape(recipe.model).vocab_size * 4
    expected = activation(plan, "hf_llama", "no_recompute") + copies + log_softmax
    assert saved_activation_bytes(recipe, autocast=True) == pytest.approx(expected, rel=0.03)
    plain = estimate_plan(recipe_from_dict({**recipe.to_dict(), "engine": {"kind": "deepspeed", "zero_stage": 0}}), 1)
    assert activation(plan, "hf_llama", "no_recompute") > activation(plain, "hf_llama", "no_recompute")


# -- GPU memory rows beyond the model states and activations ----------------------------------------


def rows(plan: dict[str, Any]) -> dict[str, Any]:
    return plan["gpu_memory"]["rows"]


@pytest.mark.parametrize("keys", CONSTRUCTED, ids=[json.dumps(k) for k in CONSTRUCTED])
def test_gpu_totals_sum_the_rows_they_name(keys: dict[str, Any]) -> None:
    plan = estimate_plan(make(**keys), 8)
    memory, table = plan["gpu_memory"], rows(plan)
    for phase, peak in memory["peaks"].items():
        assert peak["rows"] == [k for k, r in table.items() if phase in r["phases"]]
        assert peak["gpu_bytes"] == sum(table[k]["gpu_bytes"] for k in peak["rows"])
    allocated = plan["gpu_allocated_per_rank"]
    assert allocated["value"] == max(p["gpu_bytes"] for p in memory["peaks"].values())
    assert allocated["rows"] == memory["peaks"][allocated["phase"]]["rows"]
    assert plan["gpu_total_per_rank"]["value"] == (allocated["value"] + table["allocator_rounding"]["gpu_bytes"]
                                                   + table["cuda_context"]["gpu_bytes"])
    assert plan["gpu_total_per_rank"]["rows"] == ["allocated_peak", "allocator_rounding", "cuda_context"]
    for key in ("params", "grads", "optimizer_states", "activations", "logits_loss"):
        assert key in table  # the earlier rows stay, summed where they are live


def test_zero_buckets_follow_the_recipes_deepspeed_section() -> None:
    def bucket(stage: int, **zero: Any) -> dict[str, Any]:
        recipe = make(stage=stage)
        recipe.deepspeed = {"zero_optimization": zero}
        return rows(estimate_plan(recipe, 8))

    # DeepSpeed's default reduce_bucket_size 5e8 elements, in bf16; stage 3 allocates it once
    assert bucket(3)["zero_reduce_bucket"]["gpu_bytes"] == 2 * 500_000_000
    assert bucket(3, reduce_bucket_size=10**8)["zero_reduce_bucket"]["gpu_bytes"] == 2 * 10**8
    assert bucket(3, contiguous_gradients=False)["zero_reduce_bucket"]["gpu_bytes"] == 0
    # stages 1/2: one buffer during backward, two with overlap_comm; the all-gather runs in place
    z2 = bucket(2)
    assert z2["zero_reduce_bucket"]["gpu_bytes"] == 2 * 500_000_000
    assert z2["zero_reduce_bucket"]["phases"] == ["forward_backward"]
    assert bucket(2, overlap_comm=True)["zero_reduce_bucket"]["gpu_bytes"] == 2 * 2 * 500_000_000
    assert z2["zero_allgather_bucket"]["gpu_bytes"] == 0 and "all_gather_into_tensor" in z2["zero_allgather_bucket"]["source"]


def test_a_key_deepspeed_refuses_names_the_section() -> None:
    recipe = make(stage=3)
    recipe.deepspeed = {"zero_optimization": {"reduce_bucket_sise": 10}}
    with pytest.raises(RecipeError, match="recipe key 'deepspeed.zero_optimization.reduce_bucket_sise'"):
        estimate_plan(recipe, 8)


def test_zero3_gathered_window() -> None:
    from trainprof.plan_memory import _kept_at_turn

    one = rows(estimate_plan(make(stage=3), 1))
    assert one["zero3_gathered_params"]["gpu_bytes"] == one["zero3_prefetch"]["gpu_bytes"] == 0  # no copy on one rank
    # DeepSpeed's defaults: prefetching keeps the window at stage3_max_live_parameters (1e9) in bf16
    eight = rows(estimate_plan(make(stage=3), 8))
    assert eight["zero3_gathered_params"]["gpu_bytes"] + eight["zero3_prefetch"]["gpu_bytes"] == 2 * 10**9
    # no reuse, no prefetch: only the module backward fetches first (lm_head) is gathered at the turn
    recipe = make(stage=3)
    recipe.deepspeed = {"zero_optimization": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}}
    bare = rows(estimate_plan(recipe, 8))
    assert bare["zero3_gathered_params"]["gpu_bytes"] == 2 * 32000 * 4096 and bare["zero3_prefetch"]["gpu_bytes"] == 0
    # kept when twice the elements after a module are within the reuse distance
    assert _kept_at_turn([10, 10, 10, 10], 45) == 30
    assert _kept_at_turn([10, 10, 10, 10], 0) == 10
    # Llama's norms (<= 1e5 elements) stay whole on every rank
    norms = (2 * 32 + 1) * 4096
    assert eight["zero3_persistent_params"]["gpu_bytes"] == math.ceil(2 * norms * 7 / 8)


def test_zero_step_transient_is_the_largest_flat_gradient_copy() -> None:
    from trainprof.plan_memory import _sub_groups

    assert _sub_groups([[5, 5, 5, 5, 5]], 1, 10) == [10, 10, 5]
    assert _sub_groups([[5, 5, 5, 5, 5]], 2, 10) == [12, 3]  # partitions of ceil(5 / 2)
    total = 6_738_415_616
    z3 = rows(estimate_plan(make(stage=3), 8))["optimizer_step_transient"]
    assert z3["phases"] == ["optimizer_step"] and "_prepare_fp32_grad_for_sub_group" in z3["source"]
    # one sub group: the 2-D group's partition (< sub_group_size 1e9), bf16 flatten + fp32 copy
    norms = (2 * 32 + 1) * 4096
    assert z3["gpu_bytes"] == pytest.approx(6 * (total - norms) / 8, abs=6 * 300)
    z2 = rows(estimate_plan(make(stage=2), 8))["optimizer_step_transient"]
    assert z2["gpu_bytes"] == 6 * math.ceil((total - norms) / 8)
    assert rows(estimate_plan(make(stage=2, offload="optimizer"), 8))["optimizer_step_transient"]["gpu_bytes"] == 0


def test_offload_pins_host_buffers_in_powers_of_two() -> None:
    from trainprof.plan_memory import _pinned

    assert [_pinned(n) for n in (0, 1, 3, 4, 2**20 + 1)] == [0, 1, 4, 4, 2**21]
    plan = estimate_plan(make(stage=2, offload="optimizer"), 8)
    row = rows(plan)["offload_pinned_buffers"]
    assert row["gpu_bytes"] == 2 * 32000 * 4096  # the largest param, staged in bf16 on the GPU
    fp32_grads = 4 * (6_738_415_616 // 8)
    assert row["cpu_bytes"] > fp32_grads and "CachingHostAllocator" in row["source"]
    host = plan["gpu_memory"]["host_total"]
    assert host["cpu_bytes"] == states(plan, "total")[1] + row["cpu_bytes"]
    # the gradients live on the host under offload: the model-state row's GPU figure is an upper bound
    for stage, offload in ((2, "optimizer"), (3, "optimizer"), (3, "optimizer+params")):
        offloaded = estimate_plan(make(stage=stage, offload=offload), 8)
        assert rows(offloaded)["grads"]["gpu_bytes"] == 0 < states(offloaded, "grads")[0]


def test_torch_engine_rows() -> None:
    total, embedding = 6_738_415_616, 32000 * 4096
    norms = (2 * 32 + 1) * 4096
    one, eight = (rows(estimate_plan(make(engine="torch"), n)) for n in (1, 8))
    assert one["grads"]["phases"] == ["optimizer_step"]  # zero_grad(set_to_none=True) before the next forward
    assert one["optimizer_step_transient"]["gpu_bytes"] == 4 * total  # foreach AdamW's sqrt of exp_avg_sq
    assert one["autocast_weight_copies"]["gpu_bytes"] == 2 * (total - embedding - norms)
    assert "ddp_buckets" not in one and eight["ddp_buckets"]["gpu_bytes"] == 4 * total
    accumulating = make(engine="torch")
    accumulating.train.grad_accum = 2
    assert rows(estimate_plan(accumulating, 1))["grads"]["phases"] == ["forward_backward", "optimizer_step"]


def test_allocator_rounds_blocks_as_the_caching_allocator() -> None:
    from trainprof.plan_memory import allocator_block_bytes

    mib = 2**20
    assert allocator_block_bytes(1000) == 1024  # 512 B blocks
    assert allocator_block_bytes(5 * mib + 1) == 5 * mib + 512  # shares a 20 MiB segment
    assert allocator_block_bytes(10 * mib) == 10 * mib
    assert allocator_block_bytes(350 * 8 * 2048 * 2) == 12 * mib  # own segment, rounded to 2 MiB
    plan = estimate_plan(recipe_from_dict({"model": {"name": "llama2-1b"}, "engine": {"zero_stage": 3},
                                           "train": {"micro_batch_size": 8}}), 1)
    assert rows(plan)["allocator_rounding"]["gpu_bytes"] > 0


def test_plan_text_shows_the_memory_rows() -> None:
    text = render_plan(estimate_plan(make(stage=3, offload="optimizer"), 8))
    for label in ("GPU memory per rank", "zero_reduce_bucket", "zero3_gathered_params", "offload_pinned_buffers",
                  "optimizer_step_transient", "allocator_rounding", "cuda_context", "allocated peak",
                  "GPU total per rank", "Host memory per rank"):
        assert label in text, label


# -- FLOPs, tokens, speed --------------------------------------------------------------------------


def test_palm_flops_and_tokens_per_step() -> None:
    recipe = recipe_from_dict({"model": {"name": "llama2-7b"}, "data": {"seq_len": 4096},
                               "train": {"micro_batch_size": 2, "grad_accum": 4}})
    plan = estimate_plan(recipe, 8)
    n = 6_738_415_616 - 32000 * 4096  # minus the input embedding
    per_token = 6 * n + 12 * 32 * 32 * 128 * 4096  # PaLM appendix B
    assert plan["flops"]["per_token_6n"]["value"] == per_token
    assert plan["tokens_per_step"]["value"] == 2 * 4 * 4096 * 8
    assert plan["flops"]["per_step_6n"]["value"] == per_token * 2 * 4 * 4096 * 8
    assert "per_token_frozen_base" not in plan["flops"]


def test_lora_frozen_base_flops_below_6n() -> None:
    flops = estimate_plan(make(kind="lora", seq_len=4096, recompute=True), 1)["flops"]
    assert flops["per_token_frozen_base"]["value"] < flops["per_token_6n"]["value"]
    assert flops["per_token_frozen_base"]["value"] > 0.6 * flops["per_token_6n"]["value"]
    assert flops["recompute_extra_per_token"]["value"] > 0


def test_70b_plan_takes_seconds() -> None:
    estimate_plan(make(name="llama2-tiny"), 1)  # imports torch/transformers/deepspeed first
    start = time.perf_counter()
    for kind, stage in (("pretrain", 3), ("lora", 3), ("qlora", 2)):
        check_plan(estimate_plan(make(name="llama2-70b", kind=kind, stage=stage, seq_len=4096), 64))
    assert time.perf_counter() - start < 10


def test_json_on_stdout_stays_clean_in_a_fresh_process() -> None:
    # `trainprof plan --json` prints the plan to stdout; importing DeepSpeed on a CPU machine would
    # log a warning there unless plan.py silences it.
    code = ("import json; from trainprof.recipe import recipe_from_dict; from trainprof.plan import estimate_plan; "
            "print(json.dumps(estimate_plan(recipe_from_dict({'model': {'name': 'llama2-7b'}, "
            "'engine': {'zero_stage': 3}}), 8)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout)["model_states"]["deepspeed_estimator"]["applicable"] is True


def test_a_cpu_resident_set_holds_only_the_gradients_a_reduce_bucket_is_filled_with():
    """DeepSpeed's reduce bucket (reduce_bucket_size elements, 5e8 by default) is allocated whole, which a
    GPU's allocator counts; a CPU process's resident set holds only the pages the gradients fill. For the
    quickstart the bucket is ~1 GB of capacity and a few MB of gradients: the resident peak counts those."""
    from trainprof.plan_memory import zero_settings

    quickstart = REPO / "recipes" / "quickstart_cpu.yaml"
    for stage in (2, 3):
        recipe = load_recipe(quickstart, [f"engine.zero_stage={stage}"])
        plan = estimate_plan(recipe, world_size=2)
        z, rows = zero_settings(recipe), plan["gpu_memory"]["rows"]
        trainable = plan["params"]["trainable"]["value"]
        assert z.reduce_bucket_size > trainable  # the bucket is larger than the gradients
        bucket = rows["zero_reduce_bucket"]["gpu_bytes"]
        filled = bucket * trainable // z.reduce_bucket_size
        allocated, resident = plan["gpu_allocated_per_rank"], plan["resident_per_rank"]
        assert resident["rows"] == allocated["rows"] and "zero_reduce_bucket" in resident["rows"]
        assert resident["value"] == allocated["value"] - bucket + filled
    torch_plan = estimate_plan(load_recipe(quickstart, ["engine.kind=torch", "engine.zero_stage=0"]), world_size=2)
    assert torch_plan["resident_per_rank"]["value"] == torch_plan["gpu_allocated_per_rank"]["value"]  # no buffer
