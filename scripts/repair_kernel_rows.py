"""Re-read a kept GPU profile's operator table by the rule trainprof/profiler/ops.py now applies: a kernel
that an aten op launched is the op's, never a `kernel::` row of its own. Tables written before that rule
could hold an op's kernels again under non-op events (an H100 torch step's AdamW kernels, 557 ms in a
445 ms step). The kept Kineto trace names what the operators launched; those rows are dropped, the
GPU busy share (which sums the table) is recomputed, and `ops_info.repaired` says what was done.

    python scripts/repair_kernel_rows.py profiles/h100-llama1b_zero3_sdpa-torch-gpubound
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainprof.analysis.gpu_busy import gpu_busy_fields, trace_device_time
from trainprof.io import atomic_write_json, profile_file, read_json
from trainprof.profiler.ops import counted_again


def repair(folder: Path) -> dict:
    """Drop the folder's op-launched `kernel::` rows; returns what was dropped (rows, ms)."""
    path = profile_file(folder)
    if path is None:
        raise SystemExit(f"{folder}: no profile.json")
    doc = read_json(path)
    traces = sorted(folder.glob("*.pt.trace.json.gz"))
    if not traces:
        raise SystemExit(f"{folder}: no kept trace (*.pt.trace.json.gz) names what the operators launched")
    op_kernels = trace_device_time(traces[0]).op_kernels
    dropped = counted_again(doc["ops"], op_kernels)
    if not dropped:
        return {"rows": 0, "self_ms": 0.0}
    doc["ops"] = [r for r in doc["ops"] if r not in dropped]
    done = {"rows": len(dropped), "self_ms": sum(r["self_ms"] for r in dropped),
            "why": "kernel:: rows of kernels that aten ops launched (counted again under non-op events), "
                   "dropped by scripts/repair_kernel_rows.py from the kept trace; every other row as measured"}
    doc["ops_info"]["repaired"] = done
    doc.update(gpu_busy_fields(doc))
    atomic_write_json(path, doc)
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="kept GPU profile folders (profiles/<kind>-<run>)")
    for folder in ap.parse_args(argv).folders:
        done = repair(folder)
        print(f"{folder}: dropped {done['rows']} rows, {done['self_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
