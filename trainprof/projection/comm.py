"""The exposed communication of a predicted step.

How a collective is priced: alpha + bytes x bus factor / bus bandwidth (nccl-tests' convention). On
the source's machine the alpha and bandwidth are a least-squares fit measured there (gloo); on a
catalog target the bandwidth is the link's datasheet figure and the alpha is NCCL's own latency model
of a ring (src/graph/tuning.cc: a base latency plus a per-step latency of the hardware each step
crosses), so latency grows with the ranks and the nodes.

What is exposed:
  * same machine: the source's collectives re-timed over the fit, at the exposed fraction the source
    measured, or (a change of ZeRO stage 0-2, DDP or model size) derived from the parameter census and
    DeepSpeed's / DDP's rules, blocking calls waiting as long beyond their price as the source's did;
  * another machine: derived from the census for the target's engine; prefetched ZeRO-3 gathers and
    overlapped reductions hide behind the phase's compute (exposed = max(0, comm - compute)), blocking
    ones are exposed whole.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from trainprof.projection.assumptions import Assumption, assume
from trainprof.projection.calibrate import bus_factor
from trainprof.projection.census import Census, zero3_traffic
from trainprof.projection.measured import Measured
from trainprof.projection.stats import expected_max_normal

# ZeRO paper (Rajbhandari et al. 2020, sec. 7): per-step communication volume per rank in units of Ψ
# (parameters): DP/stage 1/2: reduce-scatter + all-gather = 2Ψ; stage 3 adds a forward gather: 3Ψ.
ZERO_VOLUME = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}
SMALL_COLLECTIVE_BYTES = 1024  # per call: a gradient norm or an overflow flag, latency-bound
# torch.nn.parallel.DistributedDataParallel's buckets: the first holds at most 1 MiB
# (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES), the others bucket_cap_mb=25 (its default)
DDP_FIRST_BUCKET_BYTES = 1024 ** 2
DDP_BUCKET_BYTES = 25 * 1024 ** 2
NAN = float("nan")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NcclLatency:
    """NCCL's ring latency model (src/graph/tuning.cc, Simple protocol): base + per-step latencies."""

    base_us: float
    intra_us: float  # a step inside a node (NVLink or PCIe)
    net_us: float  # a step between nodes
    nodes: int
    source: str

    def alpha_ms(self, op: str, n: int) -> float:
        steps = 2 * (n - 1) if op == "all_reduce" else n - 1
        inter = (2 * self.nodes if self.nodes > 1 else 0) if op == "all_reduce" else self.nodes - 1
        inter = min(inter, steps)
        return (self.base_us + (steps - inter) * self.intra_us + inter * self.net_us) / 1e3


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """How the target's collectives are priced: a measured α-β fit, or a catalog link with NCCL's latency."""

    busbw_gbps: float
    source: str  # a short name for the assumptions that price over it
    alpha_ms: float = 0.0
    latency: NcclLatency | None = None  # a catalog link: the alpha follows the ranks and nodes
    measured_here: bool = False  # a fit measured on the source's machine (gloo), not a catalog link
    described: Assumption | None = None  # where its figures come from

    def ms(self, op: str, nbytes: float, n: int) -> float:
        """One collective of nccl-tests size `nbytes` over n ranks."""
        if n <= 1:
            return 0.0
        alpha = self.latency.alpha_ms(op, n) if self.latency else self.alpha_ms
        return alpha + nbytes * bus_factor(op, n) / (self.busbw_gbps * 1e9) * 1e3

    @property
    def fit(self) -> dict[str, float]:
        return {"alpha_ms": self.alpha_ms, "busbw_gbps": self.busbw_gbps}


