"""The step model: a measured profile split into parts that scale differently, and re-derived for a
changed recipe, model size, world size or machine.

A measured optimizer step (per rank, ms) is split as the profiler measured it:

    step = data_wait + forward + backward + recompute + optimizer + comm_exposed + other + unattributed

and each part is re-derived for the target:

  * forward / backward / recompute, per micro batch (x grad_accum): see projection/compute.py. On the
    source's machine a changed shape (micro batch, sequence, attention, model size) is probed: one
    decoder layer and the rest of the model timed at both shapes, bare; otherwise (another machine, or
    a shape too large to probe) the work is re-derived from its GEMMs at each machine's rate for their
    shapes and its memory traffic, and on a GPU a phase takes the longer of its device and host time.
    An engine change (ZeRO stage, offload, DeepSpeed <-> torch, pretrain <-> LoRA/QLoRA) scales the
    phases by both engines probed at the source's shape. Turning recomputation on adds one forward of
    every decoder layer.
  * optimizer: a fixed part plus Adam's elementwise pass over the state this rank holds (ZeRO
    partitions it) at the memory bandwidth; another engine's probed step(); on a GPU target the longer
    of Adam's pass at the target's bandwidth and the host's operator calls.
  * comm_exposed: projection/comm.py (re-timed or derived collectives, NCCL's latency on catalog links).
  * data_wait: as measured, per micro batch. other: as measured.
  * unattributed: the source's (signed) residual scaled with the phases' sum (residual_ms), so that a
    faster target does not inherit the source's ms.
"""

from __future__ import annotations

import dataclasses

from trainprof.analysis.gpu_busy import HOST_BOUND_BUSY
from trainprof.projection.assumptions import Assumption, assume
from trainprof.projection.comm import CommTarget, Link, exposed_comm
from trainprof.projection.compute import (ADAM_BYTES_PER_ELEMENT, EngineProbe, Machine, Parts,
                                          StepProbe, combine, elementwise, engine_scaled, optimizer_ms, per_micro_batch,
                                          probed_compute, rerated_phase)
from trainprof.projection.gemm import Work
from trainprof.projection.measured import PHASES, Measured


@dataclasses.dataclass(slots=True, kw_only=True)
class Change:
    """The target of one prediction, relative to the source."""

    work: Work  # the target's model and micro batch
    source_work: Work
    grad_accum: int
    recompute: bool
    state_elements_per_rank: float | None  # optimizer state elements this rank would hold
    source_state_elements_per_rank: float | None
    comm: CommTarget

    @property
    def world_size(self) -> int:
        return self.comm.world_size


@dataclasses.dataclass(slots=True, kw_only=True)
class Inputs:
    """What a prediction measured or looked up besides the profile."""

    parts: Parts | None = None  # the source's machine, the shape probed
    zero3_bytes: tuple[float, float] | None = None  # (source, target) parameter bytes ZeRO-3 gathers
    engine: EngineProbe | None = None  # an engine or task change, probed
    step_probe: StepProbe | None = None  # the target engine's step(), probed
    source_machine: Machine | None = None  # set with target_machine: re-derive from GEMMs and traffic
    target_machine: Machine | None = None
    host_us_per_op: dict[str, float] | None = None  # a GPU target from a CPU source: host time per call
    ops_per_layer: dict[str, float] | None = None  # a GPU target from a CPU source: calls a GPU run issues
    link: Link | None = None
    memory_gbps: float | None = None  # the source machine's measured memory bandwidth
    optimizer_bytes_per_param: tuple[float, str] | None = None  # a GPU target from a CPU source: its Adam's bytes
    optimizer_host: tuple[float, float, str] | None = None  # DeepSpeed on a GPU target: (calls, host µs each, source)


