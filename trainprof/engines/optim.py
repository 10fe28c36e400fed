"""AdamW for the engines: parameter groups, and the optimizer when its states are quantized.

`optimizer.state_bits` 32 keeps Adam's two moments in fp32 (DeepSpeed's own AdamW, or torch.optim's);
8 and 4 store them block-quantized with torchao's AdamW8bit / AdamW4bit (Dettmers et al. 2022; Li et
al. 2023, "Memory Efficient Optimizers with 4-bit States"). Every parameter still trains: this is the
pretraining "+4-bit" row, where QLoRA's 4-bit weights would freeze the base.

torchao quantizes a state tensor only when it has at least 4096 elements and a multiple of the block
size (128 for 4-bit, 256 for 8-bit), and keeps the others in full precision. Under ZeRO the optimizer
sees one flat partition per parameter group and rank, so the groups are laid out to keep the big
partition a multiple of the block: matrices in one group, the small 1-D norms and biases in another
(which is also where weight decay does not belong). The run measures what was actually quantized
(`model_state_bytes` in profile.json) rather than assuming it.
"""

from __future__ import annotations

from typing import Any

import torch

from trainprof.recipe import OptimizerConfig

# torchao.optim's default block sizes (elements per quantization scale)
TORCHAO_BLOCK_SIZE = {8: 256, 4: 128}
TORCHAO_MIN_NUMEL = 4096


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters as [matrices (decayed), 1-D norms/biases (no decay)], empty groups dropped.

    The split is the usual GPT/Llama one and it keeps the large group's flat ZeRO partition free of
    the odd-sized norm vectors.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if _ndim(p) >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if _ndim(p) < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _ndim(p: torch.nn.Parameter) -> int:
    """Dimensions of the logical parameter (a ZeRO-3 partitioned one is an empty 1-D placeholder)."""
    return len(getattr(p, "ds_shape", p.shape))


def quantized_adamw(groups: list[dict[str, Any]], o: OptimizerConfig) -> torch.optim.Optimizer:
    """torchao AdamW8bit/AdamW4bit over `groups` (o.state_bits 8 or 4).

    Its update is torch.compile'd per tensor shape on the first step (the recipe requires a warm-up
    step so that compilation is not measured)."""
    from trainprof.env import quiet_library_noise

    quiet_library_noise()
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = {8: AdamW8bit, 4: AdamW4bit}[o.state_bits]
    return cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
               block_size=TORCHAO_BLOCK_SIZE[o.state_bits])


def build_adamw(groups: list[dict[str, Any]], o: OptimizerConfig) -> torch.optim.Optimizer:
    """torch.optim.AdamW (state_bits 32) or the torchao quantized one."""
    if o.state_bits == 32:
        return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    return quantized_adamw(groups, o)
