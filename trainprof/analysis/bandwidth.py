"""Collective bandwidth by the nccl-tests formulas
(https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):

    algbw = S / t                 S: the collective's size as nccl-tests counts it, t: its time
    busbw = algbw * factor(n)     all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
                                  broadcast, reduce (and point-to-point) 1

S is the all_reduce buffer, the all_gather output (n x the input), the reduce_scatter input
(n x the output), the all_to_all input. GB here is 1e9 bytes, as in nccl-tests.
"""

from __future__ import annotations

from typing import Callable


def _all_reduce(n: int) -> float:
    return 2 * (n - 1) / n


def _gather_like(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": _all_reduce,
    "all_reduce_coalesced": _all_reduce,
    "all_gather": _gather_like,
    "all_gather_into_tensor": _gather_like,
    "all_gather_single": _gather_like,  # all_gather_into_tensor under its torch 2.13 name (FSDP2 calls it)
    "_all_gather_base": _gather_like,
    "all_gather_coalesced": _gather_like,
    "reduce_scatter": _gather_like,
    "reduce_scatter_tensor": _gather_like,
    "reduce_scatter_single": _gather_like,  # reduce_scatter_tensor under its torch 2.13 name
    "_reduce_scatter_base": _gather_like,
    "all_to_all": _gather_like,
    "all_to_all_single": _gather_like,
    "gather": _gather_like,
    "scatter": _gather_like,
    "broadcast": _one,
    "reduce": _one,
    "send": _one,
    "recv": _one,
    "isend": _one,
    "irecv": _one,
}


def bus_factor(op: str, group_size: int) -> float | None:
    """busbw / algbw for a collective over `group_size` ranks (None: not a bandwidth op, e.g. barrier)."""
    factor = BUS_FACTORS.get(op)
    return factor(group_size) if factor is not None and group_size >= 1 else None


def bandwidth_gbps(op: str, nbytes: float, seconds: float | None, group_size: int) -> tuple[float | None, float | None]:
    """(algbw, busbw) in GB/s, or (None, None) when the time or the formula is unknown."""
    factor = bus_factor(op, group_size)
    if not seconds or factor is None or not nbytes:
        return None, None
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * factor
