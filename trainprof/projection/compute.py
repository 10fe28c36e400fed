"""The compute phases of a predicted step (forward, backward, recompute) and its optimizer phase.

Same machine, shape probed (projection/probes.py): each phase is split as the profiler timed it into
the decoder layers, the rest of the model (embedding, final norm, LM head, loss) and what lies outside
the model (the engine's wrapper, hooks). The engine's own work per module call (its probe minus the
bare model's) is taken out of the model's time first; the rest of the layers' time scales with one
probed layer's target/source ratio and the layer count, the rest of the model's with its probed ratio;
the engine's work is kept (ZeRO-3's: its fixed part, plus the parameter bytes it moves at the memory
bandwidth); outside time stays as measured.

Otherwise (another machine, or a shape too large to probe here) the model's work is re-derived from its
GEMMs and memory traffic (projection/gemm.py): GEMM time at each machine's rate for each GEMM's shape,
the rest of the device work by memory traffic over bandwidth. On a GPU target a phase takes the longer
of its device time and its host time (operator calls x host time per call), as an asynchronous GPU
does: a host-bound source stays host-bound.

Optimizer: a fixed part (the engine's step machinery) plus Adam's elementwise pass over the state the
rank holds, at ADAM_BYTES_PER_ELEMENT over the memory bandwidth; an engine change takes the target
engine's probed step().
"""

from __future__ import annotations

import dataclasses

from trainprof.analysis.gpu_busy import HOST_BOUND_BUSY
from trainprof.projection.assumptions import Assumption, assume
from trainprof.projection.gemm import GemmRate, Work
from trainprof.projection.measured import COMPUTE_PHASES, Measured

ADAM_BYTES_PER_ELEMENT = 28  # fp32 Adam: read param, grad, exp_avg, exp_avg_sq; write param, exp_avg, exp_avg_sq
# the probed layers' relative standard error (probes.paired_error) beyond which a row says the probe was noisy
PROBE_ERROR_NOTE = 0.05
# a bare probed layer at the source's shape against the run's measured layer, which adds hooks to the same work:
# above this the probe ran at another machine speed than the run (a busy spell), and a row says so
PROBE_OVER_RUN_NOTE = 1.5
ZERO3_COPIES_PER_BYTE = 2.0  # a ZeRO-3 fetch writes the gathered parameter and reads it back into the module
# operator calls a task adds per adapted linear and pass, for the host's time: peft's LoraLayer.forward runs
# dropout, lora_A, lora_B, the scaling and the add; bitsandbytes' Linear4bit dequantizes before its matmul
LORA_OPS_PER_TARGET = 5
DEQUANT_OPS_PER_LINEAR = 2


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """The rates a machine's work is priced at: GEMM throughput by shape, memory bandwidth, host time."""

    name: str
    is_gpu: bool
    gemm: dict[str, GemmRate]  # by phase: forward, backward, recompute
    memory_gbps: float | None
    matmul_source: str = ""
    memory_source: str = ""
    host_us_per_op: dict[str, float] | None = None  # a GPU host: per phase, time per operator call
    host_source: str = ""
    accelerator: str | None = None  # its catalog key where known (a source run's GPU), else its name is one

    @property
    def matmul_tflops(self) -> float | None:
        rates = [g.best_tflops for g in self.gemm.values() if g.best_tflops]
        return max(rates) if rates else None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineProbe:
    """The target's engine against the source's, both probed at the source's shape in one process, in a
    group of one (probes.probe_engines): what the engine adds around the model, without communication."""

    forward: float  # target / source forward ms
    backward: float
    step: float  # target / source optimizer step() ms
    target_step: "StepProbe"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepProbe:
    """An engine's optimizer `step()` probed in a group of one."""

    step_ms: float
    state_elements: float  # the optimizer state elements of that one rank: every trainable parameter's


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """One decoder layer's and the rest of the model's bare work per micro batch (ms, by phase), at the
    source's shape and at the target's, probed on this machine (probes.probe_parts)."""

    layer_source: dict[str, float]
    layer_target: dict[str, float]
    rest_source: dict[str, float]
    rest_target: dict[str, float]
    layers_probed: int
    threads: tuple[int, int] | None = None  # (source, target) intra-op threads, where they differ
    step_ns: tuple[float, float] | None = None  # (source, target) ns of a mixed-precision AdamW step per element
    error: float | None = None  # the larger of the two probes' layer_error (a fraction); None: not kept


