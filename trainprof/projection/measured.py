"""What the step model reads from a measured profile: the step split into phases, the model's parts
(decoder layers and the rest), the operators of each phase, the collectives, and the run's shape.

The step is the slowest rank's median (what tokens/s divides by); its split into phases and the
model's parts is the critical rank's (`critical_rank`): all times are ms per optimizer step unless named
otherwise.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from typing import Any

from trainprof.phases import MODULE_PHASES as COMPUTE_PHASES
from trainprof.phases import PHASES
from trainprof.report.rundir import run_peak_memory
from trainprof.shapes import DTYPE_BYTES
# operators whose time is GEMM or attention work (scaled by the matmul rate); the rest is memory-bound
MATMUL_OPS = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|addbmm|matmul|linear|_scaled_mm)$|attention|flash|gemm",
                        re.IGNORECASE)


@dataclasses.dataclass(slots=True, kw_only=True)
class PhaseOps:
    """One phase's operators per optimizer step (the traced steps' mean), split into the decoder
    layers' and the rest: how many calls (each a kernel launch on a GPU), and their self time in GEMM or
    attention work and in the rest (device time on a GPU source, host time on a CPU one)."""

    layer_calls: float
    rest_calls: float
    matmul_ms: float
    other_ms: float

    @property
    def calls(self) -> float:
        return self.layer_calls + self.rest_calls


@dataclasses.dataclass(slots=True, kw_only=True)
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
    # per compute phase: (the decoder layers' time, the whole model call's time), summed over micro batches
    parts_ms: dict[str, tuple[float, float]] | None = None
    num_layers: int = 0  # decoder layers the profile timed
    param_bytes: float = 0.0  # parameters x bytes per element of the model dtype (collective volumes)
    trainable_param_bytes: float = 0.0  # the trainable ones: what ZeRO reduces and gathers (the gradients' dtype)
    dtype_bytes: int = 2  # bytes per element of the model dtype
    device_type: str = "cpu"
    # per phase, the operators of the traced steps (None: the profile has no operator trace)
    ops: dict[str, PhaseOps] | None = None
    ranks_busy_ms: dict[int, float] | None = None  # per rank: busy_ms (None: the profile has no per-rank rows)

    @property
    def kernel_ms(self) -> dict[str, tuple[float, float]] | None:
        """GPU sources with an operator trace: per phase (matmul kernel ms, other kernel ms)."""
        if self.device_type != "cuda" or not self.ops:
            return None
        return {ph: (o.matmul_ms, o.other_ms) for ph, o in self.ops.items()}

    def busy_frac(self) -> float | None:
        """The share of the step a GPU source's device ran kernels (operator trace), None elsewhere."""
        kernels = self.kernel_ms
        if kernels is None or self.step_ms <= 0:
            return None
        return min(sum(mm + rest for mm, rest in kernels.values()) / self.step_ms, 1.0)


def measured_from_profile(profile: dict[str, Any]) -> Measured:
    """The figures the step model needs, from a merged profile.json dict: the slowest rank's median
    step (what tokens/s divides by), split as the critical rank's phases (`critical_rank`, `_split`) and
    module times. `unattributed_ms` is the step minus the phases, kept signed, so that the parts add up
    to the measured step exactly."""
    s = profile["summary"]
    ranks = [r for r in profile.get("ranks") or [] if r.get("phases_ms")]
    rank_index, scale = None, {}
    if ranks:
        step = float(max(r["step_ms_median"] for r in ranks))
        critical = critical_rank(ranks)
        phases = _split(critical, step)
        rank_index = ranks.index(critical) if len(ranks) == len(profile.get("ranks") or []) else None
        # module figures are per-step medians: each moves with its phase's split over its median, so that a
        # phase minus its model's time stays what lies outside the model
        medians = critical["phases_ms"]
        scale = {f"{ph}_ms": phases[ph] / medians[ph] for ph in COMPUTE_PHASES if medians.get(ph)}
    else:
        step, phases = float(s["step_ms"]["median"]), dict(s.get("phases_ms") or {})
    phases = {k: float(phases.get(k) or 0.0) for k in PHASES}
    modules = [_rank_figures(m, rank_index, scale) for m in profile.get("modules") or []]
    layers = [m for m in modules if is_decoder_layer(m["name"])]
    states = profile.get("model_state_bytes") or {}
    recipe = profile.get("recipe") or profile.get("workload") or {}  # a wrapped run records its workload
    dtype_bytes = DTYPE_BYTES.get(((recipe.get("model") or {}).get("dtype")), 2)
    params = profile.get("params") or {}
    return Measured(
        step_ms=step, phases_ms=phases, unattributed_ms=step - sum(phases.values()),
        flops_by_phase={k: float(v) for k, v in (s.get("flops_by_phase") or {}).items()},
        comm=list(profile.get("comm") or []), world_size=int(profile["env"]["world_size"]),
        grad_accum=int(((recipe.get("train") or {}).get("grad_accum")) or 1),
        optimizer_state_elements=states.get("optimizer_state_elements"),
        peak_memory_bytes=run_peak_memory(s),
        forward_layers_ms=sum(m["forward_ms"] for m in layers) if layers else None,
        step_std_ms=_step_std(profile),
        leaf_ms=_leaf_ms(modules),
        parts_ms=_parts_ms(modules, layers),
        num_layers=len(layers),
        param_bytes=float(params.get("total", 0)) * dtype_bytes,
        trainable_param_bytes=float(params.get("trainable", 0)) * dtype_bytes,
        dtype_bytes=dtype_bytes,
        device_type=profile["env"].get("device_type", "cpu"),
        ops=_phase_ops(profile),
        ranks_busy_ms={int(r["rank"]): busy_ms(r) for r in ranks} or None,  # `rank` is required by the schema
    )


