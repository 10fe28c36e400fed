"""Calibration microbenchmarks: the machine's achievable matmul rate, memory bandwidth and collective
α-β, measured in seconds and stored as calibration.json in a run dir, so that a run made elsewhere
can be projected on another machine (the model probes are in probes.py).

Every figure is the median of repeated timed calls after warm-up calls: on CPU on the host monotonic
clock, with the thread count it ran with; on CUDA with CUDA events around a burst of calls (a single
small kernel is shorter than a host synchronization), at sizes that fill the GPU.
"""

from __future__ import annotations

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
    import subprocess
    import sys
    import tempfile

    from trainprof.distributed import free_port

    port = free_port()
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


if __name__ == "__main__":
    import sys

    sys.exit(_collective_rank_main(sys.argv[1:]))
