"""torchrun script: the tiny Llama under real DeepSpeed ZeRO-3 (gloo, CPU), profiled as the runner
profiles it, with gradient accumulation. Writes the run dir (profile.json, rank files, CSVs, summary.md).

    torchrun --nproc_per_node 2 tests/helpers/zero3_llama.py OUT_DIR [STAGE] [DEPTH] [OPS_STEPS]
"""

from __future__ import annotations

import sys
from pathlib import Path


import transformers.models.llama.modeling_llama  # noqa: E402,F401  (before zero.Init patches tensor creation)

import deepspeed  # noqa: E402
import torch  # noqa: E402

from trainprof.models import build_model  # noqa: E402
from trainprof.profiler import Profiler  # noqa: E402
from trainprof.recipe import Recipe  # noqa: E402

SEQ, MICRO, ACCUM, STEPS, WARMUP = 64, 2, 2, 4, 1


def ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "train_batch_size": MICRO * ACCUM * 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True},
        # every parameter is gathered by the module that uses it, when it uses it: no persistence of
        # small parameters and no prefetch (which would issue module N+1's all-gather inside module N)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 0},
        "steps_per_print": 10**9,
    }


def batches(vocab: int, n: int):
    g = torch.Generator().manual_seed(1234)
    for _ in range(n):
        ids = torch.randint(0, vocab, (MICRO, SEQ), generator=g)
        yield {"input_ids": ids, "labels": ids}


def main(out: str, stage: int = 3, depth: int = 4, ops_steps: int = 0) -> None:
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    recipe = Recipe()
    recipe.model.name = "llama2-tiny"
    config = ds_config(stage)
    if stage == 3:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_model(recipe)
    else:
        model = build_model(recipe)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    # created after deepspeed.initialize, so its hooks wrap ZeRO-3's
    with Profiler(engine.module, optimizer=optimizer, module_depth=depth, warmup_steps=WARMUP,
                  ops=ops_steps > 0, ops_steps=ops_steps, trace_dir=Path(out) / "tb") as prof:
        loader = prof.wrap_loader(batches(model.config.vocab_size, (STEPS + WARMUP) * ACCUM))
        for _ in range(STEPS + WARMUP):
            with prof.step():
                for _ in range(ACCUM):
                    batch = next(loader)
                    loss = engine(**batch).loss
                    with prof.phase("backward"):
                        engine.backward(loss)
                    with prof.phase("optimizer"):
                        engine.step()
                    prof.record(loss=loss, tokens=batch["input_ids"].numel())
    profile = prof.save(out, recipe=recipe.to_dict())
    if prof.rank == 0:  # the tables and summary.md, as `trainprof report` renders them
        from trainprof.report.summary import write_summary

        write_summary(profile, out)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
