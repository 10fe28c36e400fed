"""Warm starts for the suite's runs of `trainprof.run`: a server process imports torch, transformers'
Llama and (for a DeepSpeed run) DeepSpeed once, and forks each run's ranks from itself, started as
torchrun starts them (its environment variables, a session per rank; when a rank fails the others are
stopped). What a fork skips is the imports, 5-6 s a rank and most of a 6-step test run; the run itself is
the same program on the same engines, with the same losses (test_warm). One thing differs: a forked rank's
resident memory leaves out the library pages that only the imports touched, which a fresh process has
mapped in (65-75 MiB of 450-520 here), so the suite compares memory between its own runs. Launching
processes stays tested where it is the subject (torchrun errors, killed ranks, a sweep's timeouts and
signals, wrapped scripts, maxbatch's tries).

Protocol: one JSON request a line on the server's stdin, one JSON reply a line on its stdout (the fd it
had at start; the imports' and ranks' own output never reaches it)."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

GRACE_S = 10.0  # after one rank failed or time ran out, how long the others get after SIGTERM
POLL_S = 0.02
PIN_CPU = "TRAINPROF_TEST_CPU"  # in a request's env: the CPU its ranks run on (a test's run pinned to one core)


def preload_for(engine_kind: str, zero_stage: int) -> tuple[str, ...]:
    """What every run of this engine imports before its first step, and nothing more: a module a run
    would not import would sit in its resident memory."""
    if engine_kind == "megatron":
        return ("torch",)
    mods = ("torch", "transformers.models.llama.modeling_llama")
    if engine_kind == "deepspeed":
        mods += ("deepspeed",)
        if zero_stage > 0:  # ZeRO's optimizer check imports it (compiling its kernels' wrappers)
            mods += ("deepspeed.runtime.zero.muon.muon_optimizer",)
    return mods


class WarmPool:
    """Warm servers of this process, one per preload set, each started when a run first needs it."""

    def __init__(self, log: Path) -> None:
        self.log, self.servers = log, {}
        atexit.register(self.close)

    def run(self, args: list[str], *, nproc: int, env: dict[str, str], cwd: Path, logs: Path,
            timeout: float) -> dict:
        """`python -m trainprof.run ARGS` (ARGS: the recipe, then its overrides) on `nproc` ranks; the
        reply's `code` is the first failing rank's exit code (0: none failed), `codes` the ranks' own, and
        `timed_out` whether they were stopped at `timeout`.
        Rank r's output is in LOGS.rank{r}.out and .err."""
        from trainprof.recipe import RecipeError, load_recipe

        try:
            engine = load_recipe(args[0], args[1:]).engine
            preload = preload_for(engine.kind, engine.zero_stage)
        except RecipeError:  # the ranks say so, as `trainprof.run` would
            preload = preload_for("torch", 0)
        if preload not in self.servers:
            self.servers[preload] = WarmServer(preload, self.log, env)
        return self.servers[preload].run(args, nproc=nproc, env=env, cwd=cwd, logs=logs, timeout=timeout)

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


class WarmServer:
    """A server for one preload set, in this process's environment (started on first use)."""

    def __init__(self, preload: tuple[str, ...], log: Path, env: dict[str, str]) -> None:
        self.preload, self.log, self.requests = preload, log, 0
        with open(log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, *preload], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the warm server for {preload} did not start; its log: {log}")

    def run(self, module_args: list[str], *, nproc: int, env: dict[str, str], cwd: Path, logs: Path,
            timeout: float) -> dict:
        self.requests += 1
        request = {"id": self.requests, "args": module_args, "nproc": nproc, "env": env, "cwd": str(cwd),
                   "logs": str(logs), "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        while True:  # a reply to an earlier request whose caller was interrupted (a test's timeout) is skipped
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the warm server for {self.preload} exited; its log: {self.log}")
            reply = json.loads(line)
            if reply["id"] == self.requests:
                return reply

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _rank_env(rank: int, nproc: int, port: int, error_file: str) -> dict[str, str]:
    """What torchrun's agent sets for a rank on one node (torch.distributed.elastic)."""
    if nproc == 1:  # `python -m trainprof.run`: no launcher at all
        return {}
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "warm", "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCHELASTIC_ERROR_FILE": error_file}


def _rank(request: dict, rank: int, port: int) -> None:
    """In the forked child: become the rank, run `python -m trainprof.run ARGS`, exit as it would."""
    code = 1
    try:
        os.setsid()
        logs = request["logs"]
        out = os.open(f"{logs}.rank{rank}.out", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(f"{logs}.rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.chdir(request["cwd"])
        if cpu := request["env"].get(PIN_CPU):
            os.sched_setaffinity(0, {int(cpu)})
        os.environ.clear()
        os.environ.update(request["env"], **_rank_env(rank, request["nproc"], port, f"{logs}.rank{rank}.error.json"))
        sys.argv = ["trainprof.run", *request["args"]]
        runpy.run_module("trainprof.run", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
    except BaseException:  # noqa: BLE001  as the interpreter would: the traceback, exit code 1
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()  # what interpreter shutdown runs (logging, writers), then no server code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _stop(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.killpg(pid, sig)  # the rank's session: itself and what it started
        except ProcessLookupError:
            pass


def serve_one(request: dict) -> dict:
    from trainprof.distributed import free_port

    port = free_port()
    rank_of = {}
    for rank in range(request["nproc"]):
        pid = os.fork()
        if pid == 0:
            _rank(request, rank, port)
        rank_of[pid] = rank
    codes: dict[int, int] = {}
    first_failure: int | None = None  # the run's exit code, as torchrun reports the first failure
    deadline, stop_at, timed_out = time.monotonic() + request["timeout"], None, False
    while len(codes) < len(rank_of):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[rank_of[pid]] = os.waitstatus_to_exitcode(status)
            if codes[rank_of[pid]] != 0 and first_failure is None:  # torchrun stops the rest of the group
                first_failure = codes[rank_of[pid]]
                _stop([p for p, r in rank_of.items() if r not in codes], signal.SIGTERM)
                stop_at = time.monotonic() + GRACE_S
            continue
        now = time.monotonic()
        if stop_at is None and now > deadline:
            timed_out = True
            _stop([p for p, r in rank_of.items() if r not in codes], signal.SIGTERM)
            stop_at = now + GRACE_S
        if stop_at is not None and now > stop_at:
            _stop([p for p, r in rank_of.items() if r not in codes], signal.SIGKILL)
        time.sleep(POLL_S)
    for pid in rank_of:  # what a rank left behind (its own child processes) goes with it
        _stop([pid], signal.SIGKILL)
    return {"id": request["id"], "code": first_failure or 0, "codes": [codes[r] for r in range(len(rank_of))],
            "timed_out": timed_out}


def main(preload: list[str]) -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the imports' prints (DeepSpeed's accelerator line) go to the log, not to the replies
    for name in preload:
        importlib.import_module(name)
    replies.write("ready\n")
    replies.flush()
    for line in sys.stdin:
        sys.stdout.flush()
        sys.stderr.flush()
        replies.write(json.dumps(serve_one(json.loads(line))) + "\n")
        replies.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
