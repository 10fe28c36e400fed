"""The kinds of change a prediction makes, in one table: which recipe keys each kind covers, whether it
reshapes the model's work (the parts are probed or re-derived at the target's shape) and whether it
changes the engine (both engines are probed). `change_kinds`, `reshapes`, `modelled_key` and the
expected error all read this table.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainprof.shapes import DIM_KEYS

THIS = "this"  # `--to this`: the machine the source run was measured on


def counts_ranks(hardware: str, source_device_type: str) -> bool:
    """Whether a row's world size counts ranks rather than GPUs: the target is a CPU source's own machine
    (`hardware`: THIS, or a prediction's "this (...)" label)."""
    return hardware.startswith(THIS) and source_device_type == "cpu"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChangeKind:
    name: str
    keys: tuple[str, ...]  # dotted recipe keys; a key ending in "." covers its whole section
    reshapes: bool = False  # the model's work per micro batch changes shape (probes or GEMM shapes)
    engine: bool = False  # the engine or what it trains changes (engine probes)

    def covers(self, key: str) -> bool:
        return any(key == k or (k.endswith(".") and key.startswith(k)) for k in self.keys)


MODEL_SIZE_KEYS = ("model.name", *(f"model.{k}" for k in DIM_KEYS if k != "max_position_embeddings"))

CHANGE_KINDS: tuple[ChangeKind, ...] = (
    ChangeKind(name="micro_batch", keys=("train.micro_batch_size",), reshapes=True),
    ChangeKind(name="seq_len", keys=("data.seq_len",), reshapes=True),
    ChangeKind(name="grad_accum", keys=("train.grad_accum",)),
    ChangeKind(name="recompute", keys=("model.recompute",), reshapes=True),
    ChangeKind(name="attention", keys=("model.attention",), reshapes=True),
    ChangeKind(name="model_size", keys=MODEL_SIZE_KEYS, reshapes=True),
    ChangeKind(name="zero_stage", keys=("engine.zero_stage",), engine=True),
    ChangeKind(name="offload", keys=("engine.offload",), engine=True),
    ChangeKind(name="engine", keys=("engine.kind", "engine.reshard_after_forward"), engine=True),
    ChangeKind(name="compile", keys=("model.compile",), engine=True),
    ChangeKind(name="task", keys=("task.",), engine=True),
    # probed as an engine change: the engine's 16-bit machinery (DeepSpeed's bf16 optimizer, autocast) changes
    # with it, and both engines timed at the source's shape carry the compute's rate at each dtype too
    ChangeKind(name="dtype", keys=("model.dtype",), engine=True),
)
KINDS = {k.name: k for k in CHANGE_KINDS}

# keys that do not change the work of a step: how long a run is, its seed, its output, the optimizer's
# hyperparameters (not its kind), what the profiler records, the RoPE table's length
STEP_NEUTRAL_KEYS = ("train.steps", "train.warmup_steps", "train.seed", "train.memory_cap_gb", "optimizer.lr",
                     "optimizer.weight_decay", "optimizer.betas", "optimizer.eps", "data.synthetic_pattern_len",
                     "model.max_position_embeddings", "profile.", "output.")


def modelled_key(key: str) -> bool:
    """Whether the step model re-derives a change of `key` (or the key does not change a step)."""
    neutral = any(key == k or (k.endswith(".") and key.startswith(k)) for k in STEP_NEUTRAL_KEYS)
    return neutral or any(kind.covers(key) for kind in CHANGE_KINDS)


def changed_keys(source_recipe: Any, target_recipe: Any) -> list[str]:
    """Dotted recipe keys whose values differ (the diff's own flattening)."""
    from trainprof.analysis.diff import recipe_changes

    return sorted(k for k, _, _ in recipe_changes(source_recipe.to_dict(), target_recipe.to_dict()))


def recipe_kinds(source_recipe: Any, target_recipe: Any) -> list[str]:
    """The kinds of recipe change between two recipes, in table order. A model-size change is a change
    of the resolved shape (a named shape and the same dims spelled out are no change); a task change is
    one of the task's kind or of the adapters and quantization it uses."""
    keys = changed_keys(source_recipe, target_recipe)
    out = []
    for kind in CHANGE_KINDS:
        if kind.name == "model_size":
            if model_shape(source_recipe) != model_shape(target_recipe):
                out.append(kind.name)
        elif kind.name == "task":
            if task_key(source_recipe) != task_key(target_recipe):
                out.append(kind.name)
        elif any(kind.covers(k) for k in keys):
            out.append(kind.name)
    return out


def change_kinds(source_recipe: Any, target_recipe: Any, source_world: int, world: int, machine: str,
                 source_device_type: str = "cpu") -> list[str]:
    """The kinds of change a prediction makes; another accelerator is 'hardware_gpu' from a GPU source
    (validated on lent GPUs) and 'hardware' from a CPU source (not validated)."""
    kinds = recipe_kinds(source_recipe, target_recipe)
    if source_world != world:
        kinds.append("world_size")
    if machine != THIS:
        kinds.append("hardware_gpu" if source_device_type == "cuda" else "hardware")
    return kinds or ["none"]


def reshapes(source_recipe: Any, target_recipe: Any) -> bool:
    """Whether the model's work per micro batch changes shape (what the part probes measure)."""
    return any(KINDS[k].reshapes for k in recipe_kinds(source_recipe, target_recipe))


def unmodelled_changes(source_recipe: Any, target_recipe: Any) -> list[str]:
    """Recipe keys whose value differs, that change the work of a step, and that the step model does not
    re-derive (optimizer kind or state bits, pipeline layout, DeepSpeed's own settings, data loading): a
    prediction across them is null."""
    return [k for k in changed_keys(source_recipe, target_recipe) if not modelled_key(k)]


def model_shape(recipe: Any) -> tuple[int, ...]:
    from trainprof.models import resolve_shape

    shape = resolve_shape(recipe.model)
    return tuple(getattr(shape, k) for k in DIM_KEYS if k != "max_position_embeddings")


def task_key(recipe: Any) -> str:
    """What of the recipe's task decides the step's work: the kind, and the adapters and quantization it uses."""
    t = recipe.task
    return repr((t.kind, dataclasses.asdict(t.lora) if t.kind != "pretrain" else None,
                 dataclasses.asdict(t.quant) if t.kind == "qlora" else None))


def zero_stage_of(recipe: Any) -> int:
    """The recipe's DeepSpeed ZeRO stage; 0 for the engines that have none."""
    return recipe.engine.zero_stage if recipe.engine.kind == "deepspeed" else 0


def offload_of(recipe: Any) -> str:
    """What the recipe's engine offloads to the host; "none" for the engines that cannot."""
    return recipe.engine.offload if recipe.engine.kind in ("deepspeed", "fsdp") else "none"


def engine_key(recipe: Any) -> tuple[Any, ...]:
    """What decides the engine a probe builds: its kind and settings, and whether the layers are compiled."""
    e = recipe.engine
    return (e.kind, zero_stage_of(recipe), offload_of(recipe),
            getattr(e, "reshard_after_forward", True) if e.kind == "fsdp" else None, getattr(recipe.model, "compile", False))
