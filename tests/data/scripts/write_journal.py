"""Write a profiler journal of a tiny Llama with activation recomputation (1 warm-up + 2 measured steps,
module depth 4, data-wait and optimizer regions) into OUT_DIR: the fixture tests/data/journal_v2 holds
one written by the code before the hooks' records became classes, which `replay` must still read.

    python tests/data/scripts/write_journal.py OUT_DIR
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch

from trainprof.models import build_model
from trainprof.profiler import Profiler
from trainprof.profiler.journal import journal_path
from trainprof.recipe import Recipe


def main(out_dir: Path) -> None:
    recipe = Recipe()
    recipe.model.dtype, recipe.model.num_layers, recipe.model.recompute = "fp32", 2, True
    torch.manual_seed(0)
    model = build_model(recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    with tempfile.TemporaryDirectory() as tmp:
        prof = Profiler(model, optimizer=opt, warmup_steps=1, module_depth=4, flops=False, journal_dir=tmp,
                        journal_interval_s=0, rank=0, world_size=1)
        for batch in prof.wrap_loader([{"input_ids": ids, "labels": ids}] * 3):
            with prof.step():
                loss = model(**batch).loss
                loss.backward()
                with prof.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
                prof.record(loss=loss)
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(journal_path(tmp, 0), out_dir / journal_path(tmp, 0).name)  # before close() discards it


if __name__ == "__main__":
    main(Path(sys.argv[1]))
