"""Splitting a Hugging Face Llama into pipeline stages: contiguous decoder layers per stage, the
embedding on the first stage, the final norm, LM head and loss on the last.

A stage keeps the attribute names of LlamaForCausalLM (`model.embed_tokens`, `model.layers.<i>` with
the layer's index in the whole model, `model.norm`, `lm_head`), so module tables of the stages line up
with the unsplit model's; the parameters are the unsplit model's own (built from the same seed and
then split), which is how losses match the unsplit run. The split follows torchtitan's manual one
(torchtitan/distributed/pipeline_parallel.py: delete what another stage owns, keep layers in a dict
keyed by their global index).
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Any

import torch
from torch import nn


def stage_layer_ranges(num_layers: int, num_stages: int, counts: list[int] | None = None) -> list[range]:
    """Contiguous decoder layers per stage: `counts` (engine.pipeline_layers), or an even split where
    the first `num_layers % num_stages` stages get one more (the last stage also runs the LM head and
    the loss, so it should not get the extra layer).

    Args:
        num_layers: decoder layers in the model.
        num_stages: pipeline stages (<= num_layers).
        counts: layers per stage (validated by the recipe: num_stages entries >= 1 adding up to num_layers).
    Returns:
        One range of global layer indices per stage.
    """
    if counts is None:
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


class CausalLMLoss(nn.Module):
    """The model's own causal-LM loss (transformers' ForCausalLMLoss: shift by one, mean cross entropy)
    as a module of the last stage, so its forward and backward are timed like any module's."""

    def __init__(self, loss_function: Any, vocab_size: int) -> None:
        super().__init__()
        self.loss_function = loss_function
        self.vocab_size = vocab_size

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)


class LlamaStageBody(nn.Module):
    """The decoder part of one stage: what LlamaModel.forward does, for this stage's layers."""

    def __init__(self, llama: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = llama.config
        self.embed_tokens = llama.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): llama.layers[i] for i in layers})
        self.norm = llama.norm if last else None
        self.rotary_emb = llama.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        no_cache = {_cache_keyword(create_causal_mask): None}
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None,
                                  position_ids=position_ids, **no_cache)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers.values():
            hidden = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                           position_ids=position_ids)
        return self.norm(hidden) if self.norm is not None else hidden


class LlamaStage(nn.Module):
    """One pipeline stage of a LlamaForCausalLM: token ids (first stage) or the previous stage's
    hidden states in; hidden states (to the next stage) or logits (last stage) out.

    The forward runs under torch.autocast in `autocast_dtype` (None: no autocast), as the torch engine
    does for the unsplit model; `config` is the model's config with this stage's layer count (the
    analytic FLOP estimate reads it).
    """

    def __init__(self, causal_lm: nn.Module, stage: int, num_stages: int, *, layers: list[int] | None = None,
                 autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        ranges = stage_layer_ranges(causal_lm.config.num_hidden_layers, num_stages, layers)
        self.stage, self.num_stages = stage, num_stages
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.layer_range = ranges[stage]
        self.config = copy.copy(causal_lm.config)
        self.config.num_hidden_layers = len(self.layer_range)
        self.model = LlamaStageBody(causal_lm.model, self.layer_range, self.first, self.last)
        self.lm_head = causal_lm.lm_head if self.last else None
        self.loss = CausalLMLoss(causal_lm.loss_function, causal_lm.config.vocab_size) if self.last else None
        self.autocast_dtype = autocast_dtype

    @property
    def is_gradient_checkpointing(self) -> bool:
        return any(getattr(layer, "gradient_checkpointing", False) for layer in self.model.layers.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.autocast_dtype
        device_type = x.device.type if x.device.type != "meta" else "cpu"
        with torch.autocast(device_type, dtype=dtype or torch.float32, enabled=dtype is not None):
            hidden = self.model(x)
            return self.lm_head(hidden) if self.lm_head is not None else hidden


@functools.cache
def _cache_keyword(fn) -> str:
    """The name `fn` takes the KV cache by: transformers 5 renamed `past_key_values` to `cache` (the old
    name warns, and goes in 5.40)."""
    return "cache" if "cache" in inspect.signature(fn).parameters else "past_key_values"
