"""Pipeline parallelism: which point-to-point transfer carries what, each stage's timeline of one step
(micro-batch forwards and backwards, waits for the neighbours), the bubble measured and analytic,
stage imbalance and which stage to rebalance.

Definitions (every figure says how it was measured in `method`):
  * a transfer to or from the next stage's rank is forward activations when sent and backward
    gradients when received; to or from the previous stage's rank the other way round. A point-to-
    point op's `phase` in `comm` is what it carries (forward = activations, backward = gradients).
  * pipeline_bubble: the time this stage's thread was blocked in a point-to-point transfer with a
    neighbour (in the isend / irecv call or in its `Work.wait()`): waiting for the neighbour's
    activations (forward) or gradients (backward), or, for a send, for the neighbour to take them
    (gloo completes a send only once the receiver has posted its receive). The transfer itself is
    inside that time; its bytes, time and bandwidth are the `comm` rows.
  * drain (measured across stages, when the rank profiles are merged): the time this stage was blocked
    in a collective (comm_exposed, e.g. the optimizer's grad-norm all-reduce) while another stage was
    still inside its schedule (its first micro-batch action to its last action or neighbour wait), on
    the aligned clock. A stage that finished early waits there for the pipeline to drain: that is
    bubble, so the merged stage figures move it from comm_exposed to pipeline_bubble; the rest of the
    wait (the collective itself, the other stages' optimizer code before it) stays comm_exposed.
  * measured bubble fraction: pipeline_bubble / schedule time, schedule time = wall - optimizer -
    data_wait (what the schedule's step took on this stage); merged, the drain is in pipeline_bubble.
  * analytic bubble fraction (GPipe; Huang et al. 2019, sec. 2.3): (p - 1) / (m + p - 1) for p stages
    and m micro batches, assuming equal stage times and free communication. 1F1B (PipeDream-Flush,
    Narayanan et al. 2021) idles as long; it keeps fewer micro batches' activations alive.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from trainprof.analysis.intervals import IntervalSet
from trainprof.analysis.records import ACTION_CLOSE, ACTION_OPEN, REGION_CLOSE, REGION_OPEN, Event

ACTION_KINDS = ("forward", "backward")
BUBBLE_METHOD = ("time blocked in a point-to-point transfer with a neighbouring stage (the isend/irecv call and "
                 "its Work.wait()): waiting for its activations (forward) or gradients (backward), or for it to take "
                 "ours; the transfer itself included; host timer on CPU, CUDA events on GPU")
FRACTION_METHOD = "pipeline_bubble / (wall - optimizer - data_wait), median over the measured steps"
DRAIN_METHOD = ("drain: time blocked in a collective (comm_exposed) while another stage was still in its schedule "
                "(first micro-batch action to last action or neighbour wait), on the aligned clock: waiting for "
                "the pipeline to drain, moved from comm_exposed to pipeline_bubble; median over the measured steps")
SCHEDULE_KINDS = ("forward", "backward", "bubble_forward", "bubble_backward")  # timeline kinds inside the schedule
ANALYTIC_FORMULA = "(p - 1) / (m + p - 1): GPipe, Huang et al. 2019 sec. 2.3; equal stage times, free transfers"
TIMELINE_ALIGNMENT = ("each rank's intervals are ms since its own step start; ranks are placed by the system "
                      "clock (time.time_ns) read at each step start: exact to microseconds on one machine, "
                      "NTP-accurate across machines (with CUDA events the GPU may start later than the host read)")


def gpipe_bubble_fraction(stages: int, micro_batches: int) -> float:
    """GPipe's idle fraction (p - 1) / (m + p - 1) (Huang et al. 2019, sec. 2.3)."""
    return (stages - 1) / (micro_batches + stages - 1)


def boundary_bytes(micro_batch_size: int, seq_len: int, hidden_size: int, dtype_bytes: int = 4) -> int:
    """Bytes of the hidden states one micro batch passes from a stage to the next, and of their
    gradient coming back: micro_batch_size x seq_len x hidden_size elements of the residual stream
    (fp32 under autocast: the master weights' dtype)."""
    return micro_batch_size * seq_len * hidden_size * dtype_bytes


