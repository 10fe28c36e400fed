"""Probes: the recipe's own model parts and engines, timed at a shape on this machine.

Part probes build the recipe's architecture bare (random init, no engine, no hooks, no recomputation)
with no decoder layer and with k of them, so that the rest of the model (embedding, final norm, LM head
and loss) is timed alone, rest = T(0), and one decoder layer is layer = (T(k) - T(0)) / k. Building k
layers, never the whole model, is what lets a large shape be probed where its model would not fit. Engine probes build each recipe's whole engine in a group of one.

Every figure is the median of repeated calls after warm-up (as a run's figures are medians of its
steps: the fastest call can miss a cost most calls pay, such as page faults on a large tensor the
allocator returned to the system), all probes called in turn within each
round (a slow spell of the machine hits every shape alike), on the host clock, beside as many busy
processes as the run has other ranks on a CPU (they share its cores and memory bandwidth), and with the
host allocator the measured run had (`train.cpu_allocator`, which the projection sets from the source's
profile): with glibc's defaults a run page-faults its large tensors in again at some shapes and not at
others, and a probe does so at other shapes than the run. A process keeps the `cache` allocator once set.

Engine probes and busy neighbours time work in processes of their own, forked from a server (multiprocessing's
forkserver) that has imported torch, transformers' Llama and DeepSpeed once: such a process starts in a fraction of
a second where a fresh interpreter spends about 10 s on those imports, and runs the same code once started. Probes
of a process's resident memory (engine_resident) stay fresh interpreters: the imports' pages are part of what
they measure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

PROBE_ROUNDS = 12  # timed calls per model in a probe (their median counts), after 2 warm-up calls
# where k layers read no slower than none (a slow spell larger than the layers' time), up to this many more
# sets of rounds are taken before the layer is given as 0 ms
UNRESOLVED_EXTRA = 2
# above this many parameters per decoder layer a probe on CPU would take longer than the projection is
# worth; such shapes are re-derived from their GEMMs instead (projection/gemm.py)
PROBE_MAX_LAYER_PARAMS = 60_000_000
PROBE_MAX_PARAMS = 200_000_000  # k, the layers of the larger probe model, stays under this
GO_TIMEOUT_S = 300.0  # how long an engine probe waits for its busy neighbours (they get 120 s to start)
ENGINE_PROBE_TIMEOUT_S = 600.0
# what the server that timing probes are forked from imports once (see _forked): what every engine probe and busy
# neighbour would import itself, DeepSpeed's ZeRO optimizer check included
WARM_IMPORTS = ("torch", "transformers.models.llama.modeling_llama", "deepspeed",
                "deepspeed.runtime.zero.muon.muon_optimizer", "trainprof.engines", "trainprof.projection.probes")


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    """What a probe's timing depends on: the model's dims and the micro batch it runs."""

    dims: tuple[int, ...]
    micro_batch: int
    seq_len: int
    attention: str

    @classmethod
    def of(cls, recipe: Any) -> "ProbeShape":
        """The shape a recipe's micro batch runs at (probes run without recomputation)."""
        from trainprof.projection.changes import model_shape

        return cls(model_shape(recipe), recipe.train.micro_batch_size, recipe.data.seq_len, recipe.model.attention)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PartProbe:
    """ms per micro batch of one decoder layer and of the rest of the model, bare, on this machine."""

    layer_forward_ms: float
    layer_backward_ms: float
    rest_forward_ms: float
    rest_backward_ms: float
    layers_probed: int
    threads: int  # torch intra-op threads it ran with
    # a mixed-precision AdamW step's ns per parameter element (the k layers' step minus the rest's, over
    # their elements); None where the probe did not time steps
    step_ns_per_element: float | None = None
    # how firm the layers' time is: the relative standard error of the median over the rounds of the per-round
    # forward and backward of k layers minus none (paired_error); None: not kept
    layer_error: float | None = None


