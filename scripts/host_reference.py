"""Print the catalog's `gpu_host_us_per_op`, `gpu_optimizer_bytes_per_param` and `gpu_ops_per_layer`
blocks from the GPU reference runs under profiles/: per engine kind and phase, the mean over the runs of
a host-bound phase's µs per operator call, per engine kind the optimizer kernels' bytes per trainable
parameter (trainprof/projection/hostref.py; pretraining runs), and the operator calls a decoder layer
issues per micro batch (pretraining runs), with the runs they came from as the source.

    python scripts/host_reference.py            # paste the output into trainprof/hardware.yaml
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def reference_values(profiles_dir: Path = ROOT / "profiles") -> dict[str, dict[str, tuple[float, list[str]]]]:
    """engine kind -> phase -> (mean µs per call, ['<profile dir>: <µs>', ...]) over host-bound phases."""
    from trainprof.io import kept_profiles, read_json
    from trainprof.projection.hostref import HOST_PHASES, host_us_per_op

    found: dict[str, dict[str, list[tuple[str, float]]]] = {}
    for path in kept_profiles(profiles_dir):
        profile = read_json(path)
        if profile["env"].get("device_type") != "cuda":
            continue
        kind = (profile.get("engine") or {}).get("kind") or profile["recipe"]["engine"]["kind"]
        for phase, us in host_us_per_op(profile).items():
            if us is not None and phase in HOST_PHASES:
                found.setdefault(kind, {}).setdefault(phase, []).append((path.parent.name, us))
    return {kind: {ph: (statistics.mean(v for _, v in runs), [f"{d}: {v:.1f}" for d, v in runs])
                   for ph, runs in phases.items()} for kind, phases in found.items()}


def optimizer_values(profiles_dir: Path = ROOT / "profiles") -> dict[str, tuple[float, list[str]]]:
    """engine kind -> (mean bytes per trainable parameter, ['<profile dir>: <bytes>', ...])."""
    from trainprof.io import kept_profiles, read_json
    from trainprof.projection.hostref import optimizer_bytes_per_param

    found: dict[str, list[tuple[str, float]]] = {}
    for path in kept_profiles(profiles_dir):
        cal = path.parent / "calibration.json"
        profile = read_json(path)
        if profile["env"].get("device_type") != "cuda" or not cal.is_file() \
                or profile["recipe"]["task"]["kind"] != "pretrain":  # LoRA's optimizer: fixed costs over few params
            continue
        value = optimizer_bytes_per_param(profile, json.loads(cal.read_text())["memory"]["gbps"])
        if value is not None:
            kind = (profile.get("engine") or {}).get("kind") or profile["recipe"]["engine"]["kind"]
            found.setdefault(kind, []).append((path.parent.name, value))
    return {kind: (statistics.mean(v for _, v in runs), [f"{d}: {v:.1f}" for d, v in runs])
            for kind, runs in found.items()}


def ops_values(profiles_dir: Path = ROOT / "profiles") -> dict[str, dict[str, tuple[float, list[str]]]]:
    """engine kind -> phase -> (median operator calls per decoder layer and micro batch, the runs) over the
    GPU pretraining runs with an operator trace."""
    from trainprof.io import kept_profiles, read_json
    from trainprof.projection.measured import measured_from_profile
    from trainprof.recipe import recipe_from_dict, resolve_shape

    found: dict[str, dict[str, list[tuple[str, float]]]] = {}
    for path in kept_profiles(profiles_dir):
        profile = read_json(path)
        if profile["env"].get("device_type") != "cuda" or profile["recipe"]["task"]["kind"] != "pretrain":
            continue
        m = measured_from_profile(profile)
        layers = resolve_shape(recipe_from_dict(profile["recipe"]).model).num_layers
        for phase in ("forward", "backward"):
            if m.ops and phase in m.ops:
                found.setdefault(profile["recipe"]["engine"]["kind"], {}).setdefault(phase, []).append(
                    (path.parent.name, m.ops[phase].layer_calls / layers / m.grad_accum))
    return {kind: {ph: (statistics.median(v for _, v in runs), [d for d, _ in runs]) for ph, runs in phases.items()}
            for kind, phases in found.items()}


def print_per_phase(block: str, values: dict[str, dict[str, tuple[float, list[str]]]], what: str, sep: str) -> None:
    """A catalog block of engine -> phase -> {value, source} as YAML."""
    print(f"{block}:")
    for kind, phases in sorted(values.items()):
        print(f"  {kind}:")
        for phase, (value, runs) in phases.items():
            print(f'    {phase}: {{value: {value:.1f}, source: "{what} (profiles/ {sep.join(runs)})"}}')


def main() -> int:
    print_per_phase("gpu_host_us_per_op", reference_values(), "mean of host-bound phases, us per operator call", "; ")
    print("gpu_optimizer_bytes_per_param:")
    for kind, (mean, runs) in sorted(optimizer_values().items()):
        print(f'  {kind}: {{value: {mean:.1f}, source: "mean of the optimizer kernels\' device time x the measured '
              f'copy bandwidth / trainable parameters (profiles/ {"; ".join(runs)})"}}')
    print_per_phase("gpu_ops_per_layer", ops_values(), "median operator calls per decoder layer and micro batch", ", ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
