"""The Projector: one measured run (its Source) -> one prediction for a target recipe, machine and world
size: step and phases (stepmodel), memory and fit (trainprof plan and the run's measured peak), MFU,
cost, confidence and assumptions. `project.py` runs it over many targets and sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

from trainprof.env import threads_when_launched
from trainprof.hardware import Catalog, Target, find_accelerator
from trainprof.analysis.gpu_busy import HOST_BOUND_BUSY
from trainprof.projection import pipeline
from trainprof.projection.assumptions import Assumption, assume
from trainprof.projection.census import census, trainable_tensors, zero3_settings, zero3_traffic
from trainprof.projection.changes import (KINDS, THIS, change_kinds, engine_key, model_shape, offload_of,
                                          task_key, unmodelled_changes, zero_stage_of)
from trainprof.projection.comm import CommTarget, Link
from trainprof.projection.compute import EngineProbe, Parts, StepProbe
from trainprof.projection.gemm import Work
from trainprof.projection.machines import (by_host_path, catalog_link, gpu_host, gpu_ops_per_layer, host_key,
                                           host_pace, machine_from_calibration, machine_from_target, measured_link,
                                           missing_link, reference_hosts)
from trainprof.projection.prices import price_for
from trainprof.projection.source import (PROBES_FILE, Source, ensure_calibration, kept_probe, no_calibration,
                                        same_machine_as_source)
from trainprof.projection.stepmodel import Change, Inputs, predict_phases, residual_ms
from trainprof.projection.validation import (CARRIED_SHARE, COMM_BOUND_MARK, COMM_BOUND_SHARE, HOST_BOUND_MARK,
                                             confidence, cpu_to_gpu_task_error)
from trainprof.recipe import shape_label
from trainprof.shapes import DTYPE_BYTES

PROJECTION_VERSION = 2  # 2: assumptions as records, confidence, model-size changes, NCCL latency
MFU_CONVENTION = ("PaLM model FLOPs (6N + 12LHQT a token; 4N for a LoRA/QLoRA frozen base, as the run report counts "
                  "them; trainprof plan) over the datasheet dense peak")
DATA_WAIT_DOMINATES = 0.2  # flag data wait above this share of the predicted step
UNEVEN_RANKS = 0.05  # ranks busier than the least busy by more than this: a smaller world is told its pace is kept
# recipe changes tried, in order, when a prediction does not fit the target's memory: each alone, then
# together, the last the least memory a recipe can ask for (DeepSpeed's keys: engine.kind=deepspeed is
# added for a source on another engine)
FIT_SUGGESTIONS = (["engine.zero_stage=3"], ["model.recompute=true"], ["engine.offload=optimizer"],
                   ["engine.zero_stage=3", "engine.offload=optimizer+params"],
                   ["engine.zero_stage=3", "model.recompute=true"],
                   ["engine.zero_stage=3", "model.recompute=true", "engine.offload=optimizer"],
                   ["engine.zero_stage=3", "model.recompute=true", "engine.offload=optimizer+params"],
                   ["engine.zero_stage=3", "model.recompute=true", "engine.offload=optimizer+params",
                    "train.micro_batch_size=1"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResidentProbe:
    """What a fresh process of the source's recipe and one of the target's held besides what the plan
    counts (peak RSS minus the plan's resident figure), as Projector.resident_fixed probed them."""

    source_bytes: int
    target_bytes: int
    layers: int | None  # the decoder layers both were built with; None: the source's model, two engines


@dataclasses.dataclass(kw_only=True)
class TargetRun:
    """One prediction's target: the recipe, where it runs, and what changes from the source."""

    recipe: Any
    machine: str
    world: int
    gpus_per_node: int
    threads: int | None
    hardware: Target | None  # a catalog target; None: the source's machine
    kinds: list[str]
    change: Change

    @property
    def same_machine(self) -> bool:
        return self.machine == THIS


class Projector:
    """Holds the source, the catalog and caches (probes, calibrations) across predictions."""

    def __init__(self, source: Source, catalog: Catalog, *, prices: dict[str, dict[str, Any]] | None = None,
                 validation: dict[str, Any] | None = None, probe: bool = True) -> None:
        self.source = source
        self.catalog = catalog
        self.prices = prices or {}
        self.validation = validation
        self.probe = probe
        self._cache: dict[Any, Any] = {}
        self._resident_failed: str | None = None  # why engine_fixed's probe failed, for the memory note
        self._kept_from: dict[Any, tuple[str, str]] = {}  # probe key -> (what, when timed): read from probes.json
        self._used: list[Any] = []  # the probe keys the prediction under way used
        self._host_pace: dict[str, Any] | None = None  # the host per call the prediction under way assumed
        self._fit_advice: dict[str, Any] | None = None  # what a catalog target that does not fit was tried with
        env = source.profile["env"]
        self.source_threads = int(env.get("cpu_threads") or 1)
        import torch

        self.default_threads = torch.get_num_threads()  # one process's, before any probe or calibration here
        self.source_census = census(source.recipe)
        self.source_gpu = find_accelerator(catalog, env.get("device", ""))  # None: a CPU, or a GPU not catalogued
        from trainprof.projection.probes import Neighbours

        self.neighbours = Neighbours()  # the probes' busy neighbours, kept across them until close()

    def __enter__(self) -> "Projector":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stops the probes' busy neighbours."""
        self.neighbours.close()

    # -- one prediction ----------------------------------------------------------------------------

    def predict(self, target_recipe: Any, *, machine: str = THIS, world: int | None = None, gpus_per_node: int = 8,
                threads: int | None = None, tokens: float | None = None, overrides: list[str] | None = None
                ) -> dict[str, Any]:
        """One prediction dict (see the module docstring for its fields)."""
        m, notes = self.source.measured, []
        world = world or m.world_size
        if threads is None and machine == THIS and m.device_type == "cpu" and world != m.world_size:
            launched, why = threads_when_launched(world, self.default_threads)
            if launched != self.source_threads:  # 2 ranks on a 2-core machine do not each get both cores
                threads = launched
                notes.append(assume("threads_launched", world=world, threads=launched, why=why,
                                    source_threads=self.source_threads))
        t = self._target(target_recipe, machine, world, gpus_per_node, threads)
        reasons: dict[str, str] = {}
        self._refuse(t, reasons)
        self._used, self._host_pace, self._fit_advice = [], None, None
        inputs = self._inputs_here(t, reasons, notes) if t.same_machine else self._inputs_there(t, reasons, notes)
        phases, step_ms, pipeline_block = self._step(t, inputs, reasons, notes)
        notes += [assume("probe_kept", what=what, made_utc=when, file=PROBES_FILE)
                  for what, when in (self._kept_from[k] for k in dict.fromkeys(self._used) if k in self._kept_from)]
        return self._figures(t, phases, step_ms, pipeline_block, notes, reasons, tokens, overrides or [])

    def memory_per_rank(self, target_recipe: Any, *, machine: str = THIS, world: int | None = None) -> int | None:
        """The memory per rank a prediction would give, without predicting its step (which on the source's machine
        may probe for minutes): what a search checks first."""
        hardware = None if machine == THIS else self.catalog.resolve(machine)
        return self._memory(target_recipe, world or self.source.measured.world_size, hardware, [])[0]

    def _target(self, recipe: Any, machine: str, world: int, gpus_per_node: int, threads: int | None) -> TargetRun:
        src, m = self.source, self.source.measured
        hardware = None if machine == THIS else self.catalog.resolve(machine)
        if hardware is not None:
            gpus_per_node = hardware.gpus_per_node or gpus_per_node
        kinds = change_kinds(src.recipe, recipe, m.world_size, world, machine,
                             src.profile["env"].get("device_type", "cpu"))
        if threads and threads != self.source_threads:
            kinds = [k for k in kinds if k != "none"] + ["threads"]
        tgt_census = census(recipe)
        other_params = "task" in kinds or "model_size" in kinds
        trainable_t = tgt_census.trainable if other_params else float(src.profile["params"]["trainable"])
        dtype_bytes = DTYPE_BYTES[recipe.model.dtype] if "dtype" in kinds else None
        comm = CommTarget(
            engine=recipe.engine.kind, zero_stage=zero_stage_of(recipe), world_size=world,
            grad_accum=recipe.train.grad_accum,
            source_engine=src.recipe.engine.kind, source_zero_stage=zero_stage_of(src.recipe),
            trainable_param_bytes=trainable_t * (dtype_bytes or m.dtype_bytes) if other_params else None,
            dtype_bytes=dtype_bytes,
            census=tgt_census, source_census=self.source_census,
            zero3=zero3_settings(recipe), source_zero3=zero3_settings(src.recipe),
            reshard_after_forward=getattr(recipe.engine, "reshard_after_forward", True),
            # a GPU's collectives run beside its compute: priced so on a catalog target, and on the source's own
            # machine where the run measured none at the target's world size
            cross_machine=hardware is not None or (m.device_type != "cpu" and world != m.world_size),
            **_zero_buckets(recipe))
        # on the source's machine a dtype change is the engine probe's, so the reshaped work stays in the source's
        change = Change(work=Work.of(recipe if hardware is not None else in_dtype(recipe, src.recipe.model.dtype)),
                        source_work=Work.of(src.recipe), grad_accum=recipe.train.grad_accum,
                        recompute=recipe.model.recompute,
                        state_elements_per_rank=_state_elements_per_rank(recipe, trainable_t, world),
                        source_state_elements_per_rank=_state_elements_per_rank(
                            src.recipe, float(src.profile["params"]["trainable"]), m.world_size),
                        comm=comm)
        return TargetRun(recipe=recipe, machine=machine, world=world, gpus_per_node=gpus_per_node, threads=threads,
                       hardware=hardware, kinds=kinds, change=change)

    def _refuse(self, t: TargetRun, reasons: dict[str, str]) -> None:
        """Changes the step model does not re-derive make the step null, with what to do."""
        unmodelled = unmodelled_changes(self.source.recipe, t.recipe)
        if unmodelled:
            reasons["step_ms"] = (f"the step model does not re-derive a change of {', '.join(unmodelled)}: measure "
                                  "a run with it (trainprof.run) and project from that run")
        elif "megatron" in (t.recipe.engine.kind, self.source.recipe.engine.kind) and "engine" in t.kinds:
            reasons["step_ms"] = ("a change to or from Megatron's engine is not derived (its tensor- and pipeline-"
                                  "parallel collectives and its own kernels): measure a run of the target engine")
        elif not t.same_machine and (offload_of(t.recipe) != "none" or (
                self.source.measured.device_type == "cuda" and offload_of(self.source.recipe) != "none")):
            reasons["step_ms"] = ("engine.offload on a GPU moves the optimizer step to the host CPU (DeepSpeed's CPU "
                                  "Adam; torch's Adam for FSDP) and the gradients and parameters over PCIe, and the "
                                  "catalog describes no GPU machine's host: measure the offload on the source's "
                                  "machine (--to this) or on a GPU machine with the host you will use")
        elif "dtype" in t.kinds and self.source.measured.device_type == "cuda":
            reasons["step_ms"] = ("a GPU source's kernels and operator calls were recorded at its model.dtype "
                                  "(autocast's casts, the 16-bit optimizer's copies): measure a run at the target "
                                  "dtype and project from that run")
        elif "threads" in t.kinds and self.source.measured.device_type == "cuda":
            reasons["step_ms"] = ("--threads sets the intra-op threads of a CPU run, and this run computed on a GPU: "
                                  "project it without --threads")
        elif "compile" in t.kinds and not t.same_machine:
            reasons["step_ms"] = ("torch.compile's effect is probed on the source's machine only (what inductor "
                                  "fuses on the target's GPU cannot be derived): project the compile change there, "
                                  "or measure a compiled run and project that run to other hardware")

    # -- inputs on the source's machine -------------------------------------------------------------

    def _inputs_here(self, t: TargetRun, reasons: dict[str, str], notes: list[Assumption]) -> Inputs:
        """Probes (of a CPU run), calibrations and the link (gloo between this CPU's processes, or a GPU run's
        catalogued links) for a prediction on the source's machine."""
        src, m = self.source, self.source.measured
        inputs = Inputs(memory_gbps=self._memory_gbps())
        if t.world > 1 and (t.world != m.world_size or set(t.kinds) & {"zero_stage", "engine", "task", "model_size",
                                                                         "offload", "dtype"}):
            inputs.link = self.gloo_link(t.world) if m.device_type == "cpu" else self._gpu_link(t, reasons)
        if "step_ms" in reasons:
            return inputs  # nothing to probe for a step that will not be predicted
        busy = m.ranks_busy_ms or {}
        if t.world < len(busy):
            slowest, fastest_ms = max(busy, key=busy.__getitem__), min(busy.values())
            if busy[slowest] > (1 + UNEVEN_RANKS) * fastest_ms:
                notes.append(assume("ranks_uneven", fastest_ms=fastest_ms, slowest_ms=busy[slowest],
                                    slowest_rank=slowest, spread=busy[slowest] / fastest_ms - 1, world=t.world))
        reshaped = any(KINDS[k].reshapes for k in t.kinds if k in KINDS)
        neighbours_differ = self.neighbour_count(m.world_size) != self.neighbour_count(t.world)
        threads = t.threads if t.threads and t.threads != self.source_threads else None
        # the timing probes run bare models and engines on this machine's CPU: a GPU run's change is re-derived
        # from its GEMMs at the GPU's measured rates instead, as its validation cases were (docs/projection.md)
        on_cpu = m.device_type == "cpu"
        from trainprof.projection.probes import probeable

        try:
            if (reshaped or neighbours_differ or threads) and self.probe and on_cpu and probeable(src.recipe) \
                    and probeable(t.recipe) and same_machine_as_source(src):
                inputs.parts = self.parts(t.recipe, t.world, threads)
                inputs.zero3_bytes = self._zero3_gathered_bytes(t)
            elif reshaped:
                self._rerate_here(t, inputs, reasons)
            if engine_key(src.recipe) != engine_key(t.recipe) or task_key(src.recipe) != task_key(t.recipe) \
                    or "dtype" in t.kinds:
                if not on_cpu:
                    there = (f" (`--to {self.source_gpu}` predicts it from the catalog's GPU references for the "
                             "target engine instead)" if self.source_gpu else "")
                    reasons["step_ms"] = ("an engine, task or dtype change of a GPU run is not predicted: what the "
                                          "engine adds around the model is probed on a CPU, not on a GPU; measure "
                                          "the target's recipe on the GPU (trainprof.run) and compare with `trainprof "
                                          f"diff`{there}")
                    return inputs
                if not (self.probe and same_machine_as_source(src)):
                    reasons["step_ms"] = ("an engine or task change is probed where the run was made (what the "
                                          "engine adds around the model is timed there): run `trainprof project` "
                                          "on that machine" + ("" if self.probe else ", without --no-probe"))
                    return inputs
                inputs.engine = self.engine_probe(t.recipe)
            one_rank_zero3 = t.world == 1 < m.world_size and zero_stage_of(src.recipe) == 3
            if self.probe and on_cpu and inputs.engine is None and one_rank_zero3:
                inputs.step_probe = self.source_step()  # one rank: no gathers after the step
        except ValueError as err:
            reasons["step_ms"] = f"the step could not be probed on this machine: {err}"
        if threads:  # the optimizer's memory traffic, and the compute where it could not be probed
            inputs.source_machine = machine_from_calibration(self.calibration_at(self.source_threads),
                                                             f"this machine, {self.source_threads} threads")
            inputs.target_machine = machine_from_calibration(self.calibration_at(t.threads),
                                                             f"this machine, {t.threads} threads")
        return inputs

    def _gpu_link(self, t: TargetRun, reasons: dict[str, str]) -> Link | None:
        """A GPU run's collectives at another world size or bucket on its kind of machine: its accelerator's
        catalogued links with NCCL's latency model, as for a catalog target (gloo between CPU processes says
        nothing of them)."""
        if self.source_gpu is None:
            reasons.setdefault("step_ms", f"the run's GPU ({self.source.profile['env'].get('device')}) is not in the "
                                          "catalog, so its links are unknown: add it with --catalog FILE")
            return None
        return catalog_link(self.catalog, self.catalog.resolve(self.source_gpu), t.world, t.gpus_per_node)

    def _rerate_here(self, t: TargetRun, inputs: Inputs, reasons: dict[str, str]) -> None:
        """A reshaped target that cannot be probed here is re-derived from its GEMMs at this machine's
        measured rates (its calibration)."""
        cal = ensure_calibration(self.source)
        if cal is None:
            reasons["step_ms"] = ("the shape changed and cannot be probed here (another machine, a shape too large "
                                  "to probe, or --no-probe) and the run has no calibration.json: run on the source machine")
            return
        here = machine_from_calibration(cal, "this machine")
        inputs.source_machine = inputs.target_machine = here

    # -- inputs on another machine ------------------------------------------------------------------

    def _inputs_there(self, t: TargetRun, reasons: dict[str, str], notes: list[Assumption]) -> Inputs:
        """Rates, link and host for a catalog target: the source's calibration re-rated to the target's
        figures, NCCL's latency on its links, and its host time per operator call."""
        src = self.source
        assert t.hardware is not None
        inputs = Inputs(link=catalog_link(self.catalog, t.hardware, t.world, t.gpus_per_node))
        missing = missing_link(self.catalog, t.hardware, t.world, t.gpus_per_node)
        if missing:
            reasons.setdefault("step_ms", missing)
            return inputs
        cal = ensure_calibration(src)
        if cal is None:
            reasons.setdefault("step_ms", no_calibration(src))
            return inputs
        inputs.source_machine = machine_from_calibration(cal, "source", accelerator=self.source_gpu)
        inputs.target_machine, more = machine_from_target(
            t.hardware, t.recipe.model.dtype, measured=inputs.source_machine,
            source=self.catalog.resolve(self.source_gpu) if self.source_gpu else None,
            accelerator=self.catalog.accelerator_key(t.hardware))
        notes += more
        if not inputs.target_machine.gemm:
            reasons.setdefault("step_ms", f"{t.machine} lacks a matmul rate or memory bandwidth in the catalog")
        # a CPU source's host work on the GPU is the target engine's, as the reference GPU runs measured it; so
        # is a GPU source's across a change of host path (ZeRO-3's hooks issue more calls, each dearer), at its pace
        cpu_source = src.measured.device_type == "cpu"
        path_change = self._host_path_change(t.recipe.engine.kind, t.recipe.engine.zero_stage)
        engine = t.recipe.engine if cpu_source or path_change else src.recipe.engine
        own_gpu = self.source_gpu is not None and self.source_gpu == self.catalog.accelerator_key(t.hardware)
        inputs.host_us_per_op = self._gpu_host(notes, engine.kind, engine.zero_stage, own_gpu=own_gpu)
        if inputs.host_us_per_op is not None and (cpu_source or path_change):
            calls, calls_source = gpu_ops_per_layer(self.catalog, engine.kind, engine.zero_stage)
            if calls:
                inputs.ops_per_layer = calls
                notes.append(assume("gpu_ops_per_layer", forward=calls.get("forward", 0.0),
                                    backward=calls.get("backward", 0.0), source=calls_source))
                if t.recipe.task.kind != "pretrain":
                    notes.append(assume("gpu_ops_finetune", task=t.recipe.task.kind,
                                        quantized=" and bitsandbytes' 4-bit matmuls" if t.recipe.task.kind == "qlora"
                                        else ""))
        # ZeRO-1/2's step moves more than ZeRO-3's: their own where kept
        ref = by_host_path(self.catalog.optimizer_bytes_per_param, t.recipe.engine.kind, t.recipe.engine.zero_stage)
        if ref:
            inputs.optimizer_bytes_per_param = (float(ref["value"]), ref["source"])
        inputs.optimizer_host = self._optimizer_host(t)
        if cpu_source and engine_key(src.recipe) != engine_key(t.recipe):
            notes.append(assume("engine_change_other_machine"))
        return inputs

    def _links(self, t: TargetRun) -> dict[str, Any]:
        """The links a catalog target's collectives were priced over, as the catalog gives them: inside a node and,
        across nodes, between them (the catalog's default for a GPU named alone, beside the inter-node link of its
        node templates), each at its datasheet bandwidth, which the comm model takes as bus bandwidth."""
        hw = t.hardware
        assert hw is not None
        nodes = max(1, math.ceil(t.world / t.gpus_per_node))

        def said(link: Any) -> dict[str, Any] | None:
            return None if link is None else {"key": link.key, "name": link.name, "gbps_per_direction": link.gbps,
                                              "source": link.gbps_source}

        gpu = self.catalog.accelerator_key(hw)
        templates = {key: node.get("inter_node_link") or self.catalog.default_inter_node_link
                     for key, node in self.catalog.nodes.items() if node["accelerator"] == gpu and key != t.machine}
        templates = {key: {"key": link, "name": self.catalog.links[link]["name"]} for key, link in templates.items()}
        return {"intra_node": said(hw.intra_node_link), "inter_node": said(hw.inter_node_link) if nodes > 1 else None,
                "nodes": nodes, "inter_node_is_default": nodes > 1 and hw.gpus_per_node is None,
                "node_templates_inter_node": templates,
                "bandwidth": "datasheet, taken as bus bandwidth (an upper bound)"}

    def _optimizer_host(self, t: TargetRun) -> tuple[float, float, str] | None:
        """A DeepSpeed target's optimizer host calls and µs per call on a GPU (catalog gpu_optimizer_host):
        the source's own calls scaled by trainable tensors where it ran the same host path on a GPU, else the
        catalog's calls per trainable tensor (a CPU source's count does not carry over)."""
        target = t.recipe.engine
        key = host_key(target.kind, target.zero_stage)
        ref = self.catalog.optimizer_host.get(key) if target.kind == "deepspeed" else None
        if not ref:
            return None
        m, src = self.source.measured, self.source.recipe.engine
        tensors = trainable_tensors(t.change.comm.census)
        ops = (m.ops or {}).get("optimizer")
        if m.device_type == "cuda" and ops is not None and host_key(src.kind, src.zero_stage) == key:
            calls = ops.calls * tensors / max(trainable_tensors(t.change.comm.source_census), 1)
            how, counted_at = f"the source's {ops.calls:,.0f} calls x {tensors} / its trainable tensors", m.world_size
        else:
            calls = float(ref["calls_per_tensor"]["value"]) * tensors
            how, counted_at = f"{tensors} trainable tensors x {ref['calls_per_tensor']['source']}", 1  # one-GPU runs
        if t.world != counted_at:
            how += (f"; counted at {counted_at} rank{'s' * (counted_at > 1)} and used at {t.world}: DeepSpeed's "
                    "optimizer calls per rank change with the world size (measured on CPU only, docs/projection.md)")
        return calls, float(ref["us_per_call"]["value"]), f"{how}; µs per call: {ref['us_per_call']['source']}"

    def _host_path_change(self, engine: str, zero_stage: int) -> bool:
        """Whether `engine` runs another host path than the source's (machines.host_key: ZeRO-3's module hooks
        against ZeRO-0/1/2's root hook, or another engine)."""
        src = self.source.recipe.engine
        return host_key(src.kind, src.zero_stage) != host_key(engine, zero_stage)

    def _gpu_host(self, notes: list[Assumption], engine: str, zero_stage: int, *, own_gpu: bool = False
                  ) -> dict[str, float] | None:
        """Host µs per operator call on the target: a GPU source's own (where its phase was host-bound,
        else the catalog's reference for `engine`, on the source's own GPU kind at most what its device-bound
        phase leaves: hostref.host_us_and_ceiling); on another host path, the catalog's reference for the
        target's `engine` x the source host's pace against the reference for its own path; a CPU source's
        from the catalog's GPU references for `engine` (the target's)."""
        m = self.source.measured
        if not m.ops and m.device_type == "cuda":  # its own host time per call is what a GPU source's needs
            notes.append(assume("host_unknown", why="the source profile has no operator trace (profile.ops=true "
                                                    "records the operator calls the host issues)"))
            return None
        if not m.ops:
            notes.append(assume("host_layers_only"))
        ref, ref_source, stand_in = gpu_host(self.catalog, engine, zero_stage)
        if stand_in is not None:
            notes.append(assume("host_stand_in", why=stand_in))
        values = dict(ref)
        basis = {ph: "reference" for ph in ref}  # whose host each phase's µs per call is
        if m.device_type == "cuda":
            from trainprof.projection.hostref import host_us_and_ceiling

            own, ceilings = host_us_and_ceiling(self.source.profile)
            src_engine, path_change = self.source.recipe.engine, self._host_path_change(engine, zero_stage)
            src_ref = gpu_host(self.catalog, src_engine.kind, src_engine.zero_stage)[0] if path_change else ref
            basis.update({ph: "own" for ph in own})
            if own_gpu:  # the source's own host: a device-bound phase's calls took it no longer than the phase
                capped = {ph: us for ph, us in ceilings.items() if src_ref.get(ph) and us < src_ref[ph]}
                own.update(capped)
                basis.update({ph: "ceiling" for ph in capped})
                if capped:
                    notes.append(assume("host_ceiling", phases=", ".join(f"{ph} {us:.1f}" for ph, us in capped.items())))
            if path_change:  # the target's calls at this host's pace (own / reference)
                pace = {ph: us / src_ref[ph] for ph, us in own.items() if src_ref.get(ph)}
                own = {ph: values[ph] * f for ph, f in pace.items() if ph in values}
                basis.update({ph: "paced" for ph in own})
                if own:
                    notes.append(assume("host_engine_change", pace=", ".join(f"{ph} x{f:.2f}" for ph, f in pace.items()),
                                        source_engine=host_key(src_engine.kind, src_engine.zero_stage),
                                        target_engine=host_key(engine, zero_stage)))
            values.update(own)
            if "forward" in own:
                values["recompute"] = own["forward"]
                basis["recompute"] = basis["forward"]
            busy = m.busy_frac()
            if busy is not None and busy < HOST_BOUND_BUSY:
                notes.append(assume("host_bound_source", busy_frac=busy))
            ref_source = "the source's own host where a phase was host-bound; else " + ref_source
        self._host_pace = host_pace(values, basis, ref, reference_hosts(self.catalog, engine, zero_stage), stand_in)
        if m.ops:
            notes.append(assume("host_time", ops_per_step=sum(o.calls for o in m.ops.values()),
                                us_per_op=values.get("forward") or 0.0, us_source=ref_source))
        else:
            notes.append(assume("host_time_per_call", us_per_op=values.get("forward") or 0.0, us_source=ref_source))
        return values

    # -- the step and the figures -------------------------------------------------------------------

    def _step(self, t: TargetRun, inputs: Inputs, reasons: dict[str, str], notes: list[Assumption]
              ) -> tuple[dict[str, float] | None, float | None, dict[str, Any] | None]:
        src, m = self.source, self.source.measured
        if "step_ms" in reasons:
            return None, None, None
        try:
            phases, more = predict_phases(m, t.change, inputs)
        except ValueError as err:
            reasons["step_ms"] = str(err)
            return None, None, None
        notes += more
        if any(math.isnan(v) for v in phases.values()):
            why = [a.values.get("why") for a in more if a.kind == "comm_no_wait" and a.values.get("why")]
            reasons["step_ms"] = "comm not predictable: " + ("; ".join(why) or "no collective model")
            return None, None, None
        block, unattributed = None, m.unattributed_ms
        if pipeline.is_pipeline(src.profile):
            why = pipeline.check_world(src.profile, t.world)
            if why:
                reasons["step_ms"] = why
                return None, None, None
            # the step model's unattributed holds the measured bubble: swap it for the prediction
            bubble, block, more = pipeline.pipeline_term(src.profile, m.phases_ms, phases, t.recipe, inputs.link)
            unattributed -= block["bubble_ms_measured"]
            notes += more
        residual = residual_ms(m, phases, unattributed)
        if t.kinds == ["none"] and block is None:  # no change: the measured step, which its phases' medians need not sum to
            residual = m.step_ms - sum(phases.values())
        if block is not None:
            phases["pipeline_bubble"] = bubble
        step_ms = sum(phases.values()) + residual
        notes.append(assume("unattributed", ms=residual, source_ms=unattributed))
        if phases["data_wait"] > DATA_WAIT_DOMINATES * step_ms:
            notes.append(assume("data_wait_dominates", share=phases["data_wait"] / step_ms))
        return phases, step_ms, block

    def _figures(self, t: TargetRun, phases: dict[str, float] | None, step_ms: float | None,
                 block: dict[str, Any] | None, notes: list[Assumption], reasons: dict[str, str],
                 tokens: float | None, overrides: list[str]) -> dict[str, Any]:
        src = self.source
        r = t.recipe
        tokens_per_step = (r.train.micro_batch_size * r.train.grad_accum * r.data.seq_len
                           * (1 if pipeline.is_pipeline(src.profile) else t.world))
        tps = tokens_per_step / (step_ms / 1e3) if step_ms else None
        memory, fits, fit_note = self._memory(r, t.world, t.hardware, overrides)
        if memory is None:  # a catalog target's is always planned
            reasons["memory_per_rank_bytes"] = "the source profile records no peak memory to move with the plan"
        if t.hardware is None and memory is not None:
            notes += self._memory_notes(r)
        host_bound = (src.measured.busy_frac() or 1.0) < HOST_BOUND_BUSY
        gpus = (self.source_gpu, self.catalog.accelerator_key(t.hardware)) if t.hardware is not None else None
        conf = confidence(t.kinds, self.validation, host_bound=host_bound, source_device=src.measured.device_type,
                          gpus=gpus)
        bound_by, marks, leading = self._marks(t, phases, step_ms, notes)
        conf = dataclasses.replace(conf, marks=tuple(marks), leading=tuple(leading))
        if step_ms is None:  # no figure to weigh: no expected error beside an n/a
            conf = dataclasses.replace(conf, label="n/a", expected_error_pct=None, max_error_pct=None, cases=None,
                                       why="step not predicted", reason=f"step not predicted: {reasons.get('step_ms')}")
        pred: dict[str, Any] = {
            "hardware": t.machine if t.hardware is not None else
            f"this ({src.profile['env']['device']}" + (f", {t.threads} thread{'s' * (t.threads > 1)}" if t.threads else "") + ")",
            "nodes": max(1, math.ceil(t.world / t.gpus_per_node)) if t.hardware is not None else 1,
            "gpus_per_node": t.gpus_per_node if t.hardware is not None else t.world,
            "world_size": t.world,
            "overrides": list(overrides),
            "model": shape_label(r.model),
            "step_ms": step_ms, "phases_ms": phases, "tokens_per_step": tokens_per_step, "tokens_per_s": tps,
            "mfu": None, "scaling_efficiency": None, "scaling_base_gpus": None,
            "memory_per_rank_bytes": memory, "fits": fits,
            "time_to_train_s": (tokens / tps) if (tokens and tps and fits is not False) else None,
            "cost_per_million_tokens_usd": None, "cost_to_train_usd": None,
            "change_kinds": t.kinds,
            "confidence": conf.label, "confidence_text": conf.text,
            "confidence_marks": [*conf.leading, *conf.marks],
            "confidence_reason": conf.reason,
            "expected_error_pct": conf.expected_error_pct, "expected_max_error_pct": conf.max_error_pct,
            "expected_error_text": conf.error_text() if conf.expected_error_pct is not None else None,
            "expected_error_source": conf.reason,
            "host_bound_source": host_bound, "bound_by": bound_by,
            "assumptions": [a.to_dict() for a in notes],
        }
        if fit_note:
            pred["fit_suggestion"] = fit_note
        elif fits is False and t.hardware is not None and self._fit_advice:  # what was tried, and whether more GPUs help
            pred["fit_advice"] = self._fit_advice
        if t.hardware is not None:  # offload's host side: the catalog describes no node's host memory to fit it in
            pred["host_memory_per_rank_bytes"] = _host_bytes(r, t.world)
        if block is not None:
            pred["pipeline"] = block
        if self._host_pace is not None:  # whose host the row's operator calls run at: it orders host-bound rows
            pred["host_pace"] = self._host_pace
        if t.hardware is not None and t.world > 1:
            pred["links"] = self._links(t)
        self._mfu(t, pred, reasons)
        if fits is False and tps:  # a run of these settings cannot start: no time nor cost to train with them
            reasons["time_to_train_s"] = reasons["cost_per_million_tokens_usd"] = (
                "does not fit the target's memory (plan): no time nor cost to train with these settings")
        else:
            self._cost(t, pred, reasons)
        pred["reasons"] = reasons  # always written (empty where every figure is predicted): a fixed field
        return pred


    def _marks(self, t: TargetRun, phases: dict[str, float] | None, step_ms: float | None,
               notes: list[Assumption]) -> tuple[str | None, list[str], list[str]]:
        """What bounds the row ("comm", "host" or None), the marks its confidence cell shows after the validated
        error, and those it shows before it (the probes' noise, which can outweigh it), where the reader looks
        and not only among the assumptions (to which the comm-bound and carried shares are added)."""
        src = self.source
        noted, marks = {a.kind for a in notes}, []
        if "gpu_ops_finetune" in noted:
            seen = cpu_to_gpu_task_error(t.recipe.task.kind) if src.measured.device_type == "cpu" else None
            marks.append(f"{src.recipe.task.kind} -> {t.recipe.task.kind}: host likely low" + (f" ({seen})" if seen else ""))
        comm = (phases or {}).get("comm_exposed") or 0.0
        # phases whose collectives outlast their compute take the collectives' time: a row can be set by its
        # links with little of it exposed (ZeRO-3 over two nodes: 33% exposed, 94% of the step in such phases)
        outlast = next((a.values for a in notes if a.kind == "comm_outlasts_compute"), None)
        held = outlast["ms"] if outlast else 0.0
        bound_by = None
        if step_ms and max(comm, held) > COMM_BOUND_SHARE * step_ms:
            bound_by = "comm"
            held_text = (f"; its {outlast['phases']} take their collectives' time ({held:.1f} ms, {held / step_ms:.0%} "
                         "of the step), which outlasts their compute") if held > COMM_BOUND_SHARE * step_ms else ""
            notes.append(assume("comm_bound", share=comm / step_ms, ms=comm, held_text=held_text))
            # a catalog link's figure is its datasheet bandwidth, taken as bus bandwidth: the comm is at least this
            upper = ", its links at datasheet bandwidth: an upper bound" if t.hardware is not None else ""
            share = (f"{comm / step_ms:.0%} of the step" if comm > COMM_BOUND_SHARE * step_ms else
                     f"its {outlast['phases']} set by their collectives, {held / step_ms:.0%} of the step")
            marks.append(f"{COMM_BOUND_MARK} ({share}{upper})")
        elif "host_bound_target" in noted:
            bound_by = "host"
            marks.append(HOST_BOUND_MARK)
        carried = sum((phases or {}).get(ph) or 0.0 for ph in ("other", "data_wait"))
        if step_ms and t.hardware is not None and src.measured.device_type == "cpu" and \
                carried > CARRIED_SHARE * step_ms:
            notes.append(assume("carried_as_measured", ms=carried, share=carried / step_ms))
            marks.append(f"{carried / step_ms:.0%} of the step is the CPU run's time outside its phases, as measured")
        leading = []
        noisy = next((a.values["error"] for a in notes if a.kind == "probes_noisy"), None)
        if noisy is not None:
            leading.append(f"probed on a busy machine (±{noisy:.0%})")
        slower = next((a.values for a in notes if a.kind == "probe_slower_than_run"), None)
        if slower:
            leading.append(f"probe {slower['ratio']:.1f}x slower than the run's layers")
        uneven = next((a.values for a in notes if a.kind == "ranks_uneven"), None)
        if uneven:
            marks.append(f"source ranks {uneven['spread']:+.0%} apart: slowest kept")
        return bound_by, marks, leading

    def _mfu(self, t: TargetRun, pred: dict[str, Any], reasons: dict[str, str]) -> None:
        if t.hardware is None:  # the source's machine: its own accelerator's datasheet peak, as the run's MFU
            from trainprof.hardware import dense_peak

            env = self.source.profile["env"]
            found, why = dense_peak(env["device"], self.source.measured.device_type, t.recipe.model.dtype)
            if found is None:
                reasons["mfu"] = why
                return
            peak = found["tflops"]
        else:
            peak = t.hardware.figure("peak_bf16_dense_tflops" if t.recipe.model.dtype in ("bf16", "fp16")
                                     else "peak_fp32_tflops")
        if peak and pred["step_ms"]:
            pred["mfu"] = _plan_flops(t.recipe, t.world) / (pred["step_ms"] / 1e3) / (t.world * peak * 1e12)
            pred["mfu_convention"] = MFU_CONVENTION

    def _cost(self, t: TargetRun, pred: dict[str, Any], reasons: dict[str, str]) -> None:
        gpu = self.catalog.accelerator_key(t.hardware) if t.hardware is not None else None
        price = price_for(self.prices, t.machine, gpu)
        tps = pred["tokens_per_s"]
        if price and tps:
            usd_per_s = price["usd_per_gpu_hour"] * t.world / 3600
            pred["cost_per_million_tokens_usd"] = usd_per_s / tps * 1e6
            pred["cost_to_train_usd"] = usd_per_s * pred["time_to_train_s"] if pred["time_to_train_s"] else None
            pred["price"] = price
        else:
            named = f"'{t.machine}'" + (f" nor its GPU '{gpu}'" if gpu not in (None, t.machine) else "")
            reasons["cost_per_million_tokens_usd"] = (f"no price for {named}: pass --price {t.machine}=USD_PER_GPU_HOUR "
                                                      "or --prices FILE (with source and date)")

    def _memory(self, recipe: Any, world: int, target: Target | None, overrides: list[str]
                ) -> tuple[int | None, bool | None, list[str] | None]:
        m, src = self.source.measured, self.source
        if target is None:
            if m.peak_memory_bytes is None:
                return None, None, None
            # measured + (plan(target) - plan(source)): the process's fixed part (libraries, CUDA context,
            # allocator slack) stays as measured, what the formulas see moves with the recipe. A CPU run's
            # meter is its resident set, which holds only the written part of a buffer
            alloc = "gpu_allocated_per_rank" if m.device_type == "cuda" else "resident_per_rank"
            fixed = self.resident_fixed(recipe)
            memory = int(m.peak_memory_bytes + _plan_bytes(recipe, world, alloc) - _plan_bytes(src.recipe, m.world_size, alloc)
                         + (fixed.target_bytes - fixed.source_bytes if fixed else 0))
            return memory, self._fits_here(recipe, world, memory), None
        planned = _plan_bytes(recipe, world)
        capacity = target.memory_bytes()
        self._fit_advice = None
        if capacity is None:
            return planned, None, None
        if planned <= capacity:
            return planned, True, None
        deepspeed = [] if recipe.engine.kind == "deepspeed" else ["engine.kind=deepspeed"]
        tried, refused, least = [], {}, (planned, [], recipe)
        for extra in FIT_SUGGESTIONS:  # the target recipe (the run's, with the user's overrides) plus these
            extra = [*deepspeed, *extra] if any(e.startswith("engine.") for e in extra) else extra
            try:
                candidate = with_overrides(src, [*overrides, *extra])
            except Exception as err:  # noqa: BLE001  a suggestion the recipe rules refuse is skipped, and said
                refused[" ".join(extra)] = str(err).splitlines()[0]
                continue
            nbytes = _plan_bytes(candidate, world)
            if nbytes <= capacity:
                return planned, False, extra
            tried.append({"overrides": extra, "bytes": nbytes})
            if nbytes < least[0]:
                least = (nbytes, extra, candidate)
        self._fit_advice = {"tried": tried, "refused": refused, "least": {"overrides": least[1], "bytes": least[0]},
                            "capacity_bytes": capacity, "more_gpus": _more_gpus(least[2], world, capacity)}
        return planned, False, None

    def _fits_here(self, recipe: Any, world: int, memory: int) -> bool | None:
        """Whether a prediction on the source's own machine fits: under train.memory_cap_gb (GiB, the cap a run
        checks its peak against), else on a catalogued GPU under its capacity, with what an allocator peak
        leaves out added (plan's device total minus its allocated: the CUDA context, the allocator's reserve).
        None on a CPU without a cap."""
        if recipe.train.memory_cap_gb is not None:
            return memory <= recipe.train.memory_cap_gb * 2**30
        capacity = self.catalog.resolve(self.source_gpu).memory_bytes() if self.source_gpu else None
        if self.source.measured.device_type != "cuda" or not capacity:
            return None
        beyond = _plan_bytes(recipe, world) - _plan_bytes(recipe, world, "gpu_allocated_per_rank")
        return memory + beyond <= capacity

    # -- probes and measurements, cached -------------------------------------------------------------

    def neighbour_count(self, world: int) -> int:
        """Other ranks that share this machine with each rank of a `world`-rank run: on a CPU all of them
        (their compute contends for the same cores, caches and memory bandwidth), on a GPU none."""
        return world - 1 if self.source.profile["env"].get("device_type") == "cpu" else 0

    def parts(self, target_recipe: Any, world: int, threads: int | None = None) -> Parts:
        """One decoder layer's and the rest of the model's bare work at both shapes, probed on this
        machine, the target's at `threads` (None: the source's). Shapes with as many CPU neighbours are
        probed in one call, called in turn (a slow spell of the machine during one probe taken alone
        moved a ratio by up to 15% here); otherwise each with its own neighbours."""
        from trainprof.projection.probes import PartProbe, ProbeShape, probe_parts

        src, src_world = self.source.recipe, self.source.measured.world_size
        target_recipe = in_dtype(target_recipe, src.model.dtype)  # a dtype change is the engine probe's
        nb_s, nb_t = self.neighbour_count(src_world), self.neighbour_count(world)
        th_s, th_t = self.source_threads, threads or self.source_threads
        # a changed model also has its optimizer step's pass timed, where the state is fp32 AdamW's
        steps = model_shape(src) != model_shape(target_recipe) and target_recipe.optimizer.state_bits == 32
        key = ("parts", ProbeShape.of(src), ProbeShape.of(target_recipe), nb_s, nb_t, th_s, th_t,
               *(("steps",) if steps else ()))
        if key not in self._cache:
            def make() -> list[dict[str, Any]]:
                if nb_s == nb_t:
                    probes = probe_parts([src, target_recipe], threads=[th_s, th_t], neighbours=nb_s, steps=steps,
                                         pool=self.neighbours)
                else:
                    probes = [*probe_parts([src], threads=th_s, neighbours=nb_s, steps=steps, pool=self.neighbours),
                              *probe_parts([target_recipe], threads=th_t, neighbours=nb_t, steps=steps,
                                           pool=self.neighbours)]
                return [dataclasses.asdict(p) for p in probes]

            s, t = (PartProbe(**d) for d in self._kept(key, "parts", make))
            by_phase = lambda probe, part: {ph: getattr(probe, f"{part}_{ph}_ms") for ph in ("forward", "backward")}  # noqa: E731
            self._cache[key] = Parts(layer_source=by_phase(s, "layer"), layer_target=by_phase(t, "layer"),
                                     rest_source=by_phase(s, "rest"), rest_target=by_phase(t, "rest"),
                                     layers_probed=max(s.layers_probed, t.layers_probed),
                                     threads=(th_s, th_t) if th_s != th_t else None,
                                     step_ns=(s.step_ns_per_element, t.step_ns_per_element)
                                     if s.step_ns_per_element and t.step_ns_per_element else None,
                                     error=max((p.layer_error for p in (s, t) if p.layer_error is not None),
                                               default=None))
        self._used.append(key)
        return self._cache[key]

    def engine_probe(self, target_recipe: Any) -> EngineProbe:
        """The target's engine and task against the source's, both probed at the source's shape in one
        process, with the source's CPU neighbours. A task change (pretrain, LoRA, QLoRA) is probed this way
        too: frozen weights skip their gradient GEMMs, adapters and 4-bit dequantization add work, and the
        step updates only the adapters."""
        from trainprof.projection.probes import probe_engines

        src = self.source.recipe
        target_engine = dataclasses.replace(in_dtype(src, target_recipe.model.dtype), engine=target_recipe.engine,
                                            task=target_recipe.task)
        key = ("engine", engine_key(src), engine_key(target_recipe), task_key(target_recipe),
               *((target_recipe.model.dtype,) if target_recipe.model.dtype != src.model.dtype else ()))
        if key not in self._cache:
            s, t = self._kept(key, "engine", lambda: probe_engines(
                [src, target_engine], threads=self.source_threads,
                neighbours=self.neighbour_count(self.source.measured.world_size), pool=self.neighbours))
            self._cache[key] = EngineProbe(
                forward=t["engine_forward_ms"] / s["engine_forward_ms"],
                backward=t["engine_backward_ms"] / s["engine_backward_ms"],
                step=t["engine_step_ms"] / s["engine_step_ms"],
                target_step=StepProbe(step_ms=t["engine_step_ms"], state_elements=census(target_engine).trainable))
        self._used.append(key)
        return self._cache[key]

    def _memory_notes(self, r: Any) -> list[Assumption]:
        """What a same-machine memory prediction took from the resident-memory probes, or left out."""
        src, fixed = self.source, self.resident_fixed(r)
        kept = heap_kept(src.measured.device_type, src.recipe, r)
        world = src.measured.world_size
        why = f"; {self._resident_failed}" if self._resident_failed else ""
        notes = []
        if fixed is not None and fixed.layers is not None:
            notes.append(assume("memory_heap_probed", layers=fixed.layers, world=world, source_mib=fixed.source_bytes / 2**20,
                                target_mib=fixed.target_bytes / 2**20, source_logits_mib=kept.values["source_logits_mib"],
                                target_logits_mib=kept.values["target_logits_mib"]))
        elif kept is not None:
            notes.append(assume("memory_heap_kept", **{**kept.values, "why": why}))
        if src.recipe.engine.kind != r.engine.kind and (fixed is None or fixed.layers is None):
            notes.append(assume("memory_engine_probed", source_engine=src.recipe.engine.kind, target_engine=r.engine.kind,
                                world=world, source_mib=fixed.source_bytes / 2**20, target_mib=fixed.target_bytes / 2**20)
                         if fixed else assume("memory_engine_fixed_part", engine=src.recipe.engine.kind, why=why))
        return notes

    def resident_fixed(self, target_recipe: Any) -> ResidentProbe | None:
        """On a CPU source: what a process of the source's and one of the target's hold besides what the
        plan counts, where the target changes what that is. An engine change moves the libraries and the
        engine's runtime and buffers: each engine is built around the source's model. A step whose largest
        transient tensors grow (heap_kept) makes the heap keep more freed blocks: the source's and the
        target's recipes are each built with k decoder layers (the parts probe's k, at most the source's),
        the target's engine and shape in the second. Either way by as many fresh processes as the source
        had ranks, the fullest one's peak RSS minus the plan's resident figure for the same recipe (each
        recipe probed once: a search's targets share the source's). None where neither changes, on a GPU
        (the allocator's peak holds no libraries) or where a probe failed (its reason in
        self._resident_failed)."""
        from trainprof.models import resolve_shape
        from trainprof.projection.probes import probe_layers

        src = self.source
        if src.measured.device_type != "cpu":
            return None
        heap = heap_kept(src.measured.device_type, src.recipe, target_recipe) is not None
        if not heap and src.recipe.engine.kind == target_recipe.engine.kind:
            return None
        if not (self.probe and same_machine_as_source(src)):
            self._resident_failed = "not probed: --no-probe" if not self.probe else "not probed: another machine"
            return None
        if heap:
            layers = min(resolve_shape(src.recipe.model).num_layers, probe_layers(target_recipe))
            recipes = [dataclasses.replace(r, model=dataclasses.replace(r.model, num_layers=layers))
                       for r in (src.recipe, target_recipe)]
        else:
            layers = None
            recipes = [src.recipe, dataclasses.replace(src.recipe, engine=target_recipe.engine)]
        try:
            fixed = [self._resident_beyond_plan(r, src.measured.world_size) for r in recipes]
        except ValueError as err:  # a probe process failed: memory keeps the measured fixed part, saying why
            self._resident_failed = str(err)
            return None
        return ResidentProbe(source_bytes=fixed[0], target_bytes=fixed[1], layers=layers)

    def _resident_beyond_plan(self, recipe: Any, world: int) -> int:
        """engine_resident's peak for `recipe` on `world` fresh processes minus the plan's resident figure,
        probed once per recipe (kept in the run dir); a failed probe's ValueError is raised again, not retried."""
        from trainprof.projection.probes import engine_resident

        key = ("resident", json.dumps(recipe.to_dict(), sort_keys=True, default=str), world)
        if key not in self._cache:
            try:
                self._cache[key] = self._kept(key, "resident memory", lambda: engine_resident(recipe, world)
                                              - _plan_bytes(recipe, world, "resident_per_rank"))
            except ValueError as err:
                self._cache[key] = err
        self._used.append(key)
        if isinstance(self._cache[key], ValueError):
            raise ValueError(str(self._cache[key]))
        return self._cache[key]

    def source_step(self) -> StepProbe:
        """The source's engine's step() in a group of one."""
        return StepProbe(step_ms=self._source_engine_probe()["engine_step_ms"],
                         state_elements=float(self.source.profile["params"]["trainable"]))

    def _source_engine_probe(self) -> dict[str, float]:
        from trainprof.projection.probes import probe_engines

        key = ("source_engine",)
        if key not in self._cache:
            (self._cache[key],) = self._kept(key, "source engine", lambda: probe_engines(
                [self.source.recipe], threads=self.source_threads,
                neighbours=self.neighbour_count(self.source.measured.world_size), pool=self.neighbours))
        self._used.append(key)
        return self._cache[key]

    def _kept(self, key: tuple[Any, ...], what: str, make: Any) -> Any:
        """kept_probe's result for `key`; where it was read from the run dir, what it probed and when it was
        timed are kept for the predictions that use it (the `probe_kept` assumption)."""
        result, made_utc = kept_probe(self.source, repr(key), make)
        if made_utc is not None:
            self._kept_from[key] = (what, made_utc)
        return result

    def _zero3_gathered_bytes(self, t: TargetRun) -> tuple[float, float] | None:
        if zero_stage_of(self.source.recipe) != 3:
            return None
        b = self.source.measured.dtype_bytes
        s = zero3_traffic(self.source_census, zero3_settings(self.source.recipe))
        g = zero3_traffic(census(t.recipe), zero3_settings(t.recipe))
        return b * s.gather_elements, b * g.gather_elements

    def calibration_at(self, threads: int) -> dict[str, Any]:
        from trainprof.projection.calibrate import calibrate

        key = ("calibration", threads)
        if key not in self._cache:
            self._cache[key] = calibrate("cpu", dtype=self.source.recipe.model.dtype, threads=threads)
        return self._cache[key]

    def _memory_gbps(self) -> float | None:
        """The source machine's memory bandwidth: its calibration.json, or measured now on this machine (a GPU
        run's on its GPU, which prices its optimizer's pass, not on the host's memory)."""
        if self.source.calibration is not None:
            return self.source.calibration["memory"]["gbps"]
        if not same_machine_as_source(self.source):
            return None
        if self.source.measured.device_type != "cpu":
            cal = ensure_calibration(self.source)
            return cal["memory"]["gbps"] if cal else None
        return self.calibration_at(self.source_threads)["memory"]["gbps"]

    def gloo_link(self, world: int) -> Link:
        from trainprof.projection.calibrate import gloo_collectives

        key = ("gloo", world)
        if key not in self._cache:
            cal = self.source.calibration
            if cal and cal.get("collectives") and cal["collectives"]["world_size"] == world \
                    and cal["collectives"].get("backend") == "gloo":
                fits = cal["collectives"]["ops"]
            else:
                fits = gloo_collectives(world)["ops"]
            self._cache[key] = measured_link(fits, world)
        return self._cache[key]


# ---------------------------------------------------------------------------------------------
# Recipe helpers
# ---------------------------------------------------------------------------------------------

def _state_elements_per_rank(recipe: Any, trainable: float, world: int) -> float:
    partitioned = recipe.engine.kind == "deepspeed" and recipe.engine.zero_stage >= 1
    return trainable / world if partitioned else float(trainable)


def _plan(recipe: Any, world: int) -> dict[str, Any]:
    """trainprof plan for a recipe and world size, cached: a search predicts many variants of one recipe."""
    import json

    return _plan_cached(json.dumps(recipe.to_dict(), sort_keys=True, default=str), world)


@functools.lru_cache(maxsize=512)
def _plan_cached(recipe_json: str, world: int) -> dict[str, Any]:
    import json

    from trainprof.plan import estimate_plan
    from trainprof.recipe import recipe_from_dict

    return estimate_plan(recipe_from_dict(json.loads(recipe_json)), world)


def in_dtype(recipe: Any, dtype: str) -> Any:
    """The recipe with its model in `dtype`."""
    return dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, dtype=dtype))


