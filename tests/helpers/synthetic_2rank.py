"""torchrun script: the synthetic model on every rank (gloo) with a collective of known cost inside
module `comm`: after an all_gather lines the ranks up, rank 1 waits SLOW_MS before an all_reduce, so
rank 0 is blocked in that all_reduce for about SLOW_MS. Each rank writes its ledger (ground truth).

    torchrun --nproc_per_node 2 tests/helpers/synthetic_2rank.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the `helpers` package

from helpers.checks import module_rows_per_step  # noqa: E402
from helpers.synthetic import Synthetic, train  # noqa: E402

SLOW_MS = 25.0
STEPS, WARMUP = 5, 1


def main(out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = Synthetic(with_comm=True, slow_rank_extra_ms=SLOW_MS)
    dist.barrier()
    prof, ledger = train(model, {"module_depth": 2}, steps=STEPS, warmup=WARMUP)
    profile = prof.save(out, recipe={"name": "synthetic-2rank"})
    rank = dist.get_rank()
    if rank == 0:  # the tables and summary.md, as `trainprof report` renders them
        from trainprof.report.summary import write_summary

        write_summary(profile, out)
    (Path(out) / f"ledger.rank{rank}.json").write_text(
        json.dumps([{f"{n}|{p}": v for (n, p), v in step.items()} for step in ledger]))
    rows, index = module_rows_per_step(prof)  # per-step module rows, for checks against the ledger
    (Path(out) / f"rows.rank{rank}.json").write_text(
        json.dumps([{name: row[i] for name, i in index.items() if i in row} for row in rows]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
