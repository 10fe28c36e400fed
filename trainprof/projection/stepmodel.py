"""The step model: a measured profile split into parts that scale differently, and re-derived for a
changed recipe, world size or machine.

A measured optimizer step (per rank, ms) is split as the profiler measured it:

    step = data_wait + forward + backward + recompute + optimizer + comm_exposed + other + unattributed

and each part is re-derived for the target:

  * forward / backward / recompute, per micro batch (x grad_accum); an engine change (ZeRO stage,
    offload, DeepSpeed <-> torch) scales them by probe_engines(target) / probe_engines(source):
      same machine: the profiled leaf modules' time (attention, MLP, norms, embedding, LM head: the
        model's work, as the ranks ran it) x probe(target) / probe(source), where probe times the recipe's
        whole model at each shape on this machine (calibrate.probe_models, both shapes in one call; on a
        CPU beside as many busy copies as that run has other ranks, since they share the cores and
        memory); what the parents add
        on top (hooks, engine bookkeeping, the loss) stays as measured, and so does the engine's own work
        inside the leaves (ZeRO-3's fetch and release per module call: the source engine's probe minus the
        bare model's), which does not grow with the shape. Turning recomputation on adds one forward of
        every decoder layer at the leaves' measured/probed ratio.
      other machine: matmul share = FLOPs of the phase / the source's matmul rate for that phase (a
        calibration times the GEMM layouts of a Linear's forward and backward apart), scaled by
        source/target matmul rate (the target's MAMF, else its datasheet peak); the rest
        is taken as memory-bound and scaled by source/target memory bandwidth.
    A task change (pretrain <-> LoRA/QLoRA, adapter rank or targets) is an engine change: both models
    built by their engines and probed, so the frozen base's skipped weight gradients, the adapters and
    4-bit dequantization are in the ratio (same machine only).
  * optimizer: a fixed part (the engine's step machinery, launches, gradient clipping) plus Adam's
    elementwise pass over the state this rank holds (ZeRO partitions it over the world size), priced at
    7 fp32 accesses per element (read param, grad, m, v; write param, m, v) over the measured memory
    bandwidth; the fixed part is what the source measured beyond that pass. A target whose step does no
    per-parameter work for other ranks (below ZeRO-3, or one rank) where the source's did (ZeRO-3's
    gathers after the step), or another engine: that engine's `step()` probed in a group of one, Adam's
    pass re-priced for the rank; a change to ZeRO-3: x the two engines' probed `step()` ratio. Another
    machine: scaled by source/target memory bandwidth.
  * comm_exposed: per collective of the profile, α-β time for its bytes over the target's link
    (nccl-tests bus factors), times the exposed fraction measured at the source (exposed/total);
    forward/backward collectives repeat per micro batch. A change to DeepSpeed ZeRO stage 0-2 derives that
    stage's bucketed collectives from the trainable parameters instead (gradient all_reduce, the all-gather
    of the updated partitions; `_bucketed_zero_comm`); a change to stage 3 scales by the ZeRO paper's
    volumes (stage 1/2: 2Ψ, stage 3: 3Ψ per step). A change to PyTorch DDP derives DDP's bucketed gradient
    all_reduce (the last bucket exposed; `_ddp_comm`). A task change derives stage 0-2's and DDP's
    collectives from the target's trainable parameters; under ZeRO-3 on several ranks it is not predicted.
    One rank: none.
  * data_wait: as measured, per micro batch. other: as measured.
  * unattributed: per step it is small and >= 0 (the profiler's closure), but the source's figure is the
    median step minus the sum of per-phase medians, a signed difference of statistics; it is scaled with
    the phases' sum (residual_ms), so that a faster target does not inherit the source's ms.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from trainprof.phases import PHASES
from trainprof.projection.calibrate import collective_ms

# ZeRO paper (Rajbhandari et al. 2020, sec. 7): per-step communication volume per rank in units of Ψ
# (parameters): DP/stage 1/2: reduce-scatter + all-gather = 2Ψ; stage 3 adds a forward gather: 3Ψ.
ZERO_VOLUME = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}
SMALL_COLLECTIVE_BYTES = 1024  # per call: a gradient norm or an overflow flag, latency-bound
# torch.nn.parallel.DistributedDataParallel's buckets: the first holds at most 1 MiB
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), the others bucket_cap_mb=25 (its default)
DDP_FIRST_BUCKET_BYTES = 1024 ** 2
DDP_BUCKET_BYTES = 25 * 1024 ** 2
ADAM_BYTES_PER_ELEMENT = 28  # fp32 Adam: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq


@dataclasses.dataclass(kw_only=True)
class Measured:
    """What the step model reads from a profile (per rank, ms per optimizer step)."""

    step_ms: float
    phases_ms: dict[str, float]
    unattributed_ms: float
    flops_by_phase: dict[str, float]
    comm: list[dict[str, Any]]
    world_size: int
    grad_accum: int
    optimizer_state_elements: int | None
    peak_memory_bytes: int | None
    forward_layers_ms: float | None  # decoder layers' forward, summed (for turning recompute on)
    step_std_ms: float = 0.0  # spread of the measured steps (for the wait on the slowest rank)
    leaf_ms: tuple[float, float] | None = None  # (forward, backward) of the profiled leaf modules, summed
    param_bytes: float = 0.0  # parameters x bytes per element of the model dtype (collective volumes)
    trainable_param_bytes: float = 0.0  # the trainable ones: what ZeRO reduces and gathers (the gradients' dtype)
    dtype_bytes: int = 2  # bytes per element of the model dtype
    # GPU sources with an operator trace: per phase, (matmul/attention kernel ms, other kernel ms) per
    # optimizer step, the device self time of the traced steps
    kernel_ms: dict[str, tuple[float, float]] | None = None


def measured_from_profile(profile: dict[str, Any]) -> Measured:
    """The figures the step model needs, from a merged profile.json dict: the slowest rank's median
    step (what tokens/s divides by) and that rank's phase medians. `unattributed_ms` is the step minus
    the phases, kept signed (a sum of per-phase medians need not equal the median step), so that the
    parts add up to the measured step exactly."""
    s = profile["summary"]
    ranks = [r for r in profile.get("ranks") or [] if r.get("phases_ms")]
    if ranks:
        slowest = max(ranks, key=lambda r: r["step_ms_median"])
        step, phases = float(slowest["step_ms_median"]), dict(slowest["phases_ms"])
    else:
        step, phases = float(s["step_ms"]["median"]), dict(s.get("phases_ms") or {})
    phases = {k: float(phases.get(k) or 0.0) for k in PHASES}
    layers = [m for m in profile.get("modules") or [] if _is_decoder_layer(m["name"])]
    states = profile.get("model_state_bytes") or {}
    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}.get(profile["recipe"]["model"]["dtype"], 2)
    return Measured(
        step_ms=step, phases_ms=phases, unattributed_ms=step - sum(phases.values()),
        flops_by_phase={k: float(v) for k, v in (s.get("flops_by_phase") or {}).items()},
        comm=list(profile.get("comm") or []), world_size=int(profile["env"]["world_size"]),
        grad_accum=int(profile["recipe"]["train"]["grad_accum"]),
        optimizer_state_elements=states.get("optimizer_state_elements"),
        peak_memory_bytes=s.get("peak_memory_bytes_max"),
        forward_layers_ms=sum(m["forward_ms"] for m in layers) if layers else None,
        step_std_ms=_step_std(profile),
        leaf_ms=_leaf_ms(profile),
        param_bytes=float((profile.get("params") or {}).get("total", 0)) * dtype_bytes,
        trainable_param_bytes=float((profile.get("params") or {}).get("trainable", 0)) * dtype_bytes,
        dtype_bytes=dtype_bytes,
        kernel_ms=_kernel_ms(profile),
    )


# operators whose device time is tensor-core work (scaled by the matmul rate); the rest is memory-bound
MATMUL_OPS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm)$|attention|flash|gemm",
                        re.IGNORECASE)


def _kernel_ms(profile: dict[str, Any]) -> dict[str, tuple[float, float]] | None:
    """Per phase (matmul kernel ms, other kernel ms) per optimizer step from the operator table, on a
    CUDA source only (there `self_ms` is device self time; on CPU it is host time)."""
    info = profile.get("ops_info") or {}
    traced = len(info.get("steps") or [])
    if profile["env"].get("device_type") != "cuda" or not traced or not profile.get("ops"):
        return None
    out: dict[str, list[float]] = {}
    for row in profile["ops"]:
        acc = out.setdefault(row.get("phase") or "other", [0.0, 0.0])
        acc[0 if MATMUL_OPS.search(row["name"]) else 1] += float(row["self_ms"] or 0.0) / traced
    return {ph: (mm, rest) for ph, (mm, rest) in out.items()}


def _leaf_ms(profile: dict[str, Any]) -> tuple[float, float] | None:
    """Forward and backward ms of the modules with no profiled children (attention, MLP, norms,
    embedding, LM head at the default depth): the model's work; what their parents add on top
    (hooks, engine bookkeeping, the loss) is the rest of the phase."""
    modules = profile.get("modules") or []
    parents = {m.get("parent") for m in modules}
    leaves = [m for m in modules if m["name"] not in parents and m["name"]]
    if not leaves:
        return None
    return sum(m["forward_ms"] for m in leaves), sum(m["backward_ms"] for m in leaves)


def _step_std(profile: dict[str, Any]) -> float:
    import statistics

    walls = [s["wall_ms"] for s in profile.get("steps") or [] if not s.get("warmup") and not s.get("instrumented")]
    return statistics.stdev(walls) if len(walls) >= 3 else 0.0


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] (0 for n = 1; 0.564 for 2; 1.424 for 8), by quadrature:
    the expected lead of the slowest of n ranks whose step times vary independently."""
    import math

    if n <= 1:
        return 0.0
    h, total = 0.01, 0.0
    for i in range(-800, 801):
        x = i * h
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = 0.5 * (1 + math.erf(x / math.sqrt(2)))
        total += x * n * pdf * cdf ** (n - 1) * h
    return total