def _plan_bytes(recipe: Any, world: int, key: str = "gpu_total_per_rank") -> int:
    """trainprof plan's bytes per rank: the device total (what must fit) or, with key
    "gpu_allocated_per_rank", what the allocator hands out (what a measured peak compares with)."""
    plan = _plan(recipe, world)
    if plan.get("pipeline"):  # per stage: the fullest stage is the one that must fit
        return max(st["gpu_total_bytes"] for st in plan["pipeline"]["stages"])
    return int(plan[key]["value"])


MOST_GPUS = 4096  # the largest world the fit advice tries before saying more GPUs do not help


def _more_gpus(recipe: Any, world: int, capacity: float) -> dict[str, Any]:
    """Whether more GPUs bring the plan per GPU under `capacity`: the fewest (doubling from `world`, up to
    MOST_GPUS) that do, or none, with the plan there (a replicated part, such as a QLoRA 4-bit base, does not
    shrink with the world)."""
    w, nbytes = world, None
    while w < MOST_GPUS:
        w *= 2
        nbytes = _plan_bytes(recipe, w)
        if nbytes <= capacity:
            return {"gpus": w, "bytes": nbytes}
    return {"gpus": None, "bytes": _plan_bytes(recipe, w) if nbytes is None else nbytes, "tried_up_to": w}


