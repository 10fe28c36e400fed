"""Recipe loading, overrides and every validation rule: one line naming the key, exit code 2."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest

from trainprof.recipe import (
    Recipe,
    RecipeError,
    apply_overrides,
    check_environment,
    load_recipe,
    recipe_from_dict,
    resolve_shape,
    shape_label,
)
from trainprof.shapes import SHAPES

from conftest import QUICKSTART, REPO


def test_quickstart_loads_typed():
    r = load_recipe(QUICKSTART)
    assert isinstance(r, Recipe)
    assert r.engine.zero_stage == 3 and r.model.name == "llama2-tiny" and r.output.name == "quickstart_cpu"


def test_defaults():
    r = recipe_from_dict({})
    assert r.data.seq_len == 350  # Zhang et al.'s (arXiv 2311.03687) sequence length
    assert r.task.kind == "pretrain" and r.engine.kind == "deepspeed"


def test_overrides_are_typed_and_short_keys_resolve():
    r = load_recipe(QUICKSTART, ["zero_stage=2", "train.micro_batch_size=4", "lr=1e-3", "recompute=true",
                                 "task.lora.target_modules=[q_proj, k_proj]", "deepspeed.zero_optimization.overlap_comm=true"])
    assert r.engine.zero_stage == 2 and r.train.micro_batch_size == 4
    assert r.optimizer.lr == 1e-3 and isinstance(r.optimizer.lr, float)
    assert r.model.recompute is True
    assert r.task.lora.target_modules == ["q_proj", "k_proj"]
    assert r.deepspeed == {"zero_optimization": {"overlap_comm": True}}


def test_deepspeed_passthrough_reaches_config():
    from trainprof.engines.deepspeed_engine import deepspeed_config

    r = load_recipe(QUICKSTART, ["deepspeed.zero_optimization.overlap_comm=true", "deepspeed.communication_data_type=fp32"])
    cfg = deepspeed_config(r, world_size=2)
    assert cfg["zero_optimization"] == {"overlap_comm": True, "stage": 3}
    assert cfg["communication_data_type"] == "fp32"
    assert cfg["train_batch_size"] == 4 * 1 * 2


def test_every_named_shape_is_real():
    from trainprof.models import SHAPES, resolve_shape

    r = Recipe()
    r.model.name = "llama2-70b"
    s = resolve_shape(r.model)
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.intermediate_size) == (8192, 80, 64, 8, 28672)
    assert {"llama2-7b", "llama2-13b", "llama2-70b", "llama2-tiny", "llama2-small"} <= set(SHAPES)


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


# (overrides on the quickstart recipe, text the one-line error must contain)
BAD_OVERRIDES = [
    (["engine.zero_stag=2"], "did you mean 'engine.zero_stage'"),
    (["micro_batch_sze=2"], "did you mean 'train.micro_batch_size'"),
    (["train.zero_stage=2"], "did you mean 'engine.zero_stage'"),
    (["foo.bar=1"], "; the top-level sections are data, deepspeed, engine, model, optimizer, output, profile, task, train"),
    (["train.foo=1"], "; keys of section 'train': train.cpu_allocator, train.grad_accum,"),
    (["zero_stage=5"], "'engine.zero_stage': 5 is out of range"),
    (["zero_stage=two"], "'engine.zero_stage': expected int"),
    (["lr=abc"], "'optimizer.lr': expected float"),
    (["model.dtype=fp8"], "'model.dtype': 'fp8' is not one of"),
    (["model.attention=flash3"], "'model.attention'"),
    (["model.name=llama3-8b"], "'model.name': unknown shape"),
    (["model.name=custom"], "'model.hidden_size' is required"),
    (["model.num_heads=3"], "'model.num_heads': 3 does not divide"),
    (["model.num_kv_heads=3"], "'model.num_kv_heads': 3 does not divide"),
    (["model.checkpoint=/nonexistent/ckpt"], "'model.checkpoint'"),
    (["data.seq_len=5000"], "'data.seq_len': 5000 exceeds"),
    (["data.seq_len=1"], "'data.seq_len' must be >= 2"),
    (["data.source=file"], "'data.path' is required"),
    (["data.source=file", "data.path=/nonexistent.txt"], "'data.path': file '/nonexistent.txt' not found"),
    (["train.micro_batch_size=0"], "'train.micro_batch_size': 0 is out of range"),
    (["train.grad_accum=0"], "'train.grad_accum'"),
    (["train.steps=0"], "'train.steps'"),
    (["train.warmup_steps=-1"], "'train.warmup_steps'"),
    (["optimizer.lr=0"], "'optimizer.lr'"),
    (["optimizer.betas=[0.9]"], "'optimizer.betas'"),
    (["optimizer.grad_clip=-1"], "'optimizer.grad_clip'"),
    (["optimizer.state_bits=16"], "'optimizer.state_bits': 16 is not one of 32 | 8 | 4"),
    (["optimizer.state_bits=4", "engine.offload=optimizer"], "'optimizer.state_bits': 4-bit states cannot combine"),
    (["optimizer.state_bits=8", "train.warmup_steps=0"], "'train.warmup_steps': 8-bit optimizer states compile"),
    (["engine.kind=torch"], "ZeRO stage 3 needs engine.kind deepspeed"),
    (["engine.kind=torch", "zero_stage=0", "deepspeed.zero_optimization.overlap_comm=true"], "recipe section 'deepspeed'"),
    (["zero_stage=0", "engine.offload=optimizer"], "'engine.offload': offload 'optimizer' needs DeepSpeed ZeRO"),
    (["zero_stage=2", "engine.offload=optimizer+params"], "parameter offload needs ZeRO stage 3"),
    (["task.kind=lora", "task.lora.target_modules=[qproj]"], "did you mean 'q_proj'"),
    (["task.kind=lora", "task.lora.r=0"], "'task.lora.r'"),
    (["task.kind=lora", "task.lora.dropout=1.5"], "'task.lora.dropout'"),
    (["task.kind=qlora", "zero_stage=3"], "qlora with ZeRO stage 3"),
    (["deepspeed.zero_optimization.stage=2"], "'deepspeed.zero_optimization.stage' conflicts with 'engine.zero_stage'"),
    (["deepspeed.train_micro_batch_size_per_gpu=8"], "conflicts with 'train.micro_batch_size'"),
    (["output.name=a/b"], "'output.name'"),
    (["kind=torch"], "ambiguous"),
    (["notakey"], "must look like key=value"),
]


@pytest.mark.parametrize("overrides,expected", BAD_OVERRIDES, ids=[o[0][-1] for o in BAD_OVERRIDES])
def test_bad_override_is_one_line_error(overrides, expected):
    with pytest.raises(RecipeError) as info:
        load_recipe(QUICKSTART, overrides)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_bad_files(tmp_path):
    with pytest.raises(RecipeError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(RecipeError, match=r"r.yaml. line \d+ is not valid YAML"):
        load_recipe(_write(tmp_path, "model:\n  name: [unclosed\n"))
    with pytest.raises(RecipeError, match="unknown recipe key 'modle'; did you mean 'model'"):
        load_recipe(_write(tmp_path, "modle:\n  name: llama2-tiny\n"))
    with pytest.raises(RecipeError, match="section 'train.' must be a mapping"):
        load_recipe(_write(tmp_path, "train: 3\n"))


def test_unknown_key_names_the_full_key_or_only_its_sections_keys(tmp_path):
    """A typo inside a YAML section is suggested as the dotted key to write; with no near miss, the error
    lists the keys of the section named (or the top-level sections), not every recipe key."""
    with pytest.raises(RecipeError, match=r"unknown recipe key 'train.micro_batch_sze'; did you mean "
                                          r"'train.micro_batch_size'\?$"):
        load_recipe(_write(tmp_path, "train:\n  micro_batch_sze: 4\n"))
    with pytest.raises(RecipeError) as info:
        load_recipe(_write(tmp_path, "task:\n  lora:\n    xyzzy: 1\n"))
    assert str(info.value).endswith("keys of section 'task.lora': task.lora.alpha, task.lora.dropout, task.lora.r, "
                                    "task.lora.target_modules")
    with pytest.raises(RecipeError) as info:
        load_recipe(QUICKSTART, ["foo.bar=1"])
    assert "micro_batch_size" not in str(info.value) and len(str(info.value)) < 200


def test_file_data_rules(tmp_path):
    text = tmp_path / "corpus.csv"
    text.write_text("a,b\n")
    with pytest.raises(RecipeError, match="must end in .txt or .jsonl"):
        load_recipe(QUICKSTART, ["data.source=file", f"data.path={text}"])
    good = tmp_path / "corpus.txt"
    good.write_text("hello")
    with pytest.raises(RecipeError, match="'data.tokenizer' is required"):
        load_recipe(QUICKSTART, ["data.source=file", f"data.path={good}"])
    with pytest.raises(RecipeError, match="'data.tokenizer': '/no/tok' is not a local directory"):
        load_recipe(QUICKSTART, ["data.source=file", f"data.path={good}", "data.tokenizer=/no/tok"])


def test_environment_rules():
    r = load_recipe(QUICKSTART, ["model.attention=flash2"])
    with pytest.raises(RecipeError, match="flash2 needs a CUDA GPU; use model.attention=sdpa"):
        check_environment(r, cuda_available=False)
    r = load_recipe(QUICKSTART, ["model.dtype=fp16"])
    with pytest.raises(RecipeError, match="fp16 training needs a CUDA GPU"):
        check_environment(r, cuda_available=False)
    check_environment(load_recipe(QUICKSTART), cuda_available=False)  # the quickstart itself is fine


def test_an_output_dir_that_cannot_be_written_is_refused_before_training(tmp_path, cli):
    """A file (or a dir without write permission) as output.dir: one line naming the key before any rank
    trains, where it was found only when the finished run was written. A dir still to be made is fine."""
    a_file = tmp_path / "afile"
    a_file.write_text("")
    r = load_recipe(QUICKSTART, [f"output.dir={a_file}/runs"])
    with pytest.raises(RecipeError, match=r"recipe key 'output.dir': cannot write run dirs to .*afile' is a file"):
        check_environment(r, cuda_available=False)
    check_environment(load_recipe(QUICKSTART, [f"output.dir={tmp_path}/new/runs"]), cuda_available=False)
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == [a_file]  # the check left nothing behind
    with pytest.raises(RecipeError, match=r"cannot write run dirs to '/proc/nope'.*'/proc' (is not writable|refuses)"):
        check_environment(load_recipe(QUICKSTART, ["output.dir=/proc/nope"]), cuda_available=False)  # root, too
    proc = cli("run", QUICKSTART, f"output.dir={a_file}", "--nproc", "2")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "output.dir" in proc.stderr, proc.stderr


def test_flash2_without_package_suggests_sdpa():
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    r = load_recipe(QUICKSTART, ["model.attention=flash2"])
    with pytest.raises(RecipeError, match="flash2 needs the flash-attn package.*sdpa"):
        check_environment(r, cuda_available=True)


@pytest.mark.parametrize("entry", [["-m", "trainprof.run"], ["-m", "trainprof", "run"], ["-m", "trainprof", "plan"]])
def test_cli_bad_recipe_exit_2_one_line_no_traceback(entry):
    proc = subprocess.run([sys.executable, *entry, str(QUICKSTART), "engine.zero_stage=9"],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["trainprof: recipe key 'engine.zero_stage': 9 is out of range; use 0, 1, 2 or 3"]


def test_apply_overrides_creates_sections():
    assert apply_overrides({}, ["train.steps=3"]) == {"train": {"steps": 3}}


def test_naming_a_shape_drops_a_custom_models_dims_but_not_a_named_ones():
    """A `custom` model's dims are its shape (a wrapped run records one): naming a shape replaces them,
    except dims the same overrides set. A named shape's explicit dims adjust it, and stay."""
    dims = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 4,
            "vocab_size": 256, "max_position_embeddings": 256}
    custom = {"model": {"name": "custom", "dtype": "bf16", **dims}}
    assert apply_overrides(copy.deepcopy(custom), ["model.name=llama2-70b"]) == {
        "model": {"name": "llama2-70b", "dtype": "bf16"}}
    assert apply_overrides(copy.deepcopy(custom), ["model.name=llama2-7b", "model.num_layers=4"])["model"] == {
        "name": "llama2-7b", "dtype": "bf16", "num_layers": 4}
    assert resolve_shape(recipe_from_dict(apply_overrides(copy.deepcopy(custom), ["model.name=llama2-70b"])).model) \
        == SHAPES["llama2-70b"]
    assert apply_overrides(copy.deepcopy(custom), ["model.num_layers=3"])["model"] == {
        "name": "custom", "dtype": "bf16", **dims, "num_layers": 3}
    named = {"model": {"name": "llama2-7b", "num_layers": 2}}
    assert apply_overrides(named, ["model.name=llama2-13b"])["model"] == {"name": "llama2-13b", "num_layers": 2}
    # which a projection's tables say: the kept dim beside the name, a dim equal to the named shape's left out
    adjusted = recipe_from_dict(apply_overrides(named, ["model.num_heads=40"])).model
    assert shape_label(adjusted) == "llama2-13b (num_layers 2)"
    assert shape_label(recipe_from_dict(apply_overrides(copy.deepcopy(custom), ["model.name=llama2-70b"])).model) \
        == "llama2-70b"
    assert shape_label(recipe_from_dict({**custom, "data": {"seq_len": 128}}).model) == "custom"


