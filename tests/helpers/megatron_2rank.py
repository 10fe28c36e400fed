"""torchrun script: megatron-core on 2 CPU ranks (gloo). Writes OUT_DIR/megatron.rank<r>.json.

    torchrun --nproc_per_node 2 tests/helpers/megatron_2rank.py OUT_DIR

1. The tiny Llama built as Megatron splits it, tensor_parallel=2 then pipeline_parallel=2: each rank's
   parameter count and its modules' mapped (HF) names.
2. The profiler on megatron-core's tensor-parallel GPTModel (tensor_parallel=2, SDPA core attention),
   trained for a few steps through `Profiler.for_recipe` with the Megatron recipe: module x phase under
   the mapped names and the tensor-parallel all-reduces. megatron-core 0.16.1 builds RoPE's tables with
   torch.cuda.current_device(), so this CPU run builds the model without a position encoding (RoPE has no
   parameters; every other module is the recipe's). The optimizer is torch's AdamW: Megatron's own keeps
   its gradient buffers on CUDA. The engine itself (Megatron's DDP, optimizer and schedule) is
   tests/test_megatron.py's GPU test.
3. megatron-core's cached references to collectives (its coalescing manager, its all-gather) timed.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart_cpu.yaml"
STEPS, WARMUP = 3, 1


def megatron_recipe(*overrides: str):
    from trainprof.recipe import load_recipe

    return load_recipe(QUICKSTART, ["engine.kind=megatron", "engine.zero_stage=0", "model.attention=sdpa",
                                    "data.seq_len=32", "train.micro_batch_size=2", *overrides])


def split_counts(tp: int, pp: int) -> dict:
    from megatron.core import parallel_state

    from trainprof.megatron_model import build_megatron_model
    from trainprof.megatron_names import hf_module_names

    parallel_state.initialize_model_parallel(tp, pp)
    model = build_megatron_model(megatron_recipe(f"engine.tensor_parallel={tp}", f"engine.pipeline_parallel={pp}"),
                                 device="meta")
    out = {"params": sum(p.numel() for p in model.parameters()), "names": sorted(hf_module_names(model).values())}
    parallel_state.destroy_model_parallel()
    return out


def profile_tp2(out_dir: Path) -> dict:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    from trainprof.megatron_model import megatron_config, megatron_layer_spec
    from trainprof.models import resolve_shape
    from trainprof.profiler import Profiler

    recipe = megatron_recipe("engine.tensor_parallel=2", "model.dtype=fp32", f"train.steps={STEPS}",
                             f"train.warmup_steps={WARMUP}")
    parallel_state.initialize_model_parallel(2, 1)
    shape = resolve_shape(recipe.model)
    torch.manual_seed(0)
    model = GPTModel(config=megatron_config(recipe, device="cpu"), transformer_layer_spec=megatron_layer_spec("sdpa"),
                     vocab_size=shape.vocab_size, max_sequence_length=shape.max_position_embeddings,
                     position_embedding_type="none", share_embeddings_and_output_weights=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)  # both tensor-parallel ranks read the same samples
    prof = Profiler.for_recipe(model, opt, recipe, device="cpu", journal_dir=None)
    losses = []
    with prof:
        for _ in range(WARMUP + STEPS):
            ids = torch.randint(0, shape.vocab_size, (2, 32), generator=g)
            with prof.step():
                per_token = model(ids, None, None, labels=torch.roll(ids, -1, dims=1))
                loss = per_token[:, :-1].float().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                prof.record(loss=loss, tokens=ids.numel())
                losses.append(float(loss))
    merged = prof.save(out_dir / "profile")
    parallel_state.destroy_model_parallel()
    return {"profile": merged, "losses": losses}


def cached_references(out_dir: Path) -> dict:
    """megatron-core's own references to collectives, called as its gradient buffers and tensor-parallel
    mappings call them: a coalescing manager around two all-reduces (Megatron's bucket reduction), and
    the all-gather it took by name at import. Checks that the Profiler puts them back when it closes."""
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import mappings

    from trainprof.profiler import Profiler

    model = torch.nn.Linear(4, 4)
    a, b = torch.ones(1000), torch.ones(24)
    gathered = torch.empty(2 * 24)
    with Profiler(model, device="cpu", flops=False, memory=False) as prof:
        with prof.step():
            model(torch.ones(1, 4)).sum().backward()
            with param_and_grad_buffer._coalescing_manager(dist.group.WORLD, async_ops=False):
                dist.all_reduce(a)
                dist.all_reduce(b)
            mappings.dist_all_gather_func(gathered, b)
    restored = (param_and_grad_buffer._coalescing_manager is dist.distributed_c10d._coalescing_manager
                and mappings.dist_all_gather_func is dist.all_gather_into_tensor)
    return {"comm": prof.rank_result()["comm"], "reduced": a[0].item(), "restored": restored}


def main(out: str) -> None:
    warnings.filterwarnings("ignore")  # megatron-core: "Transformer Engine and Apex are not installed"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out_dir = Path(out)
    result = {"tp2": split_counts(2, 1), "pp2": split_counts(1, 2), "cached": cached_references(out_dir),
              **profile_tp2(out_dir)}
    (out_dir / f"megatron.rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