def p2p_bytes_per_step(micro_batches: int, boundary: int) -> dict[str, int]:
    """Bytes one stage boundary carries per optimizer step, each way."""
    return {"activations": micro_batches * boundary, "gradients": micro_batches * boundary}


@dataclass(frozen=True)
class PipelineInfo:
    """Where this rank sits in the pipeline (set by Profiler.watch_pipeline)."""

    stage: int
    num_stages: int
    schedule: str
    micro_batches: int
    prev_rank: int | None
    next_rank: int | None

    def classify(self, op: str, peer: int | None) -> tuple[str, str] | None:
        """(phase, exposed label) of a point-to-point op with a neighbour, None for anything else."""
        if peer is None or op not in ("send", "recv", "isend", "irecv"):
            return None
        sending = op in ("send", "isend")
        if peer == self.next_rank:
            phase = "forward" if sending else "backward"
        elif peer == self.prev_rank:
            phase = "backward" if sending else "forward"
        else:
            return None
        return phase, "pipeline_bubble"

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "num_stages": self.num_stages, "schedule": self.schedule,
                "micro_batches": self.micro_batches, "prev_rank": self.prev_rank, "next_rank": self.next_rank}


def step_timeline(events: list[Event], waits: list[tuple[float, float, str]]) -> list[list[Any]]:
    """One step's intervals on this stage, sorted: [kind, micro batch or None, t0 ms, t1 ms] with kind
    forward | backward (a micro batch's action) | bubble_forward | bubble_backward (blocked on a
    transfer of activations / gradients with a neighbour) | optimizer | comm_exposed (blocked in a
    collective, e.g. the gradient-norm all-reduce across stages inside the optimizer).

    Args:
        events: the step's events in ms (analysis.records.Event; a pipeline action's subject is
            (kind, micro batch), a list once read back from a journal).
        waits: (t0, t1, kind) of the blocked intervals, kind bubble_forward | bubble_backward | comm_exposed.
    """
    out: list[list[Any]] = []
    open_actions: dict[tuple[str, int], float] = {}
    open_optimizer: list[float] = []
    for e in events:
        code, payload, t = e.code, e.subject, e.at
        if code == ACTION_OPEN:
            open_actions[tuple(payload)] = t
        elif code == ACTION_CLOSE and tuple(payload) in open_actions:
            kind, mb = payload
            out.append([kind, mb, open_actions.pop(tuple(payload)), t])
        elif code == REGION_OPEN and payload == "optimizer":
            open_optimizer.append(t)
        elif code == REGION_CLOSE and payload == "optimizer" and open_optimizer:
            t0 = open_optimizer.pop()
            if not open_optimizer:
                out.append(["optimizer", None, t0, t])
    out.extend([kind, None, a, b] for a, b, kind in waits if b > a)
    out.sort(key=lambda r: (r[2], r[3]))
    return [[k, mb, round(a, 4), round(b, 4)] for k, mb, a, b in out]


def step_pipeline(events: list[Event], comms: list[Any], origin_unix_ns: int | None) -> dict[str, Any]:
    """What a pipeline stage keeps of one step (StepRecord.pipeline): its timeline, its transfers with
    the neighbours as [op, phase, peer, bytes, issued, first wait began, last wait ended] (ms since the
    step began), and where the step began on the system clock.

    Args:
        events: the step's events in ms.
        comms: the step's CommEvents, pipeline transfers marked (exposed_as "pipeline_bubble").
        origin_unix_ns: time.time_ns() of the step's start.
    """
    waits = [(a, b, f"bubble_{c.phase}" if c.exposed_as == "pipeline_bubble" else "comm_exposed")
             for c in comms for a, b in c.exposed_intervals()]
    transfers = [[c.op, c.phase, c.peer, c.nbytes, c.issue, c.waits[0][0] if c.waits else None,
                  c.waits[-1][1] if c.waits else None] for c in comms if c.exposed_as == "pipeline_bubble"]
    return {"origin_unix_ns": origin_unix_ns, "timeline": step_timeline(events, waits), "transfers": transfers}