def _host_bytes(recipe: Any, world: int) -> int | None:
    """trainprof plan's host memory per rank (offloaded model states and their pinned buffers); None where
    the plan gives none (pipeline stages)."""
    host = (_plan(recipe, world).get("gpu_memory") or {}).get("host_total")
    return int(host["cpu_bytes"]) if host else None


def heap_kept(device_type: str, source: Any, target: Any) -> Assumption | None:
    """The memory note of a same-machine CPU prediction whose step frees and allocates larger tensors than
    the source's under the cache allocator: the heap keeps more freed blocks than the plan sees."""
    if device_type != "cpu" or target.train.cpu_allocator != "cache":
        return None
    before, after = _logits_bytes(source), _logits_bytes(target)
    if after <= before:
        return None
    return assume("memory_heap_kept", source_logits_mib=before / 2**20, target_logits_mib=after / 2**20, why="")


def _logits_bytes(recipe: Any) -> int:
    """A micro batch's fp32 logits, the loss's input: on a CPU the largest tensor a step frees and allocates
    again."""
    from trainprof.models import resolve_shape

    return recipe.train.micro_batch_size * recipe.data.seq_len * resolve_shape(recipe.model).vocab_size * 4


def _plan_flops(recipe: Any, world: int) -> float:
    """The step's model FLOPs as the run report counts them for its MFU: PaLM's 6N + 12LHQT a token, with 4N
    for a LoRA/QLoRA frozen base (no weight gradients), so that a finetuning prediction's MFU reads on the
    same scale as its measured run's."""
    flops = _plan(recipe, world)["flops"]
    return float((flops.get("per_step_frozen_base") or flops["per_step_6n"])["value"])


