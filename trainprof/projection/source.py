"""The run a projection starts from: its profile, its recipe and its calibration.

A run made by `trainprof run` has its recipe.yaml. A run profiled in the user's own script
(`trainprof wrap`, the HF / Lightning callbacks) has none; its profile records the workload instead
(`workload`: the model's shape, dtype, task, engine and its settings, micro batch, sequence length,
gradient accumulation, as recipe keys, and `unknown`: the keys it could not read and why), from which
a recipe is rebuilt; a key it could not read keeps the recipe default and is named in `unknown`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

from trainprof.projection import pipeline
from trainprof.projection.measured import Measured, measured_from_profile


class ProjectionError(ValueError):
    """A projection the inputs cannot support: one line saying what is missing and what to do."""


@dataclasses.dataclass(kw_only=True)
class Source:
    run_dir: Path
    profile: dict[str, Any]
    recipe: Any
    measured: Measured
    calibration: dict[str, Any] | None
    recipe_origin: str  # "recipe.yaml", "profile.json" (its resolved recipe) or "workload" (a wrapped run's)
    unknown: dict[str, str]  # recipe keys a wrapped run could not record, and why


def load_source(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[Source, Any]:
    """The measured run and the target recipe (the run's recipe with `overrides` applied).

    Raises:
        ProjectionError: no profile.json, a partial profile, or neither a recipe nor a workload.
        RunDirError: no such dir, or its profile.json is not a profile; UserError: it is cut short.
    """
    from trainprof.io import profile_file
    from trainprof.recipe import RecipeError, apply_overrides, load_recipe, recipe_from_dict
    from trainprof.report.rundir import existing_run_dir, read_profile_file

    run_dir = existing_run_dir(run_dir)
    path = profile_file(run_dir)
    if path is None and (run_dir / "inference.json").is_file():
        raise ProjectionError(f"'{run_dir}' is an inference run (`trainprof infer`); `trainprof project` predicts "
                              "training steps: pass a run dir written by `trainprof run`, `trainprof wrap` or a "
                              "trainprof callback")
    if path is None:
        raise ProjectionError(f"'{run_dir}' has no profile.json; pass a run dir written by `trainprof run`, "
                              "`trainprof wrap` or a trainprof callback")
    profile = read_profile_file(path)
    if profile.get("partial"):
        raise ProjectionError(f"'{run_dir}' holds a partial profile (the run failed); project from a finished run")
    recipe_path = run_dir / "recipe.yaml"
    unknown: dict[str, str] = {}
    try:
        if recipe_path.is_file():
            source_recipe, target_recipe = load_recipe(recipe_path, []), load_recipe(recipe_path, overrides or [])
            origin = "recipe.yaml"
        elif profile.get("workload") or profile.get("recipe"):
            origin = "workload" if profile.get("workload") else "profile.json"
            data = dict(profile.get("workload") or profile["recipe"])
            unknown = dict(data.pop("unknown", None) or {})
            if "model" in unknown:  # the recipe's default shape would stand in for a model it is not
                raise ProjectionError(f"'{run_dir}': {unknown['model']}, so there is no model shape to re-time or "
                                      "scale (the step model derives Llama-style decoders' work from their shape)")
            source_recipe = recipe_from_dict(copy.deepcopy(data))
            target_recipe = recipe_from_dict(apply_overrides(copy.deepcopy(data), overrides or []))
        else:
            raise ProjectionError(f"'{run_dir}' has no recipe.yaml and its profile records no workload (an older "
                                  "trainprof wrote it): profile it again (trainprof.Profiler, `trainprof wrap` and "
                                  "the callbacks record it), or pass recipe= to Profiler.save")
    except RecipeError as err:
        raise ProjectionError(f"'{run_dir}': {err}") from None
    source_recipe, target_recipe = ran_allocator(profile, source_recipe, target_recipe, overrides or [])
    cal_path = run_dir / "calibration.json"
    calibration = json.loads(cal_path.read_text()) if cal_path.is_file() else None
    if pipeline.is_pipeline(profile):  # the stage that sets the pace; its transfers are the bubble term's
        measured = measured_from_profile(pipeline.pace_view(profile))
        measured.comm = pipeline.without_p2p(measured.comm)
    else:
        measured = measured_from_profile(profile)
    return Source(run_dir=run_dir, profile=profile, recipe=source_recipe, measured=measured, calibration=calibration,
                  recipe_origin=origin, unknown=unknown), target_recipe


def ran_allocator(profile: dict[str, Any], source_recipe: Any, target_recipe: Any,
                  overrides: list[str]) -> tuple[Any, Any]:
    """Both recipes with the host allocator the source process recorded (profile env `host_allocator`;
    runs made before it was recorded, and wrapped scripts, ran the system's), the target's unless an
    override names it: probes then run with the allocator the measured steps ran with."""
    from trainprof.recipe import override_key

    mode = ((profile.get("env") or {}).get("host_allocator") or {}).get("mode", "system")

    def ran(recipe: Any) -> Any:
        return dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, cpu_allocator=mode))

    named = any(override_key(o) == "train.cpu_allocator" for o in overrides)
    return ran(source_recipe), target_recipe if named else ran(target_recipe)


def torch_device(env: dict[str, Any]):
    import torch

    return torch.device("cuda" if env.get("device_type") == "cuda" and torch.cuda.is_available() else "cpu")


def same_machine_as_source(src: Source) -> bool:
    env = src.profile["env"]
    return _device_here(str(torch_device(env))) == env["device"]


@functools.lru_cache(maxsize=None)
def _device_here(device: str) -> str:
    """This machine's device name as a run records it (a few ms each: a projection asks per prediction)."""
    import torch

    from trainprof.env import collect_env

    return collect_env(torch.device(device), 1)["device"]


PROBES_FILE = "probes.json"  # in the run dir, beside calibration.json
PROBES_VERSION = 3  # of what a kept probe holds


def machine_fingerprint() -> str:
    """What a probe's timing depends on besides its recipe: this host and CPU, torch and trainprof."""
    import platform
    from importlib.metadata import version

    import torch

    from trainprof.engines.cpu_info import cpu_key

    return (f"probes v{PROBES_VERSION} {platform.node()} cpu {cpu_key()} torch {torch.__version__} "
            f"trainprof {version('trainprof')}")


def kept_probe(source: Source, key: str, make: Any) -> tuple[Any, str | None]:
    """A probe's result (JSON data) under `key`, and when it was timed where an earlier call kept it in
    the run dir on this machine (PROBES_FILE; calibration.json keeps the calibration alike); else
    `make()`'s and None, the result then kept there. A run is probed once per machine, not at every
    `trainprof project`; a run dir that cannot be written is probed every time."""
    import datetime as dt

    from trainprof.io import atomic_write_json

    path = source.run_dir / PROBES_FILE
    name = f"{machine_fingerprint()} {key}"
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    kept = kept if isinstance(kept, dict) else {}
    entry = kept.get(name)
    if isinstance(entry, dict) and "result" in entry and "made_utc" in entry:
        return entry["result"], entry["made_utc"]
    result = make()
    kept[name] = {"made_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"), "result": result}
    try:
        atomic_write_json(path, kept)
    except OSError:
        pass
    return result, None


def ensure_calibration(source: Source, *, force: bool = False) -> dict[str, Any] | None:
    """The source's calibration: calibration.json from the run dir, or measured now when the source
    ran on this kind of machine (then stored in the run dir). None when neither is possible."""
    from trainprof.io import atomic_write_json
    from trainprof.projection.calibrate import calibrate

    if source.calibration is not None and not force:
        return source.calibration
    if not same_machine_as_source(source):
        return None
    env = source.profile["env"]
    cal = calibrate(torch_device(env), dtype=source.recipe.model.dtype, threads=int(env.get("cpu_threads") or 1),
                    collectives_world=2 if env.get("device_type") == "cpu" else 0)
    atomic_write_json(source.run_dir / "calibration.json", cal)
    source.calibration = cal
    return cal


def no_calibration(source: Source) -> str:
    """Why a run without calibration.json, made on another machine, cannot be re-rated here, and what to do:
    the folders beside it calibrated on the same device, or a calibration made on that device."""
    device = source.profile["env"].get("device") or "its device"
    same = []
    for path in sorted(source.run_dir.parent.glob("*/calibration.json")):
        try:
            if json.loads(path.read_text()).get("device") == device and path.parent != source.run_dir:
                same.append(path.parent.name)
        except (OSError, ValueError):
            continue
    same.sort(key=lambda name: -len(os.path.commonprefix([name, source.run_dir.name])))  # the likeliest twin first
    beside = (f"; {', '.join(same[:3])}{' ...' if len(same) > 3 else ''} beside it calibrated the same {device}: copy "
              f"its calibration.json into {source.run_dir}, or project from that folder" if same else "")
    return (f"the source run has no calibration.json (the GEMM and copy rates of its {device}, which it is re-rated "
            f"from) and was made on another machine, where they must be measured{beside}; or run `trainprof project` "
            "once on a machine with that device, or run the recipe there with profile.calibrate=true (the default)")
