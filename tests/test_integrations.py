"""`python -m trainprof.wrap` on unmodified scripts with the real libraries on CPU: an HF Trainer script,
a Lightning script and a plain DeepSpeed ZeRO-2 script on 2 ranks (gloo); exit codes pass through."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPTS = REPO / "tests" / "data" / "scripts"
STEPS, WARMUP = 5, 1  # the scripts' optimizer steps; trainprof.wrap's default warm-up
# The closure checked here (unattributed time within 2% of the step) is the median over the measured steps: a
# preempted step does not move it, so these tests share the machine with the other worker's (docs/suite.md).


def wrap(tmp_path: Path, script: str, *args: str, nproc: int = 0, timeout: int = 240,
         options: tuple[str, ...] = ()) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRAINPROF_OUTPUT_DIR": str(out),
           "PYTHONPATH": str(REPO)}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m"] if nproc
                else [sys.executable, "-m"])
    proc = subprocess.run([*launcher, "trainprof.wrap", *options, str(SCRIPTS / script), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, env=env)
    return proc, out


def the_run(out: Path, stem: str) -> tuple[Path, dict]:
    (run_dir,) = list(out.iterdir())
    assert run_dir.name.startswith(f"{stem}-")
    return run_dir, json.loads((run_dir / "profile.json").read_text())


def assert_profiled(run_dir: Path, profile: dict, tokens_per_step: int, kind: str) -> None:
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(measured) == STEPS - WARMUP  # one optimizer step (2 micro batches) = one profiled step
    assert all(s["tokens"] == tokens_per_step for s in measured), [s["tokens"] for s in measured]
    assert all(math.isfinite(s["loss"]) for s in measured)
    s = profile["summary"]
    assert s["unattributed_frac"] <= 0.02, s["unattributed_frac"]
    for phase in ("data_wait", "forward", "backward", "optimizer"):
        assert s["phases_ms"][phase] > 0, (phase, s["phases_ms"])
    assert profile["engine"]["kind"] == kind
    for name in ("summary.md", "modules.csv", "report.md", "report.html"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").rglob("events.out.tfevents.*"))
    report = (run_dir / "report.md").read_text()
    assert report.index("## The answer") < report.index("## What to change") < report.index("## Run facts")
    assert (run_dir / "summary.md").read_text().startswith("# trainprof profile\n\n## What to change")


def test_wrap_passes_output_and_exit_code(tmp_path):
    proc, out = wrap(tmp_path, "exit3.py", "a", "--b")
    assert proc.returncode == 3
    assert "exit3 says hello ['a', '--b']" in proc.stdout
    assert not out.exists()  # nothing was trained, so no run dir
    proc, _ = wrap(tmp_path, "raises.py")
    assert proc.returncode == 1
    assert "raises is about to fail" in proc.stdout and "RuntimeError: boom from the wrapped script" in proc.stderr
    assert "nothing profiled" not in proc.stderr  # the traceback is the news
    # a loop of its own: its model and optimizer are found at the first step, profiled from the next
    proc, out = wrap(tmp_path, "plain_loop.py")
    assert proc.returncode == 0 and "plain loop done" in proc.stdout, proc.stderr
    assert "torch run profiled" in proc.stderr and "nothing profiled" not in proc.stderr
    run_dir, profile = the_run(out, "plain_loop")
    assert profile["engine"]["kind"] == "torch" and len(profile["steps"]) == 2  # 3 optimizer steps, the first unprofiled


def test_wrap_options_are_checked_and_both_entries_say_the_same(cli, capsys):
    """`trainprof wrap` and `python -m trainprof.wrap` share one parser: negative counts are refused before
    the script runs, and both --help texts name what is attached to (Accelerate included)."""
    from trainprof.wrap import parse_args

    for option in ("--warmup-steps", "--module-depth"):
        proc = cli("wrap", option, "-1", "never_run.py")
        assert proc.returncode == 2 and f"argument {option}: must be an integer >= 0, got '-1'" in proc.stderr
        with pytest.raises(SystemExit):
            parse_args([option, "-1", "never_run.py"])
        assert f"argument {option}: must be an integer >= 0" in capsys.readouterr().err
    assert parse_args(["--warmup-steps", "0", "train.py", "--lr", "1"]).args == ["--lr", "1"]
    helps = [cli("wrap", "--help").stdout]
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    helps.append(capsys.readouterr().out)
    for text in helps:
        assert "Accelerate" in " ".join(text.split()) and "trainprof.Profiler" in text


def test_wrap_hf_trainer(tmp_path):
    proc, out = wrap(tmp_path, "hf_trainer.py", str(tmp_path / "hf"), "--steps", str(STEPS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"hf_trainer done: {STEPS} optimizer steps" in proc.stdout
    assert "[transformers]" not in proc.stderr, proc.stderr[-3000:]  # trainprof reads no deprecated name
    run_dir, profile = the_run(out, "hf_trainer")
    assert_profiled(run_dir, profile, tokens_per_step=2 * 2 * 32, kind="hf")
    assert profile["engine"]["config"]["gradient_accumulation_steps"] == 2
    # the Trainer divides each micro batch's loss by the step's tokens: the recorded loss is the step's
    # (random init over a 256-token vocab: about ln 256 = 5.55)
    assert all(abs(s["loss"] - math.log(256)) < 0.5 for s in profile["steps"])
    assert_projectable(run_dir, profile, model={"hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
                                                "num_heads": 4, "vocab_size": 256},
                       train={"micro_batch_size": 2, "grad_accum": 2}, seq_len=32, engine="torch")
    # on its own machine the memory moves from the run's highest phase peak (the script's loop has no runner), and
    # the rebuilt recipe's parts are probed at both depths. How near the step lands is test_projection's (timed):
    # this test shares the machine, and a spell over one shape's probe rounds once put the 4-layer step below the
    # 2-layer run's
    from helpers.projection import kinds
    from trainprof.projection.project import project, research_tables

    (deeper,) = project(run_dir, overrides=["model.num_layers=4"])["predictions"]
    peak = max(v for v in profile["summary"]["peak_memory_bytes"].values() if v)
    assert deeper["memory_per_rank_bytes"] > peak and deeper["change_kinds"] == ["model_size"], deeper.get("reasons")
    parts = kinds(deeper)["parts_probed"]
    assert (parts["source_layers"], parts["target_layers"]) == (2, 4) and deeper["step_ms"] > 0, parts
    # the research's tables are DeepSpeed's methods, whatever engine the script ran
    table = research_tables(run_dir, targets=["a800-80g"])["table_iii"]
    zero3 = next(r for r in table if r["model"] == "llama2-7b" and r["method"] == "ZeRO-3")["a800-80g"]
    assert zero3["tokens_per_s"] > 0 and zero3["fits"], zero3


def test_wrap_leaves_a_script_that_adds_the_callback_itself_to_that_callback(tmp_path):
    """Two profilers on one Trainer wrote two run dirs of the same steps, each timing the other's hooks. With
    no warm-up the FLOP-counting step is measured but left out of the medians, which the closing line says."""
    proc, out = wrap(tmp_path, "hf_trainer.py", str(tmp_path / "hf"), "--steps", "3", "--own-callback")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir, profile = the_run(out, "own")  # the script's callback's run dir, and no other
    assert "gives its HF Trainer trainprof's callback itself" in proc.stderr
    assert [s for s in profile["steps"] if not s.get("warmup")]
    (tmp_path / "cold").mkdir()
    proc, out = wrap(tmp_path / "cold", "hf_trainer.py", str(tmp_path / "hf"), "--steps", "3",
                     options=("--warmup-steps", "0"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, profile = the_run(out, "hf_trainer")
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(measured) == 3 and sum(bool(s.get("instrumented")) for s in measured) == 1
    assert "3 measured steps (2 in the medians, 1 instrumented)" in proc.stderr


def assert_projectable(run_dir: Path, profile: dict, *, model: dict, train: dict, seq_len: int, engine: str) -> None:
    """The wrapped run recorded what `trainprof project` needs (its shape, engine, batch), and a projection
    of it to another machine is a prediction, from the rebuilt recipe."""
    from trainprof.projection.project import project

    w = profile["workload"]
    assert profile["env"]["host_allocator"]["mode"] == "system"  # the user's script runs as it is
    assert {k: w["model"][k] for k in model} == model and w["train"] == train and w["data"] == {"seq_len": seq_len}
    assert w["engine"]["kind"] == engine and w["unknown"] == {}
    result = project(run_dir, targets=["h100-sxm"], gpus_per_node=1)
    (pred,) = result["predictions"]
    assert result["source"]["recipe_origin"] == "workload" and pred["step_ms"] > 0, pred.get("reasons")
    assert pred["tokens_per_step"] == train["micro_batch_size"] * train["grad_accum"] * seq_len
    # the script's time outside the phases (a Trainer's clipping, logging) is carried to the GPU as measured on
    # the CPU: past a tenth of the predicted step the row says so where the reader looks
    carried = pred["phases_ms"]["other"] + pred["phases_ms"]["data_wait"]
    marked = "of the step is the CPU run's time outside its phases, as measured" in pred["confidence_text"]
    noted = "carried_as_measured" in {a["kind"] for a in pred["assumptions"]}
    assert marked == noted == (carried > 0.1 * pred["step_ms"]), (carried, pred["step_ms"])
    # the recorded model is `custom`: naming a size predicts that size, not the recorded dims under its name
    (seven,) = project(run_dir, overrides=["model.name=llama2-7b"], targets=["h100-sxm"], gpus_per_node=1)["predictions"]
    assert seven["memory_per_rank_bytes"] > 6.7e9 * 2 and seven["step_ms"] > 10 * pred["step_ms"], seven


def test_wrap_lightning(tmp_path):
    proc, out = wrap(tmp_path, "lightning_module.py", "--steps", str(STEPS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"lightning done: {STEPS} optimizer steps" in proc.stdout
    run_dir, profile = the_run(out, "lightning_module")
    assert_profiled(run_dir, profile, tokens_per_step=2 * 2 * 32, kind="lightning")
    assert profile["engine"]["config"]["accumulate_grad_batches"] == 2


@pytest.mark.slow
def test_wrap_deepspeed_zero2_two_ranks(tmp_path):
    proc, out = wrap(tmp_path, "ds_zero2.py", "--steps", str(STEPS), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"ds_zero2 done: {STEPS} optimizer steps" in proc.stdout
    run_dir, profile = the_run(out, "ds_zero2")
    assert_profiled(run_dir, profile, tokens_per_step=2 * 2 * 128, kind="deepspeed")
    assert profile["env"]["world_size"] == 2 and len(profile["ranks"]) == 2
    assert sorted(p.name for p in run_dir.glob("profile.rank*.json")) == ["profile.rank0.json", "profile.rank1.json"]
    assert profile["engine"]["config"]["zero_optimization"]["stage"] == 2
    # the script's evaluation forward after each optimizer step (a quarter of a step's forward work) is neither a
    # step's work nor the next step's data wait (it read 8.3 ms of data wait beside a 27.9 ms forward)
    phases = profile["summary"]["phases_ms"]
    assert phases["data_wait"] < 0.1 * phases["forward"], phases
    assert_projectable(run_dir, profile, model={"hidden_size": 128, "num_layers": 2, "vocab_size": 256},
                       train={"micro_batch_size": 2, "grad_accum": 2}, seq_len=128, engine="deepspeed")
    assert profile["workload"]["engine"]["zero_stage"] == 2
    assert any(c["op"] in ("all_reduce", "reduce_scatter", "reduce") or "reduce" in c["op"] for c in profile["comm"]), \
        profile["comm"]


def test_lightning_callback_in_a_script(tmp_path):
    """The public callback, given to a Lightning Trainer by hand (no wrap)."""
    import lightning as L
    import torch

    from trainprof.integrations.lightning import TrainprofCallback

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 1, generator=g))
    callback = TrainprofCallback(output_dir=tmp_path / "runs", name="tiny", warmup_steps=2)
    trainer = L.Trainer(max_steps=6, accumulate_grad_batches=3, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    assert callback.run_dir is not None and callback.run_dir.parent == tmp_path / "runs"
    profile = json.loads((callback.run_dir / "profile.json").read_text())
    assert len([s for s in profile["steps"] if not s.get("warmup")]) == 6 - 2
    assert profile["summary"]["unattributed_frac"] <= 0.02
    # no child with a config holds the parameters: the LightningModule stays the root, its net a child
    assert {"net.0", "net.2"} <= {m["name"] for m in profile["modules"]}, [m["name"] for m in profile["modules"]]


LIGHTNING_VOCAB = 256  # random init: the loss starts near ln 256 = 5.55


def lightning_llama_run(out: Path, accumulate: int) -> tuple[Path, dict]:
    """A LightningModule holding a tiny random-init HF Llama, as users write one, trained 4 optimizer steps
    (micro batch 2, sequence 32) with the callback: (run dir, profile)."""
    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainprof.integrations.lightning import TrainprofCallback

    class LitLlama(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=4,
                                                      vocab_size=LIGHTNING_VOCAB, max_position_embeddings=64))

        def training_step(self, batch, batch_idx):
            return self.model(input_ids=batch, labels=batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.randint(0, LIGHTNING_VOCAB, (64, 32), generator=torch.Generator().manual_seed(0))
    callback = TrainprofCallback(output_dir=out, name=f"lit-llama-acc{accumulate}")
    trainer = L.Trainer(max_steps=4, accumulate_grad_batches=accumulate, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.fit(LitLlama(), torch.utils.data.DataLoader(data, batch_size=2))
    return callback.run_dir, json.loads((callback.run_dir / "profile.json").read_text())


@pytest.fixture(scope="module")
def lightning_llama_runs(tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    """accumulate_grad_batches -> its run; one run each, shared by the tests below."""
    return {acc: lightning_llama_run(tmp_path_factory.mktemp(f"lightning-acc{acc}"), acc) for acc in (1, 2)}


def test_lightning_records_the_steps_loss_whatever_the_accumulation(lightning_llama_runs):
    """Lightning divides training_step's loss by accumulate_grad_batches before backward: the recorded loss
    is training_step's, the same at 1 and 2 micro batches a step."""
    mean_loss = {}
    for acc, (_, profile) in lightning_llama_runs.items():
        losses = [s["loss"] for s in profile["steps"]]
        assert all(abs(x - math.log(LIGHTNING_VOCAB)) < 0.3 for x in losses), (acc, losses)
        mean_loss[acc] = sum(losses) / len(losses)
    assert abs(mean_loss[2] - mean_loss[1]) < 0.1, mean_loss


