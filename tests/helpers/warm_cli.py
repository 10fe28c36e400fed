"""`python tests/helpers/warm_cli.py ARGS`: `trainprof ARGS`, with each cell of a sweep, maxbatch or scale
run forked from warm servers (warm.py) in place of its own `torchrun`/`python -m trainprof.run` process:
for the suite's sweeps, whose one-step cells are mostly imports. A cell's log is its ranks' output one
after the other. Launching cells as processes, with timeouts and signals, stays tested on its own
(test_sweep_failures, test_sweep_spec)."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.warm import WarmPool  # noqa: E402

from trainprof.sweep import runner  # noqa: E402
from trainprof.sweep.launch import Launch  # noqa: E402

POOL = WarmPool(Path(tempfile.gettempdir()) / f"trainprof-warm-{os.getpid()}.log")


def launch(cmd: list[str], *, log_path: Path, timeout_s: float, env: dict[str, str] | None = None,
           cwd: str | None = None) -> Launch:
    """trainprof.sweep.launch.launch's contract, for a command launch_command made."""
    start = time.monotonic()
    args = cmd[cmd.index("trainprof.run") + 1:]
    nproc = next((int(a.split("=", 1)[1]) for a in cmd if a.startswith("--nproc_per_node=")), 1)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    logs = log_path.with_suffix("")
    reply = POOL.run(args, nproc=nproc, env=env or dict(os.environ), cwd=Path(cwd or os.getcwd()), logs=logs,
                     timeout=timeout_s)
    outputs = [Path(f"{logs}.rank{r}.{kind}").read_text() for r in range(nproc) for kind in ("out", "err")]
    log_path.write_text("+ " + " ".join(cmd) + "\n" + "".join(outputs))
    code = reply["code"]
    return Launch(returncode=code, elapsed_s=time.monotonic() - start, timed_out=reply["timed_out"],
                  log=str(log_path))


if __name__ == "__main__":
    from trainprof.cli import main

    runner.launch = launch
    sys.exit(main(sys.argv[1:]))