@dataclasses.dataclass(slots=True, kw_only=True)
class CommTarget:
    """The target's engine as its collectives see it (Change's communication fields)."""

    engine: str
    zero_stage: int
    world_size: int
    grad_accum: int
    source_engine: str
    source_zero_stage: int
    # the target's trainable bytes (in its dtype) where it trains other parameters; None: the source's
    trainable_param_bytes: float | None
    dtype_bytes: int | None = None  # bytes per element of the target's model dtype where it differs; None: the source's
    reduce_bucket_elements: float = 5e8
    allgather_bucket_elements: float = 5e8
    overlap_comm: bool = False
    param_groups: int = 2
    census: Census | None = None  # the target's parameters (ZeRO-3, FSDP2 and model-size changes)
    reshard_after_forward: bool = True  # FSDP2: its gathered parameters are freed after forward
    source_census: Census | None = None
    zero3: dict[str, int] | None = None  # census.zero3_settings of the target
    source_zero3: dict[str, int] | None = None
    cross_machine: bool = False  # a GPU target priced from its links: collectives overlap the compute where they can
    compute_ms: dict[str, float] | None = None  # predicted forward/backward per step: what comm may hide behind


def exposed_comm(m: Measured, t: CommTarget, link: Link | None) -> tuple[float, list[Assumption]]:
    """Exposed ms of the target's collectives per optimizer step, and the assumptions made (NaN: not
    predictable, the reason in the assumptions)."""
    n = t.world_size
    if n <= 1:
        return 0.0, [assume("comm_one_rank")] if m.world_size > 1 else []
    if link is None:
        if m.world_size == n and not _derives(m, t):
            return _as_measured(m, t)
        return NAN, [assume("comm_no_wait", why=f"no collective calibration for {n} ranks")]
    notes = [link.described] if link.described is not None else []
    if t.engine == "deepspeed" and t.zero_stage <= 2 and (_derives(m, t) or t.cross_machine):
        ms, more = _bucketed_zero(m, t, link)
    elif t.engine == "torch" and (_derives(m, t) or t.cross_machine):
        ms, more = _ddp(m, t, link)
    elif t.engine == "deepspeed" and t.zero_stage == 3 and (t.cross_machine or _model_changed(t)):
        ms, more = _zero3(m, t, link)
    elif t.engine == "fsdp" and (t.cross_machine or _census_changed(t) or t.source_engine != "fsdp"):
        ms, more = _fsdp(m, t, link)
    else:
        ms, more = _retimed(m, t, link)
    return ms, notes + more


def _model_changed(t: CommTarget) -> bool:
    """Another model or dtype: the collectives' calls or bytes follow from the target's census."""
    return t.dtype_bytes is not None or _census_changed(t)


def _census_changed(t: CommTarget) -> bool:
    return t.census is not None and t.source_census is not None and t.census != t.source_census


def _element_bytes(m: Measured, t: CommTarget) -> int:
    """Bytes per element of the target's parameters in its collectives (its model dtype)."""
    return t.dtype_bytes or m.dtype_bytes


def _derives(m: Measured, t: CommTarget) -> bool:
    """Whether the target's collectives are derived from the model rather than re-timed from the source's:
    a DeepSpeed target at ZeRO stage 0-2 at another stage, training other parameters or in another dtype;
    a DDP target whose source ran no DDP (another engine, one rank) or trained other parameters (its
    gradients are fp32 in any model dtype); a model-size or dtype change."""
    other_params = t.trainable_param_bytes is not None or _census_changed(t)
    if t.engine == "deepspeed" and t.zero_stage <= 2:
        return t.zero_stage != t.source_zero_stage or t.source_engine != "deepspeed" or other_params \
            or t.dtype_bytes is not None
    if t.engine == "torch":
        return t.source_engine != "torch" or m.world_size == 1 or other_params
    return _model_changed(t)


def _trainable_bytes(m: Measured, t: CommTarget) -> float:
    """The target's trainable parameters' bytes in its dtype."""
    if t.trainable_param_bytes is not None:
        return t.trainable_param_bytes
    return m.trainable_param_bytes / m.dtype_bytes * _element_bytes(m, t)


