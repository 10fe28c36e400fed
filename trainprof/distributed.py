"""Process-group helpers every entry point needs: join the group torchrun set up, pick a free port,
seed every library."""

from __future__ import annotations

import os
import random
import socket
from typing import Any


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(recipe: Any, ctx: Any) -> None:
    """Join the process group torchrun set up (gloo on CPU, NCCL on GPU)."""
    import torch

    backend = "nccl" if ctx.device.type == "cuda" else "gloo"
    if ctx.device.type == "cuda":
        torch.cuda.set_device(ctx.device)
    if recipe.engine.kind == "deepspeed":
        import deepspeed

        if "RANK" not in os.environ:  # a single process without torchrun: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))

        deepspeed.init_distributed(dist_backend=backend)
    elif ctx.distributed:
        torch.distributed.init_process_group(backend=backend)
