"""`trainprof project` for pipeline runs: the bubble and the point-to-point volume of the target, as
a term beside the step model (trainprof/projection/stepmodel.py), which reads a pipeline run as the
phases of the stage that sets the pace (the busiest one) without the bubble.

Bubble: a stage's fill-and-drain wait is (p - 1) micro-batch times of its neighbours (GPipe, Huang et
al. 2019: bubble time (p - 1)(t_f + t_b), fraction (p - 1)/(m + p - 1)), so it does not grow with the
number of micro batches m but with the time of one micro batch. The pace-setting stage's measured bubble is
scaled by its predicted compute per micro batch over the measured one (forward + backward + recompute
per micro batch). Transfers are inside that wait; their volume per step and boundary,
m x micro_batch_size x seq_len x hidden x 4 B each way, is reported beside it (and re-timed over the
target's link when one is known).
"""

from __future__ import annotations

from typing import Any

from trainprof.analysis.pipeline import ANALYTIC_FORMULA, boundary_bytes, gpipe_bubble_fraction, p2p_bytes_per_step
from trainprof.projection.assumptions import Assumption, assume

P2P_OPS = ("send", "recv", "isend", "irecv")


def is_pipeline(profile: dict[str, Any]) -> bool:
    return bool((profile.get("pipeline") or {}).get("stages"))


def pace_view(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile as the step model should read it: its ranks narrowed to the stage that sets the
    pace (the busiest; every stage's wall time is about the same, so the slowest step says little)."""
    stage = profile["pipeline"]["balance"]["slowest_stage"]
    rank = next(s["rank"] for s in profile["pipeline"]["stages"] if s["stage"] == stage)
    return {**profile, "ranks": [r for r in profile.get("ranks") or [] if r["rank"] == rank]}


def without_p2p(comm: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The collectives the step model re-times: a pipeline's transfers are the bubble term's."""
    return [c for c in comm if c.get("op") not in P2P_OPS]


def check_world(profile: dict[str, Any], world: int) -> str | None:
    """Why a pipeline run cannot be projected to `world` ranks (None: it can)."""
    stages = profile["pipeline"]["num_stages"]
    if world != stages:
        return (f"a {stages}-stage pipeline runs on {stages} ranks (no data parallelism across pipelines); "
                f"project it with --nproc {stages}")
    return None


def pipeline_term(profile: dict[str, Any], measured_phases: dict[str, float], predicted: dict[str, float],
                  target_recipe: Any, link: Any = None) -> tuple[float, dict[str, Any], list[Assumption]]:
    """(predicted bubble ms of the slowest stage, the prediction's `pipeline` block, notes).

    Args:
        profile: the merged source profile (with `pipeline` and `ranks`).
        measured_phases: the step model's measured phases of the pace-setting stage (ms per step).
        predicted: the step model's predicted phases for the target (ms per step).
        target_recipe: the target recipe (grad_accum, micro batch, seq_len).
        link: the target's point-to-point link (comm.Link), or None.
    """
    from trainprof.models import resolve_shape

    pl = profile["pipeline"]
    (pace,) = [r for r in pace_view(profile)["ranks"] if r.get("phases_ms")]
    bubble_src = float(pace["phases_ms"].get("pipeline_bubble") or 0.0)
    m_s = int(profile["recipe"]["train"]["grad_accum"])
    t = target_recipe.train
    m_t = t.grad_accum
    compute = ("forward", "backward", "recompute")
    per_mb_s = sum(measured_phases[k] for k in compute) / m_s
    per_mb_t = sum(predicted[k] for k in compute) / m_t
    bubble_t = bubble_src * (per_mb_t / per_mb_s) if per_mb_s > 0 else bubble_src
    p = pl["num_stages"]
    boundary = boundary_bytes(t.micro_batch_size, target_recipe.data.seq_len, resolve_shape(target_recipe.model).hidden_size)
    volume = p2p_bytes_per_step(m_t, boundary)
    notes = [assume("pipeline_bubble", stage=pl["balance"]["slowest_stage"], bubble_ms=bubble_src,
                    target_mb_ms=per_mb_t, source_mb_ms=per_mb_s)]
    block: dict[str, Any] = {
        "num_stages": p, "schedule": pl["schedule"], "micro_batches": m_t,
        "bubble_ms": bubble_t, "bubble_ms_measured": bubble_src,
        "bubble_frac_analytic": gpipe_bubble_fraction(p, m_t), "bubble_frac_analytic_formula": ANALYTIC_FORMULA,
        "p2p_bytes_per_step_per_boundary": volume,
        "p2p_source": "m x micro_batch_size x seq_len x hidden x 4 B each way (fp32 residual stream)",
    }
    if link is not None and getattr(link, "busbw_gbps", None):
        per_transfer_ms = link.ms("send", boundary, 2)
        block["p2p_ms_per_transfer"] = per_transfer_ms
        notes.append(assume("pipeline_transfer", ms=per_transfer_ms, link=link.source))
    return bubble_t, block, notes