def _as_measured(m: Measured, t: CommTarget) -> tuple[float, list[Assumption]]:
    """The source's exposed comm at its own world size and link, forward/backward collectives per micro
    batch, a ZeRO stage change scaled by the ZeRO paper's volumes."""
    scale = ZERO_VOLUME[t.zero_stage] / ZERO_VOLUME[t.source_zero_stage]
    per_mb = sum(c["exposed_ms"] for c in m.comm if c["phase"] in ("forward", "backward"))
    rest = m.phases_ms["comm_exposed"] - per_mb
    ms = (per_mb * t.grad_accum / m.grad_accum + rest) * scale
    notes = [assume("comm_as_measured")]
    if scale != 1.0:
        notes.append(assume("comm_zero_volume", source_stage=t.source_zero_stage, target_stage=t.zero_stage,
                            ratio=scale))
    return max(ms, 0.0), notes


def recorded_ms(c: dict[str, Any], n: int, link: Link) -> float:
    """The price over `link` of a collective row of the profile (its calls at their mean bytes)."""
    per_call_bytes = c["bytes"] / c["calls"] if c.get("bytes") else 0.0
    return c["calls"] * link.ms(c["op"], per_call_bytes, n)


def in_training_wait(m: Measured, n: int, link: Link) -> tuple[float, Assumption]:
    """The wait per blocking collective in training beyond its α-β price (the other rank still computing
    when one arrives, cores and caches shared with the model's work): the source's blocking collectives'
    measured time minus their price by the same fit, per call, never below 0. Only where the fit was
    measured on the source's machine at its world size; 0 otherwise."""
    if not link.measured_here or m.world_size != n:
        return 0.0, assume("comm_no_wait", why="the link is not the source's own at its world size")
    rows = [c for c in m.comm if c["calls"] and c.get("total_ms") and c["exposed_ms"] >= 0.95 * c["total_ms"]]
    if not rows:
        return 0.0, assume("comm_no_wait", why="the source recorded no blocking collective")
    calls = sum(c["calls"] for c in rows)
    priced = sum(recorded_ms(c, n, link) for c in rows)
    measured = sum(c["total_ms"] for c in rows)
    wait = max(measured - priced, 0.0) / calls
    return wait, assume("comm_wait", wait_ms=wait, calls=calls, measured_ms=measured, priced_ms=priced)


def _small(c: dict[str, Any]) -> bool:
    """A collective row whose calls are latency-bound scalars (a gradient norm, an overflow flag)."""
    return (c.get("bytes") or 0) / c["calls"] < SMALL_COLLECTIVE_BYTES


def _small_optimizer_ms(m: Measured) -> float:
    return sum(c["exposed_ms"] for c in m.comm if c["phase"] == "optimizer" and c["calls"]
               and _small(c))


