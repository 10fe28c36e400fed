"""FLOPs: counted per (module, phase) on one step with torch.utils.flop_counter's formulas, and the
analytic PaLM estimate they are cross-checked against.

Counting: a TorchDispatchMode sees every aten op of the step (forward, backward, recompute) and applies
`torch.utils.flop_counter.flop_registry` (matmul, bmm, convolution, SDPA kernels); each op's FLOPs go
to the innermost profiled module open at that moment and its phase, so FLOPs and times share one
attribution. Gaps closed here: the CPU flash-attention kernels
(`_scaled_dot_product_flash_attention_for_cpu` and its backward) are missing from the registry and
count 0 there (pytorch#195460); they get flop_counter's own `sdpa_flop_count` /
`sdpa_backward_flop_count`. bitsandbytes' 4-bit matmul (`bitsandbytes::gemm_4bit`, QLoRA's forward)
counts 2*M*N*K. Gaps left (stated in the output): elementwise ops, norms and softmax count 0, as in
flop_counter; any other op outside aten and the collectives (c10d) is listed in `flops_uncounted_ops` with its call
count.
Grouped-query attention counts as many heads as the query has (the kernel broadcasts key and value).

Conventions (flop_counter's): a multiply-add is 2 FLOPs; causal attention counts the full s x s score
matrix (no 0.5 factor); attention backward counts 2.5x its forward (the scores are recomputed).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from trainprof.models import logical_numel

aten = torch.ops.aten


def _sdpa_cpu_flop(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any,
                   out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _sdpa_cpu_backward_flop(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def _gemm_4bit_flop(a: torch.Tensor, b: torch.Tensor, shape_b: list[int], *args: Any, out_val: Any = None,
                    **kwargs: Any) -> int:
    # bitsandbytes 4-bit matmul: A (..., K) @ W^T with W of shape_b = (N, K): 2*M*N*K
    return 2 * a.numel() * int(shape_b[0])


# custom (non-aten) ops by schema name: registered lazily, their packets exist only once imported
NAMED_FORMULAS: dict[str, Callable[..., int]] = {
    "bitsandbytes::gemm_4bit": _gemm_4bit_flop,
}


def as_multi_head(name: str, args: tuple) -> tuple:
    """An SDPA op's arguments with grouped-query key/value (fewer heads than the query) stood in for by
    meta tensors of the query's head count: the kernel broadcasts them, and flop_counter's formulas before
    torch 2.12 reject the shapes ("query/key/value shapes are incompatible"). Other ops: `args` as given."""
    if "attention" not in name or "flex" in name:
        return args
    q = 1 if "backward" in name else 0  # backward ops take grad_out first
    heads = 1 if "scaled_dot_product" in name else 2  # (B, H, S, D) vs the (B, S, H, D) kernels
    if len(args) < q + 3 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in args[q:q + 3]):
        return args
    query, key, value = args[q:q + 3]
    hq, hkv = query.shape[heads], key.shape[heads]
    if hq == hkv or hkv == 0 or hq % hkv:
        return args

    def widened(t: torch.Tensor) -> torch.Tensor:
        shape = list(t.shape)
        shape[heads] = hq
        return torch.empty(shape, dtype=t.dtype, device="meta")

    return (*args[:q + 1], widened(key), widened(value), *args[q + 3:])


FORMULAS: dict[Any, Callable[..., int]] = {
    **flop_registry,
    # pytorch#195460: the CPU flash kernels are not in flop_registry
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}

# aten ops that do matrix work but have no formula: worth naming when they run
_HEAVY_WORDS = ("mm", "conv", "attention", "linear", "matmul", "gemm")

FLOPS_CONVENTION = (
    "measured: torch.utils.flop_counter formulas per aten op on one step (matmul, bmm, convolution, SDPA; "
    "the CPU flash-attention kernels added with flop_counter's sdpa formulas, pytorch#195460), forward + "
    "backward + recompute as executed on this rank; elementwise, norm and softmax ops count 0. Causal "
    "attention counted as full (no 0.5 factor); attention backward = 2.5x forward (scores recomputed). "
    "achieved_tflops = flops_per_step / median step time (all executed FLOPs, recompute included). "
    "MFU uses model FLOPs = executed FLOPs minus recompute (PaLM appendix B: recomputation is not "
    "model work); for LoRA/QLoRA the frozen base gets no weight-gradient matmuls, so model FLOPs are "
    "what actually runs (about 4N_frozen + 6N_trainable per token), and 4-bit dequantization is not "
    "counted (bitsandbytes gemm_4bit counts as a dense matmul). analytic = (6N + 12*L*H*Q*T) per token (PaLM appendix B; N = parameters in matmuls, the "
    "input embedding excluded), with 4N for frozen parameters."
)


class FlopCounter(TorchDispatchMode):
    """Counts FLOPs of every dispatched aten op into (module index, phase).

    Args:
        where: returns (module index or -1, phase) at the moment an op runs.
    """

    def __init__(self, where: Callable[[], tuple[int, str]]) -> None:
        super().__init__()
        self.where = where
        self.counts: dict[tuple[int, str], int] = defaultdict(int)
        self.uncounted: Counter[str] = Counter()

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile'd code runs compiled under this mode and its ops are counted as they run (matmuls and
        # attention stay ATen calls in inductor's output; fused elementwise kernels count 0 by the convention).
        # A mode dynamo had to honour would make it skip the frame's code object for good: nn.Module._call_impl,
        # shared by every module, so a compiled model would run eagerly for the rest of the process.
        return True

    # compiled code calls higher-order operators, e.g. run_and_save_rng_state around SDPA in an activation-
    # checkpointed compiled layer: they reach this mode (see _higher_order) instead of failing the step
    supports_higher_order_operators = True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return self._higher_order(func, args, kwargs)
        out = func(*args, **kwargs)
        self._count(func, args, kwargs, out)
        return out

    def _higher_order(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run a higher-order operator (this mode is off while it dispatches here, so the ops inside are not
        seen); an RNG wrapper around one op (run_and_save_rng_state(op, *args), run_with_rng_state(state,
        op, *args)) counts as that op, any other is listed as uncounted."""
        out = func(*args, **kwargs)
        i = next((i for i, a in enumerate(args) if isinstance(a, torch._ops.OpOverload)), None)
        if i is None:
            self.uncounted[f"higher_order::{func.name()}"] += 1
        else:
            result = out[-1] if isinstance(out, tuple) else out
            self._count(args[i], args[i + 1:], kwargs, result)
        return out

    def _count(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        packet = func._overloadpacket
        formula = FORMULAS.get(packet)
        if formula is None:
            formula = NAMED_FORMULAS.get(func._schema.name)
        if formula is not None:
            args = as_multi_head(packet.__name__, args)
            self.counts[self.where()] += int(formula(*args, **kwargs, out_val=out))
        else:
            namespace = getattr(func, "namespace", "aten")
            name = packet.__name__
            if namespace not in NO_FLOP_NAMESPACES or any(w in name for w in _HEAVY_WORDS):
                self.uncounted[f"{namespace}::{name}"] += 1


# namespaces whose ops are no uncounted model work: aten's own (left to the registry), and the collectives
# (c10d::broadcast_, allreduce_ under DDP), which move data
NO_FLOP_NAMESPACES = ("aten", "prim", "prims", "profiler", "c10d", "_c10d_functional", "c10d_functional")


# wrappers that hold the model in an attribute: DDP, FSDP1 and DeepSpeed's engine (`module`), torch.compile
# (`_orig_mod`); FSDP2's fully_shard changes the model in place and keeps its config
_WRAPPED_IN = ("_orig_mod", "module")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP / FSDP / DeepSpeed / torch.compile wrappers: the first one whose config has a layer
    count (the model itself where none does)."""
    seen = set()  # DeepSpeed's engine has a `config` of its own (its JSON): look for the model's shape
    while getattr(getattr(model, "config", None), "num_hidden_layers", None) is None and id(model) not in seen:
        seen.add(id(model))
        inner = next((getattr(model, a) for a in _WRAPPED_IN if isinstance(getattr(model, a, None), torch.nn.Module)),
                     None)
        if inner is None:
            break
        model = inner
    return model


def _shape(model: torch.nn.Module) -> tuple[Any, int | None, int | None, int | None]:
    """(config, layers, heads, hidden) of an unwrapped model (unwrap_model)."""
    cfg = getattr(model, "config", None)
    return (cfg, getattr(cfg, "num_hidden_layers", None), getattr(cfg, "num_attention_heads", None),
            getattr(cfg, "hidden_size", None))


def analytic_missing_reason(model: torch.nn.Module, seq_len: int | None) -> str | None:
    """Why analytic_flops has no estimate for `model` (None when it has one)."""
    model = unwrap_model(model)
    cfg, layers, heads, hidden = _shape(model)
    if cfg is None:
        return (f"no analytic FLOPs: the model ({type(model).__name__}) has no Hugging Face-style "
                "`config` (under .module / ._orig_mod wrappers included)")
    missing = [k for k, v in (("num_hidden_layers", layers), ("num_attention_heads", heads),
                              ("hidden_size", hidden)) if not v]
    if missing:
        return f"no analytic FLOPs: the model's config has no {', '.join(missing)}"
    return None if seq_len else "no analytic FLOPs: the sequence length was not seen (no batch with input_ids)"


def note_missing_analytic(summary: dict[str, Any], model: torch.nn.Module, seq_len: int | None) -> None:
    """FLOPs counted without the PaLM cross-check: summary.analytic_reason says why it is null."""
    if summary.get("flops_per_step") and summary.get("analytic") is None:
        summary["analytic_reason"] = analytic_missing_reason(model, seq_len) or \
            "no analytic FLOPs: no step's tokens were counted"


def analytic_flops(model: torch.nn.Module, seq_len: int | None) -> dict[str, Any] | None:
    """PaLM appendix B estimate of training FLOPs per token: 6N + 12*L*H*Q*T.

    N counts parameters that take part in matmuls (all but the input embedding); frozen parameters
    (LoRA base) count 4N instead of 6N (forward 2N + input gradient 2N, no weight gradient).

    Args:
        model: a model with a Hugging Face config (num_hidden_layers, num_attention_heads, hidden_size),
            or a DDP / FSDP / DeepSpeed / torch.compile wrapper of one.
        seq_len: T, tokens per sequence.
    Returns:
        {flops_per_token, n_params_matmul, n_trainable, n_frozen, layers, heads, head_dim, seq_len,
        formula}, or None when the model has no such config or seq_len is unknown
        (analytic_missing_reason says which).
    """
    model = unwrap_model(model)
    cfg, layers, heads, hidden = _shape(model)
    if not (layers and heads and hidden and seq_len):
        return None
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    embedding_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    trainable = frozen = 0
    for p in model.parameters():
        if id(p) in embedding_params:
            continue
        if p.requires_grad:
            trainable += logical_numel(p)
        else:
            frozen += logical_numel(p)
    attention = 12 * layers * heads * head_dim * seq_len  # PaLM appendix B: 12*L*H*Q*T per token
    per_token = 6 * trainable + 4 * frozen + attention
    return {
        "flops_per_token": per_token,
        "n_params_matmul": trainable + frozen,
        "n_trainable": trainable,
        "n_frozen": frozen,
        "layers": layers,
        "heads": heads,
        "head_dim": head_dim,
        "seq_len": seq_len,
        "formula": "6*N_trainable + 4*N_frozen + 12*L*H*Q*T per token (PaLM appendix B; input embedding excluded)",
    }
