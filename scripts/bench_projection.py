"""Validate `trainprof project` on this machine: measure a baseline, project a grid of changes from it,
run each change for real, and print per-case and mean absolute percentage errors on step time and on
peak memory. Goal: step time mean <= 5%, max <= 10%; memory within 10%.

    python scripts/bench_projection.py                 # ~50 min on 2 cores (5 repeats of 40 steps)
    python scripts/bench_projection.py --repeats 2     # ~12 min, noisier
    python scripts/bench_projection.py --write         # also store the table as the package's
                                                       # validation.json (what expected_error_pct cites)

Cases marked `tuned` are the ones the step model was developed against (and that tests/test_projection.py
runs); the others were held out of that work. Every run is a real torchrun of trainprof.run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = "recipes/quickstart_cpu.yaml"
COMMON = ["train.warmup_steps=3", "profile.ops=false"]
# (name, kinds, overrides of the target, nproc, threads, tuned)
DS_CASES = [
    ("micro_batch 4->8", ["micro_batch"], ["train.micro_batch_size=8"], 2, 1, True),
    ("seq_len 256->128", ["seq_len"], ["data.seq_len=128"], 2, 1, False),
    ("grad_accum 1->2", ["grad_accum"], ["train.grad_accum=2"], 2, 1, True),
    ("recompute on", ["recompute"], ["model.recompute=true"], 2, 1, False),
    ("attention sdpa->eager", ["attention"], ["model.attention=eager"], 2, 1, False),
    ("ZeRO-3 -> ZeRO-2", ["zero_stage"], ["engine.zero_stage=2"], 2, 1, True),  # its collectives and step: tuned on it
    ("2 ranks -> 1", ["world_size"], [], 1, 1, True),
    # a task change probes both engines with their models (LoRA's frozen base, QLoRA's 4-bit one); its
    # ZeRO stage 0-2 collectives come from the adapters (under ZeRO-3 it is not predicted)
    ("pretrain -> LoRA, ZeRO-2", ["task", "zero_stage"], ["task.kind=lora", "engine.zero_stage=2"], 2, 1, False),
    ("pretrain -> QLoRA, ZeRO-2", ["task", "zero_stage"], ["task.kind=qlora", "engine.zero_stage=2"], 2, 1, False),
    # an engine change: both engines probed (DeepSpeedCPUAdam's step for offload)
    ("engine: ZeRO-3 -> + optimizer offload", ["offload"], ["engine.offload=optimizer"], 2, 1, False),
    # DDP's collectives derived (stepmodel._ddp_comm): developed against this case's first measurement
    ("engine: ZeRO-3 -> PyTorch DDP", ["zero_stage", "engine"], ["engine.kind=torch", "engine.zero_stage=0"], 2, 1, True),
]
TORCH_BASE = ["engine.kind=torch", "engine.zero_stage=0"]
THREAD_CASES = [
    ("1 -> 2 threads (a different CPU)", ["threads"], [], 1, 2, False),
]


def run(overrides: list[str], nproc: int, threads: int, out: Path, steps: int) -> Path:
    from trainprof.sweep.launch import torchrun_command

    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    cmd = torchrun_command(RECIPE, [*COMMON, f"train.steps={steps}", *overrides, f"output.dir={out}"], nproc=nproc)
    log = out / "launch.log"
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    found = sorted(out.glob("*/profile.json"))
    if rc != 0 or not found:
        raise SystemExit(f"bench_projection: run {overrides} nproc={nproc} failed (rc {rc}); see {log}")
    return found[-1].parent


def measured(run_dir: Path) -> tuple[float, int]:
    from trainprof.projection.stepmodel import measured_from_profile

    m = measured_from_profile(json.loads((run_dir / "profile.json").read_text()))
    return m.step_ms, m.peak_memory_bytes


def abs_errors(rows: list[dict], key: str) -> list[float]:
    """|error %| of the rows that have one under `key` (a case with no prediction has none)."""
    return [abs(r[key]) for r in rows if r[key] is not None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="store the table as trainprof/projection/validation.json")
    parser.add_argument("--only-tuned", action="store_true", help="run only the cases the model was tuned on")
    parser.add_argument("--cases", default=None,
                        help="run only the cases whose name contains this text (with --write: their rows replace "
                             "the same cases' rows in validation.json, the others are kept as they were measured)")
    parser.add_argument("--out", default=None, help="where runs go (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=40,
                        help="measured steps per run (default 40: about 4 s of a ~100 ms quickstart step; the same "
                             "configuration's runs differ more than its steps within a run, so a run should measure "
                             "seconds, not a dozen steps)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of every configuration, interleaved "
                        "(measured = their median; the baseline's spread is the noise floor; default 5: with 2 or 3 "
                        "a slow spell of a shared machine in one run moved a case's error by 5-10 points)")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from trainprof.env import quiet_library_noise
    from trainprof.projection.project import project

    quiet_library_noise()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_projection-"))
    rows = []
    groups = [("deepspeed", [], 2, 1, DS_CASES), ("torch", TORCH_BASE, 1, 1, THREAD_CASES)]
    groups = [(g[0], g[1], g[2], g[3], [c for c in g[4] if (c[5] or not args.only_tuned)
                                        and (args.cases is None or args.cases in c[0])]) for g in groups]
    groups = [g for g in groups if g[4]]
    if not groups:
        parser.error(f"--cases {args.cases!r} names no case; the cases are: "
                     + ", ".join(c[0] for c in DS_CASES + THREAD_CASES))
    total = sum(len(g[4]) + 1 for g in groups) * args.repeats
    bar = tqdm(total=total, desc="bench_projection", unit="run", file=sys.stderr)
    noise = []
    for label, base_overrides, base_nproc, base_threads, cases in groups:
        # every configuration runs `repeats` times, interleaved (base, cases..., base, cases...), so that a
        # slow spell of the machine hits all of them rather than one
        steps: dict[int, list[float]] = {}
        mems: dict[int, list[int]] = {}
        base_dirs = []
        configs = [([], base_nproc, base_threads)] + [(c[2], c[3], c[4]) for c in cases]
        for rep in range(args.repeats):
            for i, (overrides, nproc, threads) in enumerate(configs):
                d = run([*base_overrides, *overrides], nproc, threads, out / f"{label}-{i}-r{rep}", args.steps)
                bar.update()
                step, mem = measured(d)
                steps.setdefault(i, []).append(step)
                mems.setdefault(i, []).append(mem)
                if i == 0:
                    base_dirs.append((step, d))
        base_steps = steps[0]
        noise.append(100 * (max(base_steps) - min(base_steps)) / statistics.median(base_steps))
        for i, (name, kinds, overrides, nproc, threads, tuned) in enumerate(cases, 1):
            # projected from every baseline run and the median taken, as the measured side is: a slow or
            # fast baseline run moves the prediction as much as a slow run of the case moves the measurement
            preds = [project(d, overrides=[*base_overrides, *overrides], nproc=[nproc],
                             threads=threads if threads != base_threads else None)["predictions"][0]
                     for _, d in base_dirs]
            steps_pred = [p["step_ms"] for p in preds if p["step_ms"]]
            mems_pred = [p["memory_per_rank_bytes"] for p in preds if p["memory_per_rank_bytes"]]
            pred_step = statistics.median(steps_pred) if steps_pred else None
            pred_mem = statistics.median(mems_pred) if mems_pred else None
            step, mem = statistics.median(steps[i]), statistics.median(mems[i])
            rows.append({
                "case": name, "kinds": kinds, "tuned": tuned, "measured_on": dt.date.today().isoformat(),
                "baseline_step_ms": statistics.median(base_steps), "noise_floor_pct": noise[-1],
                "measured_step_ms": step, "measured_runs_ms": steps[i], "predicted_step_ms": pred_step,
                "predicted_runs_ms": steps_pred,
                "step_error_pct": 100 * (pred_step - step) / step if pred_step else None,
                "measured_memory_bytes": mem, "predicted_memory_bytes": pred_mem,
                "memory_error_pct": 100 * (pred_mem - mem) / mem if pred_mem else None,
            })
    bar.close()
    print(f"\n{'case':<34} {'tuned':>5} {'base ms':>8} {'measured':>9} {'predicted':>9} {'err %':>7} "
          f"{'mem MiB':>8} {'pred MiB':>8} {'err %':>6}")
    for r in rows:
        pe = f"{r['step_error_pct']:+.1f}" if r["step_error_pct"] is not None else "n/a"
        me = f"{r['memory_error_pct']:+.1f}" if r["memory_error_pct"] is not None else "n/a"
        pm = f"{r['predicted_memory_bytes'] / 2**20:.0f}" if r["predicted_memory_bytes"] else "n/a"
        ps = f"{r['predicted_step_ms']:.1f}" if r["predicted_step_ms"] else "n/a"
        print(f"{r['case']:<34} {'yes' if r['tuned'] else 'no':>5} {r['baseline_step_ms']:8.1f} "
              f"{r['measured_step_ms']:9.1f} {ps:>9} {pe:>7} {r['measured_memory_bytes'] / 2**20:8.0f} {pm:>8} {me:>6}")
    step_err, mem_err = abs_errors(rows, "step_error_pct"), abs_errors(rows, "memory_error_pct")
    held = abs_errors([r for r in rows if not r["tuned"]], "step_error_pct")
    print(f"\nstep time: MAPE {statistics.fmean(step_err):.1f}%, max {max(step_err):.1f}% over {len(step_err)} cases"
          + (f" (held-out only: MAPE {statistics.fmean(held):.1f}%, max {max(held):.1f}%)" if held else "")
          + "   goal: mean <= 5%, max <= 10%")
    print(f"peak memory: MAPE {statistics.fmean(mem_err):.1f}%, max {max(mem_err):.1f}%   goal: within 10%")
    print(f"noise floor: the baseline's runs differ by up to {max(noise):.1f}% of their median "
          f"({args.repeats} runs each; no predictor can be validated below it here)")
    print(f"timer: host monotonic clock; step = slowest rank's median over {args.steps} measured steps, median over the "
          "repeats; predicted = median of the projections from every baseline run; memory = peak process RSS (CPU)")
    if args.write:
        path = ROOT / "trainprof" / "projection" / "validation.json"
        if args.cases is not None and path.is_file():  # the cases not run now keep their measured rows
            ran = {r["case"] for r in rows}
            rows = [r for r in json.loads(path.read_text())["cases"] if r["case"] not in ran] + rows
            step_err, mem_err = abs_errors(rows, "step_error_pct"), abs_errors(rows, "memory_error_pct")
            noise = [r.get("noise_floor_pct") or 0.0 for r in rows]
        by_kind: dict[str, dict[str, float]] = {}
        for r in rows:
            for k in r["kinds"]:
                if r["step_error_pct"] is None:
                    continue
                d = by_kind.setdefault(k, {"errors": []})
                d["errors"].append(abs(r["step_error_pct"]))
        for k, d in by_kind.items():
            errs = d.pop("errors")
            d.update(step_mape_pct=round(statistics.fmean(errs), 2), step_max_pct=round(max(errs), 2), cases=len(errs))
        from trainprof.env import collect_env
        from trainprof.io import atomic_write_json

        import torch

        atomic_write_json(path, {
            "measured_on": f"{collect_env(torch.device('cpu'), 1)['device']} CPU, {os.cpu_count()} cores, "
                           f"{dt.date.today().isoformat()}",
            "command": f"python scripts/bench_projection.py --repeats {args.repeats} --steps {args.steps} --write",
            "by_kind": by_kind,
            "summary": {"steps_per_run": args.steps, "step_mape_pct": round(statistics.fmean(step_err), 2),
                        "step_max_pct": round(max(step_err), 2),
                        "noise_floor_pct": round(max(noise), 2), "repeats": args.repeats,
                        "memory_mape_pct": round(statistics.fmean(mem_err), 2),
                        "memory_max_pct": round(max(mem_err), 2)},
            "cases": rows,
        })
        print("wrote trainprof/projection/validation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
