"""The engine interface the runner and the profiler rely on."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class Engine(Protocol):
    """One training engine. The runner calls, per optimizer step, for each of grad_accum micro
    batches: `loss = forward(batch)`, `backward(loss)`, `step()`; `step()` runs the optimizer only at
    the accumulation boundary (the last micro batch), as DeepSpeed's engine does. An engine with a
    schedule of its own (a pipeline stage, engines/pipeline_engine.py; Megatron,
    engines/megatron_engine.py) runs all micro batches of a step in it instead: the runner calls its
    `train_step(batches, prof)`. Which samples a rank reads is `trainprof.engines.data_split`."""

    module: torch.nn.Module  # the model itself (peft-wrapped if LoRA)
    loop_module: torch.nn.Module  # what forward() calls: the model, or its DDP wrapper (profiler target)
    optimizer: Any  # the optimizer object that runs at the boundary (torch or DeepSpeed ZeRO)
    name: str  # "deepspeed" | "torch" | "fsdp" | "pipeline" | "megatron"
    config: dict[str, Any]  # what the engine was configured with (the DeepSpeed config dict, ...)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self) -> None: ...

    def is_boundary(self) -> bool:
        """True when the next step() is the one that runs the optimizer."""
        ...