def schedule_span(intervals: list[list[Any]]) -> tuple[float, float] | None:
    """(first start, last end) of a stage's schedule in one step's timeline: its micro-batch actions and
    its waits for a neighbour; None when the step has none."""
    inside = [(a, b) for kind, _, a, b in intervals if kind in SCHEDULE_KINDS]
    if not inside:
        return None
    return min(a for a, _ in inside), max(b for _, b in inside)


def drain_intervals(stages: list[dict[str, Any]]) -> list[list[tuple[float, float]]]:
    """Per stage, where (ms in its own step) it was blocked in a collective after its own schedule while
    another stage was still in its schedule: the pipeline draining into that collective.

    Args:
        stages: one step of every stage, each with `offset_ms` (its start on the shared clock) and
            `intervals` [kind, micro batch, t0, t1] (step_timeline).
    """
    spans = [schedule_span(st["intervals"]) for st in stages]
    out = []
    for i, st in enumerate(stages):
        shift = [stages[k]["offset_ms"] - st["offset_ms"] for k in range(len(stages))]  # to this stage's clock
        others = IntervalSet([(span[0] + shift[k], span[1] + shift[k])
                              for k, span in enumerate(spans) if k != i and span is not None])
        done = spans[i][1] if spans[i] is not None else float("-inf")
        pieces = []
        for kind, _, a, b in st["intervals"]:
            if kind != "comm_exposed" or not others.starts:
                continue
            a = max(a, done)
            for s0, s1 in zip(others.starts, others.ends):
                if min(b, s1) > max(a, s0):
                    pieces.append((max(a, s0), min(b, s1)))
        out.append(pieces)
    return out


def drain_ms(stages: list[dict[str, Any]]) -> list[float]:
    """Per stage, ms of one step it was blocked in a collective waiting for the other stages to drain
    (drain_intervals)."""
    return [sum(b - a for a, b in pieces) for pieces in drain_intervals(stages)]


def _relabel_drain(intervals: list[list[Any]], pieces: list[tuple[float, float]]) -> list[list[Any]]:
    """A stage's timeline with the drain parts of its collective waits as `bubble_backward`: waiting for
    the other stages' backwards (the schema's interval kinds; the diagram draws them as waits)."""
    if not pieces:
        return intervals
    out = []
    for kind, mb, a, b in intervals:
        if kind != "comm_exposed":
            out.append([kind, mb, a, b])
            continue
        cut = a
        for p0, p1 in sorted(pieces):
            if p1 <= a or p0 >= b:
                continue
            if p0 > cut:
                out.append([kind, mb, cut, p0])
            out.append(["bubble_backward", None, max(p0, a), min(p1, b)])
            cut = min(p1, b)
        if cut < b:
            out.append([kind, mb, cut, b])
    return sorted(out, key=lambda r: (r[2], r[3]))


def _stage_drains(blocks: list[dict[str, Any]], steps: list[int]) -> dict[int, list[list[tuple[float, float]]]]:
    """step -> per stage (in `blocks` order) its drain intervals, for the steps every stage kept."""
    out = {}
    for st in steps:
        chosen = [next(t for t in b["timelines"] if t["step"] == st) for b in blocks]
        start = min(t["origin_unix_ns"] for t in chosen)
        out[st] = drain_intervals([{"offset_ms": (t["origin_unix_ns"] - start) / 1e6, "intervals": t["intervals"]}
                                   for t in chosen])
    return out