def layer_params(recipe: Any) -> int:
    from trainprof.models import resolve_shape

    s = resolve_shape(recipe.model)
    kv = s.num_kv_heads * s.head_dim
    return 2 * s.hidden_size * (s.hidden_size + kv) + 3 * s.hidden_size * s.intermediate_size + 2 * s.hidden_size


def probeable(recipe: Any) -> bool:
    return layer_params(recipe) <= PROBE_MAX_LAYER_PARAMS


def probe_layers(recipe: Any) -> int:
    """k: the larger probe model's decoder layers: all of the model's, or fewer under PROBE_MAX_PARAMS
    (more layers make their time a larger part of the difference it is taken from)."""
    from trainprof.models import resolve_shape

    layers = resolve_shape(recipe.model).num_layers
    return max(1, min(layers, PROBE_MAX_PARAMS // max(layer_params(recipe), 1)))


def bare_model(recipe: Any, shape: ProbeShape, layers: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model a probe times: the recipe's architecture with `layers` decoder layers, random init, no
    engine, no hooks, no recomputation, every weight trainable; and a batch at `shape`."""
    from trainprof.models import build_model, resolve_shape

    model_cfg = dataclasses.replace(recipe.model, num_layers=max(layers, 1), attention=shape.attention, recompute=False)
    r = dataclasses.replace(recipe, model=model_cfg, task=dataclasses.replace(recipe.task, kind="pretrain"))
    torch.manual_seed(0)
    model = build_model(r).train()
    if layers == 0:  # the rest of the model alone: embedding, final norm, LM head and loss
        model.model.layers = torch.nn.ModuleList()
        model.config.num_hidden_layers = 0
    ids = torch.randint(0, resolve_shape(r.model).vocab_size, (shape.micro_batch, shape.seq_len))
    return model, {"input_ids": ids, "labels": ids}


def probe_parts(probes: list[Any], *, threads: int | list[int] | None = None, rounds: int = PROBE_ROUNDS,
                neighbours: int = 0, steps: bool = False, pool: Neighbours | None = None) -> list[PartProbe]:
    """One decoder layer's and the rest of the model's forward and backward ms for each recipe at its
    shape (see the module docstring), all models called in turn within each round, with `neighbours`
    busy processes running the first recipe's model meanwhile.

    Args:
        probes: recipes (each at its own micro batch, seq_len, attention and dims).
        threads: torch intra-op threads for all probes, or one count per probe (a change of threads is
            probed as a change of shape is); None: as set now.
        steps: also time a mixed-precision AdamW step after each backward (`MixedPrecisionStep`), for its
            cost per parameter element at each shape.
        pool: keeps the neighbours for later probes (busy_neighbours).
    """
    from trainprof.env import apply_host_allocator

    apply_host_allocator(torch.device("cpu"), probes[0].train.cpu_allocator)
    before = torch.get_num_threads()
    per_probe = threads if isinstance(threads, list) else [threads or before] * len(probes)
    try:
        models, batches, ks, threads_of = {}, {}, [], {}
        for j, recipe in enumerate(probes):
            k = probe_layers(recipe)
            ks.append(k)
            for layers in (0, k):
                models[(j, layers)], batches[(j, layers)] = bare_model(recipe, ProbeShape.of(recipe), layers)
                threads_of[(j, layers)] = per_probe[j]
        keys = list(models)
        timed: dict[Any, dict[str, list[float]]] = {key: {"forward": [], "backward": [], "step": []} for key in keys}
        stepper = {key: MixedPrecisionStep(models[key]) for key in keys} if steps else {}

        def medians(j: int, layers: int) -> list[float]:
            return [statistics.median(timed[(j, layers)][ph]) if timed[(j, layers)][ph] else 0.0
                    for ph in ("forward", "backward", "step")]

        def unresolved() -> bool:  # k layers no slower than none: noise larger than the layers' time
            for j, k in enumerate(ks):
                (f0, b0, _), (fk, bk, _) = medians(j, 0), medians(j, k)
                if fk <= f0 or bk <= b0:
                    return True
            return False

        with busy_neighbours(probes[0], neighbours, per_probe[0], pool=pool):
            _probe_rounds(models, batches, keys, rounds, timed, threads_of, stepper)
            for _ in range(UNRESOLVED_EXTRA):
                if not unresolved():
                    break
                _probe_rounds(models, batches, keys, rounds, timed, threads_of, stepper, warmup=0)
        out = []
        for j, k in enumerate(ks):
            (f0, b0, s0), (fk, bk, sk) = medians(j, 0), medians(j, k)
            elements = stepper[(j, k)].elements - stepper[(j, 0)].elements if steps else 0
            out.append(PartProbe(layer_forward_ms=max(fk - f0, 0.0) / k, layer_backward_ms=max(bk - b0, 0.0) / k,
                                 rest_forward_ms=f0, rest_backward_ms=b0, layers_probed=k, threads=threads_of[(j, k)],
                                 step_ns_per_element=max(sk - s0, 0.0) * 1e6 / elements if elements > 0 else None,
                                 layer_error=paired_error(timed[(j, k)], timed[(j, 0)])))
        return out
    finally:
        torch.set_num_threads(before)


def paired_error(with_layers: dict[str, list[float]], without: dict[str, list[float]]) -> float | None:
    """The relative standard error of the median of the layers' forward + backward over a probe's rounds
    (each round's with-layers minus without, paired: a slow spell hits both): 1.2533 sigma / sqrt(n) over the
    median, sigma from the interquartile range (IQR / 1.349, robust to a few outliers); None with fewer
    than 4 rounds or no positive median."""
    diffs = [fk + bk - f0 - b0 for fk, bk, f0, b0 in zip(with_layers["forward"], with_layers["backward"],
                                                        without["forward"], without["backward"])]
    if len(diffs) < 4:
        return None
    q1, mid, q3 = statistics.quantiles(diffs, n=4)
    return 1.2533 * (q3 - q1) / 1.349 / math.sqrt(len(diffs)) / mid if mid > 0 else None


def _recipe_file(recipe: Any, path: Path) -> Path:
    """The recipe written where a probe process reads it."""
    import yaml

    path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    return path


def _group_env(rank: int, world: int, threads: int, port: int) -> dict[str, str]:
    """A probe process's environment as one rank of a `world`-rank group on this host."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def warm_up() -> Any:
    """Starts the server that timing probes are forked from (multiprocessing's forkserver, with WARM_IMPORTS
    imported and its output to /dev/null), if it is not running; returns its context. It imports in the
    background, so a caller that will probe starts it early. Where CUDA is available each probe is a fresh
    interpreter instead (multiprocessing's spawn): those imports ask whether CUDA is available, and a process
    forked after CUDA was initialised cannot use it. As with any multiprocessing start method but fork, the
    caller's main module must be importable without side effects (the `if __name__ == "__main__"` guard).

    Raises:
        ValueError: the caller's main module is a script that is not a file (read from stdin), which each forked
            process would fail to import.
    """
    import multiprocessing
    import sys

    main = sys.modules["__main__"]
    path = getattr(main, "__file__", None)
    if getattr(getattr(main, "__spec__", None), "name", None) is None and path and not os.path.isfile(path):
        raise ValueError(f"a probe's process imports the caller's main module, and it is not a file ({path}): "
                         "run the projection from `trainprof project` or a script file")
    if torch.cuda.is_available():
        return multiprocessing.get_context("spawn")
    _start_server()
    return multiprocessing.get_context("forkserver")


@functools.cache
def _start_server() -> None:
    """The forkserver started once per process, with WARM_IMPORTS and its stdout and stderr to /dev/null: its
    imports print (DeepSpeed's accelerator notes), and its probes' output goes to their own files."""
    import multiprocessing
    import sys
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(WARM_IMPORTS))
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _forked(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str], errors: Path | str) -> Any:
    """A started multiprocessing.Process, forked from the warm server (warm_up; on a CUDA machine a fresh
    interpreter), that runs `main(argv)` with `env` set and torch's threads as its OMP_NUM_THREADS says, its
    stderr to the file `errors`. Daemonic: it dies with this process."""
    proc = warm_up().Process(target=_forked_main, args=(main, argv, env, str(errors)), daemon=True)
    proc.start()
    return proc


def _forked_main(main: Callable[[list[str]], int], argv: list[str], env: dict[str, str], errors: str) -> None:
    import sys
    import traceback
    from multiprocessing import forkserver

    # the server ends when no process holds this end of its pipe: its client, and each process forked from it
    # unless closed here. Closed, the server ends with the client, however the client ends, and this process
    # with the server (a stopped neighbour included). A spawned process has none, and dies with its client.
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    _die_with_parent()
    os.environ.update(env)
    err = os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(err, 2)
    if "OMP_NUM_THREADS" in env:  # read by the OpenMP runtime when the server imported torch, so set here
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        code = main(argv)
    except BaseException:  # noqa: BLE001 - its last line is what the parent reports
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code or 0)  # as _engine_resident_main: a library's threads torn down at exit can abort the process


class Neighbours:
    """The busy neighbours of one projection's probes (see busy_neighbours), kept from the first probe that
    needs them to `close()`: stopped (SIGSTOP) between probes, so that nothing else the projection times
    shares the machine with them, and resumed (SIGCONT) for each, so that only the first probe waits the
    4-5 s of their start."""

    def __init__(self) -> None:
        self._tmp: Any = None
        # (recipe as YAML, threads) -> [(process, the file it writes once its model runs)]
        self._procs: dict[tuple[str, int], list[tuple[Any, Path]]] = {}

    @contextlib.contextmanager
    def busy(self, recipe: Any, count: int, threads: int, go: Path | None = None):
        """`count` neighbours running `recipe`'s model on `threads` for the block; `go` as busy_neighbours'."""
        import signal

        procs = self._started(recipe, count, threads) if count > 0 else []
        try:
            for p, _ in procs:
                os.kill(p.pid, signal.SIGCONT)
            deadline = time.monotonic() + 120
            while not all(ready.exists() for _, ready in procs) and time.monotonic() < deadline:
                if any(not p.is_alive() for p, _ in procs):
                    break
                time.sleep(0.1)
            dead = [p for p, _ in procs if not p.is_alive()]
            if dead:  # a probe timed without it would read the machine as less busy than the run was
                raise ValueError(f"a busy neighbour of the probe exited (code {dead[0].exitcode}) before its model ran")
            if go is not None:
                go.write_text("1")
            yield
        finally:
            for p, _ in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGSTOP)

    def pids(self) -> list[int]:
        """The neighbours' process ids, started and not yet closed."""
        return [p.pid for procs in self._procs.values() for p, _ in procs]

    def _started(self, recipe: Any, count: int, threads: int) -> list[tuple[Any, Path]]:
        import tempfile

        import yaml

        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="trainprof-probe-")
        tmp = Path(self._tmp.name)
        key = (yaml.safe_dump(recipe.to_dict(), sort_keys=False), threads)
        procs = self._procs.setdefault(key, [])
        path = tmp / f"recipe{list(self._procs).index(key)}.yaml"
        if not path.exists():
            path.write_text(key[0])
        while len(procs) < count:
            ready = tmp / f"ready{sum(map(len, self._procs.values()))}"
            procs.append((_forked(_busy_main, [str(path), str(ready)], {**os.environ, "OMP_NUM_THREADS": str(threads)},
                                  os.devnull),
                          ready))
        return procs[:count]

    def close(self) -> None:
        for p, _ in (proc for procs in self._procs.values() for proc in procs):
            p.kill()
            p.join()
        self._procs.clear()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


