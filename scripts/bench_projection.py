"""Validate `trainprof project` on this machine: measure a baseline, project a grid of changes from it,
run each change for real, and print per-case and mean absolute percentage errors on step time and on
peak memory. Goals: settings' changes mean <= 5%, max <= 10%; model-size changes mean <= 10%, max <= 15%;
memory within 10%.

    python scripts/bench_projection.py                     # every group, 5 repeats of 40 steps (~2 h on 2 cores)
    python scripts/bench_projection.py --groups size       # the model-size grid only
    python scripts/bench_projection.py --cases "depth"     # the cases whose name contains the text
    python scripts/bench_projection.py --write             # also store the table as the package's
                                                           # validation.json (what the confidence cites)
    python scripts/bench_projection.py --best-check        # --best's micro batch against maxbatch and real runs
    python scripts/bench_projection.py --research          # what the projection says of the research's figures

Cases marked `tuned` are the ones the step model was developed against (and that tests/test_projection.py
runs); the others were held out of that work. Every run is a real torchrun of trainprof.run. Each
configuration runs `--repeats` times, interleaved (base, cases..., base, cases...), so that a slow spell
of the machine hits all of them rather than one; measured = the median run, predicted = the median of
the projections from every baseline run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = "recipes/quickstart_cpu.yaml"
COMMON = ["train.warmup_steps=3", "profile.ops=false"]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kinds: list[str]
    overrides: list[str]
    nproc: int = 2
    threads: int = 1
    tuned: bool = False


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    base: list[str]
    nproc: int
    threads: int
    cases: list[Case]
    goal: tuple[float, float]  # (mean, max) step-time error goal, %


SETTINGS = Group("settings", [], 2, 1, [
    Case("micro_batch 4->8", ["micro_batch"], ["train.micro_batch_size=8"], tuned=True),
    Case("seq_len 256->128", ["seq_len"], ["data.seq_len=128"]),
    Case("grad_accum 1->2", ["grad_accum"], ["train.grad_accum=2"], tuned=True),
    Case("recompute on", ["recompute"], ["model.recompute=true"]),
    Case("attention sdpa->eager", ["attention"], ["model.attention=eager"]),
    Case("dtype bf16->fp32", ["dtype"], ["model.dtype=fp32"]),
    Case("ZeRO-3 -> ZeRO-2", ["zero_stage"], ["engine.zero_stage=2"], tuned=True),
    Case("2 ranks -> 1", ["world_size"], [], nproc=1, tuned=True),
    # a task change probes both engines with their models (LoRA's frozen base, QLoRA's 4-bit one)
    Case("pretrain -> LoRA, ZeRO-2", ["task", "zero_stage"], ["task.kind=lora", "engine.zero_stage=2"]),
    Case("pretrain -> QLoRA, ZeRO-2", ["task", "zero_stage"], ["task.kind=qlora", "engine.zero_stage=2"]),
    Case("pretrain -> LoRA, ZeRO-3", ["task"], ["task.kind=lora"]),
    Case("engine: ZeRO-3 -> + optimizer offload", ["offload"], ["engine.offload=optimizer"]),
    Case("engine: ZeRO-3 -> PyTorch DDP", ["zero_stage", "engine"], ["engine.kind=torch", "engine.zero_stage=0"],
         tuned=True),
], goal=(5.0, 10.0))
# model sizes: depth, width, heads (GQA) and vocabulary, each probed by one decoder layer and the rest of
# the model at both shapes; the collectives re-derived from the parameter census
SIZE = Group("size", [], 2, 1, [
    Case("depth 2->4 layers", ["model_size"], ["model.num_layers=4"], tuned=True),
    Case("depth 2->6 layers", ["model_size"], ["model.num_layers=6"]),
    Case("depth 2->1 layer", ["model_size"], ["model.num_layers=1"]),
    Case("width: MLP 352->704", ["model_size"], ["model.intermediate_size=704"]),
    Case("width: hidden 128->256, MLP 704", ["model_size"], ["model.hidden_size=256", "model.intermediate_size=704"],
         tuned=True),
    Case("heads 4->8", ["model_size"], ["model.num_heads=8"]),
    Case("GQA: kv heads 4->2", ["model_size"], ["model.num_kv_heads=2"]),
    Case("GQA: kv heads 4->1", ["model_size"], ["model.num_kv_heads=1"]),
    Case("vocab 1024->4096", ["model_size"], ["model.vocab_size=4096"], tuned=True),
    Case("vocab 1024->16384", ["model_size"], ["model.vocab_size=16384"]),
    Case("llama2-tiny -> llama2-small", ["model_size"], ["model.name=llama2-small"]),
], goal=(10.0, 15.0))
TORCH = Group("threads", ["engine.kind=torch", "engine.zero_stage=0"], 1, 1, [
    Case("1 -> 2 threads (a different CPU)", ["threads"], [], nproc=1, threads=2),
], goal=(5.0, 10.0))
GROUPS = {g.name: g for g in (SETTINGS, SIZE, TORCH)}


def run(overrides: list[str], nproc: int, threads: int, out: Path, steps: int, reuse: bool = False) -> Path:
    from trainprof.sweep.launch import launch_command

    kept = sorted(out.glob("*/profile.json")) if reuse else []
    if kept:  # a run made by an earlier call with this --out: projected again, not run again
        return kept[-1].parent
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    cmd = launch_command(RECIPE, [*COMMON, f"train.steps={steps}", *overrides, f"output.dir={out}"], nproc=nproc)
    log = out / "launch.log"
    with log.open("w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    found = sorted(out.glob("*/profile.json"))
    if rc != 0 or not found:
        raise SystemExit(f"bench_projection: run {overrides} nproc={nproc} failed (rc {rc}); see {log}")
    return found[-1].parent


def slug(name: str) -> str:
    """A case's name as a folder name: its runs are found again by name (--reuse), whatever --cases picks."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def measured(run_dir: Path) -> tuple[float, int]:
    from trainprof.projection.measured import measured_from_profile

    m = measured_from_profile(json.loads((run_dir / "profile.json").read_text()))
    return m.step_ms, m.peak_memory_bytes


