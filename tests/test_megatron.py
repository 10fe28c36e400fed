"""The Megatron engine: what a CPU can check (recipe rules, the refusal without CUDA, GPTModel built for
every Llama2 shape with the HF model's parameter count, the module-name mapping, tensor/pipeline splits
against the plan, the profiler on megatron-core's tensor-parallel layers) and, on a GPU, training runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from trainprof.models import SHAPES, build_model, count_params, resolve_shape
from trainprof.recipe import RecipeError, check_environment, check_world_size, load_recipe

from conftest import QUICKSTART, REPO, run_trainprof

try:
    import megatron.core  # noqa: F401

    HAVE_MEGATRON = True
except ImportError:
    HAVE_MEGATRON = False
needs_megatron = pytest.mark.skipif(not HAVE_MEGATRON, reason="needs megatron-core (pip install 'trainprof[megatron]')")

MEGATRON = ["engine.kind=megatron", "engine.zero_stage=0"]


def megatron_recipe(*overrides: str):
    return load_recipe(QUICKSTART, [*MEGATRON, *overrides])


# -- recipe rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, key", [
    (["engine.kind=megatron"], "engine.zero_stage"),  # the quickstart runs ZeRO-3
    ([*MEGATRON, "engine.offload=optimizer"], "engine.offload"),
    ([*MEGATRON, "task.kind=lora"], "task.kind"),
    ([*MEGATRON, "task.kind=qlora"], "task.kind"),
    ([*MEGATRON, "optimizer.state_bits=4", "train.warmup_steps=1"], "optimizer.state_bits"),
    ([*MEGATRON, "model.attention=flash2"], "model.attention"),
    ([*MEGATRON, "deepspeed.zero_optimization.overlap_comm=true"], "deepspeed"),
    ([*MEGATRON, "engine.tensor_parallel=3"], "engine.tensor_parallel"),  # 4 heads
    ([*MEGATRON, "engine.pipeline_parallel=4"], "engine.pipeline_parallel"),  # 2 layers
    ([*MEGATRON, "engine.megatron_recompute=selective"], "engine.megatron_recompute"),  # model.recompute off
    (["engine.tensor_parallel=2"], "engine.tensor_parallel"),  # a Megatron key on DeepSpeed
    (["engine.distributed_optimizer=true"], "engine.distributed_optimizer"),
])
def test_combinations_megatron_cannot_run_are_refused_naming_the_key(overrides, key):
    with pytest.raises(RecipeError) as err:
        load_recipe(QUICKSTART, overrides)
    message = str(err.value)
    assert "\n" not in message and f"'{key}'" in message, message


def test_megatron_recipe_keys_and_world_size():
    r = megatron_recipe("engine.tensor_parallel=2", "engine.pipeline_parallel=2", "model.recompute=true",
                        "engine.megatron_recompute=selective")
    assert (r.engine.tensor_parallel, r.engine.pipeline_parallel, r.engine.megatron_recompute) == (2, 2, "selective")
    check_world_size(r, 8)
    with pytest.raises(RecipeError, match="'engine.tensor_parallel'.* 4 ranks per model replica does not divide the 6"):
        check_world_size(r, 6)


def test_megatron_needs_cuda_to_train():
    with pytest.raises(RecipeError, match="'engine.kind': megatron trains on a CUDA GPU only"):
        check_environment(megatron_recipe(), cuda_available=False)
    if HAVE_MEGATRON:
        check_environment(megatron_recipe(), cuda_available=True)  # what a GPU machine with megatron-core passes


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("recipe", ["llama1b_megatron.yaml", "llama7b_megatron.yaml"])
def test_run_refuses_megatron_without_cuda_in_one_line(tmp_path, recipe):
    proc = subprocess.run([sys.executable, "-m", "trainprof.run", str(REPO / "recipes" / recipe),
                           f"output.dir={tmp_path}"], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'engine.kind'" in lines[0] and "megatron" in lines[0], proc.stderr
    assert not list(tmp_path.iterdir()), "nothing is started before the refusal"


# -- the model on the meta device: every shape, parameter counts, module names --------------------------


@pytest.fixture(scope="module")
def one_rank_group():
    """torch.distributed and megatron-core's model-parallel groups, one rank (gloo, in-process store)."""
    from megatron.core import parallel_state

    dist = torch.distributed
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.xdist_group("megatron1")  # one worker makes the module's one_rank_group
@needs_megatron
@pytest.mark.parametrize("shape", list(SHAPES))
def test_megatron_gptmodel_has_the_hf_parameter_count(one_rank_group, shape):
    from trainprof.megatron_model import build_megatron_model

    recipe = megatron_recipe(f"model.name={shape}")
    megatron = build_megatron_model(recipe, device="meta")
    hf = build_model(recipe, meta=True)
    assert count_params(megatron) == count_params(hf)
    if shape == "llama2-70b":  # grouped-query attention: 8 key/value groups
        assert megatron.config.num_query_groups == 8 and hf.config.num_key_value_heads == 8