def test_lightning_profiles_the_hf_model_it_holds_as_the_hf_trainer_does(lightning_llama_runs):
    """The LightningModule's one model (an HF PreTrainedModel) is depth 0: attention and MLP rows at the default
    depth, the PaLM cross-check, the optimizer's states, and a projection of the run to a larger micro batch."""
    from trainprof.projection.project import project

    run_dir, profile = lightning_llama_runs[2]
    (root,) = [m for m in profile["modules"] if m["depth"] == 0]
    assert root["type"] == "LlamaForCausalLM", root["type"]
    names = {m["name"] for m in profile["modules"]}
    assert {"model.layers.0.self_attn", "model.layers.0.mlp"} <= names, sorted(names)
    assert profile["summary"]["analytic"] is not None
    states = profile["model_state_bytes"]
    assert states["optimizer_states"] >= 2 * states["params"], states  # AdamW: two fp32 moments a parameter
    assert profile["summary"]["phases_ms"]["optimizer"] > 0 and profile["summary"]["unattributed_frac"] <= 0.02
    # `trainprof project RUN train.micro_batch_size=4 --nproc 1`
    (pred,) = project(run_dir, overrides=["train.micro_batch_size=4"], nproc=[1])["predictions"]
    assert pred["step_ms"] is not None and pred["step_ms"] > 0, pred["reasons"]
    assert pred["tokens_per_step"] == 4 * 2 * 32