def with_overrides(source: Source, overrides: list[str]) -> Any:
    """The source's recipe with `overrides` applied and validated, as `load_recipe` would build it (from the
    source's own resolved keys: a search builds hundreds of variants, and re-reading the YAML was most of it)."""
    import copy

    from trainprof.recipe import apply_overrides, recipe_from_dict

    return recipe_from_dict(apply_overrides(copy.deepcopy(source.recipe.to_dict()), overrides))


def _zero_buckets(recipe: Any) -> dict[str, Any]:
    """The recipe's DeepSpeed settings that shape ZeRO stage 0-2's collectives (DeepSpeed's defaults where
    the recipe's `deepspeed` block sets none). LoRA trains only adapter matrices: one parameter group
    (trainprof.engines.optim.param_groups)."""
    zero = (recipe.deepspeed or {}).get("zero_optimization") or {}
    out: dict[str, Any] = {"param_groups": 1 if recipe.task.kind in ("lora", "qlora") else 2}
    if zero.get("reduce_bucket_size") is not None:
        out["reduce_bucket_elements"] = float(zero["reduce_bucket_size"])
    if zero.get("allgather_bucket_size") is not None:
        out["allgather_bucket_elements"] = float(zero["allgather_bucket_size"])
    out["overlap_comm"] = bool(zero.get("overlap_comm", zero_stage_of(recipe) == 3))  # DeepSpeed: on for stage 3 only
    return out