def _bucketed_zero(m: Measured, t: CommTarget, link: Link) -> tuple[float, list[Assumption]]:
    """Exposed ms of DeepSpeed's ZeRO stage 0-2 collectives per optimizer step, derived from the trainable
    parameters (deepspeed/runtime/engine.py `allreduce_gradients`, zero/stage_1_and_2.py):
      * gradient reduction, one all_reduce per reduce bucket (the op DeepSpeed issued in the runs here);
        stage 2 partitions gradients and reduces every micro batch, stages 0/1 once per step;
      * stage 1/2: the updated partitions all-gathered after the step, one call per parameter group
        and allgather bucket;
      * the source's small optimizer-phase collectives (gradient norm, overflow flag) as measured.
    Without overlap_comm (DeepSpeed's default below stage 3) the reduction blocks the backward: exposed
    whole; with it, at the source's measured exposed fraction of its backward reductions (another
    machine: hidden behind the backward's compute as far as it lasts)."""
    n, stage = t.world_size, t.zero_stage
    grads = _trainable_bytes(m, t)
    if grads <= 0:
        return NAN, [assume("comm_no_wait", why="the profile records no trainable parameters to derive ZeRO's "
                                                "collectives from")]
    elements = grads / _element_bytes(m, t)
    reduce_calls = max(1, math.ceil(elements / t.reduce_bucket_elements))
    reductions = t.grad_accum if stage == 2 else 1
    reduce_ms = reductions * reduce_calls * link.ms("all_reduce", grads / reduce_calls, n)
    exposed_reduce = reduce_ms
    if t.overlap_comm:
        exposed_reduce = _overlapped(reduce_ms, t, "backward", m)
    gather_ms, gather_calls = 0.0, 0
    if stage >= 1:
        gather_calls = max(t.param_groups, math.ceil(elements / t.allgather_bucket_elements))
        gather_ms = gather_calls * link.ms("all_gather_into_tensor", grads / gather_calls, n)
    small = 0.0 if t.cross_machine else _small_optimizer_ms(m)
    wait, wait_note = (0.0, None) if t.cross_machine else in_training_wait(m, n, link)
    blocking = (0 if t.overlap_comm else reductions * reduce_calls) + gather_calls
    overlap_text = (f", {exposed_reduce:.2f} ms exposed (overlap_comm)" if t.overlap_comm
                    else ", blocking (no overlap_comm): exposed whole")
    gather_text = f"; updated partitions all-gathered after the step, {gather_ms:.2f} ms, blocking" if stage >= 1 else ""
    notes = [assume("comm_zero_derived", stage=stage, mbytes=grads / 1e6, link=link.source,
                    reduce_calls=reductions * reduce_calls, reduce_ms=reduce_ms, overlap_text=overlap_text,
                    gather_text=gather_text, small_ms=small)]
    if wait_note is not None:
        notes.append(wait_note)
    if t.cross_machine and t.overlap_comm:
        notes += _outlasting(t, {"backward": reduce_ms})
    return exposed_reduce + gather_ms + wait * blocking + small, notes


def _outlasting(t: CommTarget, comm_by_phase: dict[str, float]) -> list[Assumption]:
    """Another machine: the phases whose collectives outlast the compute they overlap, which then take the
    collectives' time whatever the GPU or host (what marks a row comm-bound where they hold most of its step)."""
    compute = t.compute_ms or {}
    over = {ph: ms for ph, ms in comm_by_phase.items() if ms > 0 and ms > compute.get(ph, 0.0)}
    if not over:
        return []
    return [assume("comm_outlasts_compute", phases=", ".join(over), ms=sum(over.values()),
                   compute_ms=sum(compute.get(ph, 0.0) for ph in over))]


def _overlapped(comm_ms: float, t: CommTarget, phase: str, m: Measured) -> float:
    """Exposed part of collectives that overlap a phase: another machine, what outlasts the phase's
    predicted compute; the same machine, the fraction the source measured for its overlapped reductions."""
    if t.cross_machine:
        return max(comm_ms - (t.compute_ms or {}).get(phase, 0.0), 0.0)
    rows = [c for c in m.comm if c["phase"] == phase and c["op"] in ("all_reduce", "reduce_scatter_tensor")
            and c.get("total_ms")]
    frac = min(sum(c["exposed_ms"] for c in rows) / sum(c["total_ms"] for c in rows), 1.0) if rows else 1.0
    return comm_ms * frac