def test_cli_takes_overrides_after_options(cli):
    """`trainprof plan R.yaml --nproc 2 key=value`: overrides may follow options."""
    import json

    proc = cli("plan", QUICKSTART, "--nproc", "2", "--json", "train.micro_batch_size=3")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens_per_step"]["value"] == 3 * 256 * 2
    assert "on the meta device to count its parameters" in proc.stderr  # said before the import's silence


@pytest.mark.parametrize("command", ["plan", "run", "sweep", "maxbatch", "scale", "infer"])
def test_a_directory_given_as_the_recipe_is_called_one(command, cli):
    """`trainprof plan recipes`: it exists, so "not found" would mislead; every command that takes a recipe
    (or a sweep file) reads it through the one YAML loader."""
    proc = cli(command, REPO / "recipes")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"file '{REPO / 'recipes'}' is a directory; pass " in lines[0], lines
    assert ("recipes/sweeps/" if command == "sweep" else "recipes/quickstart_cpu.yaml") in lines[0]


def test_a_bad_count_option_names_the_option_not_a_function(cli):
    proc = cli("plan", QUICKSTART, "--nproc", "two")
    assert proc.returncode == 2 and "positive_int" not in proc.stderr
    assert proc.stderr.splitlines()[-1].endswith("argument --nproc: must be an integer >= 1, got 'two'")