def test_lightning_keeps_the_lightning_module_as_root_unless_one_model_holds_every_parameter():
    """A frozen teacher beside the student, or parameters of the LightningModule's own: no one child is the model."""
    import lightning as L
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainprof.integrations.lightning import profiled_model

    def llama():
        return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, vocab_size=32))

    student = L.LightningModule()
    student.model, student.loss_fn = llama(), torch.nn.CrossEntropyLoss()
    assert profiled_model(student) is student.model
    student.teacher = llama().requires_grad_(False)
    assert profiled_model(student) is student
    own = L.LightningModule()
    own.model, own.temperature = llama(), torch.nn.Parameter(torch.ones(()))
    assert profiled_model(own) is own


@pytest.mark.slow
def test_wrap_hf_trainer_with_its_deepspeed_integration_two_ranks(tmp_path):
    """The Trainer builds a ZeRO-2 engine through accelerate: the engine's backward and step are phases,
    the callback marks the steps (one profiled step per optimizer step, not per micro batch)."""
    proc, out = wrap(tmp_path, "hf_trainer.py", str(tmp_path / "hf"), "--steps", str(STEPS), "--zero", "2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir, profile = the_run(out, "hf_trainer")
    assert_profiled(run_dir, profile, tokens_per_step=2 * 2 * 32, kind="hf+deepspeed")
    assert profile["env"]["world_size"] == 2
    assert profile["summary"]["phases_ms"]["comm_exposed"] > 0 and profile["comm"]
    assert all(abs(s["loss"] - math.log(256)) < 0.5 for s in profile["steps"])


@pytest.mark.slow
def test_wrap_lightning_ddp_two_ranks(tmp_path):
    """Lightning DDP under torchrun: merged on rank 0; DDP's gradient all-reduce is recorded, once per
    optimizer step (Lightning skips the sync on the accumulating micro batch)."""
    proc, out = wrap(tmp_path, "lightning_module.py", "--steps", str(STEPS), nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir, profile = the_run(out, "lightning_module")
    assert_profiled(run_dir, profile, tokens_per_step=2 * 2 * 32, kind="lightning")
    assert profile["env"]["world_size"] == 2
    (allreduce,) = [c for c in profile["comm"] if c["op"] == "all_reduce"]
    assert allreduce["calls"] == 1 and allreduce["phase"] == "backward"


def test_hf_callback_in_a_script(tmp_path):
    """The public HF callback, given to a Trainer by hand (no wrap): gradient accumulation 3 makes one
    profiled step of 3 micro batches."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from trainprof.integrations.hf import TrainprofCallback

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, vocab_size=128,
                                         max_position_embeddings=32))
    ids = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    callback = TrainprofCallback(output_dir=tmp_path / "runs", name="hf-tiny", warmup_steps=2)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=5, per_device_train_batch_size=2,
                             gradient_accumulation_steps=3, report_to=[], save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
    assert callback.run_dir is not None and callback.run_dir.name.startswith("hf-tiny-")
    profile = json.loads((callback.run_dir / "profile.json").read_text())
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(measured) == 5 - 2 and all(s["tokens"] == 3 * 2 * 16 for s in measured)
    assert profile["summary"]["unattributed_frac"] <= 0.02


def test_a_forward_under_autocast_is_recorded_as_the_torch_engines_16_bit_recipe():
    """fp32 weights under torch.autocast (the HF Trainer's bf16=True, Lightning's bf16-mixed) train as
    trainprof's torch engine does at model.dtype bf16, so that is what a projection rebuilds; without
    autocast the weights' dtype is the recipe's. Inside DeepSpeed no recipe says it: fp32, and why.
    Autocast is entered as Accelerate (and so the HF Trainer) enters it: around the model's `forward`
    method, inside the call, after the model's own forward pre-hooks have run."""
    import types

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainprof.profiler.workload import BatchShape, workload

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    recorded = {}
    for amp in (False, True):
        if amp:  # accelerate.Accelerator.prepare_model with mixed_precision="bf16" does this
            model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward), model)
        shape = BatchShape(model)
        with torch.no_grad():
            model(input_ids=ids)
        shape.remove()
        for framework in ("hf", "deepspeed"):
            recorded[amp, framework] = workload(model, framework=framework, engine_config={}, shape=shape)
    assert recorded[False, "hf"]["model"]["dtype"] == "fp32" and recorded[True, "hf"]["model"]["dtype"] == "bf16"
    assert recorded[True, "hf"]["train"] == {"micro_batch_size": 2, "grad_accum": 1}
    assert recorded[True, "deepspeed"]["model"]["dtype"] == "fp32"
    assert "autocast to bf16" in recorded[True, "deepspeed"]["unknown"]["model.dtype"]