def _ddp(m: Measured, t: CommTarget, link: Link) -> tuple[float, list[Assumption]]:
    """Exposed ms of PyTorch DDP's gradient all_reduce per optimizer step (torch/nn/parallel/distributed.py,
    the C++ Reducer): gradients are bucketed in reverse parameter order (the first bucket
    DDP_FIRST_BUCKET_BYTES, the others DDP_BUCKET_BYTES) and each bucket is all-reduced as soon as the
    backward has produced all of its gradients, overlapped with the rest of the backward (on a GPU it hides
    behind the compute; on the source's CPU, where gloo reduces on the cores the ranks compute on, it does
    not: those buckets are charged at their price); the last bucket (the remainder: the first layers and
    the embedding, whose gradients come last) is launched when the backward ends and waited for: exposed
    whole, with the wait a blocking call of the source had beyond its price. Once a step: the torch engine
    skips the sync on micro batches before the boundary (DDP.no_sync).
    Gradients are fp32: the torch engine keeps trainable parameters in fp32 under autocast."""
    n = t.world_size
    grads = _trainable_bytes(m, t) / _element_bytes(m, t) * 4
    if grads <= 0:
        return NAN, [assume("comm_no_wait", why="the profile records no trainable parameters to derive DDP's "
                                                "all_reduce from")]
    rest = max(grads - DDP_FIRST_BUCKET_BYTES, 0.0)
    last = grads if rest == 0 else rest - DDP_BUCKET_BYTES * (math.ceil(rest / DDP_BUCKET_BYTES) - 1)
    buckets = 1 + math.ceil(rest / DDP_BUCKET_BYTES)
    tail = link.ms("all_reduce", last, n)
    hidden = link.ms("all_reduce", grads - last, n) if buckets > 1 else 0.0
    if t.cross_machine:  # a GPU's reductions run beside its compute: exposed as far as they outlast it
        overflow = max(hidden - (t.compute_ms or {}).get("backward", 0.0), 0.0)
        hidden_text = "all but the last overlapping the backward's compute"
    else:  # on the source's CPU gloo reduces on the cores the ranks compute on: nothing hides
        overflow = hidden
        hidden_text = (f"all but the last launched during the backward on the cores it computes on, "
                       f"{hidden:.2f} ms, charged whole")
    wait, wait_note = (0.0, None) if t.cross_machine else in_training_wait(m, n, link)
    notes = [assume("comm_ddp_derived", mbytes=grads / 1e6, buckets=buckets, last_mbytes=last / 1e6, tail_ms=tail,
                    link=link.source, hidden_text=hidden_text)]
    if wait_note is not None:
        notes.append(wait_note)
    return tail + overflow + wait, notes


def _zero3(m: Measured, t: CommTarget, link: Link) -> tuple[float, list[Assumption]]:
    """Exposed ms of DeepSpeed ZeRO-3's collectives per optimizer step, derived from the target's census
    (deepspeed/runtime/zero/partitioned_param_coordinator.py, stage3.py): each partitioned parameter is
    all-gathered in forward, and again in backward when the model exceeds stage3_max_reuse_distance (it
    was released); gradients are reduce-scattered per reduce bucket every micro batch; persistent
    parameters (at most stage3_param_persistence_threshold elements) are all-gathered after the step.
    Another machine: gathers are prefetched and reductions overlap (overlap_comm), so each phase exposes
    what outlasts its compute; the after-step gathers block. Same machine: each of the source's rows is
    re-derived (calls and bytes in the census's proportion) and its measured exposed time scaled by the
    link's price of the target's calls over that of the source's: an asynchronous gather's recorded span
    includes waiting for its handle, so the measured exposure, not a fraction of the span, carries over."""
    n, b = t.world_size, _element_bytes(m, t)
    if t.census is None or t.zero3 is None:
        return NAN, [assume("comm_no_wait", why="no parameter census for ZeRO-3's collectives")]
    tr = zero3_traffic(t.census, t.zero3)
    gather = tr.gather_calls * link.ms("all_gather_into_tensor", b * tr.gather_elements / max(tr.gather_calls, 1), n)
    scatter = tr.scatter_calls * link.ms("reduce_scatter_tensor",
                                         b * tr.scatter_elements / max(tr.scatter_calls, 1), n) if tr.scatter_calls else 0.0
    after = tr.persistent_calls * link.ms("all_gather_into_tensor", b * tr.persistent_elements / max(tr.persistent_calls, 1), n) \
        if tr.persistent_calls else 0.0
    ga = t.grad_accum
    note = assume("comm_zero3_derived", mbytes=b * t.census.total / 1e6, link=link.source, gathers=tr.gather_calls,
                  gather_ms=gather, scatters=tr.scatter_calls, scatter_ms=scatter, persistent=tr.persistent_calls,
                  after_ms=after)
    if t.cross_machine:
        compute = t.compute_ms or {}
        by_phase = {"forward": gather * ga, "backward": (scatter + (gather if tr.regathered_in_backward else 0.0)) * ga}
        fwd = max(by_phase["forward"] - compute.get("forward", 0.0), 0.0)
        bwd = max(by_phase["backward"] - compute.get("backward", 0.0), 0.0)
        return fwd + bwd + after, [note, *_outlasting(t, by_phase)]
    if t.source_census is None or t.source_zero3 is None:
        return NAN, [assume("comm_no_wait", why="no parameter census of the source to re-derive its ZeRO-3 rows")]
    src = zero3_traffic(t.source_census, t.source_zero3)
    total = 0.0
    for c in (c for c in m.comm if c["calls"]):
        calls, elements = _zero3_row_share(c, src, tr, m.dtype_bytes)
        if calls <= 0:
            continue
        repeat = ga / m.grad_accum if c["phase"] in ("forward", "backward") else 1.0
        width = m.dtype_bytes if _small(c) else b  # norms and flags keep their bytes
        total += _repriced(c, calls * link.ms(c["op"], width * elements / calls, n),
                           m, link) * repeat
    return total, [note, assume("comm_rows_repriced", link=link.source)]


