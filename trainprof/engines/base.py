"""The engine interface the runner and the profiler rely on, and the process's distributed context."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, kw_only=True)
class DistContext:
    """Where this process sits: rank, world size, device. Read from torchrun's environment."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_env(cls) -> DistContext:
        rank = int(os.environ.get("RANK", 0))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
        return cls(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


class Engine(Protocol):
    """One training engine. The runner calls, per optimizer step, for each of grad_accum micro
    batches: `loss = forward(batch)`, `backward(loss)`, `step()`; `step()` runs the optimizer only at
    the accumulation boundary (the last micro batch), as DeepSpeed's engine does. A pipeline stage
    (engines/pipeline_engine.py, name "pipeline") runs all micro batches of a step in its schedule
    instead: the runner calls its `train_step(batches, prof)`."""

    module: torch.nn.Module  # the model itself (peft-wrapped if LoRA)
    loop_module: torch.nn.Module  # what forward() calls: the model, or its DDP wrapper (profiler target)
    optimizer: Any  # the optimizer object that runs at the boundary (torch or DeepSpeed ZeRO)
    name: str  # "deepspeed" | "torch" | "fsdp" | "pipeline"
    config: dict[str, Any]  # what the engine was configured with (the DeepSpeed config dict, ...)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...

    def is_boundary(self) -> bool:
        """True when the next step() is the one that runs the optimizer."""
        ...