def _split(rank: dict[str, Any], step: float) -> dict[str, float]:
    """A rank's phases in ms of the `step` it is to split. Per-step phases and the unattributed rest add up
    to each step's wall time, so their means add up to the mean step, while a sum of medians need not
    equal the median step (a phase that holds waits is skewed, and a changed target would keep the gap
    as if it were work). The means, scaled by the median step over the mean one, split it; a profile
    without means (made before they were kept) gives the medians."""
    means, mean_step = rank.get("phases_ms_mean"), rank.get("step_ms_mean")
    if not means or not mean_step:
        return dict(rank["phases_ms"])
    return {k: float(v) * step / float(mean_step) for k, v in means.items()}


def critical_rank(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The rank whose split of the step the step model re-derives: the busiest one (the step minus its
    time blocked in collectives and data waits), the one the others wait for. Ranks that meet in
    collectives end their steps together, so a rank that computed faster spends the difference waiting
    inside a collective: its exposed communication holds the busiest rank's extra compute, which a change
    of shape or engine scales as compute, not as communication."""
    return max(ranks, key=busy_ms)


def busy_ms(rank: dict[str, Any]) -> float:
    """A rank's median step less its time blocked in collectives (and data waits, where the profile has it)."""
    if rank.get("busy_ms_median") is not None:
        return float(rank["busy_ms_median"])
    return float(rank["step_ms_median"]) - float(rank["phases_ms"].get("comm_exposed") or 0.0)


def _rank_figures(module: dict[str, Any], rank_index: int | None, scale: dict[str, float]) -> dict[str, Any]:
    """A merged module row with the critical rank's own figures where the merge kept them (`by_rank`),
    so that its phases and its parts come from one rank (else the median over ranks, as merged), each
    phase's times x `scale` of that phase."""
    spread = module.get("ranks_spread") or {}
    own = {} if rank_index is None else {
        key: s["by_rank"][rank_index] for key, s in spread.items()
        if len(s.get("by_rank") or []) > rank_index and s["by_rank"][rank_index] is not None}
    row = {**module, **own}
    return {**row, **{key: row[key] * k for key, k in scale.items() if row.get(key) is not None}}


def is_decoder_layer(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()


def _parts_ms(modules: list[dict[str, Any]], layers: list[dict[str, Any]]) -> dict[str, tuple[float, float]] | None:
    """Per compute phase: (the decoder layers' time, the whole model call's time). The model call is
    the root module's (depth 0); without decoder-layer rows (a shallow module_depth) there are no parts."""
    roots = [m for m in modules if m.get("depth") == 0]
    if not layers or not roots:
        return None
    root = roots[0]
    return {ph: (sum(m[f"{ph}_ms"] for m in layers), float(root[f"{ph}_ms"])) for ph in COMPUTE_PHASES}


def _phase_ops(profile: dict[str, Any]) -> dict[str, PhaseOps] | None:
    """Per phase, the operator rows (per-step means over the traced steps) summed into PhaseOps."""
    rows = profile.get("ops") or []
    if not rows or not (profile.get("ops_info") or {}).get("steps"):
        return None
    out: dict[str, PhaseOps] = {}
    for row in rows:
        acc = out.setdefault(row.get("phase") or "other", PhaseOps(layer_calls=0.0, rest_calls=0.0, matmul_ms=0.0,
                                                                   other_ms=0.0))
        in_layer = any(is_decoder_layer(".".join(row["module"].split(".")[:n]))
                       for n in range(2, (row.get("module") or "").count(".") + 2))
        if in_layer:
            acc.layer_calls += float(row["calls"])
        else:
            acc.rest_calls += float(row["calls"])
        if MATMUL_OPS.search(row["name"]):
            acc.matmul_ms += float(row["self_ms"] or 0.0)
        else:
            acc.other_ms += float(row["self_ms"] or 0.0)
    return out


def _leaf_ms(modules: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Forward and backward ms of the modules with no profiled children (attention, MLP, norms,
    embedding, LM head at the default depth): the model's work; what their parents add on top
    (hooks, engine bookkeeping, the loss) is the rest of the phase."""
    parents = {m.get("parent") for m in modules}
    leaves = [m for m in modules if m["name"] not in parents and m["name"]]
    if not leaves:
        return None
    return sum(m["forward_ms"] for m in leaves), sum(m["backward_ms"] for m in leaves)


def _step_std(profile: dict[str, Any]) -> float:
    walls = [s["wall_ms"] for s in profile.get("steps") or [] if not s.get("warmup") and not s.get("instrumented")]
    return statistics.stdev(walls) if len(walls) >= 3 else 0.0
