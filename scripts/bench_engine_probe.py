"""Whether `trainprof project`'s engine probe times an engine the same whichever engine it follows: the plain
torch engine against its own bare model (called in the same rounds), probed after ZeRO-3 and before it (each
engine is built in that order too), interleaved (after, before, after, ...) so that a slow spell hits both
orders. The plain engine is the bare model, so its ratio should read about 1 in both orders; ZeRO-3's, far
above 1 (its parameter fetch and release at every module).

    python scripts/bench_engine_probe.py                # 4 repeats of each order
    python scripts/bench_engine_probe.py --repeats 6
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = ["model.dtype=fp32", "train.micro_batch_size=1", "data.seq_len=32"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=4, help="probes of each order (default 4)")
    args = parser.parse_args()

    from tqdm import tqdm

    from trainprof.projection.probes import probe_engines
    from trainprof.recipe import load_recipe

    recipe = ROOT / "recipes" / "quickstart_cpu.yaml"
    zero3 = load_recipe(recipe, [*SETTINGS, "engine.kind=deepspeed", "engine.zero_stage=3"])
    plain = load_recipe(recipe, [*SETTINGS, "engine.kind=torch", "engine.zero_stage=0"])
    ratios: dict[str, list[float]] = {"after ZeRO-3": [], "before ZeRO-3": []}
    zero3_ratios: list[float] = []
    with tqdm(total=2 * args.repeats, desc="bench_engine_probe", unit="probe") as bar:
        for _ in range(args.repeats):
            for order in ratios:
                recipes = [zero3, plain] if order == "after ZeRO-3" else [plain, zero3]
                probes = probe_engines(recipes, threads=1, bare=True)
                p, z = (probes[1], probes[0]) if order == "after ZeRO-3" else probes
                ratios[order].append(p["engine_forward_ms"] / p["model_forward_ms"])
                zero3_ratios.append(z["engine_forward_ms"] / z["model_forward_ms"])
                bar.update()
    print("plain torch engine's forward over its bare model's (median of 8 rounds per probe):")
    for order, values in ratios.items():
        shown = " ".join(f"{v:.2f}" for v in values)
        print(f"  called {order:<14} {shown}   median {statistics.median(values):.2f}")
    gap = statistics.median(ratios["after ZeRO-3"]) / statistics.median(ratios["before ZeRO-3"]) - 1
    print(f"order effect (median after / median before - 1): {gap:+.1%}")
    print(f"ZeRO-3 engine's forward over its bare model's: median {statistics.median(zero3_ratios):.2f} "
          f"({min(zero3_ratios):.2f}-{max(zero3_ratios):.2f})")
    print("timer: host perf_counter around each call; every call after writing the last-level cache's size "
          "(trainprof.env.last_level_cache_bytes); OMP threads 1; quickstart fp32, micro batch 1, seq 32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
