"""torch.compile'd models: which modules are compiled regions, how the profiler times them without
being traced by dynamo, and what the profile says about it (the `compile` block of profile.json).

Why: a forward hook on a module that runs inside a compiled region is traced by dynamo with the rest
of the region; the profiler's hooks touch Python state and autograd nodes, so dynamo breaks the graph
there, cannot resume inside a hook and runs the whole region eagerly: the profile would be of another
program. So modules inside a compiled region get no hooks. A compiled region itself is timed around
its compiled call, outside dynamo:
  * `module.compile()` (torchtitan compiles each decoder layer so): the module's `_compiled_call_impl`
    is replaced, on the instance, by a call that runs the profiler's pre and post hook around it;
  * a `torch.compile(module)` wrapper (OptimizedModule): hooks on the wrapper run outside dynamo (it
    compiles `_orig_mod.__call__`), so the wrapper is hooked as usual and `_orig_mod` is dropped from
    module names (`model.layers.0._orig_mod.mlp` is profiled as `model.layers.0.mlp`).
The region's backward is timed like any module's (its outputs' producer is the compiled graph's
backward node); activation recomputation inside a compiled region runs inside that backward node, so
it counts as the region's backward, not as the recompute phase. Granularity: one row per compiled region (per decoder layer when each layer is
compiled); modules inside have no own times. With `profile.ops` their operators are attributed to the
region: inductor's CPU kernels are named after the fused operators (`cpp_fused_add_mean_mul_...`),
not after modules, so the operator trace keeps a module's name only where the module runs outside a
compiled region.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

ORIG_MOD = "_orig_mod"  # torch._dynamo.eval_frame.OptimizedModule's attribute for the wrapped module
GRANULARITY_TEXT = {
    "module": "per module: forward hooks on every module down to the profiled depth",
    "compiled_region": ("per compiled region: each torch.compile'd module is timed around its compiled call "
                        "(outside dynamo); modules inside a region run as compiled code and have no own times, and "
                        "activation recomputation inside a region is part of its backward; with profile.ops their "
                        "operators are attributed to the region (inductor names its CPU kernels after fused "
                        "operators, not modules)"),
}


def profiled_name(name: str) -> str:
    """A module's name as profiled: `_orig_mod` levels of torch.compile wrappers dropped."""
    if ORIG_MOD not in name:
        return name
    return ".".join(part for part in name.split(".") if part != ORIG_MOD)


def is_wrapper(module: torch.nn.Module) -> bool:
    return ORIG_MOD in module._modules and type(module).__name__ == "OptimizedModule"


