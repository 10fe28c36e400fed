"""A Llama2-shaped megatron-core GPTModel for a recipe: RMSNorm, SwiGLU, RoPE, no biases, untied
embeddings, grouped-query attention via num_query_groups, no dropout, the recipe's dtype, recomputation
and attention kernel.

The layers are megatron-core's local spec (`get_gpt_layer_local_spec`: its own ColumnParallelLinear /
RowParallelLinear, no Transformer Engine or Apex needed). Attention: `eager` keeps the spec's
DotProductAttention (unfused; stores the s x s scores, as transformers' eager does); `sdpa` swaps in
`SDPACoreAttention`, torch's scaled_dot_product_attention, whose CUDA flash backend is FlashAttention-2.
Recomputation: model.recompute = Megatron's full recomputation of every layer (recompute_granularity
"full", uniform, one layer per checkpoint: what the other engines do per decoder layer), or with
engine.megatron_recompute=selective only the core attention (Korthikanti et al. 2022, sec. 4.2).

Building needs torch.distributed and `parallel_state.initialize_model_parallel` (the tensor/pipeline
groups the layers split over). `device`: "meta" builds without allocating or initialising (counting,
planning); "cpu" initialises on the CPU (Megatron's use_cpu_initialization: the same weights whatever
the tensor-parallel split); "cuda" initialises on the current GPU with Megatron's CUDA RNG tracker
(`model_parallel_cuda_manual_seed`, which the engine calls first).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from trainprof.models import resolve_shape, torch_dtype
from trainprof.recipe import Recipe

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": the local spec needs neither
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig


def megatron_config(recipe: Recipe, *, device: str = "cuda") -> TransformerConfig:
    """The TransformerConfig of a recipe's model under its engine.tensor_parallel / pipeline_parallel, to be
    built on `device` ("meta", "cpu" or "cuda"; see the module docstring)."""
    shape, m, e = resolve_shape(recipe.model), recipe.model, recipe.engine
    dtype = torch_dtype(m.dtype)
    recompute: dict[str, Any] = {}
    if m.recompute and e.megatron_recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif m.recompute:
        recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return TransformerConfig(
        num_layers=shape.num_layers,
        hidden_size=shape.hidden_size,
        ffn_hidden_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_query_groups=shape.num_kv_heads,  # grouped-query attention (Llama2-70B: 8 groups)
        kv_channels=shape.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=shape.rms_norm_eps,
        gated_linear_unit=True,  # SwiGLU: silu(x W_gate) * (x W_up)
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,  # Llama has no dropout (Megatron's defaults are 0.1)
        attention_dropout=0.0,
        masked_softmax_fusion=False,  # the fused kernels come with Apex / Transformer Engine
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        attention_backend=AttnBackend.local,
        tensor_model_parallel_size=e.tensor_parallel,
        pipeline_model_parallel_size=e.pipeline_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=m.dtype == "bf16",
        fp16=m.dtype == "fp16",
        use_cpu_initialization=device in ("meta", "cpu"),
        perform_initialization=device != "meta",
        cuda_graph_scope=[],  # no CUDA graphs; the default ("full") only warns that it is deprecated
        batch_p2p_comm=False,  # pipeline transfers as torch.distributed.isend/irecv, which the profiler times
        **recompute,
    )


def megatron_layer_spec(attention: str) -> ModuleSpec:
    """megatron-core's local GPT layer spec with RMSNorm; `sdpa` swaps its core attention for torch SDPA."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    return spec


def build_megatron_model(recipe: Recipe, *, device: str = "cuda") -> GPTModel:
    """This rank's part of the recipe's model (its pipeline stage, its tensor-parallel shard).

    Args:
        recipe: a validated recipe with engine.kind megatron.
        device: "meta" (no memory, not initialised), "cpu" or "cuda" (see the module docstring).
    Returns:
        The GPTModel; with labels its forward returns the per-token loss [b, s].
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_megatron_model needs parallel_state.initialize_model_parallel() first")
    shape = resolve_shape(recipe.model)
    config = megatron_config(recipe, device=device)
    with torch.device("meta") if device == "meta" else contextlib.nullcontext():
        model = GPTModel(
            config=config,
            transformer_layer_spec=megatron_layer_spec(recipe.model.attention),
            vocab_size=shape.vocab_size,
            max_sequence_length=shape.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=False,  # Llama2's lm_head is its own matrix
            position_embedding_type="rope",
            rotary_base=10000,  # Llama2's RoPE theta
        )
    if device == "cuda":  # the linear layers are made on the GPU; torch's RMSNorm, as in Megatron-LM, is moved there
        model.cuda(torch.cuda.current_device())
    return model


class SDPACoreAttention(MegatronModule):
    """Megatron's core attention (softmax(q k^T / sqrt(d)) v) on torch.nn.functional.scaled_dot_product_attention,
    which picks FlashAttention-2 or the memory-efficient kernel on CUDA and never stores the s x s scores.

    Called as megatron-core's CoreAttention protocol: q [sq, b, heads, d], k and v [sk, b, groups, d]
    (grouped-query attention: groups < heads) -> [sq, b, heads * d]. Causal masking only (the GPT spec's).
    """

    def __init__(self, *, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPACoreAttention runs causal attention only, got {attn_mask_type}")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale  # None: 1/sqrt(d), as Megatron's DotProductAttention

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPACoreAttention takes neither an attention bias nor packed sequences")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # -> [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1),
        )
        sq, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