@contextlib.contextmanager
def busy_neighbours(recipe: Any, count: int, threads: int, go: Path | None = None, pool: Neighbours | None = None):
    """`count` other processes running the recipe's model at its shape while a probe times it: the
    ranks of a CPU run share the machine's memory bandwidth and caches, and a probe alone would not.
    `go`: a file written once they run, for a probe process started before them to begin timing.
    `pool`: where they are kept for later probes (else they are killed after the block)."""
    own = pool is None
    pool = pool or Neighbours()
    try:
        with pool.busy(recipe, count, threads, go):
            yield
    finally:
        if own:
            pool.close()


def _die_with_parent() -> None:
    """A neighbour loops until it is killed, stopped or not, and an engine probe waits for its go: on Linux, the
    kernel kills either when its parent (the warm server, or the client that spawned it) ends."""
    import signal
    import sys

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it exited before prctl
            os._exit(1)


def _busy_main(argv: list[str]) -> int:
    from trainprof.env import apply_host_allocator
    from trainprof.models import resolve_shape
    from trainprof.recipe import load_recipe

    path, ready = argv
    recipe = load_recipe(path, [])
    apply_host_allocator(torch.device("cpu"), recipe.train.cpu_allocator)
    model, batch = bare_model(recipe, ProbeShape.of(recipe), resolve_shape(recipe.model).num_layers)
    Path(ready).write_text("1")
    while True:  # until the probe kills it
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)


