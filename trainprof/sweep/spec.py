"""Sweep files: a base recipe plus a list and/or matrix of overrides, turned into validated cells.

A sweep file (YAML):

    recipe: ../quickstart_cpu.yaml     # base recipe, relative to this file
    name: zero_recompute_cpu           # output dir name; default: the file's stem
    nproc: 1                           # ranks per node for every cell (a cell or the matrix may change it)
    nnodes: 1                          # nodes per cell (> 1 needs a SLURM allocation)
    timeout_s: 900                     # per cell; a cell running longer is killed and recorded as timeout
    overrides: [data.seq_len=128]      # applied to every cell, before the cell's own
    cells:                             # explicit cells (optional) ...
      - {name: baseline, overrides: []}
      - {name: zero3, overrides: [engine.zero_stage=3], nproc: 2}
    matrix:                            # ... crossed with the cartesian product of these (optional)
      model.recompute: [false, true]
      nproc: [1, 2]                    # `nproc` / `nnodes` in the matrix vary the world size

Each cell has a key, a hash of the resolved recipe's non-default values and the world size, and an id
`<readable label>-<key>` that names its output dir. The state file knows cells by key, so the same
configuration is recognised across runs (resume) however its overrides are spelled or its label reads,
and a changed base recipe gives new keys (its cells run again).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainprof.io import read_yaml
from trainprof.recipe import Recipe, RecipeError, did_you_mean, check_environment, load_recipe

SWEEP_KEYS = ("recipe", "name", "description", "nproc", "nnodes", "timeout_s", "overrides", "cells", "matrix")
CELL_KEYS = ("name", "overrides", "nproc", "nnodes")
WORLD_KEYS = ("nproc", "nnodes")  # matrix keys that set the launch, not the recipe
DEFAULT_TIMEOUT_S = 1800.0  # per cell: room for a 7B ZeRO-3 start-up and 20 steps on a slow node


class SweepError(RecipeError):
    """A mistake in a sweep file: one line, exit code 2 (a RecipeError, so the CLI prints it so)."""


@dataclass(kw_only=True)
class Cell:
    """One run of a sweep: the base recipe with `overrides`, on nnodes x nproc ranks."""

    id: str
    label: str  # short, for tables: the cell's name and/or its varying values
    overrides: list[str]  # the sweep's common overrides, then the cell's own
    nproc: int = 1
    nnodes: int = 1
    recipe_path: str = ""
    fingerprint: str = ""  # hash of the resolved recipe's non-default values and the world size

    @property
    def key(self) -> str:
        """What the state file knows the cell by: its configuration, whatever its label says."""
        return self.fingerprint

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "label": self.label, "overrides": self.overrides, "nproc": self.nproc,
                "nnodes": self.nnodes, "world_size": self.world_size, "recipe_path": self.recipe_path,
                "fingerprint": self.fingerprint}


@dataclass(kw_only=True)
class Sweep:
    name: str
    path: str  # the sweep file ("" when built in code, e.g. by `trainprof scale`)
    recipe_path: str
    description: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    cells: list[Cell] = field(default_factory=list)


def format_value(value: Any) -> str:
    """A YAML value as the right-hand side of a key=value override."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


def _slug(text: str, limit: int = 60) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("_.+-")[:limit].rstrip("_.+-") or "cell"


