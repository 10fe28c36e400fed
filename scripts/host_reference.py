"""Print the catalog's `gpu_host_us_per_op`, `gpu_optimizer_bytes_per_param`, `gpu_ops_per_layer` and
`gpu_optimizer_host` blocks from the GPU pretraining runs under profiles/ (the finetuning runs are held
out as targets): per host path (machines.host_key: DeepSpeed ZeRO-3 and ZeRO-0/1/2 apart) and phase, the
mean over the runs of a host-bound phase's µs per operator call (trainprof/projection/hostref.py); the
optimizer kernels' bytes per trainable parameter; the operator calls a decoder layer issues per micro
batch; and DeepSpeed's optimizer calls per trainable tensor and host µs per call beside its kernels; each
with the runs it came from as the source (tests/test_reference_profiles.py recomputes the catalog's).

    python scripts/host_reference.py                      # every GPU pretraining run under profiles/
    python scripts/host_reference.py --runs h100-a,h200-b # only these folders
    # paste the output into trainprof/hardware.yaml
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def reference_profiles(profiles_dir: Path, runs: set[str] | None) -> list[tuple[str, dict]]:
    """(folder name, profile) of the GPU pretraining runs under profiles_dir (only `runs`, if given): the
    finetuning runs are held out, as targets the references are checked against (gpu_validation.py)."""
    from trainprof.io import kept_profiles, read_json

    found = []
    for path in kept_profiles(profiles_dir):
        if runs is not None and path.parent.name not in runs:
            continue
        profile = read_json(path)
        if profile["env"].get("device_type") == "cuda" and profile["recipe"]["task"]["kind"] == "pretrain":
            found.append((path.parent.name, profile))
    return found


def profile_host_key(profile: dict) -> str:
    """machines.host_key of the run's engine: the catalog key its figures go under."""
    from trainprof.projection.machines import host_key

    engine = profile["recipe"]["engine"]
    return host_key(engine["kind"], engine.get("zero_stage", 0))


def reference_values(profiles_dir: Path = ROOT / "profiles", runs: set[str] | None = None
                     ) -> dict[str, dict[str, tuple[float, dict[str, float]]]]:
    """host key -> phase -> (mean µs per call, {profile dir: its µs per call}) over host-bound phases."""
    from trainprof.projection.hostref import HOST_PHASES, host_us_per_op

    found: dict[str, dict[str, list[tuple[str, float]]]] = {}
    for name, profile in reference_profiles(profiles_dir, runs):
        kind = profile_host_key(profile)
        for phase, us in host_us_per_op(profile).items():
            if us is not None and phase in HOST_PHASES:
                found.setdefault(kind, {}).setdefault(phase, []).append((name, us))
    return {kind: {ph: (statistics.mean(v for _, v in runs), {d: round(v, 1) for d, v in runs})
                   for ph, runs in phases.items()} for kind, phases in found.items()}


def optimizer_values(profiles_dir: Path = ROOT / "profiles", runs: set[str] | None = None
                     ) -> dict[str, tuple[float, list[str]]]:
    """host key (engine kind, DeepSpeed's ZeRO-0/1/2 apart: their step moves more) -> (mean bytes per
    trainable parameter, ['<profile dir>: <bytes>', ...])."""
    from trainprof.projection.hostref import optimizer_bytes_per_param

    found: dict[str, list[tuple[str, float]]] = {}
    for name, profile in reference_profiles(profiles_dir, runs):
        cal = profiles_dir / name / "calibration.json"
        value = optimizer_bytes_per_param(profile, json.loads(cal.read_text())["memory"]["gbps"]) \
            if cal.is_file() else None
        if value is not None:
            found.setdefault(profile_host_key(profile), []).append((name, value))
    return {kind: (statistics.mean(v for _, v in runs), [f"{d}: {v:.1f}" for d, v in runs])
            for kind, runs in found.items()}


def trainable_tensors(profile: dict) -> int:
    """Trainable parameter tensors of the profile's recipe."""
    from trainprof.projection.census import census
    from trainprof.projection.census import trainable_tensors as count
    from trainprof.recipe import recipe_from_dict

    return count(census(recipe_from_dict(profile["recipe"])))