def _repriced(c: dict[str, Any], target_ms: float, m: Measured, link: Link) -> float:
    """A source row's measured exposed ms, scaled by the link's price of the target's calls (`target_ms`)
    over that of the source's at the source's world size: an asynchronous collective's recorded span
    includes waiting for its handle, so the measured exposure, not a fraction of the span, carries over."""
    source_ms = recorded_ms(c, m.world_size, link)
    return c["exposed_ms"] * (target_ms / source_ms if source_ms > 0 else 1.0)


def _fsdp(m: Measured, t: CommTarget, link: Link) -> tuple[float, list[Assumption]]:
    """Exposed ms of PyTorch FSDP2's collectives per optimizer step, derived from the target's census: one
    `fully_shard` unit per decoder layer and one for the root (embedding, final norm, LM head); each unit's
    parameters all-gathered in the compute dtype before its forward, and a layer's again before its backward
    when reshard_after_forward frees them (the engine leaves the root to FSDP2's rule: kept gathered for
    backward); its gradients reduce-scattered in fp32 (the MixedPrecisionPolicy's
    reduce dtype), every micro batch. Another machine: gathers are prefetched and reductions run on
    their own stream, so each phase exposes what outlasts its compute. The source's machine (gloo): the
    collectives are synchronous, exposed whole, each with the wait a blocking call of the source had."""
    if t.census is None:
        return NAN, [assume("comm_no_wait", why="no parameter census for FSDP2's collectives")]
    n, b, ga = t.world_size, _element_bytes(m, t), t.grad_accum
    in_layers = sum(x.numel for x in t.census.tensors if x.in_layer)
    units = [in_layers / max(t.census.layers, 1)] * t.census.layers + [t.census.total - in_layers]
    gathers = [link.ms("all_gather_into_tensor", b * u, n) for u in units]
    gather, regather = sum(gathers), sum(gathers[:-1]) if t.reshard_after_forward else 0.0
    trainable_share = t.census.trainable / max(t.census.total, 1)
    scatter = sum(link.ms("reduce_scatter_tensor", 4 * u * trainable_share, n) for u in units)
    backward = regather + scatter
    note = assume("comm_fsdp_derived", units=len(units), mbytes=b * t.census.total / 1e6, link=link.source,
                  gather_ms=gather, scatter_ms=scatter,
                  regather_text=(f", the decoder layers' again before their backward ({regather:.2f} ms; "
                                 "reshard_after_forward; the root stays gathered)") if t.reshard_after_forward
                  else "")
    if t.cross_machine:
        compute = t.compute_ms or {}
        by_phase = {"forward": gather * ga, "backward": backward * ga}
        return (max(by_phase["forward"] - compute.get("forward", 0.0), 0.0)
                + max(by_phase["backward"] - compute.get("backward", 0.0), 0.0)), [note, *_outlasting(t, by_phase)]
    wait, wait_note = in_training_wait(m, n, link)
    calls = (2 * len(units) + (t.census.layers if t.reshard_after_forward else 0)) * ga
    return (gather + backward) * ga + wait * calls, [note, wait_note]