def _with_drain(block: dict[str, Any], profile: dict[str, Any], drains: dict[int, float]) -> dict[str, Any]:
    """A stage's figures with its measured drain moved from comm_exposed into the bubble: bubble_ms,
    bubble_frac_measured and phases_ms (medians over the steps), the drain itself and what it waited in."""
    by_step = {s["step"]: s for s in profile.get("steps") or [] if not s.get("warmup")}
    bubble, fracs, drained, phases = [], [], [], defaultdict(list)
    for step, d in drains.items():
        s = by_step.get(step)
        if s is None:
            continue
        ph = dict(s["phases_ms"])
        ph["comm_exposed"] = ph.get("comm_exposed", 0.0) - d
        ph["pipeline_bubble"] = ph.get("pipeline_bubble", 0.0) + d
        span = s["wall_ms"] - ph.get("optimizer", 0.0) - ph.get("data_wait", 0.0)
        bubble.append(ph["pipeline_bubble"])
        drained.append(d)
        if span > 0:
            fracs.append(ph["pipeline_bubble"] / span)
        for k, v in ph.items():
            phases[k].append(v)
    if not drained:
        return {**block, "drain_ms": None}
    waited_in = [f"{c['op']} ({c['phase']})" for c in profile.get("comm") or []
                 if c.get("peer") is None and (c.get("exposed_ms") or 0) > 0]
    return {**block, "bubble_p2p_ms": block["bubble_ms"], "bubble_ms": _median(bubble),
            "bubble_frac_measured": _median(fracs), "drain_ms": _median(drained), "drain_in": waited_in,
            "phases_ms": {k: _median(v) for k, v in phases.items()},
            "method": {**block.get("method", {}), "drain": DRAIN_METHOD}}


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def rank_block(info: PipelineInfo, steps_used: list[Any]) -> dict[str, Any]:
    """This rank's `pipeline` block in profile.rank<r>.json.

    Args:
        info: the rank's place in the pipeline.
        steps_used: the StepRecords the medians use (measured steps without FLOP counting or operator
            tracing where there are any); their timelines and transfers are kept for the merge.
    """
    bubble, schedule_ms, fracs, busy = [], [], [], []
    per_mb: dict[tuple[str, int], list[float]] = defaultdict(list)
    p2p: dict[str, list[int]] = defaultdict(list)
    for s in steps_used:
        ph = s.breakdown.phases_ms
        span = s.breakdown.wall_ms - ph["optimizer"] - ph["data_wait"]
        bubble.append(ph["pipeline_bubble"])
        schedule_ms.append(span)
        busy.append(ph["forward"] + ph["backward"] + ph["recompute"])
        if span > 0:
            fracs.append(ph["pipeline_bubble"] / span)
        for kind, mb, a, b in (s.pipeline or {}).get("timeline", []):
            if kind in ACTION_KINDS:
                per_mb[(kind, mb)].append(b - a)
        totals: dict[str, int] = defaultdict(int)
        for row in s.breakdown.comm:
            if row.get("peer") is not None:
                direction = "sent" if row["op"] in ("send", "isend") else "received"
                what = "activations" if row["phase"] == "forward" else "gradients"
                totals[f"{what}_{direction}_bytes"] += row["bytes"]
        for key in ("activations_sent_bytes", "activations_received_bytes", "gradients_sent_bytes",
                    "gradients_received_bytes"):
            p2p[key].append(totals.get(key, 0))
    micro = []
    for mb in sorted({mb for _, mb in per_mb}):
        micro.append({"micro_batch": mb, "forward_ms": _median(per_mb.get(("forward", mb), [])),
                      "backward_ms": _median(per_mb.get(("backward", mb), []))})
    timelines = [{"step": s.step, "origin_unix_ns": s.pipeline["origin_unix_ns"], "wall_ms": s.breakdown.wall_ms,
                  "intervals": s.pipeline["timeline"], "transfers": s.pipeline.get("transfers", [])}
                 for s in steps_used if s.pipeline is not None]
    return {
        **info.to_dict(),
        "bubble_ms": _median(bubble),
        "schedule_ms": _median(schedule_ms),
        "busy_ms": _median(busy),
        "bubble_frac_measured": _median(fracs),
        "bubble_frac_analytic": gpipe_bubble_fraction(info.num_stages, info.micro_batches),
        "micro_batches_ms": micro,
        "p2p_bytes_per_step": {k: int(statistics.median(v)) for k, v in p2p.items()},
        "timelines": timelines,
        "method": {"bubble": BUBBLE_METHOD, "bubble_frac_measured": FRACTION_METHOD,
                   "bubble_frac_analytic": ANALYTIC_FORMULA,
                   "busy_ms": "forward + backward + recompute phases (median): the stage's own compute",
                   "micro_batches_ms": "each micro batch's PipelineStage.forward_one_chunk / backward_one_chunk "
                                       "call, median over the measured steps"},
    }


def _layer_costs(modules: list[dict[str, Any]]) -> dict[int, float]:
    """Decoder layer index -> forward + backward + recompute ms, from a stage's module rows."""
    out = {}
    for m in modules:
        parts = m["name"].split(".")
        if len(parts) == 3 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
            out[int(parts[2])] = (m.get("forward_ms") or 0) + (m.get("backward_ms") or 0) + (m.get("recompute_ms") or 0)
    return out


