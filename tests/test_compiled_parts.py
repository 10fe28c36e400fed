"""The model-part table ("Where a step goes, by part of the model") and the diff's model-part rows of a
torch.compile'd model: a compiled wrapper counts as the part its compiled module is, and a part whose modules
run inside compiled regions says so, naming the regions, instead of blaming the module depth. One eager and
one per-layer compiled run of a user's own loop (`model.model.layers[i] = torch.compile(layer)`, torchtitan
style) are shared by the tests that read them; the rest read profile dicts."""

from __future__ import annotations

import time

import pytest
import torch

from trainprof.report.document import render_markdown
from trainprof.report.sections import category_rows
from trainprof.report.summary import render_summary

LAYERS = ["model.layers.0", "model.layers.1"]


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(config)


def _own_loop(run_dir, compile_layers: bool) -> dict:
    """A user's own loop under trainprof.Profiler (README "In your own training loop"), 1 warm-up + 3 steps."""
    from trainprof import Profiler

    model = _tiny_llama()
    if compile_layers:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (2, 32))
    with Profiler(model, optimizer=opt, warmup_steps=1) as prof:
        for _ in range(4):
            with prof.step():
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.record(loss=loss)
    return prof.save(run_dir)


@pytest.fixture(scope="module")
def own_runs(tmp_path_factory):
    """(eager run dir, eager profile, compiled run dir, compiled profile)."""
    eager_dir, compiled_dir = tmp_path_factory.mktemp("own_eager"), tmp_path_factory.mktemp("own_compiled")
    return eager_dir, _own_loop(eager_dir, False), compiled_dir, _own_loop(compiled_dir, True)


def _row(summary: str, part: str) -> str:
    return next(line for line in summary.splitlines() if line.startswith(f"| {part} |"))


@pytest.mark.slow
def test_compiled_layers_are_counted_as_decoder_layers(own_runs):
    """The wrappers' rows carry the compiled layers' type: the decoder-layer row sums them, as the top
    modules table's share would, and no part blames the module depth (4, the default)."""
    _, _, compiled_dir, compiled = own_runs
    mods = {m["name"]: m for m in compiled["modules"]}
    assert [mods[n]["type"] for n in LAYERS] == ["LlamaDecoderLayer"] * 2
    rows = {r["label"]: r for r in category_rows(compiled)}
    assert rows["decoder layers"]["modules"] == 2
    assert rows["decoder layers"]["forward_ms"] == pytest.approx(sum(mods[n]["forward_ms"] for n in LAYERS))
    summary = render_summary(compiled, compiled_dir)
    assert "not profiled at this depth" not in summary
    assert "0.0%" not in _row(summary, "decoder layers")


@pytest.mark.slow
def test_parts_inside_compiled_regions_say_so(own_runs):
    """Attention and MLP run inside the compiled layers: their rows name the regions that timed them; the
    norms row counts the final norm and says it leaves out the layers' norms, inside those regions."""
    _, _, compiled_dir, compiled = own_runs
    inside = {m["name"]: m["type"] for m in compiled["compile"]["modules_inside"]}
    assert inside["model.layers.0.self_attn"] == "LlamaAttention" and inside["model.layers.1.mlp"] == "LlamaMLP"
    assert "model.layers.0.self_attn.q_proj" not in inside  # down to the profiled depth, as modules are
    rows = {r["label"]: r for r in category_rows(compiled)}
    assert rows["attention"]["modules"] == 0 and rows["attention"]["inside"] == [f"{n}.self_attn" for n in LAYERS]
    assert rows["attention"]["regions"] == LAYERS
    assert rows["norms"]["modules"] == 1 and len(rows["norms"]["inside"]) == 4
    summary = render_summary(compiled, compiled_dir)
    for part in ("attention", "MLP"):
        assert "inside compiled regions model.layers.0, model.layers.1: timed with them" in _row(summary, part)
        assert "0.0%" not in _row(summary, part)
    norms = _row(summary, "norms")
    assert norms.startswith("| norms | 1 timed; 4 more inside compiled regions model.layers.0, model.layers.1"), norms


