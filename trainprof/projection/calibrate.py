"""Calibration microbenchmarks: the machine's achievable matmul rate, memory bandwidth and collective
α-β, measured in seconds and stored as calibration.json in a run dir, so that a run made elsewhere
can be projected on another machine; and model probes, which time the recipe's own layers at a shape.

Every figure is the median of repeated timed calls after warm-up calls: on CPU on the host monotonic
clock, with the thread count it ran with; on CUDA with CUDA events around a burst of calls (a single
small kernel is shorter than a host synchronization), at sizes that fill the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

CALIBRATION_VERSION = 2  # 2: matmul per Linear layout and phase
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# square GEMMs probed for the achievable matmul rate (the best one is this machine's MAMF-style figure)
GEMM_SIZES = (256, 512, 1024)
GEMM_SIZES_CUDA = (2048, 4096, 8192)  # 8192^3 bf16: ~1.4 ms on an H100, well past launch overheads
GEMM_MAX_CALL_MS = 250.0  # a larger size whose call would take longer (n^3 from the last) is skipped
COPY_BYTES = 64 * 2**20  # large enough to leave the last-level cache of a server CPU
COPY_BYTES_CUDA = 2 * 2**30  # far past a GPU's L2 (50-60 MB on Hopper)
CUDA_BURST = 10  # calls per CUDA-event-timed sample
COLLECTIVE_BYTES = (2**12, 2**16, 2**20, 2**22)
COLLECTIVE_OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], Any], device: torch.device, *, repeat: int = 7, warmup: int = 2,
            budget_s: float = 2.0) -> float:
    """Median ms of fn() over `repeat` samples after `warmup` calls (fewer when over `budget_s`).
    CPU: one call per sample on the host clock. CUDA: CUDA events around CUDA_BURST calls per sample."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        return _cuda_time_ms(fn, repeat)
    samples: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) * 1e3)
        if time.perf_counter() > deadline and len(samples) >= 3:
            break
    return statistics.median(samples)


def _cuda_time_ms(fn: Callable[[], Any], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CUDA_BURST):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / CUDA_BURST)
    return statistics.median(samples)


# The three GEMMs of a Linear layer in training (row-major, weight w stored [out, in]): the forward
# y = x @ w.T ("nt"), the input gradient dx = dy @ w ("nn") and the weight gradient dw = dy.T @ x ("tn").
# Their rates can differ by 5x on a CPU (bf16 without native support: one layout threaded, another not).
LINEAR_GEMMS = {"nt": lambda a, b: a @ b.t(), "nn": lambda a, b: a @ b, "tn": lambda a, b: a.t() @ b}


def matmul_rate(device: torch.device, dtype: str, sizes: tuple[int, ...] | None = None) -> dict[str, Any]:
    """TFLOP/s of square GEMMs (2*n^3 FLOPs each, random operands) in `dtype`, in each layout a Linear
    trains with (LINEAR_GEMMS); the best of any is the achievable rate. Sizes: GEMM_SIZES on CPU,
    GEMM_SIZES_CUDA on a GPU.

    Returns:
        {dtype, gemms: [{n, layout, ms, tflops}], best_tflops, by_layout_tflops {layout: best over
        sizes}, by_phase_tflops {forward: nt, backward: nn and tn at equal FLOPs (their harmonic mean),
        recompute: nt}}
    """
    if sizes is None:
        sizes = GEMM_SIZES_CUDA if device.type == "cuda" else GEMM_SIZES
    rows: list[dict[str, Any]] = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
        b = torch.randn(n, n, device=device, dtype=DTYPES[dtype])
        for layout, gemm in LINEAR_GEMMS.items():
            last = [r for r in rows if r["layout"] == layout]
            if last and last[-1]["ms"] * (n / last[-1]["n"]) ** 3 > GEMM_MAX_CALL_MS:
                continue  # a layout this slow is timed well at the smaller size already
            ms = time_ms(lambda: gemm(a, b), device)
            rows.append({"n": n, "layout": layout, "ms": ms, "tflops": 2 * n**3 / (ms * 1e-3) / 1e12})
    best = {layout: max(r["tflops"] for r in rows if r["layout"] == layout) for layout in LINEAR_GEMMS}
    return {"dtype": dtype, "gemms": rows, "best_tflops": max(best.values()), "by_layout_tflops": best,
            "by_phase_tflops": {"forward": best["nt"], "backward": 2 / (1 / best["nn"] + 1 / best["tn"]),
                                "recompute": best["nt"]}}


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> dict[str, Any]:
    """GB/s of a device-to-device tensor copy (read + write counted, as STREAM's copy does) of `nbytes`
    (COPY_BYTES on CPU, COPY_BYTES_CUDA on a GPU)."""
    if nbytes is None:
        nbytes = COPY_BYTES_CUDA if device.type == "cuda" else COPY_BYTES
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device)
    return {"bytes": nbytes, "ms": ms, "gbps": 2 * nbytes / (ms * 1e-3) / 1e9}


