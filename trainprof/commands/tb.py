"""`trainprof tb RUN_DIR...`: TensorBoard on a loopback address over the tb/ dirs of one or more runs
(the PyTorch Profiler plugin's trace views and trainprof's scalars), printing the URL."""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from trainprof.distributed import free_port
from trainprof.layout import TRACES_HOW

HOST = "127.0.0.1"  # loopback only: traces name hosts, paths and code; do not serve them to the network
START_TIMEOUT_S = 90


def tb_dir(path: str | Path) -> Path:
    """A run dir's tb/ (or the path itself when it already is a TensorBoard logdir)."""
    from trainprof.errors import UserError

    path = Path(path)
    if not path.exists():
        raise UserError(f"'{path}' does not exist: give a run dir (or its tb/ dir)")
    if not path.is_dir():
        raise UserError(f"'{path}' is a file: give a run dir (or its tb/ dir)")
    if (path / "tb").is_dir():
        return path / "tb"
    if path.is_dir() and (_files_at_top(path) or any(path.glob("*/events.out.tfevents.*"))):
        return path
    raise UserError(f"'{path}' has no tb/ dir with traces or scalars; `trainprof report {path}` writes its "
                    f"scalars, and {traces_from([path])} traces")


def traces_from(run_dirs: list[str | Path]) -> str:
    """What writes operator traces for these runs: infer's own switch for `trainprof infer` runs."""
    if not any((Path(p) / "inference.json").is_file() for p in run_dirs):
        return f"{TRACES_HOW} write operator"
    if len(run_dirs) == 1:
        return "`trainprof infer` without --no-ops writes operator"
    return f"{TRACES_HOW} (`trainprof infer`: without --no-ops) write operator"


def has_traces(run_dirs: list[str | Path]) -> bool:
    """Whether any of the runs holds a Kineto trace (the PyTorch Profiler tab is empty otherwise)."""
    return any(next(tb_dir(p).rglob("*.pt.trace.json*"), None) is not None for p in run_dirs)


def _files_at_top(d: Path) -> bool:
    """Traces or event files directly in d: a run dir written before tb/<run name>/ (layout.tb_run_dir)."""
    return any(d.glob("*.pt.trace.json*")) or any(d.glob("events.out.tfevents.*"))


def logdir_for(run_dirs: list[str | Path]) -> tuple[Path, Path | None]:
    """The logdir to serve, so that TensorBoard and its profiler plugin list each run by its name: one
    run's tb/ itself (its files sit in tb/<run name>/), else a temp dir of symlinks named after the run
    dirs (several runs, or a run dir whose files sit directly in tb/, which would be listed as `tb`).

    Returns:
        (logdir, temp dir to remove afterwards or None).
    """
    dirs = [tb_dir(p) for p in run_dirs]
    if len(dirs) == 1 and not _files_at_top(dirs[0]):
        return dirs[0], None
    tmp = Path(tempfile.mkdtemp(prefix="trainprof-tb-"))
    for d, given in zip(dirs, run_dirs):
        name = Path(given).resolve().name if d.name == "tb" else d.name
        inner = [p for p in d.iterdir() if p.is_dir()]
        target = inner[0] if len(inner) == 1 and not _files_at_top(d) else d
        link, n = tmp / name, 1
        while link.exists():
            n += 1
            link = tmp / f"{name}-{n}"
        link.symlink_to(target.resolve(), target_is_directory=True)
    return tmp, tmp