def probe_engines(recipes: list[Any], *, threads: int, rounds: int = 8, neighbours: int = 0,
                  bare: bool = False, pool: Neighbours | None = None) -> list[dict[str, float]]:
    """Forward and backward ms of one micro batch through each recipe's own engine (DeepSpeed at its
    ZeRO stage and offload, or plain torch), all built in one fresh process in a group of one and
    called alternately (drift hits all of them), each call after writing the size of the last-level cache,
    the median of `rounds` after 2 warm-up rounds, with `neighbours` busy processes as in probe_parts.
    What an engine adds around the model (ZeRO-3's parameter fetch and release at every module, gradient
    bucketing, the optimizer wrapper) is in these times, and the optimizer step (`engine.step()`) is timed
    apart; communication at world size 1 is not. With `bare`, each recipe's bare model is called in the same
    rounds too (a check of the probe: the plain torch engine is its bare model), so engine minus bare keeps
    little of the drift. `pool` keeps the neighbours for later probes (busy_neighbours).

    Returns:
        per recipe: {engine_forward_ms, engine_backward_ms, engine_step_ms}, and with `bare` also {model_forward_ms,
        model_backward_ms}
    Raises:
        ValueError: the probe process failed (its last error line).
    """
    import json
    import tempfile

    from trainprof.distributed import free_port

    with tempfile.TemporaryDirectory(prefix="trainprof-engine-probe-") as tmp:
        paths = [_recipe_file(recipe, Path(tmp) / f"recipe{i}.yaml") for i, recipe in enumerate(recipes)]
        out, go, errors = Path(tmp) / "probe.json", Path(tmp) / "go", Path(tmp) / "stderr"
        # the probe builds its engines while the neighbours start; it times once they run
        proc = _forked(_probe_engines_main, [str(rounds), str(int(bare)), str(out), str(go), *map(str, paths)],
                       _group_env(0, 1, threads, free_port()), errors)
        try:
            with busy_neighbours(recipes[0], neighbours, threads, go=go, pool=pool):
                proc.join(ENGINE_PROBE_TIMEOUT_S)
                timed_out = proc.is_alive()
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
        if timed_out:
            raise ValueError(f"the engine probe timed out after {ENGINE_PROBE_TIMEOUT_S:.0f} s")
        if proc.exitcode != 0 or not out.is_file():
            stderr = errors.read_text(errors="replace") if errors.is_file() else ""
            raise ValueError(f"the engine probe failed ({_error_line(stderr)[:200]})")
        return json.loads(out.read_text())