def probed_compute(m: Measured, src: Work, tgt: Work, parts: Parts, memory_gbps: float | None,
                   zero3_bytes: tuple[float, float] | None) -> tuple[dict[str, float], float, list[Assumption]]:
    """Forward and backward ms per micro batch on the source's machine at the target's shape: each
    decoder layer's measured time plus the probed change of one layer's work, times the target's layer
    count; the rest of the model's measured time plus its probed change; the time outside the model as
    measured. What the measurement holds beyond the bare work (hooks, the engine's work per module call,
    the loss's glue) is kept, per layer where it is per layer; ZeRO-3's copies of the gathered parameters
    move with their bytes at the memory bandwidth.

    Args:
        zero3_bytes: (source, target) parameter bytes ZeRO-3 gathers in a forward.
    Returns:
        ({forward, backward}, the target's decoder layers' forward per micro batch (for recompute),
        assumptions).
    Raises:
        ValueError: the profile has no decoder-layer rows.
    """
    if m.parts_ms is None:
        raise ValueError("the shape changed but the profile has no decoder-layer rows to scale "
                         "(profile with profile.module_depth >= 3)")
    ga, layers_s, layers_t = m.grad_accum, max(src.shape.num_layers, 1), tgt.shape.num_layers
    out: dict[str, float] = {}
    layers_by_phase: dict[str, float] = {}
    # a change of depth alone leaves each layer's and the rest's work as measured: their probed change is noise
    same = parts.threads is None and _per_layer_work(src) == _per_layer_work(tgt)
    slower: dict[str, float] = {}  # phase -> the probe's bare layer over the run's measured one
    for ph in ("forward", "backward"):
        layers, model = (x / ga for x in m.parts_ms[ph])
        outside = m.phases_ms[ph] / ga - model
        measured_layer = layers / layers_s
        per_layer = measured_layer + (0.0 if same else parts.layer_target[ph] - parts.layer_source[ph])
        if not same and per_layer <= 0:  # the probe's change is more than the run's whole layer: nothing stands on it
            raise ValueError(
                f"the probe of the run's own shape took {parts.layer_source[ph]:.1f} ms a bare decoder layer {ph} "
                f"(per micro batch) against the run's measured {measured_layer:.1f} ms with its hooks: this machine "
                "ran at another speed while it probed than during the run (the run's load is in its report); "
                "project again when the machine is as busy as it was during the run")
        if not same and measured_layer > 0 and parts.layer_source[ph] > PROBE_OVER_RUN_NOTE * measured_layer:
            slower[ph] = parts.layer_source[ph] / measured_layer
        layers_by_phase[ph] = per_layer * layers_t
        rest = max(model - layers + (0.0 if same else parts.rest_target[ph] - parts.rest_source[ph]), 0.0)
        out[ph] = max(layers_by_phase[ph] + rest + outside, 0.0)
    copies = 0.0
    if zero3_bytes and memory_gbps:
        copies = (zero3_bytes[1] - zero3_bytes[0]) * ZERO3_COPIES_PER_BYTE / (memory_gbps * 1e9) * 1e3
        out["forward"] = max(out["forward"] + copies, 0.0)
    notes = [assume("parts_probed", layer_source_ms=parts.layer_source["forward"],
                    layer_target_ms=parts.layer_target["forward"], rest_source_ms=parts.rest_source["forward"],
                    rest_target_ms=parts.rest_target["forward"], probe_layers=parts.layers_probed,
                    target_layers=layers_t, source_layers=layers_s, copies_ms=copies,
                    neighbours_text=f", beside {m.world_size - 1} busy copies" if m.world_size > 1 else "",
                    same_text="; the layers' and the rest's work unchanged (a change of depth): their measured time "
                              "kept, the probed change being noise" if same else "",
                    threads_text=(f", the source's shape at {parts.threads[0]} threads and the target's at "
                                  f"{parts.threads[1]}") if parts.threads else "")]
    if parts.error is not None and parts.error > PROBE_ERROR_NOTE:
        notes.append(assume("probes_noisy", error=parts.error, limit=PROBE_ERROR_NOTE))
    if slower:
        ph, ratio = max(slower.items(), key=lambda kv: kv[1])
        notes.append(assume("probe_slower_than_run", phase=ph, ratio=ratio, limit=PROBE_OVER_RUN_NOTE))
    return out, layers_by_phase["forward"], notes