def _zero3_row_share(c: dict[str, Any], src: Any, tgt: Any, b: int) -> tuple[float, float]:
    """A source ZeRO-3 collective row's calls and elements at the target: gathers in forward and backward
    follow the partitioned parameters, the optimizer phase's gathers the persistent ones, reduce-scatters the
    trainable ones; small collectives (norms, flags) stay."""
    if _small(c):
        return c["calls"], (c.get("bytes") or 0) / b
    if c["op"].startswith("reduce_scatter"):
        return _scaled(c, b, src.scatter_calls, tgt.scatter_calls, src.scatter_elements, tgt.scatter_elements)
    if c["phase"] == "optimizer":
        return _scaled(c, b, src.persistent_calls, tgt.persistent_calls, src.persistent_elements, tgt.persistent_elements)
    return _scaled(c, b, src.gather_calls, tgt.gather_calls, src.gather_elements, tgt.gather_elements)


def _scaled(c: dict[str, Any], b: int, calls_s: int, calls_t: int, elems_s: int, elems_t: int) -> tuple[float, float]:
    calls = c["calls"] * calls_t / calls_s if calls_s else float(calls_t)
    elements = (c.get("bytes") or 0) / b * (elems_t / elems_s) if elems_s else float(elems_t)
    return calls, elements


def _retimed(m: Measured, t: CommTarget, link: Link) -> tuple[float, list[Assumption]]:
    """The source's collectives at the target's world size: each measured row repriced (`_repriced`); a
    one-rank source gains the ZeRO paper's parameter gathers, priced whole, and waits for the slowest of
    the target's ranks (its measured step spread)."""
    n = t.world_size
    rows = [c for c in m.comm if c["calls"]]
    notes: list[Assumption] = []
    if m.world_size == 1:
        gathers = {3: ("forward", "backward"), 2: ("optimizer",), 1: ("optimizer",)}.get(t.zero_stage, ())
        rows += [{"op": "all_gather_into_tensor", "phase": ph, "calls": 1, "bytes": m.param_bytes, "total_ms": 0.0,
                  "exposed_ms": 0.0} for ph in gathers]
        if gathers:
            notes.append(assume("comm_gathers_added", phases=", ".join(gathers), stage=t.zero_stage))
    if not rows:
        return NAN, [assume("comm_no_wait", why="the source recorded no collectives to re-time")]
    total = 0.0
    widen = _element_bytes(m, t) / m.dtype_bytes
    for c in rows:
        repeat = t.grad_accum / m.grad_accum if c["phase"] in ("forward", "backward") else 1.0
        measured = m.world_size > 1 and c.get("total_ms")  # a one-rank source's added gathers are priced whole
        # gathers carry the parameters in the model dtype; DDP's and FSDP2's reductions stay fp32 in any
        at = {**c, "bytes": (c.get("bytes") or 0) * widen} if widen != 1 and c["op"].startswith("all_gather") else c
        total += (_repriced(c, recorded_ms(at, n, link), m, link) if measured else recorded_ms(at, n, link)) * repeat
    if m.world_size == 1 and m.step_std_ms:
        factor = expected_max_normal(n)
        total += m.step_std_ms * factor
        notes.append(assume("comm_slowest_rank", wait_ms=m.step_std_ms * factor, ranks=n, std_ms=m.step_std_ms,
                            factor=factor))
    scale = ZERO_VOLUME[t.zero_stage] / ZERO_VOLUME[t.source_zero_stage]
    notes.append(assume("comm_retimed", link=link.source))
    if scale != 1.0:
        notes.append(assume("comm_zero_volume", source_stage=t.source_zero_stage, target_stage=t.zero_stage,
                            ratio=scale))
    return total * scale, notes