@pytest.mark.slow
def test_diff_keeps_the_decoder_layers_and_compares_parts_over_modules_timed_on_both_sides(own_runs):
    """Eager A against per-layer compiled B: the decoder layers are compared (the part compile changes); norms
    compare only the final norm, timed in both, and the report says what each part leaves out and why."""
    from trainprof.report.diff_report import run_diff

    eager_dir, eager, compiled_dir, _ = own_runs
    d, doc = run_diff(eager_dir, compiled_dir, stat="median", plots=False)
    parts = {(r.name, r.phase): r for r in d.parts}
    assert ("decoder layers", "forward") in parts
    final_norm = next(m for m in eager["modules"] if m["name"] == "model.norm")
    assert parts[("norms", "forward")].a_ms == pytest.approx(final_norm["forward_ms"])
    assert ("attention", "forward") not in parts
    text = render_markdown(doc)
    assert ("attention: A's 2 modules (model.layers.0.self_attn, model.layers.1.self_attn) ran inside B's compiled "
            "regions model.layers.0, model.layers.1, timed with them: no row") in text
    assert "norms: A's 4 modules (" in text and "left out of the row" in text


def test_a_whole_model_wrapper_is_described_as_the_model_it_compiles():
    """`torch.compile(model)` (trainprof wrap's case): the root row is the model's type, and every module
    under it down to the depth is listed inside the one region, so each part can say where it went."""
    from trainprof.profiler.hooks import ModuleHooks
    from trainprof.profiler.log import StepLog

    hooks = ModuleHooks(torch.compile(_tiny_llama()), 4, StepLog(), now=time.perf_counter)
    try:
        assert hooks.modules[0].name == "" and hooks.modules[0].type == "LlamaForCausalLM"
        inside = {m["name"]: m["type"] for m in hooks.modules_inside_regions()}
    finally:
        hooks.close()
    assert inside["model.embed_tokens"] == "Embedding" and inside["lm_head"] == "Linear"
    assert inside["model.layers.0"] == "LlamaDecoderLayer" and "" not in inside


def _profile(modules: list[dict], compile_block: dict) -> dict:
    rows = [{"forward_ms": 1.0, "backward_ms": 2.0, "recompute_ms": 0.0, "self_forward_ms": 1.0,
             "self_backward_ms": 2.0, "self_recompute_ms": 0.0, "depth": m["name"].count(".") + 1, **m}
            for m in modules]
    return {"modules": rows, "compile": compile_block, "steps": [],
            "summary": {"step_ms": {"median": 10.0}, "phases_ms": {"optimizer": 1.0}}}


def test_a_whole_model_region_names_the_whole_model():
    profile = _profile([{"name": "", "type": "LlamaForCausalLM", "depth": 0}], {
        "compiled": True, "regions": [""], "modules_inside": [
            {"name": "model.embed_tokens", "type": "Embedding"}, {"name": "model.layers.0", "type": "LlamaDecoderLayer"},
            {"name": "model.norm", "type": "LlamaRMSNorm"}, {"name": "lm_head", "type": "Linear"}]})
    summary = render_summary(profile)
    for part in ("embedding", "decoder layers", "norms", "head"):
        row = _row(summary, part)
        assert "inside compiled region <whole model>: timed with it" in row and "0.0%" not in row, row


def test_a_profile_recorded_before_the_wrapped_type_was_kept_still_reports():
    """A profile written before the compiled module's type was recorded (wrappers typed OptimizedModule, no
    modules_inside): the report renders, says which rows it could not place, and does not blame the depth."""
    profile = _profile([{"name": "", "type": "LlamaForCausalLM", "depth": 0},
                        {"name": "model.embed_tokens", "type": "Embedding"},
                        *({"name": n, "type": "OptimizedModule"} for n in LAYERS)],
                       {"compiled": True, "regions": LAYERS, "modules_inside_regions": 24})
    summary = render_summary(profile)
    assert "not profiled at this depth" not in _row(summary, "attention")
    assert "none timed outside compiled regions model.layers.0, model.layers.1" in _row(summary, "attention")
    assert "model.layers.0, model.layers.1 are torch.compile wrappers" in summary
