"""torch.compile'd models profiled compiled (inductor's CPU backend): the recipe toggle model.compile
(each decoder layer compiled, torchtitan style) against the same run eager, and a whole model wrapped
in torch.compile given to the Profiler as a user's script would. One compiled and one eager run are
shared by the tests that read them (the first compile takes ~30 s on 2 cores)."""

from __future__ import annotations

import contextlib
import itertools
import json
import math

import pytest
import torch

from conftest import machine_lock, run_trainprof
from helpers.checks import check_closure, retry_on_noise
from trainprof.recipe import Recipe, RecipeError, recipe_from_dict

# fp32: compiled and eager losses agree to rounding; warm-up 1 makes the first (compiling) step the
# FLOP-counting one, whose dispatch mode used to make dynamo give up on nn.Module._call_impl for good.
# 4 x 128 tokens: the loop's ~0.2 ms a step outside every phase is ~2% of a 2 x 64 token step on this
# machine (eager and compiled alike), which the closure bound would measure instead of the compiled regions
TORCH = ["engine.kind=torch", "engine.zero_stage=0", "model.dtype=fp32", "profile.calibrate=false",
         "profile.ops_steps=1", "profile.trace_warmup=0", "train.micro_batch_size=4", "data.seq_len=128"]
LAYERS = ["model.layers.0", "model.layers.1"]
INSIDE = ["self_attn", "mlp", "input_layernorm", "post_attention_layernorm"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pytestconfig):
    """(eager run dir, eager profile, compiled run dir, compiled profile), both profiled the same way. The
    compiled run, whose closure a test bounds, has the machine to itself under pytest-xdist; the eager
    run's figures are only compared by structure, loss and FLOPs."""
    eager_dir, eager = run_trainprof(tmp_path_factory.mktemp("eager"), 1, *TORCH)
    machine = machine_lock(pytestconfig)
    with machine.alone() if machine is not None else contextlib.nullcontext():
        compiled_dir, compiled = run_trainprof(tmp_path_factory.mktemp("compiled"), 1, *TORCH, "model.compile=true",
                                               timeout=600)
    return eager_dir, eager, compiled_dir, compiled


@pytest.mark.xdist_group("compile")  # one worker makes the module's runs
@pytest.mark.slow
def test_compiled_layers_run_compiled_while_profiled(runs):
    _, eager, _, compiled = runs
    c = compiled["compile"]
    assert c["compiled"] and c["module_granularity"] == "compiled_region" and c["regions"] == LAYERS
    assert c["region_style"] == ["module.compile"]
    dynamo = c["dynamo"]
    assert dynamo["while_profiled"]["graphs_captured"] > 0 and dynamo["total"]["ops_captured"] > 0
    assert dynamo["total"]["graph_breaks"] == 0
    assert dynamo["during_measured_steps"]["frames_converted"] == 0  # no recompilation, no fallback while measured
    # the traced (measured) step ran inductor's code inside each layer, forward and backward
    compiled_rows = {(o["module"], o["phase"]) for o in compiled["ops"] if o["name"] == "inductor::compiled_graph"}
    assert {(layer, phase) for layer in LAYERS for phase in ("forward", "backward")} <= compiled_rows
    assert not any(o["name"] == "inductor::compiled_graph" for o in eager["ops"])
    assert eager["compile"] == {"compiled": False, "module_granularity": "module",
                                "module_times": eager["compile"]["module_times"]}
    assert "module_granularity" in compiled["measurement"]


@pytest.mark.xdist_group("compile")  # one worker makes the module's runs
@pytest.mark.slow
def test_compiled_profile_closes_and_times_each_layer(runs):
    _, eager, compiled_dir, compiled = runs
    check_closure(compiled)
    mods = {m["name"]: m for m in compiled["modules"]}
    for layer in LAYERS:
        assert mods[layer]["forward_ms"] > 0 and mods[layer]["backward_ms"] > 0
        assert mods[layer]["self_forward_ms"] == mods[layer]["forward_ms"]  # nothing inside has own times
        for child in INSIDE:
            assert f"{layer}.{child}" not in mods
            assert f"{layer}.{child}" in {m["name"] for m in eager["modules"]}
    # the FLOP-counting step ran compiled: the matmuls and attention it counted match the eager count
    assert compiled["summary"]["flops_per_step"] == pytest.approx(eager["summary"]["flops_per_step"], rel=0.01)
    summary = (compiled_dir / "summary.md").read_text()
    assert "- **compiled**: torch.compile, 2 compiled region(s)" in summary
    assert "compile" in (compiled_dir / "report.md").read_text()


@pytest.mark.xdist_group("compile")  # one worker makes the module's runs
@pytest.mark.slow
def test_compiled_loss_equals_eager(runs):
    _, eager, _, compiled = runs
    a = [s["loss"] for s in eager["steps"]]
    b = [s["loss"] for s in compiled["steps"]]
    assert len(a) == len(b) and all(math.isfinite(x) for x in b)
    for x, y in zip(a, b):
        assert abs(x - y) <= 1e-3 * abs(x), (a, b)
    assert b[-1] < b[0] - 0.5  # and it trains