def predict_phases(m: Measured, change: Change, inputs: Inputs) -> tuple[dict[str, float], list[Assumption]]:
    """Predicted phases (ms per optimizer step, per rank) and the assumptions made.

    Raises:
        ValueError: a part the inputs cannot support (the message says what is missing).
    """
    notes: list[Assumption] = []
    mb, recompute_layers = _compute_per_micro_batch(m, change, inputs, notes)
    if change.recompute and m.phases_ms["recompute"] == 0:
        if recompute_layers is None:
            raise ValueError("recomputation turned on, but the profile has no decoder-layer rows to re-run "
                             "(profile with module_depth >= 3)")
        mb["recompute"] = recompute_layers
        notes.append(assume("recompute_on", layers_forward_ms=recompute_layers))
    elif not change.recompute:
        mb["recompute"] = 0.0
    if inputs.engine is not None:
        mb, note = engine_scaled(mb, inputs.engine)
        notes.append(note)
    ga = change.grad_accum
    out = {ph: mb[ph] * ga for ph in ("data_wait", "forward", "backward", "recompute")}
    out["optimizer"], opt_notes = _optimizer(m, change, inputs)
    notes += opt_notes
    change.comm.compute_ms = {"forward": out["forward"], "backward": out["backward"] + out["recompute"]}
    out["comm_exposed"], comm_notes = exposed_comm(m, change.comm, inputs.link)
    notes += comm_notes
    out["other"] = m.phases_ms["other"]
    return {ph: out[ph] for ph in PHASES}, notes


def _compute_per_micro_batch(m: Measured, change: Change, inputs: Inputs, notes: list[Assumption]
                             ) -> tuple[dict[str, float], float | None]:
    """Forward, backward, recompute and data wait per micro batch, and the target's decoder layers'
    forward per micro batch (what turning recomputation on re-runs)."""
    mb = per_micro_batch(m)
    layers_f = m.forward_layers_ms / m.grad_accum if m.forward_layers_ms else None
    if inputs.parts is not None:  # probed here; a change of threads also sets the machines, for the optimizer
        phases, layers_f_t, more = probed_compute(m, change.source_work, change.work, inputs.parts,
                                                  inputs.memory_gbps, inputs.zero3_bytes)
        notes += more
        if mb["recompute"] and layers_f:
            mb["recompute"] *= (layers_f_t or 0.0) / layers_f
        mb.update(phases)
        return mb, layers_f_t
    if inputs.target_machine is not None and inputs.source_machine is not None:
        return _rerated(m, change, inputs, notes, mb, layers_f)
    return mb, layers_f


def _rerated(m: Measured, change: Change, inputs: Inputs, notes: list[Assumption], mb: dict[str, float],
             layers_f: float | None) -> tuple[dict[str, float], float | None]:
    src_m, dst_m = inputs.source_machine, inputs.target_machine
    assert src_m is not None and dst_m is not None
    host, calls = inputs.host_us_per_op or {}, inputs.ops_per_layer or {}
    host_ms = device_ms = host_calls = 0.0  # of the phases whose host work is modelled on a GPU target
    for ph in ("forward", "backward", "recompute"):
        if mb[ph] > 0:
            r = rerated_phase(m, ph, change.source_work, change.work, src_m, dst_m, host.get(ph), calls.get(ph))
            mb[ph] = combine(r, dst_m.is_gpu)
            if dst_m.is_gpu and r.host_ms is not None:
                host_ms, device_ms = host_ms + r.host_ms, device_ms + r.device_ms
                host_calls += r.calls or 0.0
    if device_ms < HOST_BOUND_BUSY * host_ms:  # the bar a source phase is called host-bound by (hostref)
        notes.append(assume("host_bound_target", target=dst_m.name, calls=host_calls * m.grad_accum,
                            layers=change.work.shape.num_layers, host_ms=host_ms * m.grad_accum,
                            device_ms=device_ms * m.grad_accum, busy=device_ms / host_ms, bar=HOST_BOUND_BUSY))
    recompute_t = None
    if layers_f and m.phases_ms["forward"] > 0:
        # the layers' share of the forward, re-rated as the forward was
        fwd_s = m.phases_ms["forward"] / m.grad_accum
        recompute_t = mb["forward"] * layers_f / fwd_s
    if src_m.is_gpu == dst_m.is_gpu:
        notes.append(assume("device_rerated", target=dst_m.name, matmul_source=dst_m.matmul_source,
                            memory_source=dst_m.memory_source, elementwise=elementwise(dst_m)[1],
                            source_elementwise=elementwise(src_m)[1]))
    else:
        notes.append(assume("device_analytic", target=dst_m.name, matmul_source=dst_m.matmul_source,
                            memory_source=dst_m.memory_source, elementwise=elementwise(dst_m)[1]))
    return mb, recompute_t


