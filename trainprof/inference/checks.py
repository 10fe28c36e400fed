"""What `trainprof infer` accepts before it measures: the recipe as served (its engine section replaced by the
single process infer runs), infer's own refusals, and the machine rules that apply to serving. Each error is
one line (exit 2) found before the model is built."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

from trainprof.errors import UserError
from trainprof.layout import output_dir_problem
from trainprof.recipe import EngineConfig, OptimizerConfig, Recipe, check_environment, load_recipe

# infer serves in one process with plain torch modules: no DeepSpeed, ZeRO, offload, FSDP or pipeline stages.
# The recipe's engine (and deepspeed) sections are replaced by this before validation, so no training
# engine's rule refuses or shapes an inference run.
SERVING_ENGINE: dict[str, Any] = {"kind": "torch"}
ENGINE_NOT_USED = ("not used: infer serves in one process without DeepSpeed, ZeRO, offload, FSDP or pipeline "
                   "stages (the recipe's engine and deepspeed sections are replaced by engine.kind torch)")


def refuse_task(task_kind: Any, recipe_path: str | Path) -> None:
    """infer's own refusal, before any training rule: 4-bit weights cannot take merged LoRA adapters."""
    if task_kind == "qlora":
        raise UserError(f"{recipe_path}: task.kind=qlora is not supported by infer (4-bit weights cannot be "
                        "merged with LoRA); pass task.kind=lora or pretrain")


def load_inference_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """The recipe as infer serves it: overrides applied, infer's refusals first, then the recipe's static
    rules with the engine sections replaced by SERVING_ENGINE (load_recipe's, minus the engine's)."""
    def as_served(data: dict[str, Any]) -> None:
        refuse_task((data.get("task") or {}).get("kind"), path)
        data["engine"] = dict(SERVING_ENGINE)
        data.pop("deepspeed", None)

    return load_recipe(path, overrides, before_validation=as_served)


def serving_recipe(recipe: Recipe) -> Recipe:
    """`recipe` with the engine infer runs (a recipe loaded for training keeps its model, task and output)."""
    return dataclasses.replace(recipe, engine=EngineConfig(**SERVING_ENGINE), deepspeed={})


def check_output_dir(output_dir: str, from_flag: bool, *, create: bool = False) -> None:
    """UserError when run dirs cannot be made under `output_dir`, before the model is built: the problem
    layout.output_dir_problem sees; with `create` (the last check: a run dir follows at once) also the one
    making the dir meets, such as a path the permission bits allow but the filesystem refuses (/proc).
    Names the flag or the recipe key the dir came from."""
    problem = output_dir_problem(output_dir)
    if problem is None and create:
        try:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            problem = f"creating it failed ({err.strerror or err})"
    if problem is not None:
        where, fix = ("--output-dir", "--output-dir ") if from_flag else ("recipe key 'output.dir'", "output.dir=")
        raise UserError(f"{where}: cannot write run dirs to '{output_dir}': {problem}; pass {fix}<a writable "
                        "directory>")


def check_serving_environment(recipe: Recipe, *, cuda_available: bool) -> None:
    """The machine rules of `trainprof run` (recipe.check_environment: attention kernel, peft) for what infer
    uses. Its training-only rules see neutral values: infer scales no fp16 loss and builds no optimizer."""
    view = dataclasses.replace(serving_recipe(recipe), model=dataclasses.replace(recipe.model, dtype="fp32"),
                               optimizer=OptimizerConfig())
    check_environment(view, cuda_available=cuda_available)
