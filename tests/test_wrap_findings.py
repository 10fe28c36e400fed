"""What `trainprof wrap`, the callbacks and `Profiler` do when a run does not go to plan: an unusable output
dir, a script that raises, is interrupted or never steps its optimizer, a second save into a run dir, a
compiled model with no warm-up; and operator traces on request (`--ops`), which `trainprof tb` looks for.
The wrapped subject is a tiny Accelerate loop on CPU (the cheapest framework to import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

SCRIPT = '''
import os, signal, sys
import torch
from accelerate import Accelerator

mode = sys.argv[1]
torch.manual_seed(0)
torch.set_num_threads(1)
accelerator = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
samples = torch.utils.data.TensorDataset(torch.randn(48, 16), torch.randn(48, 1))
data = torch.utils.data.DataLoader(samples, batch_size=8)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
for step, (x, y) in enumerate(data):
    if step == 4:  # stops as `mode` says, after 4 optimizer steps (1 warm-up, 3 measured)
        print(f"stopping: {mode}", flush=True)
        if mode == "raise":
            raise ValueError("bad batch at step 4")
        if mode in ("sigint", "sigterm"):
            os.kill(os.getpid(), signal.SIGINT if mode == "sigint" else signal.SIGTERM)
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    if mode != "nostep":
        optimizer.step()
    optimizer.zero_grad()
print("loop done", flush=True)
'''


def wrap(tmp_path: Path, *args: str, output_dir: Path | None = None) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "acc_loop.py"
    script.write_text(SCRIPT)
    out = output_dir or tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRAINPROF_OUTPUT_DIR": str(out),
           "PYTHONPATH": str(REPO)}
    options, mode = args[:-1], args[-1]
    proc = subprocess.run([sys.executable, "-m", "trainprof", "wrap", *options, str(script), mode], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path, env=env)
    return proc, out


@pytest.fixture(scope="module")
def stopped_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """mode -> (the wrap process, its output dir) for a script that raises, is interrupted (traced with
    --ops), is terminated, and one that never steps its optimizer."""
    runs = {}
    for args in (("raise",), ("--ops", "sigint"), ("sigterm",), ("nostep",)):
        runs[args[-1]] = wrap(tmp_path_factory.mktemp(args[-1]), *args)
    return runs


def the_profile(out: Path) -> tuple[Path, dict]:
    (run_dir,) = list(out.iterdir())
    return run_dir, json.loads((run_dir / "profile.json").read_text())


@pytest.mark.parametrize("mode, code, reason", [
    ("raise", 1, "the script raised ValueError: bad batch at step 4"),
    ("sigint", 130, "the script was interrupted by SIGINT (Ctrl-C)"),
    ("sigterm", 143, "the script was stopped: terminated by SIGTERM"),
])
def test_a_stopped_script_keeps_its_steps_marked_partial_and_exits_as_it_would(stopped_runs, mode, code, reason):
    proc, out = stopped_runs[mode]
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "stopping" in proc.stdout and "loop done" not in proc.stdout
    run_dir, profile = the_profile(out)
    assert profile["partial"] is True and profile["partial_reason"].startswith(reason), profile.get("partial_reason")
    measured = [s for s in profile["steps"] if not s.get("warmup")]
    assert len(measured) == 3  # the 4 optimizer steps before the stop, less the warm-up one
    for name in ("report.md", "summary.md"):  # where the reader looks first: the answer's first fact
        assert f"partial: the run did not finish every step ({reason}" in (run_dir / name).read_text(), name
    assert "PARTIAL" in proc.stderr
    # a signal is news in one line; a script's own exception keeps its traceback
    assert ("Traceback" in proc.stderr) == (mode != "sigterm"), proc.stderr[-2000:]


def test_a_scripts_traceback_reads_as_it_would_unwrapped(stopped_runs):
    """The script's own frames first: the wrapper's and runpy's above them would read as trainprof crashing."""
    proc, _ = stopped_runs["raise"]
    tb = proc.stderr[proc.stderr.index("Traceback (most recent call last):"):].split("ValueError: bad batch")[0]
    assert 'acc_loop.py", line' in tb.splitlines()[1], tb
    assert "runpy" not in tb and "trainprof/wrap.py" not in tb, tb


def test_wrapped_runs_describe_the_memory_they_measured(stopped_runs):
    """The profiler's per-phase peak is the only memory figure of a wrapped run: no runner measured the
    lifetime high-water mark that `trainprof run` adds."""
    run_dir, profile = the_profile(stopped_runs["raise"][1])
    assert "memory_meter" not in profile["summary"]
    methods = (run_dir / "summary.md").read_text().split("## How each figure was measured")[1]
    assert "per phase, reset at phase start" in methods and "lifetime high-water mark" not in methods