def rebalance(stages: list[dict[str, Any]], layer_costs: list[dict[int, float]]) -> dict[str, Any]:
    """Stage imbalance and the layer move that evens it most.

    Imbalance = the slowest stage's busy time over the mean stage's, minus 1 (the pipeline runs at the
    pace of its slowest stage). The suggestion moves whole decoder layers from the slowest stage to a
    neighbour, using the measured per-layer times of the slowest stage, as long as it keeps one layer.

    Args:
        stages: the rank blocks (busy_ms, stage), in stage order.
        layer_costs: per stage, decoder layer index -> measured ms.
    """
    busy = [s["busy_ms"] or 0.0 for s in stages]
    mean = statistics.fmean(busy) if busy else 0.0
    slowest = max(range(len(busy)), key=busy.__getitem__) if busy else 0
    out: dict[str, Any] = {
        "busy_ms": busy,
        "imbalance": (max(busy) / mean - 1) if mean > 0 else None,
        "slowest_stage": slowest,
        "method": "busy = forward + backward + recompute phases per stage (median); imbalance = max / mean - 1; "
                  "moves use the slowest stage's measured decoder-layer times",
        "suggestion": None,
    }
    layers = layer_costs[slowest] if slowest < len(layer_costs) else {}
    best = (max(busy) if busy else 0.0, None)
    for neighbour in (slowest - 1, slowest + 1):
        if not 0 <= neighbour < len(busy) or not layers:
            continue
        # layers at the edge facing the neighbour move first
        order = sorted(layers, reverse=neighbour > slowest)
        moved = 0.0
        for k in range(1, len(order)):  # keep at least one layer on the slowest stage
            moved += layers[order[k - 1]]
            new = list(busy)
            new[slowest] -= moved
            new[neighbour] += moved
            if max(new) < best[0] - 1e-9:
                best = (max(new), (neighbour, k, new))
    if best[1] is not None:
        neighbour, k, new = best[1]
        out["suggestion"] = {
            "from_stage": slowest, "to_stage": neighbour, "layers": k,
            "busy_ms_after": new, "slowest_ms_after": max(new),
            "text": (f"move {k} decoder layer{'s' if k > 1 else ''} from stage {slowest} to stage {neighbour} "
                     f"(engine.pipeline_layers): slowest stage {max(busy):.1f} -> {max(new):.1f} ms busy, estimated "
                     "from the measured layer times"),
        }
    elif len(busy) > 1:
        out["suggestion_none"] = (f"no whole-layer move lowers the slowest stage (stage {slowest}); its work "
                                  "outside the decoder layers (embedding, LM head, loss) or a single layer dominates")
    return out


TRANSFER_METHOD = ("sends and receives of one stage boundary and direction paired in order across the two ranks "
                   "(aligned clock, see timeline.alignment); transfer = the receive's wait end - max(send issue, "
                   "receive posted), only where the receiver was already waiting then (otherwise the data may have "
                   "arrived before it looked); median over pairs and measured steps; bandwidth = bytes / transfer")