@pytest.mark.xdist_group("megatron1")  # one worker makes the module's one_rank_group
@needs_megatron
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_megatron_modules_map_onto_the_hf_parts(one_rank_group, attention):
    """Through MEGATRON_TO_HF, the report's parts (embedding, decoder layers, attention, MLP, norms, head)
    hold the same modules with the same parameters in both models."""
    from trainprof.megatron_model import build_megatron_model
    from trainprof.megatron_names import hf_module_names
    from trainprof.report.sections import CATEGORIES

    recipe = megatron_recipe(f"model.attention={attention}", "model.name=llama2-small")
    megatron = build_megatron_model(recipe, device="meta")
    hf = build_model(recipe, meta=True)
    names = hf_module_names(megatron)
    meg_rows = {names[n]: _row(names[n], m) for n, m in megatron.named_modules()}
    hf_rows = {n: _row(n, m) for n, m in hf.named_modules()}
    for label, match in CATEGORIES:
        meg, ref = _outermost(meg_rows, match), _outermost(hf_rows, match)
        assert ref and meg == ref, label
    for name in set(meg_rows) & set(hf_rows):  # every module both models have under one name
        extra = hf.model.embed_tokens.weight.numel() if name == "model" else 0  # HF's LlamaModel holds the embedding
        assert meg_rows[name]["params"] + extra == hf_rows[name]["params"], name
    assert not [n for n in meg_rows if n.startswith(("decoder", "output_layer", "embedding"))]


def _row(name: str, module: torch.nn.Module) -> dict:
    return {"name": name, "type": type(module).__name__, "params": sum(p.numel() for p in module.parameters())}


def _outermost(rows: dict[str, dict], match) -> dict[str, int]:
    """name -> params of the outermost modules a report category matches (as report/summary.py counts)."""
    members = {n for n, r in rows.items() if match(r)}
    return {n: rows[n]["params"] for n in members if not any(n.startswith(o + ".") for o in members if o)}


