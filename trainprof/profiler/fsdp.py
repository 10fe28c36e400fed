"""FSDP2 (`torch.distributed.fsdp.fully_shard`): its collectives attributed to the module that needed them.

Why: FSDP2 issues a module's parameter all-gather in that module's pre-forward hook, and again in its
pre-backward hook, which is a tensor hook on the module's outputs: it runs before the module's
backward opens in the profiler's hooks (those watch the same autograd node, and tensor hooks run
first), so the innermost open module then is the one whose backward just ran. Backward prefetching
all-gathers the next module's parameters from inside the current one, and the gradient reduce-scatter
runs after the module's backward has closed. So, as ZeRO-3's collectives are, each collective an FSDP
parameter group issues (`FSDPParamGroup.unshard`: all-gather; `post_backward`: reduce-scatter) is
attributed to the module the group shards: `watch` wraps those two methods on each group instance.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from trainprof.profiler.compiled import profiled_name

WRAPPED_METHODS = ("unshard", "post_backward")  # FSDPParamGroup methods that issue the group's collectives


def param_groups(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(profiled module name, FSDPParamGroup) for every module fully_shard was applied to that holds
    parameters of its own group."""
    out = []
    for name, module in model.named_modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = getattr(get_state(), "_fsdp_param_group", None) if callable(get_state) else None
        if group is not None:
            out.append((profiled_name(name), group))
    return out


def below_root(groups: list[tuple[str, Any]]) -> list[Any]:
    """The FSDP2 groups of the modules below the root (the decoder layers), or the root's alone."""
    return [g for name, g in groups if name] or [g for _, g in groups]


def param_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The MixedPrecisionPolicy param_dtype(s) of the groups below the root: what FSDP2 all-gathers and
    computes in over its fp32 shards; empty where no group sets one (or the model is not fully_shard'ed)."""
    groups = below_root(param_groups(model))
    return {getattr(getattr(g, "mp_policy", None), "param_dtype", None) for g in groups} - {None}


def watch(model: torch.nn.Module, index_of: dict[str, int],
          owner: Callable[[int], contextlib.AbstractContextManager[None]]) -> Callable[[], None]:
    """Attribute each FSDP2 parameter group's collectives to its module.

    Args:
        model: the model fully_shard was applied to (the Profiler's model).
        index_of: profiled module name -> module index.
        owner: `owner(index)` makes collectives issued inside it belong to module `index`.
    Returns:
        A callable that removes the wrappers.
    """
    undo: list[Callable[[], None]] = []
    for name, group in param_groups(model):
        index = index_of.get(name)
        if index is None:  # a module deeper than the profiled depth: its nearest profiled ancestor
            parts = name.split(".")
            while parts and ".".join(parts) not in index_of:
                parts.pop()
            index = index_of.get(".".join(parts), 0)
        for method in WRAPPED_METHODS:
            undo.append(_wrap_method(group, method, functools.partial(owner, index)))
    return lambda: [u() for u in reversed(undo)]


def _wrap_method(obj: Any, method: str, context: Callable[[], contextlib.AbstractContextManager[None]]) -> Callable[[], None]:
    original = getattr(obj, method)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with context():
            return original(*args, **kwargs)

    setattr(obj, method, wrapper)

    def undo() -> None:
        if obj.__dict__.get(method) is wrapper:
            del obj.__dict__[method]

    return undo


@contextlib.contextmanager
def owned(stack: list[int], index: int) -> Iterator[None]:
    """Push `index` as the owner of the collectives issued inside."""
    stack.append(index)
    try:
        yield
    finally:
        stack.pop()
