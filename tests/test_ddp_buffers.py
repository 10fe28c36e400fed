"""DDP's forward-time collectives, which its C++ code runs past the torch.distributed wrappers: the buffer broadcast
(broadcast_buffers=True) at every forward and the bucket-order broadcast of its second forward. Each is a collective,
and the time a rank waits in it for a slower peer is comm_exposed, not forward (2 ranks over gloo, spawned)."""

from __future__ import annotations

import torch

LATE_S = 0.3  # rank 0 arrives this late at every forward: rank 1 waits in DDP's buffer broadcast
BUFFER_BYTES = 256 * 4 + 3 * 8  # the model's two buffers: 256 fp32 + 3 int64


class WithBuffers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("scale", torch.ones(256))  # e.g. HF Llama's rotary inv_freq
        self.register_buffer("counter", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.scale[:16]


def _late_rank_0(rank: int, port: int, results) -> None:
    import time

    import torch.distributed as dist

    from trainprof.profiler import Profiler

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(WithBuffers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    original = (dist._broadcast_coalesced, dist.Reducer._rebuild_buckets)
    with Profiler(model, optimizer=opt, module_depth=1, warmup_steps=1, flops=False, memory=False,
                  telemetry_period_ms=0) as prof:
        patched = dist._broadcast_coalesced is not original[0] and dist.Reducer._rebuild_buckets is not original[1]
        for _ in range(4):  # the warm-up step, then the bucket rebuild's step, then two more
            with prof.step():
                if rank == 0:
                    time.sleep(LATE_S)
                model(torch.randn(4, 16)).sum().backward()
                opt.step()
                opt.zero_grad()
    measured = [(step.breakdown.phases_ms, step.breakdown.comm) for step in prof.steps if not step.warmup]
    results.put((rank, measured, patched, (dist._broadcast_coalesced, dist.Reducer._rebuild_buckets) == original))
    dist.destroy_process_group()


def test_a_rank_waiting_in_ddps_forward_collectives_is_comm_exposed_not_forward():
    """Rank 0 sleeps before each forward; rank 1 waits for it in DDP's bucket rebuild (first measured step) and
    then in its buffer broadcast (`dist._broadcast_coalesced`). That wait is rank 1's comm_exposed, the forward
    keeps only its compute, and the comm rows list the broadcast in forward with the buffers' bytes."""
    import torch.multiprocessing as mp

    from trainprof.distributed import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_late_rank_0, args=(r, port, results)) for r in (0, 1)]
    for p in ranks:
        p.start()
    got = {rank: rest for rank, *rest in (results.get(timeout=180) for _ in ranks)}
    for p in ranks:
        p.join(timeout=60)
    for phases, _ in got[1][0]:  # rank 1, the one that waits
        assert phases["comm_exposed"] > 0.8 * LATE_S * 1e3, phases
        assert phases["forward"] < 0.5 * LATE_S * 1e3, phases
    for rank, (measured, patched, restored) in got.items():
        assert len(measured) == 3, rank
        for i, (_, comm) in enumerate(measured):
            rows = {c["op"]: c for c in comm}
            broadcast = rows["broadcast"]
            assert broadcast["phase"] == "forward" and broadcast["calls"] == 1, comm
            assert broadcast["bytes"] == BUFFER_BYTES and broadcast["total_ms"] == broadcast["exposed_ms"], comm
            # DDP rebuilds its buckets in its second forward, the first measured step here
            rebuild = rows.get("ddp_rebuild_buckets")
            assert (rebuild is not None and rebuild["phase"] == "forward") == (i == 0), comm
            if rank == 1:  # the wait is in the rebuild first, then in the buffer broadcast
                waited = rebuild if i == 0 else broadcast
                assert waited["exposed_ms"] > 0.8 * LATE_S * 1e3, comm
        assert patched and restored, rank  # wrapped while open, the originals back after close()


def test_ddps_collectives_are_not_listed_as_uncounted_flops(tmp_path):
    """A DDP step's collectives (c10d::broadcast_ of its buffers, c10d::allreduce_ of its gradients) move data:
    the FLOP counter's list of ops it could not count (summary.flops_uncounted_ops) is for model work it misses,
    and they were listed there (one process group of one rank, gloo)."""
    import torch.distributed as dist

    from trainprof.distributed import free_port
    from trainprof.profiler import Profiler

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(WithBuffers())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with Profiler(model, optimizer=opt, module_depth=1, warmup_steps=1, memory=False, telemetry_period_ms=0) as prof:
            for _ in range(2):
                with prof.step():
                    model(torch.randn(4, 16)).sum().backward()
                    opt.step()
                    opt.zero_grad()
        summary = prof.rank_result()["summary"]
    finally:
        dist.destroy_process_group()
    assert summary["flops_per_step"] > 0
    assert not any(op.startswith("c10d") for op in summary.get("flops_uncounted_ops") or {}), summary["flops_uncounted_ops"]
