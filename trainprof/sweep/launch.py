"""One cell as a process tree (torchrun and its ranks, or a single rank): its own session, a wall-clock
timeout, signals forwarded, and no process left behind.

torchrun starts each rank in a session of its own, so killing torchrun's process group does not reach
the ranks. The launcher therefore remembers every descendant it has seen (psutil) and, when it has to
stop a cell, asks torchrun first (SIGTERM, or SIGINT on Ctrl-C: torchrun passes it to the ranks), then
SIGKILLs whatever is still alive after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from trainprof.errors import UserError

GRACE_S = 15.0  # after SIGTERM/SIGINT, how long ranks get to write their failure files and exit
ORPHAN_GRACE_S = 2.0  # once the launcher has exited, how long its leftover ranks get before SIGKILL
POLL_S = 0.2


@dataclass(kw_only=True)
class Launch:
    """How a cell's launcher process ended."""

    returncode: int | None  # torchrun's exit code (negative: killed by that signal)
    elapsed_s: float  # from start until the process tree was gone (a timed-out cell's grace period included)
    timeout_s: float | None = None  # the limit it ran under
    timed_out: bool = False
    interrupted: bool = False  # the sweep itself was interrupted (Ctrl-C / SIGTERM) during this cell
    log: str = ""


def launch_command(recipe_path: str, overrides: list[str], *, nproc: int, nnodes: int = 1) -> list[str]:
    """The command that runs one cell. One rank: `python -m trainprof.run`, which makes its own group
    of one (torchrun's agent would add an interpreter and 2-3 s of start-up to each such cell). One
    node: `torchrun --standalone` (a free port per cell). Several nodes: `srun` starts one torchrun per
    node of the current SLURM allocation, which meet at the first node (c10d rendezvous); see
    scripts/slurm_sweep.sh."""
    if nproc == 1 and nnodes == 1:
        return [sys.executable, "-m", "trainprof.run", recipe_path, *overrides]
    if nnodes == 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                "-m", "trainprof.run", recipe_path, *overrides]
    if "SLURM_JOB_ID" not in os.environ:
        raise UserError(f"a cell with nnodes={nnodes} needs a SLURM allocation (run inside sbatch/salloc, see "
                        "scripts/slurm_sweep.sh), or launch the nodes yourself (scripts/multinode_torchrun.sh) "
                        "and pass the run dirs to `trainprof scale --runs`")
    head = os.environ.get("TRAINPROF_RDZV_HOST") or _first_slurm_node()
    port = os.environ.get("TRAINPROF_RDZV_PORT", "29500")
    return ["srun", f"--nodes={nnodes}", "--ntasks-per-node=1", f"--ntasks={nnodes}", "--kill-on-bad-exit=1",
            sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc_per_node={nproc}",
            "--rdzv_backend=c10d", f"--rdzv_endpoint={head}:{port}",
            f"--rdzv_id=trainprof-{os.environ['SLURM_JOB_ID']}-{time.time_ns()}",
            "-m", "trainprof.run", recipe_path, *overrides]


def check_launchable(cells) -> None:
    """Raise UserError now, before anything runs, for a cell this machine cannot launch (nnodes > 1
    outside SLURM)."""
    for cell in cells:
        launch_command(cell.recipe_path, cell.overrides, nproc=cell.nproc, nnodes=cell.nnodes)


def _first_slurm_node() -> str:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", os.environ.get("SLURM_JOB_NODELIST", "")],
                             capture_output=True, text=True, check=False)
    except OSError:
        raise UserError("scontrol is not available to find the first node of the allocation; set "
                        "TRAINPROF_RDZV_HOST to its hostname") from None
    names = out.stdout.split()
    return names[0] if names else "localhost"


def _alive(procs: dict[int, psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def _remember(root: psutil.Process, seen: dict[int, psutil.Process]) -> None:
    try:
        for child in root.children(recursive=True):
            seen.setdefault(child.pid, child)
    except psutil.Error:
        pass


def stop_tree(proc: subprocess.Popen, seen: dict[int, psutil.Process], sig: int, grace_s: float = GRACE_S) -> None:
    """Send `sig` to the launcher (it forwards to the ranks), wait up to grace_s, SIGKILL the rest."""
    try:
        root = psutil.Process(proc.pid)
        _remember(root, seen)
        seen.setdefault(proc.pid, root)
    except psutil.Error:
        pass
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(seen):
        if proc.poll() is None:
            try:
                _remember(psutil.Process(proc.pid), seen)
            except psutil.Error:
                pass
        else:  # the launcher is gone: nobody else will stop what is left, so do not wait long
            deadline = min(deadline, time.monotonic() + ORPHAN_GRACE_S)
        time.sleep(POLL_S)
    for p in _alive(seen):
        try:
            p.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's own group (it leads its session)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def launch(cmd: list[str], *, log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
           cwd: str | None = None) -> Launch:
    """Run `cmd` in a new session with stdout and stderr to `log_path`; kill it whole on timeout.

    A KeyboardInterrupt while waiting (Ctrl-C, or SIGTERM turned into one by the command) stops the
    cell with SIGINT so its ranks record `interrupted`, and returns with interrupted=True; the caller
    decides what to do next.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    seen: dict[int, psutil.Process] = {}
    with open(log_path, "w") as log:
        log.write("+ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=cwd)
        try:
            root = psutil.Process(proc.pid)
            seen[proc.pid] = root
        except psutil.Error:
            root = None
        last_scan = 0.0
        try:
            while proc.poll() is None:
                now = time.monotonic()
                if now - start > timeout_s:
                    stop_tree(proc, seen, signal.SIGTERM)
                    return Launch(returncode=proc.returncode, elapsed_s=time.monotonic() - start, timed_out=True,
                                  timeout_s=timeout_s, log=str(log_path))
                if root is not None and now - last_scan > 1.0:
                    _remember(root, seen)
                    last_scan = now
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            stop_tree(proc, seen, signal.SIGINT)
            return Launch(returncode=proc.returncode, elapsed_s=time.monotonic() - start, interrupted=True,
                          timeout_s=timeout_s, log=str(log_path))
    # torchrun has exited; a rank it lost track of (it was itself killed) must not outlive the cell
    for p in _alive({pid: p for pid, p in seen.items() if pid != proc.pid}):
        try:
            p.kill()
        except psutil.Error:
            pass
    return Launch(returncode=proc.returncode, elapsed_s=time.monotonic() - start, timeout_s=timeout_s,
                  log=str(log_path))
