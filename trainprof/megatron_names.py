"""Megatron's module names mapped onto the Hugging Face Llama's, so that a Megatron run's module x phase
tables read (and `trainprof diff` against a DeepSpeed run lines up) like every other engine's.

One table, `MEGATRON_TO_HF`: a Megatron module-name prefix (with `<i>` for a decoder layer's index) ->
the HF LlamaForCausalLM name of the same part. A module is renamed by its longest matching prefix; the
rest of its name is kept, so Megatron modules without an HF counterpart stay visible under the part
they belong to (`model.layers.0.self_attn.linear_qkv` is q_proj, k_proj and v_proj fused;
`model.layers.0.mlp.linear_fc1` is gate_proj and up_proj fused; `core_attention` is the attention
function HF calls without a module). Layer indices are the global ones (`layer_number - 1`), so a
pipeline stage's layers keep their place in the whole model.

Pure data and string work: importable without megatron-core (the profiler and the tests use it).
"""

from __future__ import annotations

import re
from typing import Iterable

# Megatron GPTModel (megatron-core 0.16, local layer spec) -> HF LlamaForCausalLM, part by part.
MEGATRON_TO_HF: dict[str, str] = {
    "": "",  # GPTModel <-> LlamaForCausalLM
    "embedding": "model.embed_tokens",  # LanguageModelEmbedding (word embeddings; no position embedding with RoPE)
    "rotary_pos_emb": "model.rotary_emb",  # RotaryEmbedding <-> LlamaRotaryEmbedding (no parameters)
    # TransformerBlock: the decoder layers and the final norm. HF's LlamaModel also holds the embedding
    # and the rotary tables, which Megatron keeps beside the block, so "model" differs by the embedding.
    "decoder": "model",
    "decoder.layers": "model.layers",
    "decoder.layers.<i>": "model.layers.<i>",  # TransformerLayer <-> LlamaDecoderLayer
    "decoder.layers.<i>.input_layernorm": "model.layers.<i>.input_layernorm",  # RMSNorm
    "decoder.layers.<i>.self_attention": "model.layers.<i>.self_attn",  # SelfAttention <-> LlamaAttention
    "decoder.layers.<i>.self_attention.linear_proj": "model.layers.<i>.self_attn.o_proj",  # RowParallelLinear
    "decoder.layers.<i>.pre_mlp_layernorm": "model.layers.<i>.post_attention_layernorm",  # RMSNorm
    "decoder.layers.<i>.mlp": "model.layers.<i>.mlp",  # MLP (SwiGLU) <-> LlamaMLP
    "decoder.layers.<i>.mlp.linear_fc2": "model.layers.<i>.mlp.down_proj",  # RowParallelLinear
    "decoder.final_layernorm": "model.norm",  # RMSNorm
    "output_layer": "lm_head",  # ColumnParallelLinear, untied from the embedding
}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)(?=\.|$)")


def hf_name(name: str, layer_index: dict[int, int] | None = None) -> str:
    """The HF name of one Megatron module name.

    Args:
        name: as in GPTModel.named_modules() ("" for the model).
        layer_index: local decoder-layer index -> global one (a pipeline stage's layers; None: the same).
    Returns:
        The name with its longest `MEGATRON_TO_HF` prefix replaced; unmatched names are returned as they are.
    """
    index = None
    m = _LAYER.match(name)
    if m:
        local = int(m.group(1))
        index = layer_index.get(local, local) if layer_index else local
        name = "decoder.layers.<i>" + name[m.end():]
    for cut in _prefixes(name):
        target = MEGATRON_TO_HF.get(cut)
        if target is not None:
            mapped = target + name[len(cut):]  # "" -> "" keeps an unmatched name as it is
            return mapped.replace("<i>", str(index)) if index is not None else mapped
    return name


def _prefixes(name: str) -> Iterable[str]:
    """`name` and each dotted prefix of it, longest first, then ""."""
    parts = name.split(".") if name else []
    for n in range(len(parts), 0, -1):
        yield ".".join(parts[:n])
    yield ""


def hf_module_names(model) -> dict[str, str]:
    """Megatron name -> HF name for every module of a (possibly pipeline-split) GPTModel.

    Args:
        model: a megatron.core GPTModel; its decoder layers' `layer_number` (1-based, global) gives the
            global index of each local layer.
    Returns:
        {native name: mapped name}, names as in `model.named_modules()`.
    """
    layers = getattr(getattr(model, "decoder", None), "layers", None) or []
    layer_index = {i: int(layer.layer_number) - 1 for i, layer in enumerate(layers)}
    return {name: hf_name(name, layer_index) for name, _ in model.named_modules()}