def _compiled_in_place(module: torch.nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


@dataclass(slots=True, kw_only=True)
class CompiledRegion:
    """One compiled region of the model: its profiled name and how it was compiled."""

    name: str
    style: str  # "module.compile" | "torch.compile wrapper"


@dataclass(slots=True, kw_only=True)
class CompiledModules:
    """The compiled regions under a model and the modules inside them."""

    regions: list[CompiledRegion] = field(default_factory=list)
    inside: set[int] = field(default_factory=set)  # id() of modules that run inside a compiled region
    in_place: set[int] = field(default_factory=set)  # id() of regions compiled with module.compile()
    inside_names: set[str] = field(default_factory=set)  # profiled names of the modules inside

    @classmethod
    def find(cls, model: torch.nn.Module) -> CompiledModules:
        found = cls()
        if "torch._dynamo" not in sys.modules:  # nothing was compiled in this process
            return found
        prefixes: list[str] = []
        for name, module in model.named_modules():
            if any(p == "" or name.startswith(p) for p in prefixes):
                found.inside.add(id(module))
                found.inside_names.add(profiled_name(name))
                continue
            if is_wrapper(module):
                found.regions.append(CompiledRegion(name=profiled_name(name), style="torch.compile wrapper"))
                prefixes.append(f"{name}.{ORIG_MOD}." if name else f"{ORIG_MOD}.")
                found.inside.add(id(module._modules[ORIG_MOD]))
            elif _compiled_in_place(module):
                found.regions.append(CompiledRegion(name=profiled_name(name), style="module.compile"))
                prefixes.append(f"{name}." if name else "")
                found.in_place.add(id(module))
        found.inside_names -= {r.name for r in found.regions}
        return found

    @property
    def compiled(self) -> bool:
        return bool(self.regions)

    def hookable(self, described: list[tuple[Any, torch.nn.Module]]) -> list[tuple[Any, torch.nn.Module]]:
        """The described modules that take ordinary forward hooks: neither inside a region nor compiled in
        place (whose hooks would run inside its compiled call)."""
        return [(info, m) for info, m in described if id(m) not in self.inside and id(m) not in self.in_place]

    def attach(self, described: list[tuple[Any, torch.nn.Module]], pre: Callable[..., None],
               post: Callable[..., None]) -> list[RegionCall]:
        """Time each in-place compiled module around its compiled call; returns handles with remove()."""
        return [RegionCall(m, info.index, pre, post) for info, m in described if id(m) in self.in_place]


class RegionCall:
    """Runs `pre(index, module, args, kwargs)` and `post(index, module, args, kwargs, output)` around an
    in-place compiled module's compiled call (post also when it raises, as the forward hooks do);
    `remove()` puts the compiled call back."""

    def __init__(self, module: torch.nn.Module, index: int, pre: Callable[..., None], post: Callable[..., None]) -> None:
        self.module = module
        self.compiled = module._compiled_call_impl
        compiled = self.compiled

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            pre(index, module, args, kwargs)
            output = None
            try:
                output = compiled(*args, **kwargs)
            finally:
                post(index, module, args, kwargs, output)
            return output

        self.timed_call = timed_call
        module._compiled_call_impl = timed_call

    def remove(self) -> None:
        if self.module._compiled_call_impl is self.timed_call:
            self.module._compiled_call_impl = self.compiled


# -- dynamo's own counters: evidence that the compiled code ran while profiled ------------------------


def dynamo_counters() -> dict[str, int] | None:
    """torch._dynamo.utils.counters, the figures that show what was compiled (None: dynamo never loaded)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    c = utils.counters
    return {
        "graphs_captured": int(c["stats"].get("unique_graphs", 0)),
        "ops_captured": int(c["stats"].get("calls_captured", 0)),
        "frames_converted": int(c["frames"].get("total", 0)),  # each compile or recompile of a frame
        "frames_compiled": int(c["frames"].get("ok", 0)),
        "graph_breaks": int(sum(c["graph_break"].values())),
    }


@dataclass(slots=True, kw_only=True)
class DynamoWatch:
    """dynamo's counters when the Profiler attached, when the first measured step began and at the end."""

    attached: dict[str, int] | None = None
    measured: dict[str, int] | None = None
    end: dict[str, int] | None = None

    def mark(self, when: str) -> None:
        if getattr(self, when) is None or when == "end":
            setattr(self, when, dynamo_counters())

    def block(self) -> dict[str, Any] | None:
        """Totals, what changed while profiled, and what changed during the measured steps."""
        end = self.end or dynamo_counters()
        if end is None:
            return None

        def delta(since: dict[str, int] | None) -> dict[str, int] | None:
            return None if since is None else {k: end[k] - since.get(k, 0) for k in end}

        return {"total": end, "while_profiled": delta(self.attached), "during_measured_steps": delta(self.measured),
                "source": "torch._dynamo.utils.counters (stats.unique_graphs, stats.calls_captured, frames.total/ok, "
                          "graph_break): cumulative in the process, and their change since the profiler attached / "
                          "since the first measured step began (frames converted there are recompilations)"}


def compile_block(compiled: CompiledModules | None, watch: DynamoWatch | None) -> dict[str, Any]:
    """profile.json `compile`: whether the model was compiled, its regions and how modules were timed."""
    if compiled is None or not compiled.compiled:
        return {"compiled": False, "module_granularity": "module", "module_times": GRANULARITY_TEXT["module"]}
    return {
        "compiled": True,
        "module_granularity": "compiled_region",
        "regions": [r.name for r in compiled.regions],
        "region_style": sorted({r.style for r in compiled.regions}),
        "modules_inside_regions": len(compiled.inside_names),
        "module_times": GRANULARITY_TEXT["compiled_region"],
        "dynamo": watch.block() if watch is not None else None,
    }