def _optimizer(m: Measured, change: Change, inputs: Inputs) -> tuple[float, list[Assumption]]:
    n_s, n_t = change.source_state_elements_per_rank, change.state_elements_per_rank
    dst = inputs.target_machine
    if dst is not None and dst.is_gpu and dst.memory_gbps:
        return _gpu_optimizer(m, change, inputs, dst)
    probed = inputs.step_probe or (inputs.engine.target_step if inputs.engine is not None else None)
    step_per_rank = change.comm.engine != "deepspeed" or change.comm.zero_stage < 3 or change.world_size == 1
    opt, notes = optimizer_ms(m, source_elements=n_s, target_elements=n_t, memory_gbps=inputs.memory_gbps,
                              probed=probed if step_per_rank else None, engine=inputs.engine,
                              step_ns=inputs.parts.step_ns if inputs.parts is not None else None)
    src = inputs.source_machine
    if dst is not None and src is not None and src.memory_gbps and dst.memory_gbps:
        opt *= src.memory_gbps / dst.memory_gbps
    return opt, notes


def _gpu_optimizer(m: Measured, change: Change, inputs: Inputs, dst: Machine) -> tuple[float, list[Assumption]]:
    """The optimizer on a GPU target: the longer of its kernels and the host's operator calls. A GPU
    source's own optimizer kernels move with the state per rank and the bandwidth (like for like);
    from a CPU the kernels are the target's state per rank x the bytes its engine's Adam moves per
    parameter on a GPU (measured on the reference GPUs) over the target's bandwidth."""
    n_s, n_t = change.source_state_elements_per_rank or 0.0, change.state_elements_per_rank or 0.0
    ops = (m.ops or {}).get("optimizer")
    src = inputs.source_machine
    if m.device_type == "cuda" and ops is not None and src is not None and src.memory_gbps and n_s:
        kernels = ops.matmul_ms + ops.other_ms
        device = kernels * n_t / n_s * src.memory_gbps / dst.memory_gbps
        measured = m.phases_ms.get("optimizer")
        if src is dst and measured is not None:  # its own GPU: the host's part is measured, not looked up
            return max(measured - kernels, 0.0) + device, [assume(
                "optimizer_own_gpu", measured_ms=measured, kernels_ms=kernels, target_elements=n_t)]
        note = assume("optimizer_rerated", target=dst.name, target_elements=n_t, memory_gbps=dst.memory_gbps)
    else:
        per_param, where = inputs.optimizer_bytes_per_param or (ADAM_BYTES_PER_ELEMENT, "one ideal fp32 Adam pass")
        device = n_t * per_param / (dst.memory_gbps * 1e9) * 1e3
        note = assume("optimizer_gpu_bytes", target=dst.name, target_elements=n_t, bytes_per_param=per_param,
                      source=where, memory_gbps=dst.memory_gbps)
    if inputs.optimizer_host is not None:  # DeepSpeed's step waits for its kernels between its calls: they add
        calls, us, where = inputs.optimizer_host
        return device + calls * us / 1e3, [note, assume("optimizer_host_added", calls=calls, us=us, source=where)]
    host = (inputs.host_us_per_op or {}).get("optimizer")
    if ops is None or not host:
        return device, [note]
    return max(device, ops.calls * host / 1e3), [note, assume("optimizer_host_longer", calls=ops.calls, us=host)]


def residual_ms(m: Measured, phases: dict[str, float], unattributed: float | None = None) -> float:
    """The unattributed part of a predicted step: the source's (signed) residual (`unattributed`, default
    m.unattributed_ms) scaled by predicted / measured phase sum. Same phases: exactly the source's
    residual, so the same recipe reproduces the measured step."""
    base = m.unattributed_ms if unattributed is None else unattributed
    measured = sum(m.phases_ms.values())
    return base * sum(phases.values()) / measured if measured > 0 else base