def test_a_compiled_model_is_recorded_as_model_compile():
    """A wrapped run of a torch.compile'd model projects from a compiled source: per-layer `.compile()` is
    the recipes' model.compile; a whole-model wrapper is taken as it, and `unknown` says so. Without this
    the what-if model.compile=false read the compiled step 'as measured'."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainprof.profiler.workload import workload
    from trainprof.profiler.compiled import CompiledModules, compile_block

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)

    def recorded(model):
        block = compile_block(CompiledModules.find(model), None)  # what the profile's `compile` holds
        return workload(model, framework="hf", engine_config={}, shape=None, compiled=block)

    eager = recorded(LlamaForCausalLM(cfg))
    assert eager["model"]["compile"] is False and "model.compile" not in eager["unknown"]
    per_layer = LlamaForCausalLM(cfg)
    for layer in per_layer.model.layers:
        layer.compile()  # lazy: nothing is compiled until a forward
    assert recorded(per_layer)["model"]["compile"] is True and "model.compile" not in recorded(per_layer)["unknown"]
    whole = recorded(torch.compile(LlamaForCausalLM(cfg)))
    assert whole["model"]["compile"] is True
    assert "not the 2 decoder layers" in whole["unknown"]["model.compile"]


def test_an_own_loop_records_its_workload_and_projects(tmp_path):
    """README's own-loop snippet, with gradient accumulation: the profile records the workload a recipe would
    (there is no recipe.yaml) and `trainprof project` predicts from it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainprof import Profiler
    from trainprof.projection.project import project

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, use_cache=False)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 32))
    with Profiler(model, optimizer=opt, warmup_steps=1) as prof:
        for _ in range(4):
            with prof.step():
                for _ in range(2):  # two micro batches a step
                    loss = model(input_ids=ids, labels=ids).loss / 2
                    loss.backward()
                opt.step()
                opt.zero_grad()
                prof.record(loss=loss * 2)
    run_dir = tmp_path / "my-run"
    profile = prof.save(run_dir)
    w = profile["workload"]
    assert w["train"] == {"micro_batch_size": 2, "grad_accum": 2} and w["data"] == {"seq_len": 32}
    assert w["engine"] == {"kind": "torch", "zero_stage": 0, "offload": "none"} and w["unknown"] == {}
    assert (w["model"]["num_layers"], w["model"]["hidden_size"], w["model"]["compile"]) == (2, 64, False)
    assert not (run_dir / "recipe.yaml").exists()
    assert {m["name"] for m in profile["modules"]} >= {"model.layers.0.self_attn", "model.layers.0.mlp"}  # depth 4
    (pred,) = project(str(run_dir), overrides=["train.micro_batch_size=4"])["predictions"]
    assert pred["step_ms"] > 0 and pred["tokens_per_step"] == 4 * 2 * 32, pred.get("reasons")


def test_an_own_loop_over_fsdp2_records_the_engine_and_its_settings():
    """fully_shard groups read as engine.kind fsdp, with reshard_after_forward and CPU offload as set: the
    report's advice and a projection take them for FSDP2, not DeepSpeed. A bf16 MixedPrecisionPolicy computes
    in bf16 over fp32 shards: the workload's model.dtype and the dtype MFU is priced at are bf16 (both took the
    weights' fp32, and project modelled fp32 compute)."""
    proc = subprocess.run([sys.executable, str(SCRIPTS / "fsdp_own_loop.py")], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    engines = json.loads(proc.stdout.strip().splitlines()[-1])
    fsdp = {"kind": "fsdp", "zero_stage": 0, "dtype": "fp32", "mfu_dtype": "fp32", "unknown": {}}
    assert engines == {"reshard": {**fsdp, "offload": "none", "reshard_after_forward": True},
                       "keep": {**fsdp, "offload": "none", "reshard_after_forward": False},
                       "offload": {**fsdp, "offload": "optimizer+params", "reshard_after_forward": True},
                       "bf16": {**fsdp, "offload": "none", "reshard_after_forward": True, "dtype": "bf16",
                                "mfu_dtype": "bf16"}}