def _per_layer_work(w: Work) -> Work:
    """`w` less what a change of depth changes: the work of one layer and of the rest of the model."""
    return dataclasses.replace(w, shape=dataclasses.replace(w.shape, name="", num_layers=0))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Rerated:
    """One phase per micro batch on the target: device work and host work (None: not modelled), and the
    operator calls the host work stands on."""

    device_ms: float
    host_ms: float | None
    calls: float | None = None


def rerated_phase(m: Measured, ph: str, src: Work, tgt: Work, src_machine: Machine, dst_machine: Machine,
                  host_us_per_op: float | None, ops_per_layer: float | None = None) -> Rerated:
    """A compute phase per micro batch re-derived for another shape or machine from its GEMMs and memory
    traffic (module docstring). The source phase splits into GEMM work, other device work and host work:
    from the operator trace where there is one (device self time on a GPU; on a CPU the operators' self
    time, the rest of the phase being Python and the framework), else its GEMMs at the source's rates
    (capped at the phase) and the rest as memory-bound work. `ops_per_layer`: the operator calls a decoder
    layer issues on the target per micro batch, where the source's own count does not carry over (a CPU
    source for a GPU target)."""
    ga = m.grad_accum
    phase = m.phases_ms[ph] / ga
    g_src = src_machine.gemm[ph].ms(src.gemms(ph))
    g_tgt = dst_machine.gemm[ph].ms(tgt.gemms(ph))
    ops = (m.ops or {}).get(ph)
    host = None
    if ops is not None and ops.calls:
        matmul, other = ops.matmul_ms / ga, ops.other_ms / ga
        host = max(phase - matmul - other, 0.0) if m.device_type == "cpu" else \
            (phase if (matmul + other) < HOST_BOUND_BUSY * phase else None)
    else:
        matmul = min(g_src, phase)
        other = phase - matmul
    if src_machine.is_gpu == dst_machine.is_gpu:  # like for like: the source's efficiency carries over
        matmul_t = matmul * g_tgt / g_src if g_src > 0 else 0.0
        traffic = tgt.device_bytes(ph) / src.device_bytes(ph)
        other_t = other * traffic * reached_gbps(src_machine) / reached_gbps(dst_machine)
    else:  # a CPU's efficiency says nothing of a GPU's: the target's work from its shapes and rates alone
        matmul_t = g_tgt
        other_t = tgt.device_bytes(ph) / (reached_gbps(dst_machine) * 1e9) * 1e3
    traced = ops is not None and ops.calls
    if ops_per_layer is not None:  # counted on pretraining runs: the target task's calls are added to them
        per_layer = (ops_per_layer + task_ops(tgt)) * ga
    elif traced:
        per_layer = ops.layer_calls / max(src.shape.num_layers, 1) + (task_ops(tgt) - task_ops(src)) * ga
    else:
        return Rerated(device_ms=matmul_t + other_t, host_ms=None)
    # without a trace (a CPU source's wrapped run) the layers' calls only: the rest of the model's are not known
    calls_t = (max(per_layer, 0.0) * tgt.shape.num_layers + (ops.rest_calls if traced else 0.0)) / ga
    host_t = None
    if host_us_per_op is not None:
        host_t = calls_t * host_us_per_op / 1e3
    elif host is not None:
        host_t = host * calls_t / (ops.calls / ga)
    return Rerated(device_ms=matmul_t + other_t, host_ms=host_t, calls=calls_t)


def reached_gbps(machine: Machine) -> float:
    """The memory bandwidth a model's non-GEMM operators reach: a GPU's datasheet figure times the share its
    runs measured (elementwise); a CPU's calibrated copy bandwidth as it is."""
    return (machine.memory_gbps or 1.0) * elementwise(machine)[0]