@needs_megatron
def test_sdpa_core_attention_is_causal_attention_with_grouped_heads():
    """SDPACoreAttention on megatron-core's [s, b, heads, d] layout against softmax(q k^T / sqrt(d)) v with
    a causal mask and each key/value group shared by heads / groups query heads."""
    from megatron.core.transformer.enums import AttnMaskType

    from trainprof.megatron_model import SDPACoreAttention, megatron_config

    config = megatron_config(megatron_recipe("model.name=llama2-70b", "model.dtype=fp32"), device="meta")
    attn = SDPACoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                             attention_type="self")
    s, b, heads, groups, d = 7, 2, 8, 2, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, n, d, generator=g) for n in (heads, groups, groups))
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    qh = q.permute(1, 2, 0, 3)
    kh, vh = (t.permute(1, 2, 0, 3).repeat_interleave(heads // groups, dim=1) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) / d**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    ref = (scores.softmax(-1) @ vh).permute(2, 0, 1, 3).reshape(s, b, heads * d)
    assert out.shape == (s, b, heads * d)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# -- planning ------------------------------------------------------------------------------------------


def test_plan_divides_megatron_states_by_its_layout():
    from trainprof.plan import estimate_plan
    from trainprof.plan_megatron import stage_params

    r = load_recipe(REPO / "recipes" / "llama7b_megatron.yaml",
                    ["engine.tensor_parallel=2", "engine.pipeline_parallel=2", "train.grad_accum=4"])
    plan = estimate_plan(r, world_size=16)
    shape = resolve_shape(r.model)
    block = plan["megatron"]
    assert block["layout"] == {"tensor_parallel": 2, "pipeline_parallel": 2, "data_parallel": 4}
    assert plan["params"]["total"]["value"] == 6_738_415_616  # the HF Llama-2-7b count
    # the two tensor-parallel ranks of each stage hold every parameter once, the norms (replicated) twice
    norms = shape.num_layers * 2 * shape.hidden_size + shape.hidden_size
    assert 2 * sum(block["stage_params"]) == plan["params"]["total"]["value"] + norms
    params = block["stage_params"][block["fullest_stage"]]  # the rows are the fullest stage's
    rows = plan["model_states"]["per_rank"]
    assert rows["params"]["gpu_bytes"] == 2 * params and rows["grads"]["gpu_bytes"] == 4 * params
    assert rows["optimizer"]["gpu_bytes"] == int(12 * params / 4)  # 6 + 12/d bytes per parameter (bf16)
    assert plan["tokens_per_step"]["value"] == 2 * 4 * 350 * 4  # micro batch x accumulation x seq x data ranks
    assert block["stage_params"] == stage_params(shape, 2, 2)
    no_dist = estimate_plan(load_recipe(REPO / "recipes" / "llama7b_megatron.yaml",
                                        ["engine.distributed_optimizer=false"]), world_size=8)
    assert no_dist["model_states"]["per_rank"]["optimizer"]["gpu_bytes"] == 12 * 6_738_415_616


# -- two CPU ranks: tensor/pipeline splits and the profiler on tensor-parallel layers --------------------


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("megatron2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "helpers" / "megatron_2rank.py"), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((out / f"megatron.rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.xdist_group("megatron2")  # one worker makes the module's two_rank_run
@needs_megatron
@pytest.mark.slow
def test_tensor_and_pipeline_splits_are_what_the_plan_counts(two_rank_run):
    from trainprof.plan_megatron import stage_params

    shape = resolve_shape(megatron_recipe().model)
    assert [r["tp2"]["params"] for r in two_rank_run] == stage_params(shape, 2, 1) * 2
    assert [r["pp2"]["params"] for r in two_rank_run] == stage_params(shape, 1, 2)
    first, last = (set(r["pp2"]["names"]) for r in two_rank_run)
    # each stage's layers keep their index in the whole model; the embedding and the head stay on their stage
    assert "model.layers.0" in first and "model.layers.1" not in first and "model.embed_tokens" in first
    assert "model.layers.1" in last and "model.layers.0" not in last and "lm_head" in last


@pytest.mark.xdist_group("megatron2")  # one worker makes the module's two_rank_run
@needs_megatron
@pytest.mark.slow
def test_profiler_on_tensor_parallel_megatron_layers(two_rank_run):
    """Module x phase under the HF names, the tensor-parallel all-reduces in forward and backward, phases
    that add up to the step, tokens counted once per model replica."""
    from trainprof.profiler.schema import validate_profile

    profile = two_rank_run[0]["profile"]
    validate_profile(profile)
    modules = {m["name"]: m for m in profile["modules"]}
    layers = resolve_shape(megatron_recipe().model).num_layers
    for i in range(layers):
        for part in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            m = modules[f"model.layers.{i}.{part}"]
            assert m["forward_ms"] > 0 and m["backward_ms"] > 0, m
        # RowParallelLinear's output all-reduce (o_proj, down_proj) in forward, ColumnParallelLinear's
        # input-gradient all-reduce (qkv, fc1) in backward: each inside its attention / MLP module
        assert modules[f"model.layers.{i}.self_attn"]["comm_ms"] > 0 and modules[f"model.layers.{i}.mlp"]["comm_ms"] > 0
    assert {"model.embed_tokens", "model.norm", "lm_head", "model"} <= set(modules)
    comm = {(c["op"], c["phase"]): c for c in profile["comm"]}
    forward, backward = comm[("all_reduce", "forward")], comm[("all_reduce", "backward")]
    assert forward["group_size"] == backward["group_size"] == 2
    # forward: the vocab-parallel embedding, o_proj and down_proj per layer, 3 in the vocab-parallel cross
    # entropy (max, target logit, sum of exp); backward: qkv and fc1 per layer, the LM head's input
    assert forward["calls"] == 1 + 2 * layers + 3 and backward["calls"] == 2 * layers + 1
    hidden = resolve_shape(megatron_recipe().model).hidden_size
    assert backward["bytes"] == (2 * layers + 1) * 2 * 32 * hidden * 4  # fp32 [s, b, h] per call
    s = profile["summary"]
    assert s["unattributed_frac"] <= 0.05, s["unattributed_frac"]  # host timer on 2 shared cores
    # one replica's tokens (the 2 tensor-parallel ranks read the same samples) over the slowest rank's median step
    slowest = max(r["step_ms_median"] for r in profile["ranks"])
    assert s["tokens_per_s"] == pytest.approx(2 * 32 / (slowest / 1e3), rel=1e-6)
    assert "tensor x pipeline parallel" in s["tokens_per_s_scope"]


@pytest.mark.xdist_group("megatron2")  # one worker makes the module's two_rank_run
@needs_megatron
@pytest.mark.slow
def test_megatron_cached_collectives_and_coalescing_are_captured(two_rank_run):
    """megatron-core calls collectives through references it took at import and batches its gradient
    buckets in a coalescing manager: one record with the batch's bytes, and everything put back."""
    cached = two_rank_run[0]["cached"]
    comm = {c["op"]: c for c in cached["comm"]}
    assert cached["reduced"] == 2.0  # the coalesced all-reduce ran (two ranks of ones)
    assert comm["all_reduce"]["calls"] == 1 and comm["all_reduce"]["bytes"] == (1000 + 24) * 4
    assert comm["all_gather_into_tensor"]["calls"] == 1 and comm["all_gather_into_tensor"]["bytes"] == 2 * 24 * 4
    assert all(c["group_size"] == 2 and c["exposed_ms"] > 0 for c in cached["comm"])
    assert cached["restored"]


# -- GPU: the engine itself ------------------------------------------------------------------------------


@needs_megatron
@pytest.mark.gpu
@pytest.mark.parametrize("overrides", [
    ["model.attention=sdpa"],
    ["model.attention=eager", "model.recompute=true"],
    ["model.attention=sdpa", "model.recompute=true", "engine.megatron_recompute=selective"],
], ids=["sdpa", "eager-full-recompute", "sdpa-selective-recompute"])
def test_megatron_engine_trains_and_profiles_on_gpu(tmp_path, overrides):
    run_dir, profile = run_trainprof(tmp_path, 1, *MEGATRON, "optimizer.lr=1e-3", *overrides, timeout=600)
    assert profile["engine"]["kind"] == "megatron" and profile["env"]["timer"] == "cuda_event"
    s = profile["summary"]
    assert s["unattributed_frac"] <= 0.02, s["unattributed_frac"]  # closure with CUDA events
    steps = [st for st in profile["steps"] if not st.get("warmup")]
    assert steps[-1]["loss"] < steps[0]["loss"]
    names = {m["name"] for m in profile["modules"]}
    assert {"model.embed_tokens", "model.layers.0.self_attn", "model.layers.0.mlp", "lm_head"} <= names
    assert not [n for n in names if n.startswith(("decoder", "output_layer"))]
    ops = {c["op"] for c in profile["comm"]}
    # the distributed optimizer: gradients reduce-scattered, updated parameters all-gathered (group of 1 here)
    assert {"reduce_scatter_tensor", "all_gather_into_tensor"} <= ops, ops
    total = count_params(build_model(megatron_recipe(), meta=True))["total"]
    assert profile["params"]["total"] == total
    # bf16 under Megatron: fp32 main gradients (its DDP buffer), fp32 master weights and two fp32 Adam moments
    states = profile["model_state_bytes"]
    assert states["grads"] >= 4 * total and states["master_params"] >= 4 * total
    assert states["optimizer_states"] >= 8 * total
    if "model.recompute=true" in overrides:
        assert s["phases_ms"]["recompute"] > 0
