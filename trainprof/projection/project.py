"""Projection: one measured run -> predictions for other hardware, world sizes and recipe settings.

    result = project(run_dir, targets=["h100-sxm", "rtx4090"], nodes=[1, 2], gpus_per_node=8,
                     overrides=["train.micro_batch_size=8"], tokens=2e10)

`result` is the projection.json dict: `source` (what was measured) and `predictions`, one per target
and size, each with step_ms, tokens_per_s, mfu, scaling_efficiency, memory_per_rank_bytes, fits,
time_to_train_s, cost_per_million_tokens_usd, expected_error_pct and its assumptions. A figure the
calibration cannot support is null with a `*_reason`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from trainprof.projection import pipeline
from trainprof.projection.catalog import THIS, Catalog, CatalogError, Target, find_accelerator, load_catalog
from trainprof.projection.stepmodel import (
    PHASES,
    Change,
    EngineProbe,
    Link,
    Machine,
    Measured,
    StepProbe,
    derives_ddp_collectives,
    derives_zero_collectives,
    measured_from_profile,
    predict_phases,
    residual_ms,
    task_change_not_derived,
)

PROJECTION_VERSION = 1
VALIDATION_FILE = Path(__file__).with_name("validation.json")
# cross-accelerator checks made on lent GPUs (scripts/gpu_check.sh), kept apart from the CPU bench's table
GPU_VALIDATION_FILE = Path(__file__).with_name("validation_gpu.json")
# probes build the model twice (1 and 2 layers); above this many parameters per layer on CPU they
# would take longer than the projection is worth, and compute is scaled by FLOPs instead
PROBE_MAX_LAYER_PARAMS = 60_000_000
DATA_WAIT_DOMINATES = 0.2  # flag data wait above this share of the predicted step
# recipe changes tried, in order, when a prediction does not fit the target's memory
FIT_SUGGESTIONS = (["engine.zero_stage=3"], ["model.recompute=true"], ["engine.offload=optimizer"],
                   ["engine.offload=optimizer+params", "engine.zero_stage=3"])


class ProjectionError(ValueError):
    """A projection the inputs cannot support: one line saying what is missing and what to do."""


# ---------------------------------------------------------------------------------------------
# Sources: the run dir's profile, recipe and calibration
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class Source:
    run_dir: Path
    profile: dict[str, Any]
    recipe: Any
    measured: Measured
    calibration: dict[str, Any] | None


def load_source(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[Source, Any]:
    """The measured run and the target recipe (the run's recipe with `overrides` applied)."""
    from trainprof.recipe import load_recipe
    from trainprof.report.rundir import RunDirError

    run_dir = Path(run_dir)
    path = run_dir / "profile.json"
    if not path.is_file():
        raise RunDirError(f"'{run_dir}' has no profile.json; pass a run dir written by `trainprof run`")
    profile = json.loads(path.read_text())
    if profile.get("partial"):
        raise ProjectionError(f"'{run_dir}' holds a partial profile (the run failed); project from a finished run")
    recipe_path = run_dir / "recipe.yaml"
    if not recipe_path.is_file():
        raise RunDirError(f"'{run_dir}' has no recipe.yaml; pass a run dir written by `trainprof run`")
    source_recipe = load_recipe(recipe_path, [])
    target_recipe = load_recipe(recipe_path, overrides or [])
    cal_path = run_dir / "calibration.json"
    calibration = json.loads(cal_path.read_text()) if cal_path.is_file() else None
    if pipeline.is_pipeline(profile):  # the stage that sets the pace; its transfers are the bubble term's
        measured = measured_from_profile(pipeline.pace_view(profile))
        measured.comm = pipeline.without_p2p(measured.comm)
    else:
        measured = measured_from_profile(profile)
    return Source(run_dir=run_dir, profile=profile, recipe=source_recipe, measured=measured,
                  calibration=calibration), target_recipe


def ensure_calibration(source: Source, *, force: bool = False) -> dict[str, Any] | None:
    """The source's calibration: calibration.json from the run dir, or measured now when the source
    ran on this kind of machine (then stored in the run dir). None when neither is possible."""
    from trainprof.env import collect_env
    from trainprof.io import atomic_write_json

    if source.calibration is not None and not force:
        return source.calibration
    env = source.profile["env"]
    here = collect_env(_torch_device(env), 1)
    if here["device"] != env["device"]:
        return None
    from trainprof.projection.calibrate import calibrate

    cal = calibrate(_torch_device(env), dtype=source.recipe.model.dtype, threads=int(env.get("cpu_threads") or 1),
                    collectives_world=2 if env.get("device_type") == "cpu" else 0)
    atomic_write_json(source.run_dir / "calibration.json", cal)
    source.calibration = cal
    return cal


def _torch_device(env: dict[str, Any]):
    import torch

    return torch.device("cuda" if env.get("device_type") == "cuda" and torch.cuda.is_available() else "cpu")


# ---------------------------------------------------------------------------------------------
# Expected error: what the validation (scripts/bench_projection.py) measured for each kind of change
# ---------------------------------------------------------------------------------------------

def change_kinds(source_recipe: Any, target_recipe: Any, source_world: int, world: int, machine: str,
                 source_device_type: str = "cpu") -> list[str]:
    """The kinds of change a prediction makes; another accelerator is 'hardware_gpu' from a GPU source
    (validated on lent GPUs) and 'hardware' from a CPU source (not validated)."""
    kinds = []
    s, t = source_recipe, target_recipe
    if s.train.micro_batch_size != t.train.micro_batch_size:
        kinds.append("micro_batch")
    if s.data.seq_len != t.data.seq_len:
        kinds.append("seq_len")
    if s.train.grad_accum != t.train.grad_accum:
        kinds.append("grad_accum")
    if s.model.recompute != t.model.recompute:
        kinds.append("recompute")
    if s.model.attention != t.model.attention:
        kinds.append("attention")
    if s.engine.zero_stage != t.engine.zero_stage:
        kinds.append("zero_stage")
    if s.engine.offload != t.engine.offload:
        kinds.append("offload")
    if s.engine.kind != t.engine.kind:
        kinds.append("engine")
    if _task_key(s) != _task_key(t):
        kinds.append("task")
    if source_world != world:
        kinds.append("world_size")
    if machine != THIS:
        kinds.append("hardware_gpu" if source_device_type == "cuda" else "hardware")
    return kinds or ["none"]


def expected_error(kinds: list[str], validation: dict[str, Any] | None) -> tuple[float | None, str]:
    """The largest validated mean absolute error among the kinds of change, or None with the reason."""
    if validation is None:
        return None, "no validation table (run scripts/bench_projection.py --write)"
    by_kind = validation.get("by_kind", {})
    missing = [k for k in kinds if k not in by_kind]
    if missing:
        return None, (f"not validated for {', '.join(missing)} changes"
                      + ("; a CPU run projected to an accelerator is not validated (GPU-to-GPU predictions are, "
                         f"as 'hardware_gpu' in {GPU_VALIDATION_FILE.name}); the CPU thread-count proxy is under "
                         "'threads'" if "hardware" in missing else ""))
    worst = max(by_kind[k]["step_mape_pct"] for k in kinds)
    where = [f"{by_kind[k].get('file', VALIDATION_FILE.name)} ({by_kind[k].get('measured_on') or validation.get('measured_on', '?')})"
             for k in kinds]
    return worst, f"largest step-time MAPE among {', '.join(kinds)}: " + "; ".join(dict.fromkeys(where))


def load_validation() -> dict[str, Any] | None:
    """The CPU bench's table (validation.json) with the GPU checks' kinds (validation_gpu.json) merged in."""
    doc = json.loads(VALIDATION_FILE.read_text()) if VALIDATION_FILE.is_file() else None
    if GPU_VALIDATION_FILE.is_file():
        gpu = json.loads(GPU_VALIDATION_FILE.read_text())
        kinds = {k: {**v, "file": GPU_VALIDATION_FILE.name, "measured_on": gpu["measured_on"]}
                 for k, v in gpu["by_kind"].items()}
        doc = {**(doc or {}), "by_kind": {**((doc or {}).get("by_kind") or {}), **kinds}}
    return doc


# ---------------------------------------------------------------------------------------------
# Machines and links
# ---------------------------------------------------------------------------------------------

def machine_from_calibration(cal: dict[str, Any], label: str) -> Machine:
    """The rates a calibration.json measured; per phase where it timed each GEMM layout of a Linear
    (calibration version 2), else one rate for every phase."""
    mm = cal["matmul"]
    by_phase = mm.get("by_phase_tflops")
    rates = (f"forward {by_phase['forward']:.3g}, backward {by_phase['backward']:.3g} TFLOP/s (a Linear's GEMM "
             f"layouts; best of any {mm['best_tflops']:.3g})" if by_phase else f"best {mm['best_tflops']:.3g} TFLOP/s")
    return Machine(name=label, matmul_tflops=mm["best_tflops"], memory_gbps=cal["memory"]["gbps"],
                   matmul_tflops_by_phase=by_phase,
                   matmul_source=f"{label}: measured GEMM {rates}"
                                 + ("" if cal.get("device_type") == "cuda" else f" ({cal['threads']} threads)"),
                   memory_source=f"{label}: measured copy {cal['memory']['gbps']:.3g} GB/s")


def machine_from_target(target: Target, dtype: str, *, source: Target | None = None,
                        measured: Machine | None = None) -> tuple[Machine, list[str]]:
    """The target's rates. With `source` (the catalogued accelerator the run was measured on) and its
    `measured` calibration, like is divided by like: the measured rates × target figure / source figure
    (MAMF over MAMF when both have one, else dense peak over dense peak; datasheet bandwidth over
    bandwidth), so the efficiency measured at the source carries over and a measured rate is never
    compared with a datasheet one. Otherwise (a CPU or uncatalogued source) the target's own figures."""
    notes = []
    bf16 = dtype in ("bf16", "fp16")
    peak_key = "peak_bf16_dense_tflops" if bf16 else "peak_fp32_tflops"
    if source is not None and measured is not None and measured.matmul_tflops and measured.memory_gbps:
        key = "mamf_bf16_tflops" if bf16 and target.figure("mamf_bf16_tflops") and source.figure("mamf_bf16_tflops") \
            else peak_key
        if not (target.figure(key) and source.figure(key) and target.figure("memory_gbps") and source.figure("memory_gbps")):
            return Machine(name=target.key, matmul_tflops=None, memory_gbps=None), notes
        rate = measured.matmul_tflops * target.figure(key) / source.figure(key)
        bw = measured.memory_gbps * target.figure("memory_gbps") / source.figure("memory_gbps")
        notes.append(f"{target.key} from {source.key} measured: matmul × {key} {target.figure(key):g}/{source.figure(key):g}, "
                     f"memory × datasheet {target.figure('memory_gbps'):g}/{source.figure('memory_gbps'):g} GB/s "
                     "(the source's measured efficiency carries over)")
        return Machine(name=target.key, matmul_tflops=rate, memory_gbps=bw,
                       matmul_source=f"{rate:.4g} TFLOP/s: {measured.matmul_source} × {target.source(key)} / "
                                     f"{source.source(key)}",
                       memory_source=f"{bw:.4g} GB/s: {measured.memory_source} × {target.source('memory_gbps')} / "
                                     f"{source.source('memory_gbps')}"), notes
    mamf = target.figure("mamf_bf16_tflops") if bf16 else None
    if mamf is not None:
        rate, src = mamf, f"MAMF {mamf:g} TFLOP/s ({target.source('mamf_bf16_tflops')})"
    else:
        rate = target.figure(peak_key)
        src = f"datasheet dense peak {rate:g} TFLOP/s ({target.source(peak_key)})" if rate else "none"
        notes.append(f"{target.key}: no published MAMF; the datasheet peak is used (optimistic)")
    bw = target.figure("memory_gbps")
    return Machine(name=target.key, matmul_tflops=rate, memory_gbps=bw, matmul_source=src,
                   memory_source=f"{bw:g} GB/s ({target.source('memory_gbps')})" if bw else "none"), notes


def _catalog_link(target: Target, world: int, gpus_per_node: int) -> Link | None:
    if world <= 1:
        return None
    link = target.intra_node_link if world <= gpus_per_node else target.inter_node_link
    if link is None:
        return None
    gbps = float(link["gbps_per_direction"]["value"])
    return Link(alpha_ms=0.0, busbw_gbps=gbps,
                source=f"{link['name']} at {gbps:g} GB/s per direction ({link['gbps_per_direction']['source']}); "
                       "latency (alpha) not modelled")


# ---------------------------------------------------------------------------------------------
# One prediction
# ---------------------------------------------------------------------------------------------

def _state_elements_per_rank(recipe: Any, trainable: int, world: int) -> float:
    partitioned = recipe.engine.kind == "deepspeed" and recipe.engine.zero_stage >= 1
    return trainable / world if partitioned else float(trainable)


def _plan_bytes(recipe: Any, world: int) -> int:
    from trainprof.plan import estimate_plan

    plan = estimate_plan(recipe, world)
    if plan.get("pipeline"):  # per stage: the fullest stage is the one that must fit
        return max(st["gpu_total_bytes"] for st in plan["pipeline"]["stages"])
    return int(plan["gpu_total_per_rank"]["value"])


def _plan_flops(recipe: Any, world: int) -> float:
    from trainprof.plan import estimate_plan

    return float(estimate_plan(recipe, world)["flops"]["per_step_6n"]["value"])


class Projector:
    """Holds the source, the catalog and caches (probes, calibrations) across predictions."""

    def __init__(self, source: Source, catalog: Catalog, *, prices: dict[str, dict[str, Any]] | None = None,
                 validation: dict[str, Any] | None = None, probe: bool = True) -> None:
        self.source = source
        self.catalog = catalog
        self.prices = prices or {}
        self.validation = validation
        self.probe = probe
        self._probes: dict[Any, dict[str, float]] = {}
        self._engine_probes: dict[Any, EngineProbe] = {}
        self._pair_probes: dict[Any, tuple[dict[str, float], dict[str, float]]] = {}
        self._source_engine_probes: dict[int, dict[str, float]] = {}
        self._calibrations: dict[int, dict[str, Any]] = {}
        self._links: dict[int, Link | None] = {}
        env = source.profile["env"]
        self.source_threads = int(env.get("cpu_threads") or 1)

    # -- caches ------------------------------------------------------------------------------------

    def neighbours(self, world: int) -> int:
        """Other ranks that share this machine with each rank of a `world`-rank run: on a CPU all of them
        (their compute contends for the same cores, caches and memory bandwidth), on a GPU none."""
        return world - 1 if self.source.profile["env"].get("device_type") == "cpu" else 0

    def probe_at(self, recipe: Any, threads: int, world: int) -> dict[str, float]:
        """The recipe's model probed at its shape as one rank of a `world`-rank run on this machine would
        run it: with the other ranks' work running beside it (see `neighbours`)."""
        from trainprof.projection.calibrate import ProbeShape, probe_model

        shape = ProbeShape.of(recipe)
        key = (shape, threads, self.neighbours(world))
        if key not in self._probes:
            self._probes[key] = probe_model(recipe, shape, threads=threads, neighbours=self.neighbours(world))
        return self._probes[key]

    def probe_pair(self, target_recipe: Any, threads: int, world: int) -> tuple[dict[str, float], dict[str, float]]:
        """(source, target) probes. When the two shapes differ and their runs have as many CPU neighbours,
        both are probed in one call, their models called in turn (calibrate.probe_models): the
        prediction uses their ratio, and a slow spell of the machine during one probe taken alone moved
        it by up to 15% here. Otherwise each is probed (and cached) on its own."""
        from trainprof.projection.calibrate import ProbeShape, probe_models

        src, src_world = self.source.recipe, self.source.measured.world_size
        s_shape, t_shape = ProbeShape.of(src), ProbeShape.of(target_recipe)
        neighbours = self.neighbours(src_world)
        if s_shape == t_shape or neighbours != self.neighbours(world):
            return self.probe_at(src, threads, src_world), self.probe_at(target_recipe, threads, world)
        key = (s_shape, t_shape, threads, neighbours)
        if key not in self._pair_probes:
            s, t = probe_models([(src, s_shape), (target_recipe, t_shape)], threads=threads, neighbours=neighbours)
            self._pair_probes[key] = (s, t)
        return self._pair_probes[key]

    def engine_probe(self, target_recipe: Any, threads: int) -> EngineProbe:
        """The target's engine and task against the source's, both probed at the source's shape in one
        process (calibrate.probe_engines), with the source's CPU neighbours. A task change (pretrain,
        LoRA, QLoRA) is probed this way too: frozen weights skip their gradient GEMMs, adapters and 4-bit
        dequantization add work, and the step updates only the adapters."""
        src = self.source.recipe
        target_engine = dataclasses.replace(src, engine=target_recipe.engine, task=target_recipe.task)
        key = (_engine_key(src), _engine_key(target_recipe), _task_key(target_recipe), threads)
        if key not in self._engine_probes:
            from trainprof.projection.calibrate import probe_engines

            s, t = probe_engines([src, target_engine], threads=threads,
                                 neighbours=self.neighbours(self.source.measured.world_size))
            self._engine_probes[key] = EngineProbe(
                forward=t["engine_forward_ms"] / s["engine_forward_ms"],
                backward=t["engine_backward_ms"] / s["engine_backward_ms"],
                step=t["engine_step_ms"] / s["engine_step_ms"],
                target_step=StepProbe(step_ms=t["engine_step_ms"], state_elements=_trainable(target_engine)))
        return self._engine_probes[key]

    def engine_overhead(self, threads: int) -> tuple[float, float]:
        """(forward, backward) ms per micro batch that the source's engine adds to the bare model at the
        source's shape: its engine in a group of one minus the bare model, called in turn in one process
        (calibrate.probe_engines with `bare`: probed in separate calls, a slow spell during one of them
        entered the difference whole), beside the source's CPU neighbours; never below 0."""
        probe = self._source_engine_probe(threads)
        return (max(probe["engine_forward_ms"] - probe["model_forward_ms"], 0.0),
                max(probe["engine_backward_ms"] - probe["model_backward_ms"], 0.0))

    def source_step(self, threads: int) -> StepProbe:
        """The source's engine's step() in a group of one (the probe `engine_overhead` makes)."""
        return StepProbe(step_ms=self._source_engine_probe(threads)["engine_step_ms"],
                         state_elements=float(self.source.profile["params"]["trainable"]))

    def _source_engine_probe(self, threads: int) -> dict[str, float]:
        if threads not in self._source_engine_probes:
            from trainprof.projection.calibrate import probe_engines

            src, world = self.source.recipe, self.source.measured.world_size
            (probe,) = probe_engines([src], threads=threads, neighbours=self.neighbours(world), bare=True)
            self._source_engine_probes[threads] = probe
        return self._source_engine_probes[threads]

    def calibration_at(self, threads: int) -> dict[str, Any]:
        from trainprof.projection.calibrate import calibrate

        if threads not in self._calibrations:
            self._calibrations[threads] = calibrate("cpu", dtype=self.source.recipe.model.dtype, threads=threads)
        return self._calibrations[threads]

    def _memory_gbps(self, same_device: bool) -> float | None:
        """The source machine's memory bandwidth: its calibration.json, or measured now on this machine."""
        if self.source.calibration is not None:
            return self.source.calibration["memory"]["gbps"]
        if same_device and _same_machine_as_source(self.source):
            return self.calibration_at(self.source_threads)["memory"]["gbps"]
        return None

    def gloo_link(self, world: int) -> Link | None:
        from trainprof.projection.calibrate import gloo_collectives

        if world not in self._links:
            cal = self.source.calibration
            fits = None
            if cal and cal.get("collectives") and cal["collectives"]["world_size"] == world \
                    and cal["collectives"].get("backend") == "gloo":
                fits = cal["collectives"]["ops"]
            else:
                fits = gloo_collectives(world)["ops"]
            usable = [f for f in fits.values() if f]
            self._links[world] = Link(
                alpha_ms=sorted(f["alpha_ms"] for f in usable)[len(usable) // 2],
                busbw_gbps=sorted(f["busbw_gbps"] for f in usable)[len(usable) // 2],
                source=f"gloo over {world} local processes, measured (median of {len(usable)} collective fits)",
                measured_here=True)
        return self._links[world]

    # -- predictions -------------------------------------------------------------------------------

    def predict(self, target_recipe: Any, *, machine: str = THIS, world: int | None = None, gpus_per_node: int = 8,
                threads: int | None = None, tokens: float | None = None, overrides: list[str] | None = None
                ) -> dict[str, Any]:
        """One prediction dict (see the module docstring for its fields)."""
        src = self.source
        m = src.measured
        world = world or m.world_size
        trainable = int(src.profile["params"]["trainable"])
        task_changed = _task_key(src.recipe) != _task_key(target_recipe)
        trainable_t = _trainable(target_recipe) if task_changed else trainable
        change = Change(
            micro_batch=target_recipe.train.micro_batch_size, seq_len=target_recipe.data.seq_len,
            grad_accum=target_recipe.train.grad_accum, recompute=target_recipe.model.recompute,
            attention=target_recipe.model.attention, zero_stage=_zero(target_recipe), engine=target_recipe.engine.kind,
            world_size=world, state_elements_per_rank=_state_elements_per_rank(target_recipe, trainable_t, world),
            source_state_elements_per_rank=_state_elements_per_rank(src.recipe, trainable, m.world_size),
            trainable_param_bytes=trainable_t * m.dtype_bytes if task_changed else None,
            source_engine=src.recipe.engine.kind,
            **_zero_settings(target_recipe))
        assumptions: list[str] = []
        reasons: dict[str, str] = {}
        unmodelled = unmodelled_changes(src.recipe, target_recipe)
        if unmodelled:
            reasons["step_ms"] = (f"the step model does not re-derive a change of {', '.join(unmodelled)}: measure "
                                  "a run with it (trainprof.run) and project from that run")
        elif why := task_change_not_derived(change):
            reasons["step_ms"] = why
        elif task_changed and machine != THIS:
            reasons["step_ms"] = ("a task change (pretrain, LoRA, QLoRA) is probed on the source's machine only: "
                                  "measure a run of the task there (trainprof.run) and project that run to other hardware")
        target: Target | None = None
        source_machine = target_machine = None
        probes = None
        engine: EngineProbe | None = None
        step_probe: StepProbe | None = None
        engine_overhead: tuple[float, float] | None = None
        link: Link | None = None
        same_device = machine == THIS
        if same_device:
            from trainprof.models import resolve_shape
            from trainprof.projection.calibrate import ProbeShape

            shape = resolve_shape(target_recipe.model)
            layer_params = 4 * shape.hidden_size ** 2 + 3 * shape.hidden_size * shape.intermediate_size
            probe_threads = self.source_threads
            refused = "step_ms" in reasons  # nothing to probe for a step that will not be predicted
            if not refused and self.probe and layer_params <= PROBE_MAX_LAYER_PARAMS and _same_machine_as_source(src):
                probes = self.probe_pair(target_recipe, probe_threads, world)
                try:
                    if _engine_key(src.recipe) != _engine_key(target_recipe) or task_changed:
                        engine = self.engine_probe(target_recipe, probe_threads or 1)
                    if (ProbeShape.of(src.recipe), self.neighbours(m.world_size)) != \
                            (ProbeShape.of(target_recipe), self.neighbours(world)):  # the probes differ
                        engine_overhead = self.engine_overhead(probe_threads or 1)
                    if engine is None and world == 1 < m.world_size and _zero(src.recipe) == 3:
                        step_probe = self.source_step(probe_threads or 1)  # one rank: no gathers after the step
                except ValueError as err:
                    reasons["step_ms"] = f"the engine could not be probed: {err}"
            elif not refused and (_shape_changed(src.recipe, target_recipe) or task_changed):
                reasons["step_ms"] = (f"the {'task' if task_changed else 'shape'} changed and the model cannot be "
                                      "probed here (another machine, a model too large to probe on CPU, or --no-probe); "
                                      "run on the source machine")
            if threads and threads != self.source_threads:
                source_machine = machine_from_calibration(self.calibration_at(self.source_threads),
                                                          f"this machine, {self.source_threads} threads")
                target_machine = machine_from_calibration(self.calibration_at(threads), f"this machine, {threads} threads")
            if world > 1 and (world != m.world_size or derives_zero_collectives(change, _zero(src.recipe))
                              or derives_ddp_collectives(change, m.world_size)):
                link = self.gloo_link(world)
        else:
            target = self.catalog.resolve(machine)
            gpus_per_node = target.gpus_per_node or gpus_per_node
            cal = ensure_calibration(src)
            if cal is None:
                reasons["step_ms"] = ("the source run has no calibration.json and was made on another machine; "
                                      "run `trainprof project` once where the run was made, or copy its calibration")
            else:
                source_machine = machine_from_calibration(cal, "source")
                source_key = find_accelerator(self.catalog, src.profile["env"].get("device", ""))
                target_machine, notes = machine_from_target(
                    target, target_recipe.model.dtype, measured=source_machine,
                    source=self.catalog.resolve(source_key) if source_key else None)
                assumptions.extend(notes)
                if not (target_machine.matmul_tflops and target_machine.memory_gbps):
                    reasons["step_ms"] = f"{machine} lacks a matmul rate or memory bandwidth in the catalog"
            link = _catalog_link(target, world, gpus_per_node)
            if m.kernel_ms is not None and cal is not None:
                busy = sum(mm + rest for mm, rest in m.kernel_ms.values())
                host = (cal.get("host") or {}).get("us_per_op")
                assumptions.append(
                    f"the source's GPU ran kernels {min(busy / m.step_ms, 1.0):.0%} of the step (operator trace); the "
                    "rest, the GPU waiting for its host (Python, hooks, engine, kernel launches), is kept as measured: "
                    "the target's host CPU is assumed as fast as the source's"
                    + (f" ({host:.2f} µs per tiny op dispatch, {src.profile['env'].get('host_cpu', 'host CPU not recorded')})"
                       if host else ""))
            if _shape_changed(src.recipe, target_recipe):
                assumptions.append("shape changes on another machine: compute scaled by the analytic FLOP ratio")
            if _engine_key(src.recipe) != _engine_key(target_recipe):
                assumptions.append("engine change on another machine not modelled: compute as under the source's "
                                   "engine (probe it on the source machine with --to this)")
        phases: dict[str, float] | None = None
        if "step_ms" not in reasons:
            try:
                phases, notes = predict_phases(m, change, probes=probes, num_layers=_num_layers(target_recipe),
                                               source_machine=source_machine, target_machine=target_machine,
                                               link=link, source_zero_stage=_zero(src.recipe),
                                               memory_gbps=self._memory_gbps(same_device), engine=engine,
                                               step_probe=step_probe, engine_overhead=engine_overhead)
                assumptions.extend(notes)
                if not same_device and _shape_changed(src.recipe, target_recipe):
                    ratio = _plan_flops(target_recipe, world) / world / (_plan_flops(src.recipe, m.world_size) / m.world_size)
                    for ph in ("forward", "backward", "recompute"):
                        phases[ph] *= ratio
            except ValueError as err:
                reasons["step_ms"] = str(err)
        if phases is not None and any(math.isnan(v) for v in phases.values()):
            reasons["step_ms"] = "; ".join(a for a in assumptions if a.startswith("comm:")) or "comm not predictable"
            phases = None
        pipeline_block, unattributed = None, m.unattributed_ms
        if pipeline.is_pipeline(src.profile):
            why = pipeline.check_world(src.profile, world)
            if why:
                reasons["step_ms"], phases = why, None
            elif phases is not None:  # the step model's unattributed holds the measured bubble: swap it for the prediction
                bubble, pipeline_block, notes = pipeline.pipeline_term(src.profile, m.phases_ms, phases, target_recipe, link)
                unattributed -= pipeline_block["bubble_ms_measured"]
                assumptions.extend(notes)
        step_ms = None
        if phases is not None:
            residual = residual_ms(m, phases, unattributed)
            if pipeline_block is not None:
                phases["pipeline_bubble"] = bubble
            step_ms = sum(phases.values()) + residual
            assumptions.append(f"unattributed {residual:.2f} ms (the source's {unattributed:.2f} ms, the median "
                               "step minus the per-phase medians, scaled with the phases); other as measured")
            if phases["data_wait"] > DATA_WAIT_DOMINATES * step_ms:
                assumptions.append(f"data wait kept as measured is {100 * phases['data_wait'] / step_ms:.0f}% of the "
                                   "predicted step: it would dominate; raise data.num_workers")
        tokens_per_step = (target_recipe.train.micro_batch_size * target_recipe.train.grad_accum
                           * target_recipe.data.seq_len * (1 if pipeline.is_pipeline(src.profile) else world))
        tps = tokens_per_step / (step_ms / 1e3) if step_ms else None
        memory, fits, fit_note = self._memory(target_recipe, world, target, overrides or [])
        if target is None and memory is not None and src.recipe.engine.kind != target_recipe.engine.kind:
            assumptions.append(
                "memory: the measured peak's fixed part (libraries, the engine's own buffers) is kept, but it belongs "
                f"to the source's engine ({src.recipe.engine.kind}); on the quickstart DeepSpeed's runs peaked 60 MiB "
                "of RSS above DDP's where the plan's formulas differ by 5 MiB (scripts/bench_projection.py, "
                "2026-11-24), so expect an error of about that size")
        pred: dict[str, Any] = {
            "hardware": machine if machine != THIS else f"this ({src.profile['env']['device']}"
                                                        + (f", {threads} threads" if threads else "") + ")",
            "nodes": max(1, math.ceil(world / gpus_per_node)) if target is not None else 1,
            "gpus_per_node": gpus_per_node if target is not None else world,
            "world_size": world,
            "overrides": list(overrides or []),
            "step_ms": step_ms,
            "phases_ms": phases,
            "tokens_per_step": tokens_per_step,
            "tokens_per_s": tps,
            "mfu": None,
            "scaling_efficiency": None,
            "memory_per_rank_bytes": memory,
            "fits": fits,
            "time_to_train_s": (tokens / tps) if (tokens and tps) else None,
            "cost_per_million_tokens_usd": None,
            "expected_error_pct": None,
            "assumptions": assumptions,
        }
        if fit_note:
            pred["fit_suggestion"] = fit_note
        if pipeline_block is not None:
            pred["pipeline"] = pipeline_block
        if reasons:
            pred["reasons"] = reasons
        if target is not None and tps:
            peak = target.figure("peak_bf16_dense_tflops" if target_recipe.model.dtype in ("bf16", "fp16")
                                 else "peak_fp32_tflops")
            if peak:
                model_flops = _plan_flops(target_recipe, world)
                pred["mfu"] = model_flops / (step_ms / 1e3) / (world * peak * 1e12)
                pred["mfu_convention"] = "PaLM 6N + 12LHQT model FLOPs (trainprof plan) over the datasheet dense peak"
        elif target is None:
            reasons["mfu"] = "no datasheet peak for this machine (CPU)"
            pred["reasons"] = reasons
        price = self.prices.get(machine)
        if price and tps:
            usd_per_s = price["usd_per_gpu_hour"] * world / 3600
            pred["cost_per_million_tokens_usd"] = usd_per_s / tps * 1e6
            pred["cost_to_train_usd"] = usd_per_s * pred["time_to_train_s"] if pred["time_to_train_s"] else None
            pred["price"] = price
        else:
            reasons["cost_per_million_tokens_usd"] = (f"no price for '{machine}': pass --price {machine}=USD_PER_GPU_HOUR "
                                                      "or --prices FILE (with source and date)")
            pred["reasons"] = reasons
        kinds = change_kinds(src.recipe, target_recipe, m.world_size, world, machine,
                             src.profile["env"].get("device_type", "cpu"))
        if threads and threads != self.source_threads:
            kinds = [k for k in kinds if k != "none"] + ["threads"]
        pred["change_kinds"] = kinds
        err, why = expected_error(kinds, self.validation)
        pred["expected_error_pct"] = err
        pred["expected_error_source"] = why
        return pred

    def _memory(self, recipe: Any, world: int, target: Target | None, overrides: list[str]
                ) -> tuple[int | None, bool | None, list[str] | None]:
        m, src = self.source.measured, self.source
        planned = _plan_bytes(recipe, world)
        if target is None:
            if m.peak_memory_bytes is None:
                return None, None, None
            # measured + (plan(target) - plan(source)): the process's fixed part (libraries, CUDA context,
            # allocator slack) stays as measured, what the formulas see moves with the recipe
            return int(m.peak_memory_bytes + planned - _plan_bytes(src.recipe, m.world_size)), None, None
        capacity = target.figure("memory_gb")
        if capacity is None:
            return planned, None, None
        fits = planned <= capacity * 1e9
        if fits:
            return planned, True, None
        from trainprof.recipe import load_recipe

        for extra in FIT_SUGGESTIONS:  # the target recipe (the run's, with the user's overrides) plus one change
            try:
                candidate = load_recipe(src.run_dir / "recipe.yaml", [*overrides, *extra])
            except Exception:  # a suggestion the recipe rules refuse is skipped
                continue
            if _plan_bytes(candidate, world) <= capacity * 1e9:
                return planned, False, extra
        return planned, False, None


def _task_key(recipe: Any) -> str:
    """What of the recipe's task decides the step's work: the kind, and the adapters and quantization it uses."""
    t = recipe.task
    return repr((t.kind, dataclasses.asdict(t.lora) if t.kind != "pretrain" else None,
                 dataclasses.asdict(t.quant) if t.kind == "qlora" else None))


def _trainable(recipe: Any) -> float:
    """Trainable parameters of the recipe's model: all of them in pretraining, the adapters' under LoRA
    (trainprof.plan.analytic_params: peft's A and B matrices per targeted linear)."""
    from trainprof.models import resolve_shape
    from trainprof.plan import analytic_params

    return float(analytic_params(resolve_shape(recipe.model), recipe)["trainable"])


# recipe keys the step model re-derives (besides the world size, threads and the machine): the shape,
# the engine and the task (the engine probe builds the target's)
MODELLED_KEYS = ("train.micro_batch_size", "data.seq_len", "train.grad_accum", "model.recompute", "model.attention",
                 "engine.zero_stage", "engine.offload", "engine.kind", "task.")
# keys that do not change the work of a step: how long a run is, its seed, its output, the optimizer's
# hyperparameters (not its kind), what the profiler records
STEP_NEUTRAL_KEYS = ("train.steps", "train.warmup_steps", "train.seed", "train.memory_cap_gb", "optimizer.lr",
                     "optimizer.weight_decay", "optimizer.betas", "optimizer.eps", "data.synthetic_pattern_len",
                     "profile.", "output.")


def _key_modelled(key: str) -> bool:
    return key.startswith(MODELLED_KEYS + STEP_NEUTRAL_KEYS)


def unmodelled_changes(source_recipe: Any, target_recipe: Any) -> list[str]:
    """Recipe keys (dotted) whose value differs between the source and the target, that change the
    work of a step, and that the step model does not re-derive (model size or dtype, optimizer kind,
    pipeline layout, DeepSpeed's own settings, data loading): a prediction across them is null."""
    from trainprof.analysis.diff import recipe_changes

    return sorted(k for k, _, _ in recipe_changes(source_recipe.to_dict(), target_recipe.to_dict())
                  if not _key_modelled(k))


def _engine_key(recipe: Any) -> tuple[str, int, str]:
    e = recipe.engine
    return (e.kind, e.zero_stage if e.kind == "deepspeed" else 0, e.offload if e.kind == "deepspeed" else "none")


def _zero_settings(recipe: Any) -> dict[str, Any]:
    """The recipe's DeepSpeed settings that shape ZeRO stage 0-2's collectives (Change's fields; DeepSpeed's
    defaults where the recipe's `deepspeed` block sets none). LoRA trains only adapter matrices: one
    parameter group (trainprof.engines.optim.param_groups)."""
    zero = (recipe.deepspeed or {}).get("zero_optimization") or {}
    out: dict[str, Any] = {"param_groups": 1 if recipe.task.kind in ("lora", "qlora") else 2}
    if zero.get("reduce_bucket_size") is not None:
        out["reduce_bucket_elements"] = float(zero["reduce_bucket_size"])
    if zero.get("allgather_bucket_size") is not None:
        out["allgather_bucket_elements"] = float(zero["allgather_bucket_size"])
    out["overlap_comm"] = bool(zero.get("overlap_comm", _zero(recipe) == 3))  # DeepSpeed: on for stage 3 only
    return out


def _zero(recipe: Any) -> int:
    return recipe.engine.zero_stage if recipe.engine.kind == "deepspeed" else 0


def _num_layers(recipe: Any) -> int:
    from trainprof.models import resolve_shape

    return resolve_shape(recipe.model).num_layers


def _shape_changed(a: Any, b: Any) -> bool:
    return (a.train.micro_batch_size, a.data.seq_len, a.model.attention, a.model.recompute) != \
           (b.train.micro_batch_size, b.data.seq_len, b.model.attention, b.model.recompute)


def _same_machine_as_source(src: Source) -> bool:
    from trainprof.env import collect_env

    env = src.profile["env"]
    return collect_env(_torch_device(env), 1)["device"] == env["device"]


# ---------------------------------------------------------------------------------------------
# The whole projection
# ---------------------------------------------------------------------------------------------

def project(run_dir: str | Path, *, targets: list[str] | None = None, nodes: list[int] | None = None,
            gpus_per_node: int = 8, nproc: list[int] | None = None, overrides: list[str] | None = None,
            tokens: float | None = None, catalog_file: str | None = None, prices: dict[str, Any] | None = None,
            threads: int | None = None, probe: bool = True, progress: bool = False) -> dict[str, Any]:
    """Predictions for every target and size (see the module docstring).

    Args:
        run_dir: the measured run.
        targets: catalog keys, or "this" (the source's machine; default).
        nodes, gpus_per_node: sizes for catalog targets (world = nodes * gpus_per_node).
        nproc: world sizes for "this" (default: the source's).
        overrides: recipe key=value changes, as everywhere else.
        tokens: tokens to train, for time and cost.
        catalog_file: a user catalog merged over the package's.
        prices: from catalog.load_prices.
        threads: for "this", intra-op threads of the target (a different CPU, calibrated here).
        probe: time the recipe's layers at both shapes on this machine for same-machine changes.
        progress: a tqdm bar over predictions.
    """
    from tqdm import tqdm

    source, target_recipe = load_source(run_dir, overrides)
    catalog = load_catalog(catalog_file)
    projector = Projector(source, catalog, prices=prices, validation=load_validation(), probe=probe)
    targets = targets or [THIS]
    jobs: list[tuple[str, int]] = []
    for t in targets:
        if t == THIS:
            jobs.extend((t, n) for n in (nproc or [source.measured.world_size]))
        else:
            catalog.resolve(t)  # unknown names fail before any work
            jobs.extend((t, n * gpus_per_node) for n in (nodes or [1]))
    predictions = []
    for machine, world in tqdm(jobs, desc="project", unit="prediction", disable=not progress):
        predictions.append(projector.predict(target_recipe, machine=machine, world=world, gpus_per_node=gpus_per_node,
                                             threads=threads if machine == THIS else None, tokens=tokens,
                                             overrides=overrides))
    _scaling_efficiency(projector, target_recipe, predictions, gpus_per_node, threads)
    _rank(predictions)
    m = source.measured
    return {
        "projection_version": PROJECTION_VERSION,
        "source": {
            "run_dir": str(source.run_dir), "device": source.profile["env"]["device"],
            "world_size": m.world_size, "timer": source.profile["env"]["timer"],
            "step_ms": m.step_ms, "phases_ms": m.phases_ms, "unattributed_ms": m.unattributed_ms,
            "tokens_per_s": source.profile["summary"].get("tokens_per_s"),
            "peak_memory_bytes": m.peak_memory_bytes, "calibration": source.calibration is not None,
            "recipe": source.profile["recipe"],
        },
        "tokens": tokens,
        "catalog": catalog.files,
        "validation": {k: projector.validation.get(k) for k in ("measured_on", "command", "by_kind")}
        if projector.validation else None,
        "method": __import__("trainprof.projection.stepmodel", fromlist=["x"]).__doc__.strip(),
        "predictions": predictions,
    }


def project_advice(run_dir: str | Path, *, probe: bool = True, progress: bool = False) -> list[dict[str, Any]]:
    """The advisor's advice for a run (trainprof.report.advisor), each with its recipe overrides projected
    on the run's own machine: predicted step and tokens/s, and the gain over the same-settings
    prediction (which reproduces the measured step), or null with the reason."""
    from tqdm import tqdm

    from trainprof.recipe import load_recipe
    from trainprof.report.advisor import advise, override_args

    source, recipe = load_source(run_dir)
    projector = Projector(source, load_catalog(), validation=load_validation(), probe=probe)
    base = projector.predict(recipe)
    out = []
    for a in tqdm(advise(source.profile)["advice"], desc="advice", unit="advice", disable=not progress):
        overrides = override_args(a["overrides"])
        row: dict[str, Any] = {"rule": a["rule"], "overrides": overrides, "predicted_step_ms": None,
                               "predicted_tokens_per_s": None, "predicted_gain": None, "expected_error_pct": None}
        unmodelled = [k for k in a["overrides"] if not _key_modelled(k)]
        if not overrides:
            row["reason"] = "the advice changes no recipe key"
        elif unmodelled:
            row["reason"] = f"the step model does not model {', '.join(unmodelled)}"
        else:
            try:
                target = load_recipe(source.run_dir / "recipe.yaml", overrides)
            except Exception as err:  # noqa: BLE001  a recipe rule refusing the combination is the answer
                row["reason"] = f"the recipe refuses {' '.join(overrides)}: {str(err).splitlines()[0]}"
            else:
                pred = projector.predict(target, overrides=overrides)
                row.update(predicted_step_ms=pred["step_ms"], predicted_tokens_per_s=pred["tokens_per_s"],
                           expected_error_pct=pred["expected_error_pct"],
                           expected_error_source=pred["expected_error_source"], phases_ms=pred["phases_ms"],
                           assumptions=pred["assumptions"])
                if pred["tokens_per_s"] and base["tokens_per_s"]:
                    row["predicted_gain"] = pred["tokens_per_s"] / base["tokens_per_s"] - 1
                    row["predicted_gain_convention"] = "predicted tokens/s over the same-settings prediction, minus 1"
                else:
                    row["reason"] = (pred.get("reasons") or {}).get("step_ms", "no step time predicted")
        out.append(row)
    return out


def _scaling_efficiency(projector: Projector, recipe: Any, predictions: list[dict[str, Any]], gpus_per_node: int,
                        threads: int | None) -> None:
    """tput(N) / (N * tput(1)) per hardware, tput(1) predicted on the same hardware with one GPU."""
    single: dict[str, float | None] = {}
    for p in predictions:
        machine = p["hardware"] if not p["hardware"].startswith("this") else THIS
        if p["tokens_per_s"] is None:
            continue
        if p["world_size"] == 1:
            single[machine] = p["tokens_per_s"]
        if machine not in single:
            one = projector.predict(recipe, machine=machine, world=1, gpus_per_node=gpus_per_node,
                                    threads=threads if machine == THIS else None)
            single[machine] = one["tokens_per_s"]
        if single[machine]:
            p["scaling_efficiency"] = p["tokens_per_s"] / (p["world_size"] * single[machine])


def _rank(predictions: list[dict[str, Any]]) -> None:
    """rank 1 = best: cheapest per million tokens when every fitting prediction has a price, else
    the highest tokens/s; predictions that do not fit or cannot be predicted come last (rank null)."""
    usable = [p for p in predictions if p["tokens_per_s"] and p["fits"] is not False]
    priced = all(p["cost_per_million_tokens_usd"] is not None for p in usable)
    key = (lambda p: p["cost_per_million_tokens_usd"]) if (usable and priced) else (lambda p: -p["tokens_per_s"])
    for i, p in enumerate(sorted(usable, key=key), 1):
        p["rank"] = i
        p["ranked_by"] = "cost_per_million_tokens_usd" if priced else "tokens_per_s"
    for p in predictions:
        p.setdefault("rank", None)


__all__ = ["project", "Projector", "load_source", "ProjectionError", "CatalogError", "PHASES",
           "find_accelerator"]
