"""A 2-rank run whose rank 1 is SIGKILLed mid-run: rank 0 writes its profiler breakdown of the finished
steps (profile.rank0.partial.json) when it fails (gloo error) or is stopped (torchrun's SIGTERM); rank 1,
which runs no handler, leaves its journal, which `trainprof report` rebuilds into
profile.rank1.partial.json; the report renders a module x phase profile, marked partial. And the
journal, replayed, gives the document the live profiler gives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from conftest import QUICKSTART, REPO


def _journal_lines(out_dir):
    """The lines rank 1 has journalled so far (a fixed sleep raced the start-up on a loaded machine)."""
    paths = list(out_dir.glob("*/profile.rank1.journal.jsonl"))
    return paths[0].read_text().splitlines() if paths else []


@pytest.mark.timeout(300)
def test_killed_rank_leaves_a_partial_profile_that_report_renders(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                             "trainprof.run", str(QUICKSTART), f"output.dir={tmp_path}", "train.steps=100000",
                             "train.warmup_steps=1", "data.seq_len=32", "train.micro_batch_size=1",
                             "engine.zero_stage=0", "profile.ops=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 150
    while sum('"kind":"step"' in line for line in _journal_lines(tmp_path)) < 4:  # warmup + 3 measured steps
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    victim = [p for p in psutil.Process(proc.pid).children(recursive=True)
              if "trainprof.run" in p.cmdline() and p.environ().get("RANK") == "1"]
    assert victim
    victim[0].send_signal(signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    run_dir = next(tmp_path.glob("*/recipe.yaml")).parent
    assert not (run_dir / "profile.json").exists()
    doc = json.loads((run_dir / "profile.rank0.partial.json").read_text())
    # rank 0 sees its peer vanish in a gloo collective (RuntimeError) or gets torchrun's SIGTERM
    assert doc["partial"] and doc["partial_reason"].startswith("rank 0 stopped after")
    assert len(doc["steps"]) >= 2 and doc["modules"]
    assert not (run_dir / "profile.rank0.journal.jsonl").exists()  # superseded by the partial profile
    # rank 1 ran no handler (SIGKILL): its journal holds its finished steps, and the report rebuilds them
    assert (run_dir / "profile.rank1.journal.jsonl").is_file() and not (run_dir / "profile.rank1.partial.json").exists()
    report = subprocess.run([sys.executable, "-m", "trainprof", "report", str(run_dir)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    text = "\n".join(p.read_text() for p in run_dir.glob("report*.md")) + report.stdout
    assert "partial" in text and "rank 0 stopped after" in text
    assert "model.layers.0" in text  # module rows of the breakdown
    killed = json.loads((run_dir / "profile.rank1.partial.json").read_text())
    assert killed["rank"] == 1 and killed["partial_reason"].startswith("rank 1 left no profile")
    assert len([s for s in killed["steps"] if not s["warmup"]]) >= 2 and killed["modules"]
    assert {s["step"] for s in killed["steps"]} <= {s["step"] for s in doc["steps"]} | {max(s["step"] for s in doc["steps"]) + 1}
    assert "rebuilt from its journal" in text


def test_the_journal_replays_to_the_live_rank_document(tmp_path):
    """Every finished step is in the journal as the run goes, and replaying it gives the document the
    live profiler gives: steps, module rows, phases, operators, comm and model states."""
    import torch

    from trainprof.models import build_model
    from trainprof.profiler import Profiler
    from trainprof.profiler.journal import journal_path, read_journal, replay
    from trainprof.profiler.schema import validate_profile
    from trainprof.recipe import Recipe

    recipe = Recipe()
    recipe.model.dtype = "fp32"
    torch.manual_seed(0)
    model = build_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    path = journal_path(tmp_path, 0)
    with Profiler(model, optimizer=opt, warmup_steps=1, module_depth=4, ops=True, trace_dir=tmp_path / "tb",
                  journal_dir=tmp_path, journal_interval_s=0, rank=0, world_size=1) as prof:
        for step, batch in enumerate(prof.wrap_loader([{"input_ids": ids, "labels": ids}] * 4)):
            with prof.step():
                loss = model(**batch).loss
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.record(loss=loss)
            _, lines = read_journal(path)  # flushed as the run goes, not at the end
            assert sum(line["kind"] == "step" for line in lines) == step + 1
    live, replayed = prof.rank_result(), replay(path)
    validate_profile(replayed)
    assert replayed["partial"] and "rebuilt from its journal" in replayed["partial_reason"]
    assert replayed["partial_reason"].startswith("rank 0 left no profile") and "after 3 measured steps" in replayed["partial_reason"]
    for key in ("steps", "modules", "summary", "ops", "comm", "model_state_bytes", "ranks", "measurement"):
        assert replayed[key] == live[key], key
    assert live["summary"]["warmup_steps"] == 1  # what a run without a recipe says of its warm-up
    assert replayed["modules"] and replayed["ops"] and replayed["steps"][1]["modules_ms"]
    prof.discard_journal()
    assert not path.exists()


@pytest.mark.timed
def test_the_journal_writes_at_most_once_an_interval_and_the_rest_at_close(tmp_path):
    """The first step is written as it ends (the header with it); later ones wait for the interval,
    several in one write; close() writes what waits, so nothing recorded is lost."""
    import torch

    from trainprof.profiler import Profiler
    from trainprof.profiler.journal import journal_path, read_journal

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8)
    path = journal_path(tmp_path, 0)

    def steps_written() -> list[int]:
        return [line["step"] for line in read_journal(path)[1] if line["kind"] == "step"]

    prof = Profiler(model, module_depth=1, journal_dir=tmp_path, journal_interval_s=1.0, rank=0, world_size=1)
    for step in range(4):
        with prof.step():
            model(x).sum().backward()
        if step == 0:
            start = time.monotonic()
    elapsed, held_back = time.monotonic() - start, steps_written()
    assert elapsed < 1.0, "the machine was too slow for this test's interval"
    assert held_back == [0]
    time.sleep(1.0)
    with prof.step():
        model(x).sum().backward()
    assert steps_written() == [0, 1, 2, 3, 4]  # the interval passed: the waiting steps and this one, in order
    with prof.step():
        model(x).sum().backward()
    prof.close()
    assert steps_written() == [0, 1, 2, 3, 4, 5]


def test_a_journal_written_before_the_hooks_records_became_classes_still_replays():
    """tests/data/journal_v2 was written by the code whose hooks logged (code, subject, stamp) tuples
    (tests/data/scripts/write_journal.py): the on-disk timeline (codes, payloads, ns) is unchanged, so
    `replay` (what `trainprof report` runs on a killed rank's journal) reads every kind of event in it:
    forward, backward and recompute windows per module and the data-wait and optimizer regions."""
    from trainprof.profiler.journal import replay
    from trainprof.profiler.schema import validate_profile

    doc = replay(REPO / "tests" / "data" / "journal_v2" / "profile.rank0.journal.jsonl")
    validate_profile(doc)
    assert doc["partial"] and "after 2 measured steps" in doc["partial_reason"]
    measured = [s for s in doc["steps"] if not s["warmup"]]
    assert len(measured) == 2
    for step in measured:
        assert abs(sum(step["phases_ms"].values()) + step["unattributed_ms"] - step["wall_ms"]) < 1e-6
        for phase in ("data_wait", "forward", "backward", "recompute", "optimizer"):
            assert step["phases_ms"][phase] > 0, (phase, step["phases_ms"])
        assert 0 <= step["unattributed_ms"] < 0.1 * step["wall_ms"]
    layers = [m for m in doc["modules"] if m["type"] == "LlamaDecoderLayer"]
    assert len(layers) == 2
    for layer in layers:  # checkpointed layers: re-run inside backward once a step
        assert layer["forward_ms"] > 0 and layer["backward_ms"] > 0 and layer["recompute_ms"] > 0, layer
        assert layer["calls"] == 1 and layer["recompute_calls"] == 1, layer


RAISING_DDP_LOOP = '''
import torch

torch.set_num_threads(1)
torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 16), torch.randn(8, 1)
for step in range(5):  # the first finds the loop, then 1 warm-up and 3 measured
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
raise ValueError("a bug on every rank")
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_wrapped_multi_rank_script_that_raises_leaves_each_ranks_partial_profile(tmp_path):
    """No collective after an exception (another rank may never reach it): each rank writes its own file, in
    the run dir rank 0 made when it attached, and `trainprof report` merges them."""
    from trainprof.report.rundir import load_run

    script = tmp_path / "raising_ddp.py"
    script.write_text(RAISING_DDP_LOOP)
    out = tmp_path / "runs"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINPROF_OUTPUT_DIR": str(out), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                           "trainprof.wrap", str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                          env=env)
    assert proc.returncode != 0 and proc.stderr.count("ValueError: a bug on every rank") >= 2, proc.stderr[-3000:]
    (run_dir,) = list(out.iterdir())
    files = sorted(p.name for p in run_dir.iterdir())
    assert files == ["profile.rank0.partial.json", "profile.rank1.partial.json"], files
    for rank in (0, 1):
        assert f"rank {rank}: the script failed; no merged profile" in proc.stderr
        doc = json.loads((run_dir / f"profile.rank{rank}.partial.json").read_text())
        assert doc["partial"] is True and doc["partial_reason"].startswith(f"rank {rank}: the script raised ValueError")
        assert len([s for s in doc["steps"] if not s.get("warmup")]) == 3
    profile = load_run(run_dir).profile
    assert profile["partial"] is True and len(profile["ranks"]) == 2