def host_dispatch(calls: int = 2000, repeat: int = 5) -> dict[str, Any]:
    """Microseconds per dispatch of a tiny CPU op (torch.add on one element, eager, from Python): the
    host's speed at the work that bounds small or hook-heavy GPU steps (Python, dispatch, launches)."""
    x = torch.zeros(1)
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.add(x, 1)
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return {"op": "torch.add on a 1-element CPU tensor", "calls": calls, "us_per_op": statistics.median(samples)}


def fit_alpha_beta(sizes: list[int], ms: list[float]) -> tuple[float, float]:
    """Least-squares t = alpha + bytes / bw over the samples; returns (alpha_ms, bw_gbps)."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(ms) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, ms)) / sxx if sxx else 0.0
    slope = max(slope, 1e-12)
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / (slope * 1e-3) / 1e9  # slope: ms per byte -> GB/s


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor (doc/PERFORMANCE.md): all_reduce 2(n-1)/n; all_gather and
    reduce_scatter (n-1)/n; broadcast/reduce 1."""
    if n <= 1:
        return 0.0
    if op in ("all_reduce",):
        return 2 * (n - 1) / n
    if op in ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor"):
        return (n - 1) / n
    return 1.0


def collective_ms(op: str, nbytes: float, n: int, fit: dict[str, Any]) -> float:
    """α-β time of one collective of nccl-tests size `nbytes` over n ranks from a fit
    {alpha_ms, busbw_gbps}: alpha + bytes * bus_factor / busbw."""
    if n <= 1:
        return 0.0
    return fit["alpha_ms"] + nbytes * bus_factor(op, n) / (fit["busbw_gbps"] * 1e9) * 1e3


