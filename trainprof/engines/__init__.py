"""Training engines behind one small interface (`Engine`): DeepSpeed, plain PyTorch (DDP), FSDP2, and
pipeline stages on torch.distributed.pipelining."""

from __future__ import annotations

from trainprof.engines.base import DistContext, Engine
from trainprof.recipe import Recipe


def build_engine(recipe: Recipe, ctx: DistContext) -> Engine:
    """Build the recipe's model and wrap it in its engine; the caller has seeded the RNGs."""
    if recipe.engine.pipeline_stages > 1:
        from trainprof.engines.pipeline_engine import PipelineEngine

        return PipelineEngine(recipe, ctx)
    if recipe.engine.kind == "deepspeed":
        from trainprof.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(recipe, ctx)
    if recipe.engine.kind == "fsdp":
        from trainprof.engines.fsdp_engine import FSDPEngine

        return FSDPEngine(recipe, ctx)
    from trainprof.engines.torch_engine import TorchEngine

    return TorchEngine(recipe, ctx)


__all__ = ["DistContext", "Engine", "build_engine"]