def test_ops_puts_a_trace_where_trainprof_tb_finds_it(stopped_runs):
    from trainprof.commands.tb import has_traces

    run_dir, profile = the_profile(stopped_runs["sigint"][1])
    assert list((run_dir / "tb" / run_dir.name).glob("rank0.*.pt.trace.json")), list(run_dir.rglob("*"))
    assert (run_dir / "ops.csv").read_text().count("\n") > 1
    assert any(s.get("instrumented") == ["ops"] for s in profile["steps"])
    assert has_traces([run_dir])
    untraced, _ = the_profile(stopped_runs["raise"][1])
    assert not has_traces([untraced]) and (untraced / "tb").is_dir()  # scalars only


def test_a_script_that_never_steps_its_optimizer_is_told_so(stopped_runs):
    proc, out = stopped_runs["nostep"]
    assert proc.returncode == 0 and "loop done" in proc.stdout
    assert "the optimizer was never stepped" in proc.stderr and "optimizer steps seen" not in proc.stderr
    assert not out.exists()


def test_wrap_refuses_an_unusable_output_dir_before_the_script_runs(tmp_path, capsys):
    from trainprof.wrap import parse_args

    a_file = tmp_path / "not_a_dir"
    a_file.write_text("")
    proc, _ = wrap(tmp_path, "raise", output_dir=a_file / "runs")
    assert proc.returncode == 2 and "stopping" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert f"'{a_file}' is a file, not a directory" in line and "TRAINPROF_OUTPUT_DIR" in line
    with pytest.raises(SystemExit):
        parse_args([])
    err = capsys.readouterr().err
    assert "required: script" in err and "args" not in err.split("error:")[1]


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=32))


def test_hf_callback_that_cannot_save_says_so_and_training_finishes(tmp_path, capsys):
    import torch
    from transformers import Trainer, TrainingArguments

    from trainprof.integrations.hf import TrainprofCallback

    a_file = tmp_path / "not_a_dir"
    a_file.write_text("")
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    callback = TrainprofCallback(output_dir=a_file)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=3, per_device_train_batch_size=2, report_to=[],
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=tiny_llama(), args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                      callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 3 and callback.run_dir is None
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("trainprof")]
    assert len(lines) == 1 and f"cannot create a run dir in '{a_file}'" in lines[0], lines


def own_loop(prof, model, opt, steps: int) -> None:
    import torch

    for _ in range(steps):
        with prof.step():
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()


def test_profiler_save_never_replaces_another_runs_profile(tmp_path):
    import torch

    from trainprof import Profiler
    from trainprof.errors import UserError

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(model, optimizer=opt, flops=False) as first:
        own_loop(first, model, opt, 2)
    first.save(tmp_path)
    first.save(tmp_path)  # its own run dir: saved again
    (tmp_path / "projections").mkdir()  # what `trainprof project` left for the first run
    kept = (tmp_path / "profile.json").read_text()
    with Profiler(model, optimizer=opt, flops=False) as second:
        own_loop(second, model, opt, 3)
    with pytest.raises(UserError, match=f"'{tmp_path}' already holds another run's profile.json"):
        second.save(tmp_path)
    assert (tmp_path / "profile.json").read_text() == kept
    assert len(second.save(tmp_path / "second")["steps"]) == 3


def test_with_no_warm_up_the_first_steps_compilation_is_not_a_recompilation():
    import torch

    from trainprof import Profiler

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    compiled = torch.compile(model, backend="eager")  # dynamo's frames without inductor's C++ build
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Profiler(compiled, optimizer=opt, flops=False) as prof:  # warmup_steps=0
        own_loop(prof, compiled, opt, 3)
    dynamo = prof.result()["compile"]["dynamo"]
    assert dynamo["while_profiled"]["frames_converted"] > 0  # the first step compiled
    assert dynamo["during_measured_steps"]["frames_converted"] == 0, dynamo
    assert "counts from the second measured step" in dynamo["source"]


def test_a_session_that_writes_no_run_dir_leaves_no_trace_staging_dir(tmp_path):
    """`wrap --ops` stages traces in a temp dir until the run dir exists; a multi-rank script that fails writes
    none, and wrap then drops the staging dir (it was left in /tmp)."""
    import torch

    from trainprof.integrations.session import ProfileSession

    session = ProfileSession(tmp_path / "runs", ops=True)
    session.attach(torch.nn.Linear(4, 4), torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1))
    staging = session._trace_staging
    try:
        assert staging is not None and staging.is_dir()
        session.drop_trace_staging()
        assert not staging.exists() and session._trace_staging is None
        session.drop_trace_staging()  # twice: nothing to do
    finally:
        session.prof.close()
