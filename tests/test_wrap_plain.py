"""`trainprof wrap` on plain PyTorch loops (no DeepSpeed, Trainer, Lightning or Accelerate), real torch on
CPU: the model and optimizer are found at the first optimizer step (not profiled) and every later
optimizer step, all its micro batches, is one profiled step. One process (an HF Llama fed by a DataLoader,
2 micro batches a step) and DDP on 2 ranks over gloo (a Sequential, the loss computed outside the model);
and, in this process, what the watch leaves alone."""

from __future__ import annotations

import math

import pytest

from test_integrations import STEPS, WARMUP, assert_profiled, the_run, wrap

FETCH_S = 0.002  # the dataset's sleep per sample: a fetch that the data wait must hold
MICRO, ACCUM, SEQ = 2, 2, 32

LLAMA_LOOP = f'''
import time, torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=4, vocab_size=256, max_position_embeddings=64))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep({FETCH_S})  # a slow loader: its time is data wait
        return torch.randint(0, 256, ({SEQ},), generator=torch.Generator().manual_seed(i))


updates = 0
for i, ids in enumerate(torch.utils.data.DataLoader(Tokens(), batch_size={MICRO})):
    loss = model(input_ids=ids, labels=ids).loss / {ACCUM}
    loss.backward()
    if (i + 1) % {ACCUM} == 0:
        opt.step()
        opt.zero_grad()
        updates += 1
        if updates == {STEPS + 1}:
            break
print(f"plain llama done: {{updates}} optimizer steps")
'''

DDP_LOOP = f'''
import torch

torch.set_num_threads(1)
torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 32), torch.randn(8, 1)
for step in range({STEPS + 1}):
    with model.no_sync():  # the first micro batch accumulates locally: one all-reduce a step
        torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
print(f"plain ddp done: {{type(model).__name__}}")  # one write: the two ranks share stdout
torch.distributed.destroy_process_group()
'''

NO_STEP = '''
import torch

model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(4, 8)).pow(2).mean().backward()  # gradients, never an update
print("no step done")
'''


EVAL_LOSS = 100.0  # added to the model's loss in eval mode: no training step's loss comes near it
EVAL_S = 0.2  # an evaluation pass's sleep: its time must land in the next step's data wait
TAIL_S = 0.5  # the script's sleep after its loop (a checkpoint save): no step's time

# A loop whose model returns its loss (as an HF model given labels does), with an evaluation pass (grad
# disabled, larger batches) between two steps; then, as argv[1] says, a tail after the loop or, after the last
# update, another evaluation pass and one forward with grad enabled that no update follows.
FINDINGS_LOOP = f'''
import sys, time, torch

mode = sys.argv[1]
torch.set_num_threads(1)
torch.manual_seed(0)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)

    def forward(self, input_ids):
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), input_ids.flatten())
        return {{"loss": loss if self.training else loss + {EVAL_LOSS}}}


def batch(n):
    return torch.randint(0, 16, (n, {SEQ}))


def evaluate():
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            model(input_ids=batch(4 * {MICRO}))
        time.sleep({EVAL_S})
    model.train()


model = Tiny()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({STEPS + 1}):
    model(input_ids=batch({MICRO}))["loss"].backward()
    opt.step()
    opt.zero_grad()
    if step == 3:
        evaluate()
if mode == "tail":
    time.sleep({TAIL_S})
elif mode == "eval":
    evaluate()
    model(input_ids=batch({MICRO}))
print("findings loop done", mode)
'''