def elementwise(machine: Machine) -> tuple[float, str]:
    """The share of its bandwidth a machine's non-GEMM operators reach, and its source: a GPU's own where its
    runs measured one (by its catalog key), else the share over the measured GPUs (elementwise_share); 1
    on a CPU, whose calibrated copy bandwidth is already a measured rate."""
    from trainprof.projection.validation import elementwise_share

    if not machine.is_gpu:
        return 1.0, "1 (a CPU: its calibrated copy bandwidth)"
    return elementwise_share(machine.accelerator or machine.name)


def task_ops(w: Work) -> float:
    """Operator calls per layer and pass that LoRA's adapters and QLoRA's dequantization add."""
    return len(w.lora_targets) * LORA_OPS_PER_TARGET + (7 * DEQUANT_OPS_PER_LINEAR if w.quantized else 0)


def combine(r: Rerated, gpu_target: bool) -> float:
    """A phase's time from its device and host work: the longer of the two on an asynchronous GPU; their
    sum on a CPU (one thread of control does both)."""
    if r.host_ms is None:
        return r.device_ms
    return max(r.device_ms, r.host_ms) if gpu_target else r.device_ms + r.host_ms


def adam_pass_ms(state_elements: float, memory_gbps: float) -> float:
    return state_elements * ADAM_BYTES_PER_ELEMENT / (memory_gbps * 1e9) * 1e3


def optimizer_ms(m: Measured, *, source_elements: float | None, target_elements: float | None,
                 memory_gbps: float | None, probed: StepProbe | None, engine: EngineProbe | None,
                 step_ns: tuple[float, float] | None = None) -> tuple[float, list[Assumption]]:
    """The optimizer phase on the source's machine for the target's state elements per rank and engine.
    A changed model whose bare shapes were probed (`step_ns`: a mixed-precision AdamW step's ns per element
    at each shape) keeps the measured phase and adds the change of that pass over the elements per rank:
    the engine's step does that pass and more, which the measurement keeps."""
    opt = m.phases_ms["optimizer"]
    n_s, n_t = source_elements, target_elements
    if probed is not None and memory_gbps and n_t:
        opt = max(probed.step_ms - adam_pass_ms(probed.state_elements, memory_gbps), 0.0) + adam_pass_ms(n_t, memory_gbps)
        return opt, [assume("optimizer_probed_step", step_ms=probed.step_ms, state_elements=probed.state_elements,
                            target_elements=n_t, bytes_per_element=ADAM_BYTES_PER_ELEMENT, memory_gbps=memory_gbps)]
    notes: list[Assumption] = []
    if step_ns is not None and n_s and n_t and n_s != n_t:
        opt = max(opt + (step_ns[1] * n_t - step_ns[0] * n_s) / 1e6, 0.0)
        notes.append(assume("optimizer_probed_pass", source_elements=n_s, target_elements=n_t, source_ns=step_ns[0],
                            target_ns=step_ns[1]))
    elif n_s and n_t and n_s != n_t:
        if memory_gbps:
            fixed = max(opt - adam_pass_ms(n_s, memory_gbps), 0.0)
            opt = fixed + adam_pass_ms(n_t, memory_gbps)
            notes.append(assume("optimizer_fixed_plus_pass", fixed_ms=fixed, target_elements=n_t,
                                bytes_per_element=ADAM_BYTES_PER_ELEMENT, memory_gbps=memory_gbps))
        else:
            opt *= n_t / n_s
            notes.append(assume("optimizer_scaled", ratio=n_t / n_s))
    if engine is not None:
        opt *= engine.step
        notes.append(assume("optimizer_engine_ratio", ratio=engine.step))
    return opt, notes


def engine_scaled(phases: dict[str, float], engine: EngineProbe) -> tuple[dict[str, float], Assumption]:
    """What the engine adds around the model lands in module hooks and wrappers alike (ZeRO-3 fetches and
    releases parameters in module hooks): the whole phase scales; a recompute re-runs forwards."""
    out = dict(phases)
    out["forward"] *= engine.forward
    out["backward"] *= engine.backward
    out["recompute"] = out.get("recompute", 0.0) * engine.forward
    return out, assume("engine_change", forward=engine.forward, backward=engine.backward)


def per_micro_batch(m: Measured) -> dict[str, float]:
    return {ph: m.phases_ms[ph] / m.grad_accum for ph in (*COMPUTE_PHASES, "data_wait")}