def _collective_worker(rank: int, world: int, port: int, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out: dict[str, Any] = {}
    for op in COLLECTIVE_OPS:
        sizes, times = [], []
        for nbytes in COLLECTIVE_BYTES:
            numel = nbytes // 4
            full = torch.ones(numel * (world if op == "reduce_scatter_tensor" else 1))
            part = torch.ones(numel // world if op == "all_gather_into_tensor" else numel)
            if op == "all_reduce":
                fn = lambda: dist.all_reduce(full)  # noqa: E731
            elif op == "all_gather_into_tensor":
                gathered = torch.empty(part.numel() * world)
                fn = lambda: dist.all_gather_into_tensor(gathered, part)  # noqa: E731
            else:
                fn = lambda: dist.reduce_scatter_tensor(part, full)  # noqa: E731
            try:
                dist.barrier()
                ms = time_ms(fn, torch.device("cpu"), repeat=9, budget_s=float("inf"))
            except RuntimeError:  # gloo lacks reduce_scatter_tensor in some builds: say so
                sizes = []
                break
            sizes.append(nbytes)
            times.append(ms)
        if sizes:
            alpha, bw = fit_alpha_beta(sizes, times)
            # algbw fit -> busbw: multiply by the op's bus factor (nccl-tests' convention)
            out[op] = {"alpha_ms": alpha, "busbw_gbps": bw * bus_factor(op, world),
                       "samples": [{"bytes": s, "ms": t} for s, t in zip(sizes, times)]}
        else:
            out[op] = None
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def gloo_collectives(world: int = 2, timeout_s: float = 120.0) -> dict[str, Any]:
    """α-β fits of gloo collectives over `world` local processes (nccl-tests sizes and bus factors).
    The ranks are fresh interpreters (`python -m trainprof.projection.calibrate --collective-rank R`),
    so this works from any caller, a REPL or a script read from stdin included."""
    import json
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="trainprof-calibrate-") as tmp:
        out = Path(tmp) / "collectives.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        procs = [subprocess.Popen([sys.executable, "-m", "trainprof.projection.calibrate", "--collective-rank", str(r),
                                   "--world", str(world), "--port", str(port), "--out", str(out)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        errors = []
        for p in procs:
            try:
                _, err = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                err = f"timed out after {timeout_s:.0f} s"
            if p.returncode:
                errors.append((err or "").strip().splitlines()[-1:] or [f"exit {p.returncode}"])
        if errors or not out.is_file():
            raise RuntimeError(f"gloo collective calibration over {world} processes failed: {errors}")
        return {"backend": "gloo", "world_size": world, "ops": json.loads(out.read_text())}


def _collective_rank_main(argv: list[str]) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(description="one rank of the gloo collective calibration (internal)")
    p.add_argument("--collective-rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    class _Queue:
        def put(self, obj: Any) -> None:
            tmp = Path(a.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(obj))
            os.replace(tmp, a.out)

    _collective_worker(a.collective_rank, a.world, a.port, _Queue())
    return 0


def group_collectives(world: int, device: torch.device) -> dict[str, Any]:
    """α-β fits of the collectives over the live default process group (the run's own backend: gloo
    on CPU, NCCL on GPU). Every rank must call it."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for op in COLLECTIVE_OPS:
        sizes, times = [], []
        for nbytes in COLLECTIVE_BYTES:
            numel = nbytes // 4
            full = torch.ones(numel * (world if op == "reduce_scatter_tensor" else 1), device=device)
            part = torch.ones(numel // world if op == "all_gather_into_tensor" else numel, device=device)
            if op == "all_reduce":
                fn = lambda: dist.all_reduce(full)  # noqa: E731
            elif op == "all_gather_into_tensor":
                gathered = torch.empty(part.numel() * world, device=device)
                fn = lambda: dist.all_gather_into_tensor(gathered, part)  # noqa: E731
            else:
                fn = lambda: dist.reduce_scatter_tensor(part, full)  # noqa: E731
            dist.barrier()
            sizes.append(nbytes)
            times.append(time_ms(fn, device, repeat=9, budget_s=float("inf")))  # same calls on every rank
        alpha, bw = fit_alpha_beta(sizes, times)
        out[op] = {"alpha_ms": alpha, "busbw_gbps": bw * bus_factor(op, world),
                   "samples": [{"bytes": s, "ms": t} for s, t in zip(sizes, times)]}
    return {"backend": dist.get_backend(), "world_size": world, "ops": out}


def calibrate_in_run(ctx: Any, dtype: str) -> dict[str, Any] | None:
    """At the end of a run, on every rank: the collectives over the run's own group, and on rank 0 the
    matmul and memory microbenchmarks. Returns the calibration.json dict on rank 0, None elsewhere."""
    import torch.distributed as dist

    collectives = None
    if ctx.world_size > 1 and dist.is_available() and dist.is_initialized():
        collectives = group_collectives(ctx.world_size, ctx.device)
    if ctx.rank != 0:
        return None
    cal = calibrate(ctx.device, dtype=dtype)
    cal["collectives"] = collectives
    return cal


def calibrate(device: torch.device | str = "cpu", *, dtype: str = "bf16", threads: int | None = None,
              collectives_world: int = 0) -> dict[str, Any]:
    """Run the microbenchmarks on this machine.

    Args:
        device: where to measure (a CUDA device on GPU machines).
        dtype: the matmul dtype (the recipe's model dtype).
        threads: torch intra-op threads to measure with (None: as set now); restored afterwards.
        collectives_world: > 1 also fits gloo collectives over that many local processes (CPU).
    Returns:
        The calibration.json dict.
    """
    from trainprof.env import collect_env

    device = torch.device(device)
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        out = {
            "calibration_version": CALIBRATION_VERSION,
            "device": collect_env(device, 1)["device"],
            "device_type": device.type,
            "threads": torch.get_num_threads(),
            "matmul": matmul_rate(device, dtype),
            "memory": copy_bandwidth(device),
            "host": host_dispatch(),
            "collectives": gloo_collectives(collectives_world) if collectives_world > 1 else None,
            "method": ("medians of repeated calls after warm-up, host monotonic clock (CUDA: CUDA events "
                       f"around bursts of {CUDA_BURST} calls); matmul: square GEMMs in the 3 layouts of a Linear "
                       "(forward x@w.T, backward dy@w and dy.T@x), 2n^3 FLOPs; memory: tensor copy, read+write "
                       "bytes; collectives: α-β least squares over nccl-tests sizes, busbw with nccl-tests' "
                       "bus factors"),
        }
        out["seconds"] = time.perf_counter() - t0
        return out
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Model probes: the recipe's own layers, timed at a shape on this machine
# ---------------------------------------------------------------------------------------------

PROBE_ROUNDS = 12  # timed calls per model in a probe (the fastest counts), after 2 warm-up calls


@dataclasses.dataclass(frozen=True)
class ProbeShape:
    micro_batch: int
    seq_len: int
    attention: str
    recompute: bool

    @classmethod
    def of(cls, recipe: Any) -> "ProbeShape":
        """The shape a recipe's micro batch runs at (probes run without recomputation)."""
        return cls(recipe.train.micro_batch_size, recipe.data.seq_len, recipe.model.attention, False)


@contextlib.contextmanager
def busy_neighbours(recipe: Any, shape: ProbeShape, count: int, threads: int):
    """`count` other processes running the same model at the same shape while the probe times it: the
    ranks of a CPU run share the machine's memory bandwidth and caches, and a probe alone would not."""
    import subprocess
    import sys
    import tempfile

    import yaml

    if count <= 0:
        yield
        return
    with tempfile.TemporaryDirectory(prefix="trainprof-probe-") as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        ready = [Path(tmp) / f"ready{i}" for i in range(count)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        procs = [subprocess.Popen([sys.executable, "-m", "trainprof.projection.calibrate", "--busy", str(path),
                                   str(shape.micro_batch), str(shape.seq_len), shape.attention, str(r)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for r in ready]
        try:
            deadline = time.monotonic() + 120
            while not all(r.exists() for r in ready) and time.monotonic() < deadline:
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.1)
            yield
        finally:
            for p in procs:
                p.kill()
                p.wait()


def _busy_main(argv: list[str]) -> int:
    from trainprof.models import resolve_shape
    from trainprof.recipe import load_recipe

    path, mbs, seq, attention, ready = argv
    recipe = load_recipe(path, [])
    model, batch = bare_model(recipe, ProbeShape(int(mbs), int(seq), attention, False),
                              resolve_shape(recipe.model).num_layers)
    Path(ready).write_text("1")
    while True:  # until the probe kills it
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)


def bare_model(recipe: Any, shape: ProbeShape, layers: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The model a probe times: the recipe's architecture with `layers` decoder layers, random init, no
    engine, no hooks, no recomputation, every weight trainable; and a batch at `shape`."""
    from trainprof.models import build_model, resolve_shape

    model_cfg = dataclasses.replace(recipe.model, num_layers=layers, attention=shape.attention, recompute=False)
    r = dataclasses.replace(recipe, model=model_cfg, task=dataclasses.replace(recipe.task, kind="pretrain"))
    torch.manual_seed(0)
    model = build_model(r).train()
    ids = torch.randint(0, resolve_shape(r.model).vocab_size, (shape.micro_batch, shape.seq_len))
    return model, {"input_ids": ids, "labels": ids}


def probe_model(recipe: Any, shape: ProbeShape, *, threads: int | None = None, rounds: int = PROBE_ROUNDS,
                neighbours: int = 0) -> dict[str, float]:
    """Forward and backward ms of the recipe's whole model at one shape: `probe_models` of one."""
    return probe_models([(recipe, shape)], threads=threads, rounds=rounds, neighbours=neighbours)[0]


def probe_models(probes: list[tuple[Any, ProbeShape]], *, threads: int | None = None, rounds: int = PROBE_ROUNDS,
                 neighbours: int = 0) -> list[dict[str, float]]:
    """Forward and backward ms of each recipe's whole model (random init, no engine, no hooks) at its
    shape, and of the same model with one decoder layer, so that one layer's share separates:
    layer = (T(L) - T(1)) / (L - 1). All the models are called in turn within each round (so a slow
    spell of the machine hits every shape, and the ratio of two shapes' times keeps little of it), the
    fastest of `rounds` calls after 2 warm-up rounds, with `neighbours` other processes running the
    first recipe's model at its shape meanwhile (the other ranks of a CPU run on this machine).

    Returns:
        per probe: {model_forward_ms, model_backward_ms, layer_forward_ms, layer_backward_ms}
    """
    from trainprof.models import resolve_shape

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        models, batches, layer_counts = {}, {}, []
        for j, (recipe, shape) in enumerate(probes):
            full_layers = resolve_shape(recipe.model).num_layers
            layer_counts.append(full_layers)
            for layers in sorted({full_layers, 1}):
                models[(j, layers)], batches[(j, layers)] = bare_model(recipe, shape, layers)
        keys = list(models)
        fwd: dict[Any, list[float]] = {k: [] for k in keys}
        bwd: dict[Any, list[float]] = {k: [] for k in keys}
        first_recipe, first_shape = probes[0]
        with busy_neighbours(first_recipe, first_shape, neighbours, torch.get_num_threads()):
            _probe_rounds(models, batches, keys, rounds, fwd, bwd)
        out = []
        for j, full_layers in enumerate(layer_counts):
            f = {n: min(fwd[(j, n)]) for n in {full_layers, 1}}
            b = {n: min(bwd[(j, n)]) for n in {full_layers, 1}}
            per = max(full_layers - 1, 1)
            out.append({"model_forward_ms": f[full_layers], "model_backward_ms": b[full_layers],
                        "layer_forward_ms": max(f[full_layers] - f[1], 0.0) / per if full_layers > 1 else f[1],
                        "layer_backward_ms": max(b[full_layers] - b[1], 0.0) / per if full_layers > 1 else b[1]})
        return out
    finally:
        torch.set_num_threads(before)


def probe_engines(recipes: list[Any], *, threads: int, rounds: int = 8, neighbours: int = 0,
                  bare: bool = False) -> list[dict[str, float]]:
    """Forward and backward ms of one micro batch through each recipe's own engine (DeepSpeed at its
    ZeRO stage and offload, or plain torch), all built in one fresh process in a group of one and
    called alternately (drift hits all of them), the fastest of `rounds` after 2 warm-up rounds, with
    `neighbours` busy processes as in probe_model. What an engine adds around the model (ZeRO-3's
    parameter fetch and release at every module, gradient bucketing, the optimizer wrapper) is in
    these times, and the optimizer step (`engine.step()`) is timed apart; communication at world size 1 is
    not. With `bare`, each recipe's bare model (what
    probe_model times) is called in the same rounds too, so engine minus bare keeps little of the drift.

    Returns:
        per recipe: {engine_forward_ms, engine_backward_ms, engine_step_ms}, and with `bare` also {model_forward_ms,
        model_backward_ms}
    Raises:
        ValueError: the probe process failed (its last error line).
    """
    import json
    import subprocess
    import sys
    import tempfile

    import yaml

    from trainprof.distributed import free_port as _free_port

    shape = ProbeShape.of(recipes[0])
    with tempfile.TemporaryDirectory(prefix="trainprof-engine-probe-") as tmp:
        paths = []
        for i, recipe in enumerate(recipes):
            paths.append(Path(tmp) / f"recipe{i}.yaml")
            paths[-1].write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
        out = Path(tmp) / "probe.json"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        with busy_neighbours(recipes[0], shape, neighbours, threads):
            proc = subprocess.run([sys.executable, "-m", "trainprof.projection.calibrate", "--probe-engines",
                                   str(rounds), str(int(bare)), str(out), *map(str, paths)], env=env,
                                  capture_output=True, text=True, timeout=600)
        if proc.returncode != 0 or not out.is_file():
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise ValueError(f"the engine probe failed ({last[:200]})")
        return json.loads(out.read_text())


def _probe_engines_main(argv: list[str]) -> int:
    import json

    from trainprof.engines import DistContext, build_engine
    from trainprof.models import resolve_shape
    from trainprof.recipe import load_recipe
    from trainprof.distributed import init_distributed, seed_everything

    rounds, bare, out, *paths = argv
    recipes = [load_recipe(p, ["train.grad_accum=1"]) for p in paths]  # every micro batch a boundary
    ctx = DistContext.from_env()
    init_distributed(ctx, engine_kind=recipes[0].engine.kind)
    engines, batches = [], []
    for recipe in recipes:
        seed_everything(recipe.train.seed)
        engines.append(build_engine(recipe, ctx))
        ids = torch.randint(0, resolve_shape(recipe.model).vocab_size,
                            (recipe.train.micro_batch_size, recipe.data.seq_len))
        batches.append({"input_ids": ids, "labels": ids})
    models = {k: bare_model(recipe, ProbeShape.of(recipe), resolve_shape(recipe.model).num_layers)
              for k, recipe in enumerate(recipes)} if bare == "1" else {}
    fwd: list[list[float]] = [[] for _ in recipes]
    bwd: list[list[float]] = [[] for _ in recipes]
    opt: list[list[float]] = [[] for _ in recipes]
    model_fwd: dict[Any, list[float]] = {k: [] for k in models}
    model_bwd: dict[Any, list[float]] = {k: [] for k in models}
    for i in range(int(rounds) + 2):
        for k, engine in enumerate(engines):
            t0 = time.perf_counter()
            loss = engine.forward(batches[k])
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            engine.step()
            t3 = time.perf_counter()
            if i >= 2:
                fwd[k].append((t1 - t0) * 1e3)
                bwd[k].append((t2 - t1) * 1e3)
                opt[k].append((t3 - t2) * 1e3)
        for k, (model, batch) in models.items():  # each bare model once a round, beside the engines' calls
            f_ms, b_ms = _forward_backward_ms(model, batch)
            if i >= 2:
                model_fwd[k].append(f_ms)
                model_bwd[k].append(b_ms)
    results = [{"engine_forward_ms": min(f), "engine_backward_ms": min(b), "engine_step_ms": min(o)}
               for f, b, o in zip(fwd, bwd, opt)]
    for k in models:
        results[k].update(model_forward_ms=min(model_fwd[k]), model_backward_ms=min(model_bwd[k]))
    Path(out).write_text(json.dumps(results))
    return 0


def _forward_backward_ms(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """One call of a bare model: (forward ms, backward ms); its gradients are dropped after."""
    t0 = time.perf_counter()
    loss = model(**batch).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def _probe_rounds(models: dict[Any, Any], batches: dict[Any, Any], keys: list[Any], rounds: int,
                  fwd: dict[Any, list[float]], bwd: dict[Any, list[float]]) -> None:
    """2 untimed rounds, then `rounds` timed ones: every model called once a round, in turn."""
    for i in range(rounds + 2):
        for n in keys:
            f_ms, b_ms = _forward_backward_ms(models[n], batches[n])
            if i >= 2:
                fwd[n].append(f_ms)
                bwd[n].append(b_ms)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--busy"]:
        sys.exit(_busy_main(sys.argv[2:]))
    if sys.argv[1:2] == ["--probe-engines"]:
        sys.exit(_probe_engines_main(sys.argv[2:]))
    sys.exit(_collective_rank_main(sys.argv[1:]))
