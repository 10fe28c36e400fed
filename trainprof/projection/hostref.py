"""Two figures of a GPU training step read from its profile: the host's time per operator call (what a
step's Python, its framework and engine hooks, dispatch and kernel launches cost the host per call),
and the bytes the optimizer's kernels move per trainable parameter.

A phase whose kernels ran less than HOST_BOUND_BUSY of its time waited for its host: its time over its
operator calls is the host's time per call. A device-bound phase hides its host time and gives only a
ceiling (`host_us_and_ceiling`): its calls took the host at most the phase.
The optimizer's kernels (device self time of the traced step) at the machine's measured copy bandwidth
(calibration.json) give the bytes an engine's Adam moves per trainable parameter on a GPU: fused, multi-
tensor and per-op implementations differ several-fold from the 28 B of one ideal pass.
DeepSpeed's optimizer step adds its host calls to its kernels (`optimizer_host`): the calls a trainable
tensor costs and each call's host time beside the kernels.
The catalog's `gpu_host_us_per_op`, `gpu_optimizer_bytes_per_param` and `gpu_optimizer_host` hold these figures for the
reference runs under profiles/ (scripts/host_reference.py writes them; tests recompute them).
"""

from __future__ import annotations

from typing import Any

from trainprof.analysis.gpu_busy import HOST_BOUND_BUSY
from trainprof.projection.measured import measured_from_profile

HOST_PHASES = ("forward", "backward", "optimizer")


def host_us_per_op(profile: dict[str, Any]) -> dict[str, float | None]:
    """Per phase, µs of host time per operator call of a GPU profile with an operator trace (None where
    the phase was device-bound or the profile has no trace)."""
    out: dict[str, float | None] = {ph: None for ph in HOST_PHASES}
    out.update(host_us_and_ceiling(profile)[0])
    return out


def host_us_and_ceiling(profile: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """Per phase of a GPU profile with an operator trace, its time over its operator calls (µs): for a host-bound
    phase the host's time per call (first dict); for a device-bound one the most host time a call can have
    taken, the host having issued them all within the phase (second dict: only a bound, the kernels hid the
    host's time)."""
    m = measured_from_profile(profile)
    own: dict[str, float] = {}
    ceiling: dict[str, float] = {}
    if m.device_type != "cuda" or not m.ops:
        return own, ceiling
    for ph in HOST_PHASES:
        ops = m.ops.get(ph)
        phase = m.phases_ms.get(ph, 0.0)
        if ops is None or not ops.calls or phase <= 0:
            continue
        host_bound = ops.matmul_ms + ops.other_ms < HOST_BOUND_BUSY * phase
        (own if host_bound else ceiling)[ph] = phase / ops.calls * 1e3
    return own, ceiling


def optimizer_host(profile: dict[str, Any]) -> tuple[float, float] | None:
    """(operator calls, host µs per call beside the kernels) of a GPU profile's optimizer phase, or None
    without a GPU operator trace. DeepSpeed's step waits for its kernels between its host calls (the
    overflow check and the gradient norm read results back), so its phase is the kernels' time plus the
    calls' host time, not the longer of the two: (phase - kernels) / calls is the host's share."""
    m = measured_from_profile(profile)
    ops = (m.ops or {}).get("optimizer") if m.device_type == "cuda" else None
    phase = m.phases_ms.get("optimizer", 0.0)
    if ops is None or not ops.calls or phase <= 0:
        return None
    return float(ops.calls), max(phase - ops.matmul_ms - ops.other_ms, 0.0) / ops.calls * 1e3


def optimizer_bytes_per_param(profile: dict[str, Any], copy_gbps: float) -> float | None:
    """Bytes the optimizer phase's kernels moved per trainable parameter, at the measured copy bandwidth
    (None without a GPU operator trace)."""
    m = measured_from_profile(profile)
    ops = (m.ops or {}).get("optimizer") if m.device_type == "cuda" else None
    trainable = (profile.get("params") or {}).get("trainable")
    if ops is None or not trainable:
        return None
    return (ops.matmul_ms + ops.other_ms) / 1e3 * copy_gbps * 1e9 / trainable