@pytest.mark.parametrize("text", ["", "# only a comment\n\n   \n"])
def test_empty_recipe_file_refused(tmp_path, text, cli):
    """An empty file is a mistake (wrong file, lost content), not a request for the defaults."""
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=r"recipe file '.*empty\.yaml' is empty; .*\{\}"):
        load_recipe(path)
    proc = cli("plan", path, "--nproc", "2")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "is empty" in lines[0] and "empty.yaml" in lines[0]


def test_explicit_empty_mapping_means_all_defaults(tmp_path):
    path = tmp_path / "defaults.yaml"
    path.write_text("{}\n")
    r = load_recipe(path)
    defaults = recipe_from_dict({})
    defaults.output.name = "defaults"  # load_recipe names the run after the file
    assert r == defaults
    assert r.data.seq_len == 350 and r.output.name == "defaults"


def test_deepspeed_zero_defaults_are_deepspeeds():
    """The report and the projection read these instead of importing DeepSpeed: they must be its defaults."""
    from trainprof.plan_memory import quiet_deepspeed
    from trainprof.recipe import DEEPSPEED_ZERO_DEFAULTS

    with quiet_deepspeed():
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    fields = DeepSpeedZeroConfig().model_dump(by_alias=True)
    assert {key: fields[key] for key in DEEPSPEED_ZERO_DEFAULTS} == DEEPSPEED_ZERO_DEFAULTS