def wrap_source(tmp_path, name: str, source: str, nproc: int = 0):
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    return wrap(tmp_path, str(script), nproc=nproc)


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """(process, run dir, profile) of the one-process loop: STEPS + 1 optimizer steps."""
    tmp = tmp_path_factory.mktemp("plain_llama")
    proc, out = wrap_source(tmp, "plain_llama", LLAMA_LOOP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, *the_run(out, "plain_llama")


def test_each_optimizer_step_after_the_first_is_one_profiled_step(llama_run):
    proc, run_dir, profile = llama_run
    assert f"plain llama done: {STEPS + 1} optimizer steps" in proc.stdout
    assert len(profile["steps"]) == STEPS  # the first step found the loop: not profiled
    # the next WARMUP are warm-up, then STEPS - WARMUP measured, each of 2 micro batches' tokens
    assert_profiled(run_dir, profile, tokens_per_step=MICRO * ACCUM * SEQ, kind="torch")
    for s in profile["steps"]:
        assert sum(s["phases_ms"].values()) + s["unattributed_ms"] == pytest.approx(s["wall_ms"], abs=1e-6)
    assert profile["engine"]["config"] == {"world_size": 1, "model": "LlamaForCausalLM", "optimizer": "AdamW"}
    assert "nothing profiled" not in proc.stderr and "torch run profiled" in proc.stderr


def test_the_loss_is_the_models_and_every_fetch_is_data_wait(llama_run):
    _, _, profile = llama_run
    # the model output's own loss, not the loop's divided one (random init over a 256-token vocab: about ln 256)
    assert all(abs(s["loss"] - math.log(256)) < 0.5 for s in profile["steps"]), [s["loss"] for s in profile["steps"]]
    # both micro batches' fetches (the one between steps and the one inside), each sleeping MICRO x FETCH_S
    fetched_ms = ACCUM * MICRO * FETCH_S * 1e3
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert all(s["phases_ms"]["data_wait"] >= 0.9 * fetched_ms for s in measured), \
        [s["phases_ms"]["data_wait"] for s in measured]


def test_a_plain_loop_records_the_workload_that_project_reads(llama_run):
    _, _, profile = llama_run
    w = profile["workload"]
    assert {k: w["model"][k] for k in ("hidden_size", "num_layers", "num_heads", "vocab_size")} == \
        {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "vocab_size": 256}
    assert w["train"] == {"micro_batch_size": MICRO, "grad_accum": ACCUM} and w["data"] == {"seq_len": SEQ}
    assert w["engine"] == {"kind": "torch", "zero_stage": 0, "offload": "none"} and w["unknown"] == {}


@pytest.fixture(scope="module")
def findings_runs(tmp_path_factory) -> dict[str, tuple]:
    """mode -> (process, output dir) of FINDINGS_LOOP: "tail", "eval", and "warmup" (all steps warm-up)."""
    runs = {}
    for mode, options in (("tail", ()), ("eval", ()), ("warmup", ("--warmup-steps", str(STEPS + 5)))):
        tmp = tmp_path_factory.mktemp(f"findings_{mode}")
        script = tmp / "findings.py"
        script.write_text(FINDINGS_LOOP)
        proc, out = wrap(tmp, str(script), mode, options=options)
        assert proc.returncode == 0 and f"findings loop done {mode}" in proc.stdout, proc.stderr[-3000:]
        runs[mode] = proc, out
    return runs


def test_the_scripts_tail_after_its_loop_is_no_steps_time(findings_runs):
    run_dir, profile = the_run(findings_runs["tail"][1], "findings")
    last = profile["steps"][-1]
    # the last step ends at its update (zero_grad), not when the script ends TAIL_S later
    assert last["wall_ms"] < TAIL_S * 1e3 / 2 and last["phases_ms"]["other"] < TAIL_S * 1e3 / 10, last
    assert profile["summary"]["step_ms"]["max"] < TAIL_S * 1e3 / 2


@pytest.mark.parametrize("mode", ["tail", "eval"])
def test_evaluation_forwards_are_no_training_and_their_time_is_the_next_steps_data_wait(findings_runs, mode):
    run_dir, profile = the_run(findings_runs[mode][1], "findings")
    steps = profile["steps"]
    assert all(s["tokens"] == MICRO * SEQ for s in steps), [s["tokens"] for s in steps]
    assert all(s["loss"] < EVAL_LOSS / 2 for s in steps), [s["loss"] for s in steps]
    # the pass ran after the loop's step 3; its step 4 (profiled index 3: the loop's first step is not profiled)
    # begins after it, so its data wait holds the pass
    after_eval = next(s for s in steps if s["step"] == 4 - 1 - WARMUP)
    assert after_eval["phases_ms"]["data_wait"] >= 0.9 * EVAL_S * 1e3, after_eval


def test_forwards_after_the_last_update_make_no_step(findings_runs):
    proc, out = findings_runs["eval"]
    run_dir, profile = the_run(out, "findings")
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(profile["steps"]) == STEPS and len(measured) == STEPS - WARMUP, [s["step"] for s in profile["steps"]]
    assert all(s["phases_ms"]["backward"] > 0 and s["phases_ms"]["optimizer"] > 0 for s in profile["steps"])
    assert f"{STEPS - WARMUP} measured steps" in proc.stderr and profile["partial"] is False


def test_the_warm_up_message_counts_every_optimizer_step(findings_runs):
    proc, out = findings_runs["warmup"]
    assert (f"{STEPS + 1} optimizer step(s) seen (the first found the loop, {STEPS} warm-up; warm-up {STEPS + 5})"
            in proc.stderr), proc.stderr[-2000:]
    assert not out.exists()


@pytest.mark.slow
def test_ddp_on_two_ranks_is_merged_with_its_all_reduce(tmp_path):
    proc, out = wrap_source(tmp_path, "plain_ddp", DDP_LOOP, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("plain ddp done: DistributedDataParallel") == 2
    run_dir, profile = the_run(out, "plain_ddp")
    assert profile["env"]["world_size"] == 2 and len(profile["ranks"]) == 2
    assert sorted(p.name for p in run_dir.glob("profile.rank*.json")) == ["profile.rank0.json", "profile.rank1.json"]
    assert profile["engine"]["kind"] == "torch" and profile["engine"]["config"]["model"] == "DistributedDataParallel"
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(profile["steps"]) == STEPS and len(measured) == STEPS - WARMUP
    assert all(math.isfinite(s["loss"]) for s in measured)  # the loss backward() ran on: the model returns none
    assert profile["summary"]["unattributed_frac"] <= 0.02, profile["summary"]["unattributed_frac"]
    (allreduce,) = [c for c in profile["comm"] if c["op"] == "all_reduce"]
    assert allreduce["calls"] == 1 and allreduce["phase"] == "backward", allreduce
    # a Sequential has no decoder shape: projecting it says so (the recipe default llama2-tiny stood in for it)
    from trainprof.projection.source import ProjectionError, load_source

    assert "model" in profile["workload"]["unknown"]
    with pytest.raises(ProjectionError, match="has a decoder config .* no model shape to re-time"):
        load_source(run_dir)


def test_a_script_that_never_steps_an_optimizer_profiles_nothing(tmp_path):
    proc, out = wrap_source(tmp_path, "no_step", NO_STEP)
    assert proc.returncode == 0 and "no step done" in proc.stdout, proc.stderr[-3000:]
    assert "nothing profiled" in proc.stderr and "trainprof.Profiler" in proc.stderr
    assert not out.exists()


# -- the watch in this process: what it picks and what it leaves alone ----------------------------------


def global_hooks() -> tuple[int, int, int]:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return (len(module._global_forward_pre_hooks), len(module._global_forward_hooks),
            len(optimizer._global_optimizer_post_hooks))


def train(model, opt, steps: int) -> None:
    import torch

    for _ in range(steps):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_the_first_step_picks_the_called_module_holding_most_stepped_parameters(tmp_path):
    """A frozen teacher (more parameters, none stepped), a loss module and the student are all called at the
    top: the student is profiled from the second step, and the global hooks are gone after the first step's
    next forward; closing restores what the run patched."""
    import torch
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    from trainprof.integrations.plain import PlainLoopWatch
    from trainprof.integrations.session import ProfileSession

    torch.manual_seed(0)
    teacher, student = torch.nn.Linear(8, 1024), torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))
    mse = torch.nn.MSELoss()
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    before, backward, fetch = global_hooks(), torch.autograd.backward, _BaseDataLoaderIter.__next__
    watch = PlainLoopWatch(lambda: ProfileSession(tmp_path, name="pick"), claimed=lambda: False)
    try:
        for _ in range(3):
            x = torch.randn(4, 8)
            with torch.no_grad():
                teacher(x)
            mse(student(x), torch.zeros(4, 1)).backward()
            opt.step()
            opt.zero_grad()
        assert watch.run is not None and watch.run.model is student and watch.run.optimizer is opt
        assert global_hooks() == before
        session = watch.run.session
        session.end_step()  # the third step's: the loop ends here
        assert [s.warmup for s in session.prof.steps] == [True, False]
        assert all(s.loss is not None for s in session.prof.steps)  # the scalar backward() ran on
    finally:
        if watch.run is not None:
            watch.run.session.prof.close()
        watch.close()
    assert global_hooks() == before and torch.autograd.backward is backward and _BaseDataLoaderIter.__next__ is fetch


def test_the_watch_leaves_a_claimed_script_or_the_scripts_own_profiler_alone(capsys):
    import torch

    from trainprof import Profiler
    from trainprof.integrations.plain import PlainLoopWatch

    before = global_hooks()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    no_session = lambda: pytest.fail("the watch made a session")  # noqa: E731
    claimed = PlainLoopWatch(no_session, claimed=lambda: True)  # another integration's session exists
    train(model, opt, 2)
    assert claimed.run is None and global_hooks() == before  # gone at the first forward
    left = []
    own = PlainLoopWatch(no_session, claimed=lambda: False, leave_alone=lambda: left.append("own Profiler"))
    try:
        with Profiler(model, optimizer=opt, flops=False) as prof:
            for _ in range(2):
                with prof.step():
                    train(model, opt, 1)
    finally:
        own.close()
    assert own.run is None and left == ["own Profiler"] and global_hooks() == before
    assert "profiles its model with trainprof.Profiler itself" in capsys.readouterr().err
    assert len(prof.steps) == 2


def test_wrap_names_plain_loops_in_its_help():
    from trainprof.wrap import description

    text = " ".join(description("trainprof wrap").split())
    assert "plain PyTorch loop" in text and "trainprof.Profiler" in text
