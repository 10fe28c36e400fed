"""Training engines behind one small interface (`Engine`): DeepSpeed, plain PyTorch (DDP), FSDP2, pipeline
stages on torch.distributed.pipelining, and megatron-core (CUDA only)."""

from __future__ import annotations

from trainprof.distributed import DistContext
from trainprof.engines.base import Engine
from trainprof.recipe import Recipe


def build_engine(recipe: Recipe, ctx: DistContext) -> Engine:
    """Build the recipe's model and wrap it in its engine; the caller has seeded the RNGs."""
    if recipe.engine.pipeline_stages > 1:
        from trainprof.engines.pipeline_engine import PipelineEngine

        return PipelineEngine(recipe, ctx)
    if recipe.engine.kind == "megatron":
        from trainprof.engines.megatron_engine import MegatronEngine

        return MegatronEngine(recipe, ctx)
    if recipe.engine.kind == "deepspeed":
        from trainprof.engines.deepspeed_engine import DeepSpeedEngine

        return DeepSpeedEngine(recipe, ctx)
    if recipe.engine.kind == "fsdp":
        from trainprof.engines.fsdp_engine import FSDPEngine

        return FSDPEngine(recipe, ctx)
    from trainprof.engines.torch_engine import TorchEngine

    return TorchEngine(recipe, ctx)


def data_split(engine: Engine, ctx: DistContext) -> tuple[int, int]:
    """(rank, ranks) of the data split this process reads: every data-parallel rank its own samples.
    A pipeline's stages all read the same samples; Megatron's ranks of one model replica (tensor x
    pipeline parallel) too, so it splits by its data-parallel rank."""
    if engine.name == "pipeline":
        return 0, 1
    if engine.name == "megatron":
        return engine.data_rank, engine.data_world_size
    return ctx.rank, ctx.world_size


__all__ = ["DistContext", "Engine", "build_engine", "data_split"]
