"""A 2-rank run whose rank 1 is killed mid-run: torchrun stops rank 0 with SIGTERM, rank 0 writes its
profiler breakdown of the finished steps (profile.rank0.partial.json) when it fails (gloo error) or is stopped (SIGTERM), and `trainprof report` renders a
module x phase profile from it, marked partial."""

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


@pytest.mark.timeout(300)
def test_killed_rank_leaves_a_partial_profile_that_report_renders(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m",
                             "trainprof.run", str(QUICKSTART), f"output.dir={tmp_path}", "train.steps=100000",
                             "train.warmup_steps=1", "data.seq_len=32", "train.micro_batch_size=1",
                             "engine.zero_stage=0", "profile.ops=false"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 150
    while not list(tmp_path.glob("*/recipe.yaml")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(8)  # a few measured steps
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
    report = subprocess.run([sys.executable, "-m", "trainprof", "report", str(run_dir)],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    text = "\n".join(p.read_text() for p in run_dir.glob("report*.md")) + report.stdout
    assert "partial" in text and "rank 0 stopped after" in text
    assert "model.layers.0" in text  # module rows of the breakdown