def wait_until_up(url: str, proc: subprocess.Popen, timeout_s: float = START_TIMEOUT_S,
                  said: Callable[[], str] = lambda: "") -> None:
    """Poll TensorBoard until it answers (bounded); raise if it exits (with `said()`, its last words) or does
    not answer in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            last = said()
            raise RuntimeError(f"tensorboard exited with code {proc.returncode} before answering"
                               + (f": {last}" if last else ""))
        try:
            with urllib.request.urlopen(f"{url}/data/plugins_listing", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"tensorboard did not answer on {url} within {timeout_s:.0f} s")


def start_tensorboard(logdir: str | Path, port: int | None = None, *,
                      quiet: bool = True) -> tuple[subprocess.Popen, str]:
    """Start `python -m tensorboard.main` on HOST over `logdir` and wait until it answers.

    Returns:
        (the process, its base URL). Stop it with `stop_tensorboard`.
    """
    port = port or free_port(HOST)
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", HOST, "--port", str(port)]
    # quiet: its output is kept aside, so that a TensorBoard that fails to start can say why
    log = tempfile.TemporaryFile() if quiet else None
    proc = subprocess.Popen(cmd, stdout=log, stderr=log)
    url = f"http://{HOST}:{port}"

    def said() -> str:
        if log is None:
            return ""  # its output went to the terminal
        log.seek(0)
        lines = [ln.strip() for ln in log.read().decode(errors="replace").splitlines() if ln.strip()]
        # its own error line; the profiler plugin's loader processes die after it with tracebacks of their own
        errors = [ln.removeprefix("ERROR: ") for ln in lines if ln.startswith("ERROR: ")]
        return (errors or lines or [""])[-1]

    try:
        wait_until_up(url, proc, said=said)
    except BaseException:
        stop_tensorboard(proc)
        raise
    finally:
        if log is not None:
            log.close()  # a running TensorBoard keeps writing to the unlinked file, unread
    return proc, url


def stop_tensorboard(proc: subprocess.Popen, timeout_s: float = 15) -> int:
    """SIGTERM, wait; SIGKILL if it does not exit in time. Returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _check_installed() -> None:
    """tensorboard serves nothing without itself; the PyTorch Profiler tab needs torch-tb-profiler."""
    import importlib.util

    from trainprof.errors import UserError

    if importlib.util.find_spec("tensorboard") is None:
        raise UserError("tensorboard is not installed; pip install tensorboard torch-tb-profiler (trainprof depends "
                        "on them: `pip install -e .` installs them)")
    if importlib.util.find_spec("torch_tb_profiler") is None:
        print("trainprof: torch-tb-profiler is not installed, so TensorBoard shows the scalars but no PyTorch Profiler "
              "tab; pip install torch-tb-profiler", file=sys.stderr)


def port_number(text: str) -> int:
    """--port: a TCP port number."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a TCP port from 1 to 65535, got '{text}'")
    return port


def _check_port(port: int | None) -> None:
    """A given port must be free on HOST: TensorBoard would only exit saying so after its start-up."""
    import socket

    from trainprof.errors import UserError

    if port is None:
        return
    with socket.socket() as sock:
        try:
            sock.bind((HOST, port))
        except OSError as err:
            raise UserError(f"--port {port}: cannot listen on {HOST}:{port} ({err.strerror or err}); pick another "
                            "port or omit --port for a free one") from None


def _tb(args: argparse.Namespace) -> int:
    _check_installed()
    _check_port(args.port)
    logdir, tmp = logdir_for(args.run_dirs)
    proc = None

    def _terminate(signum, frame):  # SIGTERM: stop TensorBoard and clean up like Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        try:
            proc, url = start_tensorboard(logdir, args.port, quiet=not args.verbose)
        except RuntimeError as err:  # it exited or never answered: its reason, one line
            from trainprof.errors import UserError

            raise UserError(f"TensorBoard did not start: {err}") from None
        if has_traces(args.run_dirs):
            print(f"TensorBoard: {url}/#pytorch_profiler (traces)  {url}/#timeseries (scalars)  logdir {logdir}",
                  flush=True)
        else:
            print(f"TensorBoard: {url}/#timeseries (scalars)  logdir {logdir}", flush=True)
            print(f"trainprof: no operator traces in {'these runs' if len(args.run_dirs) > 1 else 'this run'}: "
                  f"{traces_from(args.run_dirs)} traces", file=sys.stderr, flush=True)
        if args.no_wait:
            links = f"; then remove its link dir {tmp}" if tmp is not None else ""
            print(f"TensorBoard keeps running as process {proc.pid}: `kill {proc.pid}` stops it{links}",
                  file=sys.stderr, flush=True)
            proc = None  # leave it running
            return 0
        print("Ctrl-C stops it.", file=sys.stderr, flush=True)
        return proc.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc is not None:
            stop_tensorboard(proc)
        if tmp is not None and not args.no_wait:
            shutil.rmtree(tmp, ignore_errors=True)


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("tb", help="TensorBoard (traces + scalars) over run dirs, on loopback",
                       description="Start TensorBoard on 127.0.0.1 over the tb/ dirs of the given runs and print "
                       "the URL; each run shows in the PyTorch Profiler tab (one worker per rank) and in the "
                       "scalars. Runs until Ctrl-C.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (or a tb/ dir)")
    p.add_argument("--port", type=port_number, default=None, help="port on 127.0.0.1 (default: a free one)")
    p.add_argument("--no-wait", action="store_true", help="print the URL and leave TensorBoard running")
    p.add_argument("--verbose", action="store_true", help="show TensorBoard's own output")
    p.set_defaults(func=_tb)
    return p