def _non_default(d: dict[str, Any], defaults: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        base = defaults.get(key) if isinstance(defaults, dict) else None
        if isinstance(value, dict) and isinstance(base, dict) and value:
            out.update(_non_default(value, base, f"{prefix}{key}."))
        elif value != base:
            out[f"{prefix}{key}"] = value
    return out


def fingerprint(recipe: Recipe, nproc: int, nnodes: int) -> str:
    """sha1 of the recipe's non-default values (output section left out) and the world size."""
    values = _non_default(recipe.to_dict(), Recipe().to_dict())
    values = {k: v for k, v in values.items() if not k.startswith("output.")}
    blob = json.dumps({"recipe": values, "nproc": nproc, "nnodes": nnodes}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


def make_cell(recipe_path: str | Path, overrides: list[str], *, label: str, nproc: int = 1,
              nnodes: int = 1) -> tuple[Cell, Recipe]:
    """Validate one cell's recipe (RecipeError on a mistake) and give it its stable id."""
    recipe = load_recipe(recipe_path, overrides)
    fp = fingerprint(recipe, nproc, nnodes)
    cell = Cell(id=f"{_slug(label)}-{fp}", label=label, overrides=list(overrides), nproc=nproc, nnodes=nnodes,
                recipe_path=str(recipe_path), fingerprint=fp)
    return cell, recipe


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SweepError(f"{where} must be an integer >= 1, got {value!r}")
    return value


def _overrides(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) and "=" in v for v in value):
        raise SweepError(f"{where} must be a list of key=value strings, e.g. [engine.zero_stage=2]")
    return list(value)


def _leaf(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def _check_keys(data: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    for key in data:
        if key not in allowed:
            raise SweepError(f"{where}: unknown key '{key}'{did_you_mean(str(key), allowed)}")


def _read(path: Path) -> dict[str, Any]:
    data = read_yaml(path, what="sweep file", hint="pass the path of a sweep YAML (see recipes/sweeps/)",
                     error=SweepError)
    if not isinstance(data, dict):
        raise SweepError(f"sweep file '{path}' must be a mapping with at least a 'recipe' key")
    return data


def is_sweep_file(path: str | Path) -> bool:
    """A sweep file has a top-level `recipe:` key (a recipe file never does)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and "recipe" in data


def _variants(raw: Any, matrix: dict[str, list[Any]], default_world: dict[str, int],
              where: str) -> list[tuple[str, list[str], dict[str, int]]]:
    """One explicit cell crossed with the matrix: (label, the cell's overrides, {nproc, nnodes}) each."""
    if not isinstance(raw, dict):
        raise SweepError(f"{where} must be a mapping with keys {', '.join(CELL_KEYS)}")
    _check_keys(raw, CELL_KEYS, where)
    own = _overrides(raw.get("overrides"), f"{where}: 'overrides'")
    base_world = {k: _positive_int(raw.get(k, default_world[k]), f"{where}: '{k}'") for k in WORLD_KEYS}
    if raw.get("name"):
        base_parts = [str(raw["name"])]
    else:
        base_parts = [f"{_leaf(o.split('=', 1)[0])}={o.split('=', 1)[1]}" for o in own]
    out = []
    for combo in itertools.product(*matrix.values()):
        world, extra, parts = dict(base_world), [], list(base_parts)
        for key, value in zip(matrix, combo):
            if key in WORLD_KEYS:
                world[key] = value
            else:
                extra.append(f"{key}={format_value(value)}")
            parts.append(f"{_leaf(key)}={format_value(value)}")
        label = " ".join(parts) or "base"
        if not any(k in matrix for k in WORLD_KEYS) and world != default_world:
            label += f" n={world['nnodes'] * world['nproc']}"
        out.append((label, [*own, *extra], world))
    return out


def _checked_cell(recipe_path: Path, overrides: list[str], label: str, world: dict[str, int], *,
                  cuda: bool | None) -> Cell:
    """make_cell, then (cuda not None) the machine rules `trainprof run` applies; RecipeError on a mistake."""
    cell, recipe = make_cell(recipe_path, overrides, label=label, **world)
    if cuda is not None:
        check_environment(recipe, cuda_available=cuda)
    return cell


def _blame(err: RecipeError, recipe_path: Path, own: list[str], extra: list[str], world: dict[str, int], *,
           cuda: bool | None, cell: str) -> str:
    """The one-line error of a cell that does not validate, naming what broke it: the first command-line
    override (`extra`) that makes the valid cell invalid, else the cell (`own`: the file's overrides)."""

    def valid(overrides: list[str]) -> bool:
        try:
            _checked_cell(recipe_path, overrides, "check", world, cuda=cuda)
        except RecipeError:
            return False
        return True

    if not extra or not valid(own):
        return f"{cell}: {err}"
    bad = next((o for i, o in enumerate(extra) if not valid([*own, *extra[:i + 1]])), None)
    if bad is None:
        return f"{cell}: {err}"
    if valid([bad]):  # fine on the base recipe: it conflicts with this cell's settings
        return f"command-line override '{bad}' with {cell}: {err}"
    return f"command-line override '{bad}': {err}"


def load_sweep(path: str | Path, *, check_machine: bool = True, cuda_available: bool | None = None,
               extra_overrides: list[str] = ()) -> Sweep:
    """Read a sweep file and validate every cell's recipe before anything runs.

    Args:
        path: the sweep YAML.
        check_machine: also apply the machine rules (CUDA, installed packages) `trainprof run` applies.
        cuda_available: for check_machine; None asks torch.
        extra_overrides: applied to every cell after its own (from the command line).
    Returns:
        The sweep with its cells in file order (explicit cells, each crossed with the matrix).
    Raises:
        SweepError / RecipeError: one line naming the file, the cell and the key.
    """
    path = Path(path)
    data = _read(path)
    where = f"sweep file '{path}'"
    _check_keys(data, SWEEP_KEYS, where)
    if not isinstance(data.get("recipe"), str):
        raise SweepError(f"{where}: 'recipe' must name the base recipe YAML (relative to the sweep file)")
    recipe_path = Path(os.path.normpath(path.parent / data["recipe"]))
    if not recipe_path.is_file():
        raise SweepError(f"{where}: base recipe '{data['recipe']}' not found (looked at {recipe_path}); "
                         "give a path relative to the sweep file")
    nproc = _positive_int(data.get("nproc", 1), f"{where}: 'nproc'")
    nnodes = _positive_int(data.get("nnodes", 1), f"{where}: 'nnodes'")
    timeout = data.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise SweepError(f"{where}: 'timeout_s' must be a number of seconds > 0, got {timeout!r}")
    common = _overrides(data.get("overrides"), f"{where}: 'overrides'")

    raw_cells = data.get("cells")
    if raw_cells is None:
        raw_cells = [{}]
    if not isinstance(raw_cells, list) or not raw_cells:
        raise SweepError(f"{where}: 'cells' must be a non-empty list of {{name, overrides, nproc}} mappings")
    matrix = data.get("matrix") or {}
    if not isinstance(matrix, dict):
        raise SweepError(f"{where}: 'matrix' must map override keys to lists of values")
    for key, values in matrix.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: matrix key '{key}' must have a non-empty list of values")
        if key in WORLD_KEYS:
            for v in values:
                _positive_int(v, f"{where}: matrix '{key}' value")
    if data.get("cells") is None and not matrix:
        raise SweepError(f"{where}: give 'cells', 'matrix' or both")

    sweep = Sweep(name=_slug(str(data.get("name") or path.stem), 100), path=str(path), recipe_path=str(recipe_path),
                  description=str(data.get("description") or ""), timeout_s=float(timeout))
    cuda = cuda_available
    if check_machine and cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    seen: dict[str, str] = {}
    for i, raw in enumerate(raw_cells):
        for label, own, world in _variants(raw, matrix, {"nproc": nproc, "nnodes": nnodes}, f"{where} cell {i + 1}"):
            try:
                cell = _checked_cell(recipe_path, [*common, *own, *extra_overrides], label, world,
                                     cuda=bool(cuda) if check_machine else None)
            except RecipeError as err:
                raise SweepError(_blame(err, recipe_path, [*common, *own], extra_overrides, world,
                                        cuda=bool(cuda) if check_machine else None,
                                        cell=f"{where} cell '{label}'")) from None
            if cell.key in seen:
                raise SweepError(f"{where}: cells '{seen[cell.key]}' and '{label}' are the same configuration; "
                                 "remove one")
            seen[cell.key] = label
            sweep.cells.append(cell)
    return sweep