def optimizer_host_values(profiles_dir: Path = ROOT / "profiles", runs: set[str] | None = None
                          ) -> dict[str, dict[str, tuple[float, list[str]]]]:
    """DeepSpeed host key -> {"calls_per_tensor": (median optimizer calls per trainable tensor, runs),
    "us_per_call": (mean host µs per call beside the kernels, runs)} (hostref.optimizer_host). Plain
    PyTorch's step is left out: its foreach kernels run asynchronously, so its phase is the longer of the
    two, which gpu_host_us_per_op's optimizer figure and gpu_optimizer_bytes_per_param already price."""
    from trainprof.projection.hostref import optimizer_host

    found: dict[str, list[tuple[str, float, float]]] = {}
    for name, profile in reference_profiles(profiles_dir, runs):
        got = optimizer_host(profile) if profile["recipe"]["engine"]["kind"] == "deepspeed" else None
        if got is not None:
            calls, us = got
            found.setdefault(profile_host_key(profile), []).append(
                (name, calls / trainable_tensors(profile), us))
    out = {}
    for kind, rows in found.items():
        calls = (statistics.median(c for _, c, _ in rows), [f"{d}: {c:.1f}" for d, c, _ in rows])
        out[kind] = {"calls_per_tensor": calls,
                     "us_per_call": (statistics.mean(u for _, _, u in rows), [f"{d}: {u:.1f}" for d, _, u in rows])}
    return out


def ops_values(profiles_dir: Path = ROOT / "profiles", runs: set[str] | None = None
               ) -> dict[str, dict[str, tuple[float, list[str]]]]:
    """host key (as reference_values': ZeRO-3's hooks issue more calls) -> phase -> (median operator calls
    per decoder layer and micro batch, the runs) over the GPU pretraining runs with an operator trace."""
    from trainprof.projection.measured import measured_from_profile
    from trainprof.recipe import recipe_from_dict, resolve_shape

    found: dict[str, dict[str, list[tuple[str, float]]]] = {}
    for name, profile in reference_profiles(profiles_dir, runs):
        m = measured_from_profile(profile)
        layers = resolve_shape(recipe_from_dict(profile["recipe"]).model).num_layers
        for phase in ("forward", "backward"):
            if m.ops and phase in m.ops:
                found.setdefault(profile_host_key(profile), {}).setdefault(phase, []).append(
                    (name, m.ops[phase].layer_calls / layers / m.grad_accum))
    return {kind: {ph: (statistics.median(v for _, v in runs), [d for d, _ in runs]) for ph, runs in phases.items()}
            for kind, phases in found.items()}


def print_per_phase(block: str, values: dict[str, dict[str, tuple[float, Any]]], what: str) -> None:
    """A catalog block of engine -> phase -> {value, source} as YAML; where each run's own figure is known
    (a {run: figure} mapping), also `hosts`, which the projection shows beside the mean."""
    print(f"{block}:")
    for kind, phases in sorted(values.items()):
        print(f"  {kind}:")
        for phase, (value, runs) in phases.items():
            hosts = (", hosts: {" + ", ".join(f"{run}: {fig}" for run, fig in runs.items()) + "}"
                     if isinstance(runs, dict) else "")
            print(f'    {phase}: {{value: {value:.1f}{hosts}, source: "{what} (profiles/ {", ".join(runs)})"}}')


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", help="comma-separated profiles/ folders to use (default: every GPU pretraining run)")
    args = parser.parse_args(argv)
    runs = set(args.runs.split(",")) if args.runs else None
    print_per_phase("gpu_host_us_per_op", reference_values(runs=runs), "mean of host-bound phases, us per operator call")
    print("gpu_optimizer_bytes_per_param:")
    for kind, (mean, names) in sorted(optimizer_values(runs=runs).items()):
        print(f'  {kind}: {{value: {mean:.1f}, source: "mean of the optimizer kernels\' device time x the measured '
              f'copy bandwidth / trainable parameters (profiles/ {"; ".join(names)})"}}')
    print_per_phase("gpu_ops_per_layer", ops_values(runs=runs), "median operator calls per decoder layer and micro batch")
    host = optimizer_host_values(runs=runs)
    print("gpu_optimizer_host:")
    for kind, figs in sorted(host.items()):
        print(f"  {kind}:")
        for key, what in (("calls_per_tensor", "median optimizer calls per trainable tensor"),
                          ("us_per_call", "mean of (optimizer phase - its kernels) / its calls, us")):
            value, names = figs[key]
            print(f'    {key}: {{value: {value:.1f}, source: "{what} (profiles/ {"; ".join(names)})"}}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