def _is_decoder_layer(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()


@dataclasses.dataclass(kw_only=True)
class Machine:
    """Rates the step model scales by: achievable matmul TFLOP/s and memory GB/s, with sources."""

    name: str
    matmul_tflops: float | None
    memory_gbps: float | None
    matmul_source: str = ""
    memory_source: str = ""
    # measured per phase (forward, backward, recompute) from the Linear's GEMM layouts; None: one rate
    matmul_tflops_by_phase: dict[str, float] | None = None

    def matmul_rate(self, phase: str | None) -> float | None:
        """The matmul TFLOP/s of a phase's GEMMs: its own measured rate where there is one (None: the
        machine's one rate)."""
        return (self.matmul_tflops_by_phase or {}).get(phase) or self.matmul_tflops


@dataclasses.dataclass(kw_only=True)
class Link:
    """The collective fit for the target: {alpha_ms, busbw_gbps} and where it came from."""

    alpha_ms: float
    busbw_gbps: float
    source: str
    measured_here: bool = False  # a fit measured on the source's machine (gloo), not a catalog link

    @property
    def fit(self) -> dict[str, float]:
        """The {alpha_ms, busbw_gbps} fit that calibrate.collective_ms prices with."""
        return {"alpha_ms": self.alpha_ms, "busbw_gbps": self.busbw_gbps}


@dataclasses.dataclass(kw_only=True)
class StepProbe:
    """The target engine's optimizer `step()` probed in a group of one (calibrate.probe_engines)."""

    step_ms: float
    state_elements: float  # the optimizer state elements of that one rank: every trainable parameter's


@dataclasses.dataclass(kw_only=True)
class EngineProbe:
    """The target's engine against the source's, both probed at the source's shape in one process, in a
    group of one (calibrate.probe_engines): what the engine adds around the model, without communication."""

    forward: float  # target / source forward ms
    backward: float  # target / source backward ms
    step: float  # target / source optimizer step() ms
    target_step: StepProbe


@dataclasses.dataclass(kw_only=True)
class Change:
    """The target of one prediction, relative to the source."""

    micro_batch: int
    seq_len: int
    grad_accum: int
    recompute: bool
    attention: str
    zero_stage: int
    engine: str
    world_size: int
    state_elements_per_rank: float | None  # optimizer state elements this rank would hold
    source_state_elements_per_rank: float | None
    # the target's DeepSpeed settings that decide its ZeRO stage 0-2 collectives (DeepSpeed's defaults)
    reduce_bucket_elements: float = 5e8
    allgather_bucket_elements: float = 5e8
    overlap_comm: bool = False
    param_groups: int = 2  # trainprof.engines.optim.param_groups: matrices, and 1-D norms/biases
    # bytes of the trainable parameters when the task changes them (pretrain <-> LoRA/QLoRA); None: the source's
    trainable_param_bytes: float | None = None
    source_engine: str = "deepspeed"  # the source's engine kind (deepspeed | torch)


def predict_phases(m: Measured, change: Change, *, probes: tuple[dict[str, float], dict[str, float]] | None,
                   num_layers: int, source_machine: Machine | None, target_machine: Machine | None,
                   link: Link | None, source_zero_stage: int, memory_gbps: float | None = None,
                   engine: EngineProbe | None = None, step_probe: StepProbe | None = None,
                   engine_overhead: tuple[float, float] | None = None) -> tuple[dict[str, float], list[str]]:
    """Predicted phases (ms per optimizer step, per rank) and the assumptions made.

    Args:
        m: the measured source.
        change: the target configuration.
        probes: (source shape, target shape) timings from calibrate.probe_models on this machine, for
            same-machine predictions; None when the target is another machine.
        num_layers: decoder layers of the model.
        source_machine, target_machine: rates for a cross-machine prediction (None: same machine).
        link: the collective fit for the target's world size (None: no collectives, or one rank).
        source_zero_stage: the source's ZeRO stage (0 for the torch engine).
        memory_gbps: the source machine's measured memory bandwidth, for the optimizer's elementwise part
            (None: the optimizer scales with state elements alone).
        engine: the target's engine probed against the source's, for an engine change (ZeRO stage, offload,
            DeepSpeed/torch); None: the engine is unchanged.
        step_probe: the target engine's step() probed in a group of one, where the engine is unchanged but
            the target's step differs from the source's in kind (one rank: ZeRO-3 gathers nothing after it);
            an engine change brings its own.
        engine_overhead: (forward, backward) ms per micro batch that the source's engine adds to the bare
            model at the source's shape (Projector.engine_overhead), kept as measured when the shape
            changes; None: every ms of the leaves scales with the probe.
    """
    notes: list[str] = []
    ga_s, ga_t = m.grad_accum, change.grad_accum
    per_mb = {ph: m.phases_ms[ph] / ga_s for ph in ("forward", "backward", "recompute", "data_wait")}
    out: dict[str, float] = {}
    out["data_wait"] = per_mb["data_wait"] * ga_t
    f, b, r = per_mb["forward"], per_mb["backward"], per_mb["recompute"]
    # turning recomputation on re-runs every decoder layer's forward inside backward: their measured
    # forward (engine hooks included: ZeRO-3 fetches the parameters again), per micro batch
    layers_f = m.forward_layers_ms / ga_s if m.forward_layers_ms else None
    recompute_on = change.recompute and r == 0
    if probes is None and recompute_on:
        if layers_f:
            r = layers_f
            notes.append(_recompute_note(layers_f))
        else:
            raise ValueError("recomputation turned on, but the profile has no decoder-layer rows to re-run "
                             "(profile with module_depth >= 3)")
    if probes is not None:
        ps, pt = probes
        probe_f = lambda p: p["model_forward_ms"]  # noqa: E731
        probe_b = lambda p: p["model_backward_ms"]  # noqa: E731
        # the leaf modules' time is the model's work and scales with the probe; the rest of the phase
        # (hooks, engine bookkeeping, the loss in the root's own time) stays as measured
        leaf_f, leaf_b = (m.leaf_ms[0] / ga_s, m.leaf_ms[1] / ga_s) if m.leaf_ms else (f, b)
        leaf_f, leaf_b = min(leaf_f, f), min(leaf_b, b)
        kappa_f = leaf_f / probe_f(ps) if probe_f(ps) > 0 else 1.0
        # what the engine does per module call (ZeRO-3's parameter fetch and release, gradient hooks) is
        # inside the leaves' time but does not grow with the shape: only the rest is the model's work
        over_f, over_b = (min(engine_overhead[0], leaf_f), min(engine_overhead[1], leaf_b)) if engine_overhead \
            else (0.0, 0.0)
        work_f = (leaf_f - over_f) / probe_f(ps) if probe_f(ps) > 0 else 1.0
        work_b = (leaf_b - over_b) / probe_b(ps) if probe_b(ps) > 0 else 1.0
        f_t = f - leaf_f + over_f + work_f * probe_f(pt)
        b_t = b - leaf_b + over_b + work_b * probe_b(pt)
        if engine_overhead:
            notes.append(f"compute: {over_f:.2f} ms forward and {over_b:.2f} ms backward per micro batch are the "
                         "engine's own work (its probe minus the bare model's at the source's shape), kept as measured")
        layer_ratio = pt["layer_forward_ms"] / ps["layer_forward_ms"] if ps["layer_forward_ms"] > 0 else 1.0
        if change.recompute and r > 0:
            r_t = r * layer_ratio
        elif change.recompute and layers_f:
            r_t = layers_f * layer_ratio
            notes.append(_recompute_note(layers_f) + f", x {layer_ratio:.2f} (one layer's probed forward, target / "
                         "source)")
        elif change.recompute:
            r_t = kappa_f * num_layers * pt["layer_forward_ms"]
            notes.append("recompute: one more forward of every decoder layer, at the measured/probed forward "
                         f"ratio {kappa_f:.2f} (the profile has no decoder-layer rows)")
        else:
            r_t = 0.0
        notes.append(f"compute: the leaf modules' measured time x probe(target) / probe(source) (the recipe's model "
                     f"timed on this machine at both shapes, on a CPU beside as many busy copies as each run has "
                     f"other ranks; measured/probed: forward {work_f:.2f}, backward "
                     f"{work_b:.2f}); the rest of each phase (hooks, engine, loss) as measured")
        f, b, r = max(f_t, 0.0), max(b_t, 0.0), max(r_t, 0.0)
    if engine is not None:
        # what the engine adds around the model lands in leaves and parents alike (ZeRO-3 fetches and
        # releases parameters in module hooks): the whole phase scales; a recompute re-runs forwards
        f, b, r = f * engine.forward, b * engine.backward, r * engine.forward
        notes.append(f"engine change: forward x{engine.forward:.2f}, backward x{engine.backward:.2f} (both engines "
                     "probed at the source's shape in one process, a group of one, called alternately)")
    cross = target_machine is not None and source_machine is not None
    f_source = f
    if cross and m.kernel_ms is not None:
        f, b, r = (_scale_kernels(t, m.kernel_ms.get(ph), ga_s, source_machine, target_machine)
                   for t, ph in ((f, "forward"), (b, "backward"), (r, "recompute")))
        notes.append(f"compute on {target_machine.name}: each phase's GPU kernel time from the operator trace, "
                     f"matmul/attention kernels scaled by the matmul rate ({source_machine.matmul_source} -> "
                     f"{target_machine.matmul_source}), the other kernels by memory bandwidth; the rest of the phase "
                     "(the GPU waiting for the host: Python, hooks, engine, launches) as measured, the same host "
                     "assumed")
    elif cross:
        f, b, r = (_scale_compute(t, m.flops_by_phase.get(ph, 0.0) / ga_s, source_machine, target_machine, ph)
                   for t, ph in ((f, "forward"), (b, "backward"), (r, "recompute")))
        notes.append(f"compute on {target_machine.name}: matmul share (each phase's FLOPs / the source's measured "
                     f"rate for its GEMMs) scaled by {source_machine.matmul_source} -> "
                     f"{target_machine.matmul_source}; the rest scaled as memory-bound by memory bandwidth")
    if cross and recompute_on and f_source > 0:  # the source ran no recompute to re-rate: as its forward moved
        r = layers_f * f / f_source
    out["forward"], out["backward"], out["recompute"] = f * ga_t, b * ga_t, r * ga_t
    opt = m.phases_ms["optimizer"]
    n_s, n_t = change.source_state_elements_per_rank, change.state_elements_per_rank
    pass_ms = (lambda n: n * ADAM_BYTES_PER_ELEMENT / (memory_gbps * 1e9) * 1e3) if memory_gbps else None  # noqa: E731
    probed = step_probe or (engine.target_step if engine is not None else None)
    if probed is not None and pass_ms and n_t and (change.engine != "deepspeed" or change.zero_stage < 3
                                                   or change.world_size == 1):
        # below ZeRO-3, or on one rank, a step does no per-parameter work for other ranks (the source's may:
        # ZeRO-3 all-gathers its persistent parameters after the step): the target engine's own step,
        # probed, with Adam's pass moved from the probe's state elements to this rank's
        opt = max(probed.step_ms - pass_ms(probed.state_elements), 0.0) + pass_ms(n_t)
        notes.append(f"optimizer: the target engine's step() probed in a group of one ({probed.step_ms:.2f} ms "
                     f"over {probed.state_elements:,.0f} state elements), with Adam's pass re-priced for {n_t:,.0f} "
                     f"elements per rank at {ADAM_BYTES_PER_ELEMENT} B each over {memory_gbps:.3g} GB/s")
    else:
        if n_s and n_t and n_s != n_t:
            if pass_ms:
                fixed = max(opt - pass_ms(n_s), 0.0)
                opt = fixed + pass_ms(n_t)
                notes.append(f"optimizer: {fixed:.2f} ms fixed as measured + Adam's pass over {n_t:,.0f} state "
                             f"elements per rank at {ADAM_BYTES_PER_ELEMENT} B each over {memory_gbps:.3g} GB/s")
            else:
                opt *= n_t / n_s
                notes.append("optimizer: scaled by state elements per rank")
        if engine is not None:
            opt *= engine.step
            notes.append(f"engine change: optimizer step x{engine.step:.2f} (both engines' step() probed in a group "
                         "of one)")
    if cross and m.kernel_ms is not None:
        opt = _scale_kernels(opt, m.kernel_ms.get("optimizer"), 1, source_machine, target_machine)
    elif cross and source_machine.memory_gbps and target_machine.memory_gbps:
        opt *= source_machine.memory_gbps / target_machine.memory_gbps
    out["optimizer"] = opt
    out["comm_exposed"], comm_notes = _comm(m, change, link, source_zero_stage)
    notes.extend(comm_notes)
    out["other"] = m.phases_ms["other"]
    return out, notes


def _recompute_note(layers_f: float) -> str:
    return (f"recompute: one more forward of every decoder layer, their measured forward ({layers_f:.2f} ms per "
            "micro batch, engine hooks included)")


def residual_ms(m: Measured, phases: dict[str, float], unattributed: float | None = None) -> float:
    """The unattributed part of a predicted step: the source's (signed) residual (`unattributed`, default
    m.unattributed_ms) scaled by predicted / measured phase sum. Same phases: exactly the source's
    residual, so the same recipe reproduces the measured step."""
    base = m.unattributed_ms if unattributed is None else unattributed
    measured = sum(m.phases_ms.values())
    return base * sum(phases.values()) / measured if measured > 0 else base


def _scale_kernels(ms: float, kernels: tuple[float, float] | None, per: int, src: Machine, dst: Machine) -> float:
    """A phase's `ms` on the target: its kernel time (matmul, other; per optimizer step, / `per` micro
    batches) re-rated, the GPU's idle rest of the phase unchanged. Kernel time over the phase (the
    trace ran one step, the phase is a median) is capped at the phase."""
    _require_rates(src, dst)
    if not kernels or ms <= 0:
        return ms
    mm, rest = kernels[0] / per, kernels[1] / per
    if mm + rest > ms:
        mm, rest = mm * ms / (mm + rest), rest * ms / (mm + rest)
    return ms - mm - rest + _rerate(mm, rest, src, dst)


def _scale_compute(ms: float, flops: float, src: Machine, dst: Machine, phase: str) -> float:
    """A phase's `ms` on the target: its matmul share (its FLOPs at the source's rate for the phase's
    GEMM layouts, capped at the phase) × source/target rate, the rest × source/target bandwidth."""
    _require_rates(src, dst)
    matmul = min(flops / (src.matmul_rate(phase) * 1e12) * 1e3, ms)
    return _rerate(matmul, ms - matmul, src, dst, phase)


def _require_rates(src: Machine, dst: Machine) -> None:
    if not (src.matmul_tflops and dst.matmul_tflops and src.memory_gbps and dst.memory_gbps):
        raise ValueError("cross-machine compute needs matmul and memory rates for both machines")


def _rerate(matmul_ms: float, other_ms: float, src: Machine, dst: Machine, phase: str | None = None) -> float:
    """Matmul time × source/target matmul rate (the phase's own rates, where both were measured per
    phase) plus memory-bound time × source/target bandwidth."""
    return matmul_ms * src.matmul_rate(phase) / dst.matmul_rate(phase) + other_ms * src.memory_gbps / dst.memory_gbps


def derives_zero_collectives(change: Change, source_zero_stage: int) -> bool:
    """Whether the target's collectives are derived from the model rather than from the source's: a
    DeepSpeed target at ZeRO stage 0-2 on more than one rank, at a stage other than the source's or training
    other parameters (a task change: LoRA's adapters instead of every weight). Those
    stages issue a few bucketed, blocking collectives whose calls and bytes follow from the parameter
    count; ZeRO-3's prefetched per-module gathers do not (a stage-3 target keeps the volume ratio)."""
    return change.engine == "deepspeed" and change.zero_stage <= 2 and change.world_size > 1 \
        and (change.zero_stage != source_zero_stage or change.trainable_param_bytes is not None)


def _trainable_bytes(m: Measured, change: Change) -> float:
    """Bytes of the target's trainable parameters in the model dtype: the task's when it changes them, else
    the source's."""
    return m.trainable_param_bytes if change.trainable_param_bytes is None else change.trainable_param_bytes


def derives_ddp_collectives(change: Change, source_world_size: int) -> bool:
    """Whether the target's collectives are PyTorch DDP's, derived from the model: a torch-engine target on
    more than one rank whose source ran no DDP (another engine, or one rank) or trained other parameters
    (a task change). A DDP source at its own parameters keeps its measured (or re-timed) rows."""
    return change.engine == "torch" and change.world_size > 1 and (
        change.source_engine != "torch" or source_world_size == 1 or change.trainable_param_bytes is not None)


def _ddp_comm(m: Measured, change: Change, link: Link) -> tuple[float, list[str]]:
    """Exposed ms of PyTorch DDP's gradient all_reduce per optimizer step (torch/nn/parallel/distributed.py,
    the C++ Reducer): gradients are bucketed in reverse parameter order (the first bucket
    DDP_FIRST_BUCKET_BYTES, the others DDP_BUCKET_BYTES) and each bucket is all-reduced as soon as the
    backward has produced all of its gradients, overlapped with the rest of the backward; the last bucket
    (the remainder: the first layers and the embedding, whose gradients come last) is launched when the
    backward ends and waited for: exposed whole, with the wait a blocking call of the source had beyond its
    price (`_in_training_wait`). Once a step: the torch engine skips the sync on micro
    batches before the boundary (DDP.no_sync). Gradients are fp32: the torch engine keeps trainable
    parameters in fp32 under autocast."""
    n, fit = change.world_size, link.fit
    grads = _trainable_bytes(m, change) / m.dtype_bytes * 4
    if grads <= 0:
        return float("nan"), ["comm: the profile records no trainable parameters to derive DDP's all_reduce from"]
    rest = max(grads - DDP_FIRST_BUCKET_BYTES, 0.0)
    last = grads if rest == 0 else rest - DDP_BUCKET_BYTES * (math.ceil(rest / DDP_BUCKET_BYTES) - 1)
    buckets = 1 + math.ceil(rest / DDP_BUCKET_BYTES)
    tail = collective_ms("all_reduce", last, n, fit)
    wait, wait_note = _in_training_wait(m, n, link)
    return tail + wait, [
        f"comm: PyTorch DDP's gradient all_reduce derived from the {grads / 1e6:.3g} MB of fp32 gradients: {buckets} "
        f"bucket(s), all but the last hidden behind the backward; the last ({last / 1e6:.3g} MB), launched when the "
        f"backward ends, blocking: {tail:.2f} ms as alpha + bytes*busfactor/busbw over {link.source} (the profiler "
        "counts this wait inside the backward phase)", wait_note]


def _bucketed_zero_comm(m: Measured, change: Change, link: Link) -> tuple[float, list[str]]:
    """Exposed ms of DeepSpeed's ZeRO stage 0-2 collectives per optimizer step, derived from the trainable
    parameters (deepspeed/runtime/engine.py `allreduce_gradients`, zero/stage_1_and_2.py):
      * gradient reduction, one all_reduce per reduce bucket (the op DeepSpeed issued in the runs here);
        stage 2 partitions gradients and reduces every micro batch, stages 0/1 once per step;
      * stage 1/2: the updated partitions all-gathered after the step, one call per parameter group
        and allgather bucket;
      * the source's small optimizer-phase collectives (gradient norm, overflow flag) as measured.
    Without overlap_comm (DeepSpeed's default below stage 3) the reduction blocks the backward: exposed
    whole; with it, at the source's measured exposed fraction of its backward reductions."""
    n, stage, fit = change.world_size, change.zero_stage, link.fit
    grads = _trainable_bytes(m, change)
    if grads <= 0:
        return float("nan"), ["comm: the profile records no trainable parameters to derive ZeRO's collectives from"]
    elements = grads / m.dtype_bytes
    reduce_calls = max(1, math.ceil(elements / change.reduce_bucket_elements))
    reductions = change.grad_accum if stage == 2 else 1
    reduce_ms = reductions * reduce_calls * collective_ms("all_reduce", grads / reduce_calls, n, fit)
    exposed = 1.0
    if change.overlap_comm:
        rows = [c for c in m.comm if c["phase"] == "backward" and c["op"] in ("all_reduce", "reduce_scatter_tensor")
                and c.get("total_ms")]
        exposed = min(sum(c["exposed_ms"] for c in rows) / sum(c["total_ms"] for c in rows), 1.0) if rows else 1.0
    gather_ms, gather_calls = 0.0, 0
    if stage >= 1:
        gather_calls = max(change.param_groups, math.ceil(elements / change.allgather_bucket_elements))
        gather_ms = gather_calls * collective_ms("all_gather_into_tensor", grads / gather_calls, n, fit)
    small = sum(c["exposed_ms"] for c in m.comm if c["phase"] == "optimizer" and c["calls"]
                and (c.get("bytes") or 0) / c["calls"] < SMALL_COLLECTIVE_BYTES)
    wait, wait_note = _in_training_wait(m, n, link)
    blocking = (0 if change.overlap_comm else reductions * reduce_calls) + gather_calls
    notes = [f"comm: ZeRO stage {stage}'s collectives derived from the {grads / 1e6:.3g} MB of trainable parameters "
             f"and priced as alpha + bytes*busfactor/busbw over {link.source}: gradient all_reduce "
             f"{reductions * reduce_calls} call(s), {reduce_ms:.2f} ms"
             + (f", exposed at the source's measured fraction {exposed:.2f} (overlap_comm)" if change.overlap_comm
                else ", blocking (no overlap_comm): exposed whole")
             + (f"; updated partitions all-gathered after the step, {gather_ms:.2f} ms, blocking" if stage >= 1 else "")
             + f"; the source's small optimizer collectives (norm, overflow flag) as measured, {small:.2f} ms", wait_note]
    return reduce_ms * exposed + gather_ms + wait * blocking + small, notes


def task_change_not_derived(change: Change) -> str | None:
    """Why the collectives of a task change (pretrain <-> LoRA/QLoRA) are not predicted, or None: they are
    derived at DeepSpeed ZeRO stage 0-2 and under DDP, and absent on one rank; under ZeRO-3 on several
    ranks, which parameters are gathered, reduced and kept persistent changes with the adapters (a LoRA
    run here issued 27 parameter all-gathers after its step where pretraining issued 19)."""
    if change.trainable_param_bytes is None or change.world_size <= 1 or change.engine != "deepspeed" \
            or change.zero_stage <= 2:
        return None
    return (f"comm: a task change on {change.world_size} ranks under DeepSpeed ZeRO-3 is not derived (which "
            "parameters are gathered, reduced and kept persistent changes with the adapters); project it at "
            "DeepSpeed ZeRO stage 0-2, PyTorch DDP or on one rank, or measure a run")


def _recorded_ms(c: dict[str, Any], n: int, link: Link) -> float:
    """The α-β price over `link` of a collective row of the profile (its calls at their mean bytes)."""
    per_call_bytes = c["bytes"] / c["calls"] if c.get("bytes") else 0.0
    return c["calls"] * collective_ms(c["op"], per_call_bytes, n, link.fit)


def _in_training_wait(m: Measured, n: int, link: Link) -> tuple[float, str]:
    """The wait per blocking collective in training beyond its α-β price (the other rank still computing
    when one arrives, cores and caches shared with the model's work): the source's blocking collectives'
    measured time minus their price by the same fit, per call, never below 0. Only where the fit was
    measured on the source's machine at its world size; 0 otherwise."""
    if not link.measured_here or m.world_size != n:
        return 0.0, "comm: no in-training wait added (the link is not the source's own at its world size)"
    rows = [c for c in m.comm if c["calls"] and c.get("total_ms") and c["exposed_ms"] >= 0.95 * c["total_ms"]]
    if not rows:
        return 0.0, "comm: no in-training wait added (the source recorded no blocking collective)"
    calls = sum(c["calls"] for c in rows)
    priced = sum(_recorded_ms(c, n, link) for c in rows)
    measured = sum(c["total_ms"] for c in rows)
    wait = max(measured - priced, 0.0) / calls
    return wait, (f"comm: + {wait:.2f} ms a blocking call waited in training: the source's {calls} blocking collectives "
                  f"took {measured:.2f} ms against {priced:.2f} ms priced by the same fit")


def _comm(m: Measured, change: Change, link: Link | None, source_zero_stage: int) -> tuple[float, list[str]]:
    n = change.world_size
    if n <= 1 and m.world_size > 1:
        return 0.0, ["one rank: no collectives"]
    if derives_zero_collectives(change, source_zero_stage):
        if link is None:
            return float("nan"), [f"comm: no collective calibration for {n} ranks to price ZeRO stage "
                                  f"{change.zero_stage}'s collectives"]
        return _bucketed_zero_comm(m, change, link)
    if derives_ddp_collectives(change, m.world_size):
        if link is None:
            return float("nan"), [f"comm: no collective calibration for {n} ranks to price DDP's gradient all_reduce"]
        return _ddp_comm(m, change, link)
    why = task_change_not_derived(change)
    if why:
        return float("nan"), [why]
    if link is None:
        if m.world_size == n:
            scale = ZERO_VOLUME[change.zero_stage] / ZERO_VOLUME[source_zero_stage]
            per_mb = sum(c["exposed_ms"] for c in m.comm if c["phase"] in ("forward", "backward"))
            rest = m.phases_ms["comm_exposed"] - per_mb
            ms = (per_mb * change.grad_accum / m.grad_accum + rest) * scale
            note = "comm: as measured (same world size and link); forward/backward collectives per micro batch"
            if scale != 1.0:
                note += f"; ZeRO stage {source_zero_stage} -> {change.zero_stage} volume x{scale:.2f} (ZeRO paper)"
            return max(ms, 0.0), [note]
        return float("nan"), ["comm: no collective calibration for this world size"]
    total = 0.0
    rows = [c for c in m.comm if c["calls"]]
    notes: list[str] = []
    if m.world_size == 1:
        # one rank: DeepSpeed skips the parameter gathers; add them from the ZeRO paper's volumes (one call each)
        gathers = {3: ("forward", "backward"), 2: ("optimizer",), 1: ("optimizer",)}.get(change.zero_stage, ())
        rows += [{"op": "all_gather_into_tensor", "phase": ph, "calls": 1, "bytes": m.param_bytes, "total_ms": 0.0,
                  "exposed_ms": 0.0} for ph in gathers]
        if gathers:
            notes.append(f"comm: parameter all-gathers in {', '.join(gathers)} added (ZeRO stage {change.zero_stage}; "
                         "the one-rank source issued none), one call each")
    if not rows:
        return float("nan"), ["comm: the source recorded no collectives to re-time"]
    for c in rows:
        t = _recorded_ms(c, n, link)
        exposed_frac = (c["exposed_ms"] / c["total_ms"]) if (m.world_size > 1 and c.get("total_ms")) else 1.0
        repeat = change.grad_accum / m.grad_accum if c["phase"] in ("forward", "backward") else 1.0
        total += t * min(exposed_frac, 1.0) * repeat
    if m.world_size == 1 and m.step_std_ms:
        wait = m.step_std_ms * expected_max_normal(n)
        total += wait
        notes.append(f"comm: + {wait:.2f} ms waiting for the slowest of {n} ranks (measured step spread "
                     f"{m.step_std_ms:.2f} ms x E[max of {n} normals] = {expected_max_normal(n):.3f})")
    scale = ZERO_VOLUME[change.zero_stage] / ZERO_VOLUME[source_zero_stage]
    notes += [f"comm: each collective re-timed as alpha + bytes*busfactor/busbw over {link.source}, times the "
             "exposed fraction measured at the source (1 when the source had one rank)"]
    if scale != 1.0:
        notes.append(f"comm: ZeRO stage {source_zero_stage} -> {change.zero_stage} volume x{scale:.2f} (ZeRO paper)")
    return total * scale, notes
