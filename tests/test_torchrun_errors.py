"""A recipe mistake under a real torchrun: what trainprof can do there. Rank 0 prints the one line
first; every rank exits 2 and writes the line to its TORCHELASTIC_ERROR_FILE, so torchrun's failure
report names it as the root cause. torchrun itself then prints that report and exits 1, which a
worker cannot change (README, "Use"); `trainprof run --nproc N` validates first (tests/test_recipe.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

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
