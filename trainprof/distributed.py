"""Where this process sits and how it joins the others: the rank context read from torchrun's
environment, process-group setup, a free local port, seeding, and a run dir shared by every rank.
Entry points (the runner, calibration probes, benchmarks) share these; none of them owns them."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainprof.layout import new_run_dir

if TYPE_CHECKING:  # torch is imported where it is used: `trainprof tb` and the CLI should not pay for it
    import torch


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """Where this process sits: rank, world size, device. Read from torchrun's environment."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=_cpu)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistContext:
        import torch

        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        return cls(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (model init and synthetic data are the same on every run)."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# engines that need a process group even in one process (DeepSpeed; FSDP2's device mesh)
GROUP_ENGINES = ("deepspeed", "fsdp")


def init_distributed(ctx: DistContext, *, engine_kind: str) -> None:
    """Join the process group torchrun set up (gloo on CPU, NCCL on GPU). DeepSpeed joins through its
    own init_distributed; DeepSpeed and FSDP2 also in a single process started without torchrun (a
    group of one)."""
    import torch

    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    if engine_kind in GROUP_ENGINES and "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if engine_kind == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend=backend)
    elif ctx.distributed or engine_kind in GROUP_ENGINES:
        torch.distributed.init_process_group(backend=backend)


def shared_run_dir(parent: str | Path, name: str) -> Path:
    """<parent>/<name>-<UTC timestamp>/, created on rank 0 and broadcast to every rank (each rank
    alone when no process group is initialized)."""
    import torch.distributed as dist

    joined = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if joined else int(os.environ.get("RANK", 0))
    box: list[Any] = [str(new_run_dir(parent, name)) if rank == 0 else None]
    if joined:
        dist.broadcast_object_list(box, src=0)
    return Path(box[0])
