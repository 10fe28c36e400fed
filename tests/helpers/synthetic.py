"""A synthetic model whose modules busy-wait known durations in forward and backward, so the profiler's
recovered times can be checked against ground truth.

Every duration is wall-clock: a wait sleeps most of it and busy-polls time.perf_counter for the last
SPIN_TAIL_MS, leaving the CPU to other ranks (two ranks spinning on two cores would starve the hooks).
On a loaded machine a sleep can overshoot, so every wait also writes the time it really took into
LEDGER under (module name, phase): that is the ground truth the tests compare against.
"""

from __future__ import annotations

import gc

import statistics
import time
from collections import defaultdict

import torch
from torch.utils.checkpoint import checkpoint


SPIN_TAIL_MS = 1.0


class Ledger:
    """Actual wait durations per (name, phase), one dict per step; and each Busy module's backward window
    (name, "backward_window"): from the backward reaching its output to the backward leaving through its
    input, less any recomputation of it inside, which holds the un-ledgered work its backward also does
    (its Linear's matmuls, a LoRA adapter's, gradient accumulation, the engine's nodes)."""

    def __init__(self) -> None:
        self.current: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: list[dict[tuple[str, str], float]] = []
        self.opened: dict[str, tuple[float, float]] = {}  # name -> (start, its recompute_wall ms by then)

    def add(self, name: str, phase: str, ms: float) -> None:
        self.current[(name, phase)] += ms

    def open(self, name: str, t: float) -> None:
        self.opened[name] = (t, self.current.get((name, "recompute_wall"), 0.0))

    def close(self, name: str, t: float) -> None:
        start, recomputed_before = self.opened.pop(name)
        inside = self.current.get((name, "recompute_wall"), 0.0) - recomputed_before  # non-reentrant checkpointing
        self.add(name, "backward_window", (t - start) * 1e3 - inside)

    def close_all(self, t: float) -> None:
        """The windows of modules whose input needs no grad end with the backward call."""
        for name in list(self.opened):
            self.close(name, t)

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)
        self.opened.clear()


LEDGER = Ledger()


def spin(ms: float, name: str | None = None, phase: str | None = None) -> float:
    """Wait `ms` milliseconds of wall time (sleep, then busy-poll the last SPIN_TAIL_MS); record the
    time it really took under (name, phase) and return it."""
    start = time.perf_counter()
    end = start + ms / 1e3
    if ms > SPIN_TAIL_MS:
        time.sleep((ms - SPIN_TAIL_MS) / 1e3)
    while time.perf_counter() < end:
        pass
    took = (time.perf_counter() - start) * 1e3
    if name is not None:
        LEDGER.add(name, phase, took)
    return took


class BusyFn(torch.autograd.Function):
    """y = x + w that spins fwd_ms in forward and bwd_ms in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, fwd_ms: float, bwd_ms: float, name: str) -> torch.Tensor:
        recompute = torch._C._current_graph_task_id() != -1
        spin(fwd_ms, name, "recompute" if recompute else "forward")
        ctx.bwd_ms, ctx.name = bwd_ms, name
        ctx.save_for_backward(x)  # saved so that checkpointing has something to recompute
        return x + w

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        spin(ctx.bwd_ms, ctx.name, "backward")
        return grad, grad.sum().reshape(1), None, None, None


class BackwardEdge(torch.autograd.Function):
    """Identity whose backward stamps the ledger: at a module's output, its backward window opens; at its
    input (where the input needs grad), it closes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, name: str, edge: str) -> torch.Tensor:
        ctx.name, ctx.edge = name, edge
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (LEDGER.open if ctx.edge == "output" else LEDGER.close)(ctx.name, time.perf_counter())
        return grad, None, None


class Busy(torch.nn.Module):
    """A leaf with known forward / backward cost; `proj` is a tiny Linear for LoRA to wrap."""

    def __init__(self, fwd_ms: float, bwd_ms: float, width: int = 8) -> None:
        super().__init__()
        self.fwd_ms, self.bwd_ms = fwd_ms, bwd_ms
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.proj = torch.nn.Linear(width, width, bias=False)
        torch.nn.init.eye_(self.proj.weight)
        self.ledger_name = ""  # set by name_busy_modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with Timed(self.ledger_name):
            x = BackwardEdge.apply(x, self.ledger_name, "input")
            y = BusyFn.apply(self.proj(x), self.w, self.fwd_ms, self.bwd_ms, self.ledger_name)
            return BackwardEdge.apply(y, self.ledger_name, "output")