def _error_line(stderr: str) -> str:
    """The exception a child process died of (its traceback's last `SomethingError: ...` line), else its
    last line: warnings printed after the traceback would hide it."""
    lines = stderr.strip().splitlines() or ["no output"]
    errors = [ln for ln in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)]
    return (errors or lines)[-1]


def _probe_engines_main(argv: list[str]) -> int:
    import json

    from trainprof.distributed import DistContext, init_distributed, seed_everything
    from trainprof.engines import build_engine
    from trainprof.env import apply_host_allocator, last_level_cache_bytes
    from trainprof.models import resolve_shape
    from trainprof.recipe import load_recipe

    rounds, bare, out, go, *paths = argv
    recipes = [load_recipe(p, ["train.grad_accum=1"]) for p in paths]  # every micro batch a boundary
    ctx = DistContext.from_env()
    apply_host_allocator(ctx.device, recipes[0].train.cpu_allocator)
    init_distributed(ctx, engine_kind=recipes[0].engine.kind)
    # the bare models first: one built after a ZeRO-3 engine in the same process runs far slower
    models = {k: bare_model(recipe, ProbeShape.of(recipe), resolve_shape(recipe.model).num_layers)
              for k, recipe in enumerate(recipes)} if bare == "1" else {}
    engines, batches = [], []
    for recipe in recipes:
        seed_everything(recipe.train.seed)
        engines.append(build_engine(recipe, ctx))
        ids = torch.randint(0, resolve_shape(recipe.model).vocab_size,
                            (recipe.train.micro_batch_size, recipe.data.seq_len))
        batches.append({"input_ids": ids, "labels": ids})
    timed: list[dict[str, list[float]]] = [{"engine_forward_ms": [], "engine_backward_ms": [], "engine_step_ms": [],
                                            "model_forward_ms": [], "model_backward_ms": []} for _ in recipes]
    # written before each timed call, so that no call inherits the caches its predecessor left: the call after
    # ZeRO-3's optimizer step read 12% slower (up to 48%) than the same call after a bare model's
    scratch = torch.empty(last_level_cache_bytes() // 4)
    deadline = time.monotonic() + GO_TIMEOUT_S
    while not Path(go).exists():  # until the busy neighbours run
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go from the probe's parent after {GO_TIMEOUT_S:.0f} s")
        time.sleep(0.01)
    for i in range(int(rounds) + 2):
        for k, engine in enumerate(engines):
            scratch.fill_(1.0)
            t0 = time.perf_counter()
            loss = engine.forward(batches[k])
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            if i >= 2:
                for key, ms in (("engine_forward_ms", t1 - t0), ("engine_backward_ms", t2 - t1),
                                ("engine_step_ms", t3 - t2)):
                    timed[k][key].append(ms * 1e3)
        for k, (model, batch) in models.items():  # each bare model once a round, beside the engines' calls
            scratch.fill_(1.0)
            f_ms, b_ms, _ = _forward_backward_ms(model, batch)
            if i >= 2:
                timed[k]["model_forward_ms"].append(f_ms)
                timed[k]["model_backward_ms"].append(b_ms)
    Path(out).write_text(json.dumps([{key: statistics.median(v) for key, v in t.items() if v} for t in timed]))
    return 0


def engine_resident(recipe: Any, world: int, *, steps: int = 3) -> int:
    """Peak resident bytes of the fullest of `world` fresh processes that build `recipe`'s engine as one
    group and run `steps` micro-batch steps through it: what a run's process holds besides what the plan
    counts (libraries, the engine's runtime and its buffers at that world size, the interpreter) is in it,
    with the model's share, which the caller takes out with the plan's figure for the same recipe. Fresh
    processes: what a library import costs is only seen in a process that imports it first.

    Raises:
        ValueError: a probe process failed (its last error line).
    """
    import subprocess
    import sys
    import tempfile

    from trainprof.distributed import free_port

    with tempfile.TemporaryDirectory(prefix="trainprof-resident-probe-") as tmp:
        path, port = _recipe_file(recipe, Path(tmp) / "recipe.yaml"), free_port()
        procs = [subprocess.Popen([sys.executable, "-m", "trainprof.projection.probes", "--engine-resident", str(steps),
                                   str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=_group_env(rank, world, 1, port))
                 for rank in range(world)]
        peaks = []
        try:
            for proc in procs:
                try:
                    out, err = proc.communicate(timeout=600)
                except subprocess.TimeoutExpired:
                    raise ValueError("the resident-memory probe timed out after 600 s") from None
                lines = out.strip().splitlines()
                if proc.returncode != 0 or not lines or not lines[-1].isdigit():
                    raise ValueError(f"the resident-memory probe failed ({_error_line(err)[:200]})")
                peaks.append(int(lines[-1]))
        finally:  # a rank left waiting for one that failed would wait for good
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return max(peaks)


def _engine_resident_main(argv: list[str]) -> int:
    from trainprof.distributed import DistContext, init_distributed, seed_everything
    from trainprof.engines import build_engine
    from trainprof.env import apply_host_allocator, vm_hwm_bytes
    from trainprof.models import resolve_shape
    from trainprof.recipe import load_recipe

    steps, path = argv
    recipe = load_recipe(path, ["train.grad_accum=1"])
    ctx = DistContext.from_env()
    apply_host_allocator(ctx.device, recipe.train.cpu_allocator)
    init_distributed(ctx, engine_kind=recipe.engine.kind)
    seed_everything(recipe.train.seed)
    engine = build_engine(recipe, ctx)
    ids = torch.randint(0, resolve_shape(recipe.model).vocab_size, (recipe.train.micro_batch_size, recipe.data.seq_len))
    for _ in range(int(steps)):
        engine.backward(engine.forward({"input_ids": ids, "labels": ids}))
        engine.step()
    if torch.distributed.is_initialized():  # neither rank leaves while the other still talks to it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    print(vm_hwm_bytes(), flush=True)  # not ru_maxrss: that is at least the spawning process's peak
    os._exit(0)  # measured: a library's threads torn down at exit can abort the process (std::terminate)


class MixedPrecisionStep:
    """What a mixed-precision optimizer step does to each parameter element, on a bare model: its 16-bit
    gradient copied into an fp32 master copy, torch's AdamW (foreach) over the fp32 masters, the updated
    master copied back into the 16-bit parameter (as DeepSpeed's ZeRO optimizers and torch's autocast
    training do with their fp32 states)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float().clone() for p in self.params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=1e-6, foreach=True)
        self.elements = sum(p.numel() for p in self.params)

    def __call__(self) -> float:
        """One step over the gradients the last backward left (ms)."""
        t0 = time.perf_counter()
        for master, p in zip(self.masters, self.params):
            master.grad = p.grad.float() if p.grad is not None else None
        self.optimizer.step()
        with torch.no_grad():
            for master, p in zip(self.masters, self.params):
                p.copy_(master)
        return (time.perf_counter() - t0) * 1e3


def _forward_backward_ms(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                         step: MixedPrecisionStep | None = None) -> tuple[float, float, float | None]:
    """One call of a bare model: (forward ms, backward ms, the `step`'s ms or None); its gradients are
    dropped after."""
    t0 = time.perf_counter()
    loss = model(**batch).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    step_ms = step() if step is not None else None
    model.zero_grad(set_to_none=True)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3, step_ms


def _probe_rounds(models: dict[Any, Any], batches: dict[Any, Any], keys: list[Any], rounds: int,
                  timed: dict[Any, dict[str, list[float]]], threads: dict[Any, int],
                  stepper: dict[Any, MixedPrecisionStep], warmup: int = 2) -> None:
    """`warmup` untimed rounds, then `rounds` timed ones: every model called once a round, in turn, each with
    its own intra-op threads (`threads`, updated to the count torch took) and its `stepper`'s step if any."""
    for i in range(rounds + warmup):
        for n in keys:
            torch.set_num_threads(threads[n])
            threads[n] = torch.get_num_threads()  # what it ran with
            f_ms, b_ms, s_ms = _forward_backward_ms(models[n], batches[n], stepper.get(n))
            if i >= warmup:
                timed[n]["forward"].append(f_ms)
                timed[n]["backward"].append(b_ms)
                if s_ms is not None:
                    timed[n]["step"].append(s_ms)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--engine-resident"]:
        sys.exit(_engine_resident_main(sys.argv[2:]))
    sys.exit("usage: python -m trainprof.projection.probes --engine-resident STEPS RECIPE")