@pytest.mark.xdist_group("compile")  # one worker makes the module's runs
@pytest.mark.slow
def test_diff_eager_vs_compiled(runs):
    from trainprof.report.diff_report import run_diff

    eager_dir, _, compiled_dir, _ = runs
    d, doc = run_diff(eager_dir, compiled_dir)
    assert [tuple(c) for c in d.recipe_changes] == [("model.compile", False, True)]
    assert {f"{layer}.{child}" for layer in LAYERS for child in INSIDE} <= set(d.only_a)
    assert {r.name for r in d.modules} >= set(LAYERS)
    from trainprof.report.document import render_markdown

    text = render_markdown(doc)
    assert "inside B's compiled region model.layers.0: timed with it" in text
    assert "B ran torch.compile'd" in text


@pytest.mark.slow
def test_profiler_on_a_torch_compile_wrapped_model():
    """The user's case: `model = torch.compile(model)`, then the Profiler on it. The wrapper is the one
    compiled region, module names carry no `_orig_mod`, and dynamo captures the graph while profiled, whole:
    a workload hook inside the region (on the HF model or its embedding) broke it into 3 graphs at 7 breaks,
    which the loop then ran after the profiler had gone."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainprof.profiler import Profiler

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=64, max_position_embeddings=32, use_cache=False)
    ids = torch.randint(0, 64, (2, 16))
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        model = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with Profiler(model, optimizer=opt, warmup_steps=1, module_depth=4) as prof:
            for _ in range(4):
                with prof.step():
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    prof.record(loss=loss)
        result = prof.result()
        losses[compiled] = [s["loss"] for s in result["steps"]]
    c = result["compile"]
    assert c["regions"] == [""] and c["region_style"] == ["torch.compile wrapper"]
    assert c["dynamo"]["while_profiled"]["graphs_captured"] > 0
    assert c["dynamo"]["total"]["graph_breaks"] == 0, c["dynamo"]
    assert c["dynamo"]["during_measured_steps"]["frames_converted"] == 0
    assert not any("_orig_mod" in m["name"] for m in result["modules"])
    assert "model.dtype" in result["workload"]["unknown"]  # its embedding is inside the region: autocast unseen
    assert [m["name"] for m in result["modules"]] == [""]
    assert result["modules"][0]["forward_ms"] > 0 and result["modules"][0]["backward_ms"] > 0
    assert losses[True] == pytest.approx(losses[False], rel=1e-3)
    json.dumps(result)


@pytest.mark.parametrize("overrides,key", [
    ({"task": {"kind": "qlora"}, "engine": {"kind": "torch"}}, "model.compile"),
    ({"engine": {"kind": "torch", "pipeline_stages": 2}}, "model.compile"),
    ({"engine": {"kind": "deepspeed", "zero_stage": 3}}, "model.compile"),
])
def test_compile_combinations_that_cannot_run_are_refused(overrides, key):
    data = {"model": {"compile": True}, **overrides}
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data)
    message = str(err.value)
    assert f"'{key}'" in message and "\n" not in message and "set " in message


def test_compile_is_a_recipe_key():
    assert Recipe().model.compile is False
    assert recipe_from_dict({"model": {"compile": True}, "engine": {"kind": "torch"}}).model.compile is True
    assert recipe_from_dict({"model": {"compile": True}, "engine": {"kind": "deepspeed", "zero_stage": 2}}).model.compile


@pytest.mark.slow
@pytest.mark.parametrize("engine", [["engine.kind=deepspeed", "engine.zero_stage=2"], ["engine.kind=fsdp", "engine.zero_stage=0"]],
                         ids=["deepspeed-zero2", "fsdp"])
def test_compiled_layers_under_sharding_engines(tmp_path, engine):
    """model.compile under DeepSpeed ZeRO-2 and FSDP2 on 2 ranks: compiled while profiled, the step closes,
    and (FSDP2) each layer's all-gathers and reduce-scatter still belong to it. Closure is timing: a run
    that the suite's other processes preempt between labels (2.9% once, 0.6% alone) is made once more."""
    attempt = itertools.count()

    def check() -> None:
        _, profile = run_trainprof(tmp_path / f"attempt{next(attempt)}", 2, *engine, "model.compile=true",
                                   "profile.calibrate=false", "profile.ops=false", timeout=600)
        c = profile["compile"]
        assert c["compiled"] and c["regions"] == LAYERS
        assert c["dynamo"]["while_profiled"]["graphs_captured"] > 0 and c["dynamo"]["total"]["graph_breaks"] == 0
        assert c["dynamo"]["during_measured_steps"]["frames_converted"] == 0
        assert profile["summary"]["unattributed_frac"] <= 0.02, profile["summary"]["unattributed_frac"]
        steps = [s for s in profile["steps"] if not s.get("warmup")]
        assert steps[-1]["loss"] < steps[0]["loss"] - 0.5, [s["loss"] for s in steps]
        if engine[0] == "engine.kind=fsdp":
            mods = {m["name"]: m for m in profile["modules"]}
            for layer in LAYERS:
                assert mods[layer]["self_comm_ops"] == {"all_gather_single": 2.0, "reduce_scatter_single": 1.0}

    retry_on_noise(check, attempts=2)