def abs_errors(rows: list[dict], key: str) -> list[float]:
    """|error %| of the rows that have one under `key` (a case with no prediction has none)."""
    return [abs(r[key]) for r in rows if r[key] is not None]


def run_group(g: Group, out: Path, steps: int, repeats: int, bar, reuse: bool = False
              ) -> tuple[list[dict[str, Any]], float]:
    """Every configuration of a group `repeats` times, interleaved, and after each repeat its cases projected
    from that repeat's baseline; the rows and the baseline's noise floor."""
    from trainprof.projection.project import project

    steps_by: dict[int, list[float]] = {}
    mems: dict[int, list[int]] = {}
    preds: dict[int, list[dict[str, Any]]] = {}
    configs = [("base", [], g.nproc, g.threads)] + [(c.name, c.overrides, c.nproc, c.threads) for c in g.cases]
    for rep in range(repeats):
        for i, (name, overrides, nproc, threads) in enumerate(configs):
            d = run([*g.base, *overrides], nproc, threads, out / f"{g.name}-{slug(name)}-r{rep}", steps, reuse)
            bar.update()
            step, mem = measured(d)
            steps_by.setdefault(i, []).append(step)
            mems.setdefault(i, []).append(mem)
            if i == 0:
                base = d
        # every case projected from this repeat's baseline, right after its runs: the probes are timed in the
        # spell of the machine the runs were (its speed moves by the hour), and a slow or fast baseline run
        # moves the prediction as much as a slow run of the case moves the measurement
        for i, c in enumerate(g.cases, 1):
            bar.set_postfix_str(f"projecting {c.name}")
            preds.setdefault(i, []).append(project(
                base, overrides=[*g.base, *c.overrides], nproc=[c.nproc],
                threads=c.threads if c.threads != g.threads else None)["predictions"][0])
            bar.update()
    base_steps = steps_by[0]
    noise = 100 * (max(base_steps) - min(base_steps)) / statistics.median(base_steps)
    rows = []
    for i, c in enumerate(g.cases, 1):
        steps_pred = [p["step_ms"] for p in preds[i] if p["step_ms"]]
        mems_pred = [p["memory_per_rank_bytes"] for p in preds[i] if p["memory_per_rank_bytes"]]
        pred_step = statistics.median(steps_pred) if steps_pred else None
        pred_mem = statistics.median(mems_pred) if mems_pred else None
        step, mem = statistics.median(steps_by[i]), statistics.median(mems[i])
        rows.append({
            "case": c.name, "group": g.name, "kinds": c.kinds, "tuned": c.tuned,
            "measured_on": dt.date.today().isoformat(), "baseline_step_ms": statistics.median(base_steps),
            "noise_floor_pct": noise, "measured_step_ms": step, "measured_runs_ms": steps_by[i],
            "predicted_step_ms": pred_step, "predicted_runs_ms": steps_pred,
            "step_error_pct": 100 * (pred_step - step) / step if pred_step else None,
            "measured_memory_bytes": mem, "predicted_memory_bytes": pred_mem,
            "memory_error_pct": 100 * (pred_mem - mem) / mem if pred_mem else None,
            "reason": (preds[i][0].get("reasons") or {}).get("step_ms"),
        })
    return rows, noise