def name_busy_modules(model: torch.nn.Module, prefix: str = "") -> None:
    """Give every module its name in `model` (the ledger key)."""
    for name, mod in model.named_modules():
        mod.ledger_name = prefix + name


class Timed:
    """Context manager: records the wall time of a module's forward body as (name, "forward_wall") or
    (name, "recompute_wall") (or under `phase` if given): the truth for everything the module really
    does (its Linear, its glue, checkpointing), not only its waits."""

    def __init__(self, name: str, phase: str | None = None) -> None:
        self.name, self.phase = name, phase

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        phase = self.phase or ("recompute_wall" if torch._C._current_graph_task_id() != -1 else "forward_wall")
        LEDGER.add(self.name, phase, (time.perf_counter() - self.start) * 1e3)


class Block(torch.nn.Module):
    """A parent with its own cost (self time) around two children."""

    def __init__(self, own_fwd: float, own_bwd: float, a: Busy, b: Busy) -> None:
        super().__init__()
        self.own = Busy(own_fwd, own_bwd)  # depth+1; the block's self time is measured via its children
        self.inner1, self.inner2 = a, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with Timed(self.ledger_name):
            return self.inner2(self.inner1(self.own(x)))


class Checkpointed(torch.nn.Module):
    """Runs `body` under non-reentrant (default) or reentrant activation checkpointing."""

    def __init__(self, body: Busy, reentrant: bool = False) -> None:
        super().__init__()
        self.body = body
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with Timed(self.ledger_name):
            return checkpoint(self.body, x, use_reentrant=self.reentrant)


class AllReduceBusy(torch.nn.Module):
    """A collective of known cost: an all_gather lines the ranks up, then the slow rank waits
    `slow_rank_extra_ms` (ledger: ("comm.slow", "forward")) before an all_reduce, so the other rank
    is blocked in the all_reduce for about that long. Then a Busy child with known costs."""

    def __init__(self, fwd_ms: float, bwd_ms: float, slow_rank_extra_ms: float = 0.0, slow_rank: int = 1) -> None:
        super().__init__()
        self.busy = Busy(fwd_ms, bwd_ms)
        self.extra, self.slow_rank = slow_rank_extra_ms, slow_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        with Timed(self.ledger_name):
            buf = x.detach().clone()
            parts = [torch.empty_like(buf) for _ in range(dist.get_world_size())]
            with Timed(self.ledger_name, "comm_wall"):
                dist.all_gather(parts, buf)  # lines the ranks up
            if dist.get_rank() == self.slow_rank:
                spin(self.extra, "comm.slow", "forward")
            # the truth for the wait: when each rank arrives at the all_reduce, on the host's monotonic
            # clock, which all processes of one machine share
            LEDGER.add("comm.arrive", "abs_ms", time.perf_counter() * 1e3)
            with Timed(self.ledger_name, "comm_wall"), Timed("comm.all_reduce", "wall"):
                dist.all_reduce(buf)  # the known cost: the other ranks wait about `extra` ms here
            return self.busy(x + 0 * buf)


