"""A recipe mistake under a real torchrun: what trainprof can do there. Rank 0 prints the one line
first; every rank exits 2 and writes the line to its TORCHELASTIC_ERROR_FILE, so torchrun's failure
report names it as the root cause. torchrun itself then prints that report and exits 1, which a
worker cannot change (README, "Use"); `trainprof run --nproc N` validates first (tests/test_recipe.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import QUICKSTART, REPO
from trainprof.distributed import free_port

LINE = "trainprof: recipe key 'engine.zero_stage': 9 is out of range; use 0, 1, 2 or 3"


def test_recipe_mistake_under_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "trainprof.run",
           str(QUICKSTART), "engine.zero_stage=9"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=180,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[0] == LINE, proc.stderr  # first, before anything torchrun says
    assert [ln for ln in lines if ln.startswith("trainprof:")] == [LINE]  # rank 0 only
    root = proc.stderr.split("Root Cause (first observed failure):")[1]
    assert "exitcode  : 2" in root and f"traceback : {LINE}" in root, root
    assert "To enable traceback see" not in proc.stderr  # every rank left its error file
    assert proc.returncode == 1  # torchrun's own code for any failed worker (ChildFailedError)


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler installed for `signum` (Linux: /proc's SigCgt mask)."""
    mask = next(ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def test_a_waiting_rank_writes_its_error_file_when_it_is_stopped(tmp_path):
    """torchrun names the failure with the earliest error-file timestamp (whole seconds) its root cause: a rank
    that waits for rank 0 to say a recipe mistake writes its file when torchrun stops it, not before rank 0 has
    written its own (a fresh-clone run's report once named rank 1, stopped with -15, whose file came first)."""
    error_file = tmp_path / "error.json"
    code = "from trainprof.recipe import RecipeError; from trainprof.run import user_error; user_error(RecipeError('x'))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RANK": "1", "TORCHELASTIC_ERROR_FILE": str(error_file)})
    try:
        deadline = time.monotonic() + 60
        while not _catches(proc.pid, signal.SIGTERM):  # waiting, ready to be stopped
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the waiting rank set no SIGTERM handler in 60 s"
            time.sleep(0.05)
        assert not error_file.exists()
        stopped_at = int(time.time())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 2
    finally:
        proc.kill()
    said = json.loads(error_file.read_text())["message"]["extraInfo"]
    assert int(said["timestamp"]) >= stopped_at and said["py_callstack"] == "trainprof: x"
    assert proc.stderr.read() == ""  # rank 0 says it


def test_recipe_mistake_on_two_nodes_is_said_on_each():
    """Two nodes (two launchers of scripts/multinode_torchrun.sh on this host, one rank each): each node's log
    has the one line, not only the first node's, and neither waits for the other's ranks to time out."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "NNODES": "2", "NPROC_PER_NODE": "1", "RDZV_ID": f"test-{os.getpid()}"}
    start = time.monotonic()
    nodes = [subprocess.Popen(["bash", str(REPO / "scripts" / "multinode_torchrun.sh"), str(QUICKSTART),
                               "engine.zero_stage=9"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env=env) for _ in range(2)]
    logs = [node.communicate(timeout=180)[1] for node in nodes]
    assert time.monotonic() - start < 45, logs  # NODES_GRACE_S (10 s), not RANK0_WAIT_S (60 s), on the second
    for node, log in zip(nodes, logs):
        assert node.returncode != 0 and [ln for ln in log.splitlines() if ln.startswith("trainprof:")] == [LINE], log