def print_rows(rows: list[dict[str, Any]], noise: float, repeats: int, steps: int) -> None:
    print(f"\n{'case':<38} {'tuned':>5} {'base ms':>8} {'measured':>9} {'predicted':>9} {'err %':>7} "
          f"{'mem MiB':>8} {'pred MiB':>8} {'err %':>6}")
    for r in rows:
        pe = f"{r['step_error_pct']:+.1f}" if r["step_error_pct"] is not None else "n/a"
        me = f"{r['memory_error_pct']:+.1f}" if r["memory_error_pct"] is not None else "n/a"
        pm = f"{r['predicted_memory_bytes'] / 2**20:.0f}" if r["predicted_memory_bytes"] else "n/a"
        ps = f"{r['predicted_step_ms']:.1f}" if r["predicted_step_ms"] else "n/a"
        print(f"{r['case']:<38} {'yes' if r['tuned'] else 'no':>5} {r['baseline_step_ms']:8.1f} "
              f"{r['measured_step_ms']:9.1f} {ps:>9} {pe:>7} {r['measured_memory_bytes'] / 2**20:8.0f} {pm:>8} {me:>6}")
        if r.get("reason"):
            print(f"    not predicted: {r['reason']}")
    for name in dict.fromkeys(r["group"] for r in rows):
        group = [r for r in rows if r["group"] == name]
        err, held = abs_errors(group, "step_error_pct"), abs_errors([r for r in group if not r["tuned"]], "step_error_pct")
        goal = GROUPS[name].goal
        if err:
            print(f"\n{name}: step time MAPE {statistics.fmean(err):.1f}%, max {max(err):.1f}% over {len(err)} cases"
                  + (f" (held-out only: MAPE {statistics.fmean(held):.1f}%, max {max(held):.1f}%)" if held else "")
                  + f"   goal: mean <= {goal[0]:g}%, max <= {goal[1]:g}%")
    mem_err = abs_errors(rows, "memory_error_pct")
    if mem_err:
        print(f"peak memory: MAPE {statistics.fmean(mem_err):.1f}%, max {max(mem_err):.1f}%   goal: within 10%")
    print(f"noise floor: the baselines' runs differ by up to {noise:.1f}% of their median ({repeats} runs each; no "
          "predictor can be validated below it here)")
    print(f"timer: host monotonic clock; step = slowest rank's median over {steps} measured steps, median over the "
          "repeats; predicted = median of the projections from every baseline run; memory = peak process RSS (CPU)")