def _transfers(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each stage boundary's activation and gradient transfers timed across the two ranks."""
    out = []
    for a, b in zip(blocks, blocks[1:]):
        for carries, sender, receiver, phase in (("activations", a, b, "forward"), ("gradients", b, a, "backward")):
            times, nbytes = [], None
            steps = {t["step"]: t for t in receiver["timelines"]}
            for ts in sender["timelines"]:
                tr = steps.get(ts["step"])
                if tr is None:
                    continue
                shift_s, shift_r = ts["origin_unix_ns"] / 1e6, tr["origin_unix_ns"] / 1e6
                sends = [x for x in ts["transfers"] if x[0] in ("send", "isend") and x[1] == phase]
                recvs = [x for x in tr["transfers"] if x[0] in ("recv", "irecv") and x[1] == phase]
                for s, r in zip(sends, recvs):
                    nbytes = s[3]
                    start = max(shift_s + s[4], shift_r + r[4])
                    if r[5] is None or r[6] is None or shift_r + r[5] > start + 0.05:
                        continue  # the receiver looked only after the data could have arrived
                    times.append(shift_r + r[6] - start)
            ms = statistics.median(times) if times else None
            out.append({"from_stage": sender["stage"], "to_stage": receiver["stage"], "carries": carries,
                        "bytes": nbytes, "transfer_ms": ms, "samples": len(times),
                        "gbps": (nbytes / (ms / 1e3) / 1e9) if (ms and nbytes) else None,
                        **({} if times else {"reason": "no transfer found the receiver already waiting"})})
    return out


def merge_pipeline(profiles: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The merged `pipeline` block: stages, one aligned timeline, imbalance and the rebalance advice.

    Args:
        profiles: the rank profiles, sorted by rank.
    """
    blocks = [p.get("pipeline") for p in profiles]
    if not blocks or any(b is None for b in blocks):
        return None
    blocks = sorted(blocks, key=lambda b: b["stage"])
    by_stage = {b["stage"]: p for b, p in zip([p["pipeline"] for p in profiles], profiles)}
    common = set.intersection(*[{t["step"] for t in b["timelines"]} for b in blocks]) if blocks else set()
    drains = _stage_drains(blocks, sorted(common))
    blocks = [_with_drain(b, by_stage[b["stage"]], {st: sum(x1 - x0 for x0, x1 in d[i]) for st, d in drains.items()})
              for i, b in enumerate(blocks)]
    first = blocks[0]
    stages = [{k: v for k, v in b.items() if k != "timelines"} | {"rank": by_stage[b["stage"]]["rank"]}
              for b in blocks]
    timeline = None
    if common:
        steps = sorted(common)
        # the step whose slowest-stage wall time is the median one: a typical step, not the first
        walls = {st: max(next(t["wall_ms"] for t in b["timelines"] if t["step"] == st) for b in blocks)
                 for st in steps}
        pick = sorted(steps, key=walls.__getitem__)[len(steps) // 2]
        chosen = [next(t for t in b["timelines"] if t["step"] == pick) for b in blocks]
        start = min(t["origin_unix_ns"] for t in chosen)
        timeline = {
            "step": pick,
            "alignment": TIMELINE_ALIGNMENT,
            "stages": [{"stage": b["stage"], "offset_ms": (t["origin_unix_ns"] - start) / 1e6, "wall_ms": t["wall_ms"],
                        "intervals": _relabel_drain(t["intervals"], drains[pick][i])}
                       for i, (b, t) in enumerate(zip(blocks, chosen))],
        }
    costs = [_layer_costs(by_stage[b["stage"]].get("modules") or []) for b in blocks]
    measured = [b["bubble_frac_measured"] for b in blocks if b["bubble_frac_measured"] is not None]
    balance = rebalance(blocks, costs)
    pace = blocks[balance["slowest_stage"]]
    return {
        "num_stages": first["num_stages"],
        "schedule": first["schedule"],
        "micro_batches": first["micro_batches"],
        "bubble_frac_analytic": first["bubble_frac_analytic"],
        "bubble_frac_analytic_formula": ANALYTIC_FORMULA,
        "bubble_frac_measured": pace["bubble_frac_measured"],
        "bubble_frac_measured_stage": pace["stage"],
        "bubble_frac_measured_mean": statistics.fmean(measured) if measured else None,
        "bubble_frac_measured_method": (FRACTION_METHOD + "; the drain included (" + DRAIN_METHOD + "); "
                                        "of the stage that sets the pace (the most busy one): "
                                        "it waits only to fill and drain the pipeline, what the analytic fraction "
                                        "models; a faster stage also waits for the slower one on every micro batch "
                                        "(imbalance), so the mean over stages is given beside it"),
        "stages": stages,
        "timeline": timeline,
        "transfers": _transfers(blocks),
        "transfers_method": TRANSFER_METHOD,
        "balance": balance,
    }


__all__ = ["PipelineInfo", "gpipe_bubble_fraction", "boundary_bytes", "p2p_bytes_per_step", "step_timeline",
           "step_pipeline", "schedule_span", "drain_intervals", "drain_ms", "rank_block", "merge_pipeline", "rebalance"]