class Synthetic(torch.nn.Module):
    """root -> embed, block(own, inner1, inner2), shared (called twice), ckpt(body), [comm], head; the
    output is a scalar loss, as a Hugging Face model returns."""

    def __init__(self, *, reentrant: bool = False, with_comm: bool = False, slow_rank_extra_ms: float = 0.0,
                 scale: float = 1.0) -> None:
        super().__init__()
        # Every wait is >= 10 ms, so that the profiler's own cost at a module's boundaries (tens of us) is a
        # small part of each; `scale` stretches every wait.
        def busy(fwd: float, bwd: float) -> Busy:
            return Busy(fwd * scale, bwd * scale)

        self.embed = busy(20, 30)
        self.block = Block(12 * scale, 16 * scale, busy(24, 32), busy(16, 20))
        self.shared = busy(12, 16)
        self.ckpt = Checkpointed(busy(20, 40), reentrant=reentrant)
        self.comm = AllReduceBusy(12 * scale, 12 * scale, slow_rank_extra_ms) if with_comm else None
        self.head = busy(10, 12)
        name_busy_modules(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with Timed(self.ledger_name):
            h = self.embed(x)
            h = self.block(h)
            h = self.shared(h)
            h = self.shared(h)
            h = self.ckpt(h)
            if self.comm is not None:
                h = self.comm(h)
            return self.head(h).pow(2).mean()



class SpinOptimizer(torch.optim.SGD):
    """SGD whose step also waits a known time (the loop times step() + zero_grad() as the truth)."""

    def __init__(self, params, spin_ms: float) -> None:
        super().__init__(params, lr=1e-3)
        self.spin_ms = spin_ms

    def step(self, closure=None):
        spin(self.spin_ms)
        return super().step(closure)


def busy_loader(n: int, batch: int = 2, width: int = 8, wait_ms: float = 8.0):
    """n batches of input (no grad), each after a known data wait."""
    for _ in range(n):
        spin(wait_ms, "data", "data_wait")
        yield torch.randn(batch, width)


def _under(name: str, module: str) -> bool:
    return module == "" or name == module or name.startswith(module + ".")


def _outermost_walls(step: dict[tuple[str, str], float], module: str, key: str) -> float | None:
    names = [n for (n, k) in step if k == key and _under(n, module)]
    if not names:
        return None
    outer = [n for n in names if not any(o != n and _under(n, o) for o in names)]
    return sum(step[(n, key)] for n in outer)


def truth_ms(ledger_steps: list[dict[tuple[str, str], float]], module: str, phase: str) -> float:
    """Median over steps of what `module` (children included) really spent in `phase`.

    forward / recompute: the module's own timed body (or its outermost timed descendants), minus the
    collectives timed inside it. backward: the timed loss.backward() for the model itself, minus the
    recomputation inside it; otherwise the backward windows of the Busy modules under it (Ledger).
    """
    per_step = []
    for step in ledger_steps:
        if phase in ("forward", "recompute"):
            wall = _outermost_walls(step, module, f"{phase}_wall")
            comm = _outermost_walls(step, module, "comm_wall") or 0.0 if phase == "forward" else 0.0
            value = wall - comm if wall is not None else 0.0
        elif (module, "backward_wall") in step:
            value = step[(module, "backward_wall")] - (_outermost_walls(step, module, "recompute_wall") or 0.0)
        else:
            value = _outermost_walls(step, module, "backward_window") or 0.0
        per_step.append(value)
    return statistics.median(per_step)


def phase_truth_ms(ledger_steps: list[dict[tuple[str, str], float]], phase: str) -> float:
    """Median over steps of the step's time in a phase: the model's for forward / backward / recompute,
    the waits recorded under it for data_wait and optimizer."""
    if phase in ("forward", "backward", "recompute"):
        return truth_ms(ledger_steps, "", phase)
    return statistics.median(sum(v for (_, ph), v in step.items() if ph == phase) for step in ledger_steps)


def train(model: torch.nn.Module, profiler_kwargs: dict, *, steps: int = 3, warmup: int = 1, grad_accum: int = 1,
          optimizer: torch.optim.Optimizer | None = None):
    """Run the profiled loop of DESIGN.md over the synthetic model.

    Returns:
        (profiler, ledger of the measured steps)
    """
    from trainprof.profiler import Profiler

    opt = optimizer or SpinOptimizer([p for p in model.parameters() if p.requires_grad], spin_ms=4.0)
    LEDGER.end_step()  # drop anything recorded before
    LEDGER.steps.clear()
    # A cyclic-GC pass over the heap earlier tests left in this process can land inside one module's
    # timed window; like preemption it is machine noise, not attribution, so the loop runs without it.
    gc.collect()
    gc.disable()
    try:
        with Profiler(model, optimizer=opt, warmup_steps=warmup, **profiler_kwargs) as prof:
            batches = prof.wrap_loader(busy_loader((steps + warmup) * grad_accum))
            for _ in range(steps + warmup):
                with prof.step():
                    for _ in range(grad_accum):
                        x = next(batches)
                        loss = model(x)
                        with Timed("", "backward_wall"):
                            loss.backward()
                            LEDGER.close_all(time.perf_counter())
                        prof.record(loss=loss, tokens=x.shape[0])
                    with Timed("optimizer", "optimizer"):  # the truth: the whole step() and zero_grad() calls
                        opt.step()
                        opt.zero_grad()
                LEDGER.end_step()
    finally:
        gc.enable()
    return prof, LEDGER.steps[warmup:]