def write_validation(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """trainprof/projection/validation.json: per kind of change its MAPE (what a prediction's confidence
    cites); rows of cases not run now are kept as they were measured."""
    import torch

    from trainprof.env import collect_env
    from trainprof.io import atomic_write_json

    path = ROOT / "trainprof" / "projection" / "validation.json"
    if path.is_file():
        ran = {r["case"] for r in rows}
        rows = [r for r in json.loads(path.read_text())["cases"] if r["case"] not in ran] + rows
    by_kind: dict[str, dict[str, Any]] = {}
    for r in rows:
        for k in r["kinds"]:
            if r["step_error_pct"] is not None:
                by_kind.setdefault(k, {"errors": []})["errors"].append(abs(r["step_error_pct"]))
    for d in by_kind.values():
        errs = d.pop("errors")
        d.update(step_mape_pct=round(statistics.fmean(errs), 2), step_max_pct=round(max(errs), 2), cases=len(errs))
    step_err, mem_err = abs_errors(rows, "step_error_pct"), abs_errors(rows, "memory_error_pct")
    atomic_write_json(path, {
        "measured_on": f"{collect_env(torch.device('cpu'), 1)['device']} CPU, {os.cpu_count()} cores, "
                       f"{dt.date.today().isoformat()}",
        "command": f"python scripts/bench_projection.py --groups {args.groups} --repeats {args.repeats} --steps {args.steps} "
                   "--write (the last call; each case keeps its date)",
        "by_kind": by_kind,
        "summary": {"steps_per_run": args.steps, "step_mape_pct": round(statistics.fmean(step_err), 2),
                    "step_max_pct": round(max(step_err), 2),
                    "noise_floor_pct": round(max(r.get("noise_floor_pct") or 0.0 for r in rows), 2),
                    "repeats": args.repeats, "memory_mape_pct": round(statistics.fmean(mem_err), 2),
                    "memory_max_pct": round(max(mem_err), 2)},
        "cases": rows,
    })
    print("wrote trainprof/projection/validation.json")


def best_check(out: Path, steps: int, repeats: int, cap_gb: float) -> None:
    """--best on this machine with a memory cap: its micro batch against the largest one `trainprof maxbatch`
    finds under the cap, and against real runs of its setting at each micro batch up to that one (the real
    best), with the predicted and measured tokens/s at the predicted best."""
    import pandas as pd
    from tqdm import tqdm

    from trainprof.projection.project import best

    base = run([], 2, 1, out / "best-base", steps)
    cap = [f"train.memory_cap_gb={cap_gb}"]
    found = best(base, overrides=cap)["best"][0]
    top = found["best_throughput"]
    setting = top["setting"].split()
    print(f"\n--best with train.memory_cap_gb={cap_gb}: {top['setting'] or 'the recipe as it is'}, micro batch "
          f"{top['micro_batch']}, predicted {top['tokens_per_s']:,.0f} tokens/s ({found['tried']} settings predicted)")
    cmd = [sys.executable, "-m", "trainprof", "maxbatch", RECIPE, *COMMON, *setting, *cap, "--nproc", "2",
           "--out", str(out / "maxbatch")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    table = out / "maxbatch" / "maxbatch.csv"
    largest = int(pd.read_csv(table)["max_micro_batch"].iloc[0]) if proc.returncode == 0 and table.is_file() else None
    print(f"trainprof maxbatch under the cap, 2 ranks, the same setting: largest micro batch {largest}"
          + ("" if largest else f" (maxbatch failed: {proc.stderr.strip()[-500:]})"))
    measured_tps: dict[int, list[float]] = {}
    mbs = sorted({mb for mb in (1, 2, 4, 8, 16, 32, top["micro_batch"]) if largest is None or mb <= largest})
    bar = tqdm(total=repeats * len(mbs), desc="bench_projection --best-check", unit="run")
    for rep in range(repeats):
        for mb in mbs:
            d = run([*setting, f"train.micro_batch_size={mb}", *cap], 2, 1, out / f"best-mb{mb}-r{rep}", steps)
            measured_tps.setdefault(mb, []).append(json.loads((d / "profile.json").read_text())["summary"]["tokens_per_s"])
            bar.update()
    bar.close()
    real = {mb: statistics.median(v) for mb, v in measured_tps.items()}
    real_best = max(real, key=real.get)
    print("measured tokens/s by micro batch (median of the repeats): " + ", ".join(f"{mb}: {v:,.0f}" for mb, v in real.items()))
    at = real.get(top["micro_batch"])
    print(f"real best micro batch {real_best}; predicted best {top['micro_batch']}; largest that fits (maxbatch) "
          f"{largest}; at the predicted best: predicted {top['tokens_per_s']:,.0f} vs measured "
          + (f"{at:,.0f} tokens/s ({100 * (top['tokens_per_s'] / at - 1):+.1f}%)" if at else
             "n/a (the predicted best does not fit under the cap)"))


def research(out: Path, steps: int) -> None:
    """What the projection predicts for the research's figures (Zhang et al., arXiv 2311.03687), printed
    beside them: a sanity check, not a target to tune to."""
    from trainprof.hardware import load_catalog
    from trainprof.projection.gemm import GemmRate, Gemm
    from trainprof.projection.project import project

    base = run([], 2, 1, out / "research-base", steps)
    llama = ["model.name=llama2-7b", "data.seq_len=350", "train.micro_batch_size=2"]
    print("\n8-GPU scaling efficiency of Llama2-7B (seq 350, micro batch 2, the source's ZeRO-3), predicted vs the "
          "research's measurement:")
    tps = {}
    for node, paper in (("a800-research", "about linear"), ("rtx4090-8x", "90.8%"), ("rtx3090-8x", "85.9%"),
                        ("rtx3090-8x-nvlink", "")):
        p = project(base, overrides=llama, targets=[node])["predictions"][0]
        tps[node] = p["tokens_per_s"]
        n0 = p.get("scaling_base_gpus") or 1
        eff = (f"{100 * p['scaling_efficiency']:.1f}%" + (f" (vs {n0} GPUs, the fewest it fits)" if n0 > 1 else "")
               if p["scaling_efficiency"] is not None else
               f"n/a ({(p.get('reasons') or {}).get('scaling_efficiency', 'no step predicted')})")
        print(f"  {node:<20} predicted {eff}   research: {paper or 'n/a'}")
    print(f"NVLink on the RTX 3090: predicted {100 * (tps['rtx3090-8x-nvlink'] / tps['rtx3090-8x'] - 1):+.1f}% tokens/s; "
          "research: about +10%")
    # attention alone on an A800: eager's scores written and read in memory vs a fused (flash) kernel
    cat = load_catalog()
    a800 = cat.resolve("a800-80g")
    rate = GemmRate(best_tflops=a800.figure("peak_bf16_dense_tflops"), memory_gbps=a800.figure("memory_gbps"))
    b, s, heads, d = 2, 350, 32, 128
    gemms = [Gemm(s, s, d, b * heads), Gemm(s, d, s, b * heads)]
    scores = 4 * b * heads * s * s  # fp32 scores written once, read once (softmax), per pass
    fwd_eager = rate.ms(gemms) + 3 * scores / (rate.memory_gbps * 1e9) * 1e3
    bwd_eager = 2 * rate.ms(gemms) + 5 * scores / (rate.memory_gbps * 1e9) * 1e3
    print(f"FlashAttention on an A800 (attention only, Llama2-7B, batch 2, seq 350): predicted forward "
          f"{100 * (1 - rate.ms(gemms) / fwd_eager):.1f}% faster, backward {100 * (1 - 2 * rate.ms(gemms) / bwd_eager):.1f}% "
          "faster; research: 34.9% and 24.7%")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="store the table as trainprof/projection/validation.json")
    parser.add_argument("--groups", default="settings,size,threads", help="comma-separated groups: settings, size, threads")
    parser.add_argument("--only-tuned", action="store_true", help="run only the cases the model was tuned on")
    parser.add_argument("--cases", default=None,
                        help="run only the cases whose name contains one of these comma-separated texts")
    parser.add_argument("--out", default=None, help="where runs go (default: a temp dir)")
    parser.add_argument("--reuse", action="store_true",
                        help="with --out: a configuration whose run an earlier call left there is projected again, "
                             "not run again (a change of the step model scored on the same measurements)")
    parser.add_argument("--steps", type=int, default=40,
                        help="measured steps per run (default 40: about 4 s of a ~100 ms quickstart step; the same "
                             "configuration's runs differ more than its steps within a run)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of every configuration, interleaved (default 5: "
                        "with 2 or 3 a slow spell of a shared machine in one run moved a case's error by 5-10 points)")
    parser.add_argument("--best-check", type=float, nargs="?", const=0.75, default=None, metavar="CAP_GB",
                        help="check --best under train.memory_cap_gb (default 0.75 GiB of peak RSS per rank)")
    parser.add_argument("--research", action="store_true", help="print the projection beside the research's figures")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    from trainprof.env import quiet_library_noise

    quiet_library_noise()
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_projection-"))
    if args.research:
        research(out, args.steps)
    if args.best_check is not None:
        best_check(out, args.steps, args.repeats, args.best_check)
    if args.research or args.best_check is not None:
        return 0
    wanted = args.cases.split(",") if args.cases else None
    groups = [dataclasses.replace(GROUPS[n], cases=[c for c in GROUPS[n].cases if (c.tuned or not args.only_tuned)
                                                    and (wanted is None or any(t in c.name for t in wanted))])
              for n in args.groups.split(",") if n in GROUPS]
    groups = [g for g in groups if g.cases]
    if not groups:
        parser.error("--groups/--cases name no case; the cases are: "
                     + ", ".join(c.name for g in GROUPS.values() for c in g.cases))
    # per repeat: every configuration's run, then every case's projection from that repeat's baseline
    bar = tqdm(total=sum(2 * len(g.cases) + 1 for g in groups) * args.repeats, desc="bench_projection",
               unit="call", file=sys.stderr)
    rows, noise = [], []
    for g in groups:
        more, floor = run_group(g, out, args.steps, args.repeats, bar, args.reuse)
        rows += more
        noise.append(floor)
    bar.close()
    print_rows(rows, max(noise), args.repeats, args.steps)
    if args.write:
        write_validation(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
