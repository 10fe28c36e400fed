"""`trainprof replay` against a user's findings: its host floor at the untraced host's pace where profile.json
bounds it, its --to host named beside `trainprof project`'s, its what-if columns marked unvalidated, and its
fit check leaving `project --best`'s headroom. Recomputed on the CPU from the traces kept in profiles/."""

from __future__ import annotations

import json
import types

import pytest

from helpers.evidence import PROFILES, load

TORCH = PROFILES / "h100-llama1b_zero3_sdpa-torch-gpubound"  # GPU-bound traced and untraced: its host is hidden
ZERO3 = PROFILES / "h100-llama1b_zero3_sdpa-gpubound"  # traced 622 ms, untraced 418: tracing inflated its host
VALIDATION = json.loads((PROFILES.parent / "trainprof" / "projection" / "validation_gpu.json").read_text())


def _step(folder):
    from trainprof.analysis.replay import load_steps

    (step,) = load_steps(next(folder.glob("*.pt.trace.json.gz")))
    return step


def _line(out: str, start: str) -> str:
    return next(ln for ln in out.splitlines() if ln.startswith(start))


def test_untraced_pace_issues_the_step_within_the_untraced_step():
    """The untraced median step holds all of the untraced host's issuing: the pace replays the traced host
    within it, and stays 1.0 where the traced host already fits (the GPU-bound step hides how fast it is)."""
    from trainprof.analysis.replay import replay, untraced_pace

    step, untraced = _step(ZERO3), load(ZERO3)["summary"]["step_ms"]["median"]
    pace = untraced_pace(step, untraced)
    assert replay(step).host_ms > 1.4 * untraced and 0.4 < pace < 0.6, pace
    assert replay(step, host_scale=pace).host_ms == pytest.approx(untraced, rel=0.005)
    assert untraced_pace(_step(TORCH), load(TORCH)["summary"]["step_ms"]["median"]) == 1.0


def test_replay_to_gives_the_untraced_pace_beside_the_validated_traced_one(cli):
    """Where profile.json bounds the host, --to gives its step at the untraced host's pace beside the traced
    host's, which stays the answer: the replay cases measured it, and the untraced pace was further off on them."""
    from trainprof.analysis.replay import cross_device, device_rates, untraced_pace
    from trainprof.hardware import load_catalog

    step, untraced = _step(ZERO3), load(ZERO3)["summary"]["step_ms"]["median"]
    catalog = load_catalog()
    rates = device_rates(catalog.resolve("h100-sxm"), catalog.resolve("h200"))
    pace = untraced_pace(step, untraced)
    at_pace = cross_device(step, untraced, rates, pace=pace).step_ms
    case = next(c for c in VALIDATION["replay_cases"] if c["source"] == ZERO3.name)
    out = cli("replay", ZERO3, "--to", "h200")
    assert out.returncode == 0, out.stderr
    line = _line(out.stdout, "on h200:")
    assert line.startswith(f"on h200: {case['predicted_step_ms']:.1f} ms a step; replay's measured error on this run "
                           f"-> h200: {case['step_error_pct']:+.1f}%"), line
    assert (f"; at the untraced host's pace (its own work x{pace:.3f}, the slowest that fits the untraced median step) "
            f"{at_pace:.1f} ms, unvalidated and not the answer") in line
    assert f"tracing inflated it: untraced, its own work is at most x{pace:.3f} of this" in line


def test_replay_to_names_its_host_beside_the_one_project_assumes(cli):
    """The 1.8x between `replay --to b200` and `project --to b200` on the same run is their hosts: this one's as
    traced (per operator call) against the catalog's reference; a host-bound run's project host is its own."""
    from trainprof.hardware import load_catalog
    from trainprof.projection.hostref import host_us_and_ceiling
    from trainprof.projection.machines import gpu_host

    reference = gpu_host(load_catalog(), "torch", 0)[0]["forward"]
    out = cli("replay", TORCH, "--to", "b200")
    assert out.returncode == 0, out.stderr
    line = _line(out.stdout, "on b200:")
    assert "the host as fast as this one's as traced (its untraced pace not known" in line
    floor_ms = float(line.split("): ")[-1].split(" ms to issue the step's work on b200")[0])
    assert f"{floor_ms / 14141 * 1e3:.1f} µs per operator call (14,141 calls a step, profile.json)" in line
    assert line.endswith(f"`trainprof project` assumes the target's catalog reference host, {reference:.1f} µs per "
                         "forward operator call (gpu_host_us_per_op), not this one"), line
    hostbound = PROFILES / "h100-llama1b_zero3_sdpa-hostbound"
    own = host_us_and_ceiling(load(hostbound))[0]["forward"]
    line = _line(cli("replay", hostbound, "--to", "b200").stdout, "on b200:")
    assert line.endswith(f"`trainprof project` assumes this run's own host, {own:.1f} µs per forward operator call "
                         "(its forward was host-bound)"), line


def test_replay_what_ifs_are_marked_unvalidated_and_floored_at_the_untraced_host(cli):
    """Under the table: the what-if columns were never checked against a run; the GPU column's floor is the host,
    and where profile.json bounds the host the what-ifs are given again at the untraced pace, as the answer."""
    torch = cli("replay", TORCH)
    mark = _line(torch.stdout, "'host x0.5' and 'GPU x0.5' are unvalidated: no run on a host or a GPU that much "
                               "faster was measured")
    assert "'GPU x0.5' goes no lower than the time its host takes to issue the step: the traced host's" in mark
    assert "at the untraced host's pace" not in torch.stdout  # its untraced step does not bound its host
    zero3 = cli("replay", ZERO3)
    untraced = load(ZERO3)["summary"]["step_ms"]["median"]
    row = next(ln for ln in zero3.stdout.splitlines() if ln.split() and ln.split()[0] == "1").split()
    paced = _line(zero3.stdout, "at the untraced host's pace (step 1), the answer for this run untraced:")
    gpu_at_pace = float(paced.split("'GPU x0.5' ")[1].split(" ms")[0])
    assert float(row[-2]) > untraced > gpu_at_pace, (row, paced)  # the table's floor was tracing's
    assert "the host's at the untraced pace (the line above)" in _line(zero3.stdout, "'host x0.5' and 'GPU x0.5'")
    slower = cli("replay", TORCH, "--device-scale", "2")
    assert "goes no lower" not in _line(slower.stdout, "'host x0.5' and 'GPU x2' are unvalidated")


@pytest.mark.parametrize("share, note", [(0.89, None), (0.99, "may not fit"), (1.01, "does not fit")])
def test_replay_fit_check_leaves_the_headroom_project_best_leaves(share, note):
    """A peak within project --best's HEADROOM of the catalog memory fits; between it and the catalog figure
    (an H200's 141 GiB, of which CUDA got about 139) it may not, and says why; over the catalog figure it does not."""
    from trainprof.commands.replay import does_not_fit
    from trainprof.projection.best import HEADROOM

    capacity = 141 * 2**30
    doc = {"summary": {"peak_memory_bytes_max": share * capacity, "memory_meter": "max_memory_allocated"}}
    said = does_not_fit(doc, types.SimpleNamespace(gpu="h200", capacity_bytes=capacity))
    if note is None:
        assert said is None
        return
    assert said[0].startswith(f"{note}: measured peak {share * 141:.1f} GiB > "), said
    if note == "may not fit":
        assert f"> {HEADROOM:.0%} of 141.0 GiB" in said[0] and "project --best" in said[1] and "139" in said[1]


def test_replay_carries_matmul_rates_as_project_does():
    """replay --to and project re-rate GEMMs by one rule: MAMF over MAMF where both GPUs have one (H100 ->
    RTX 4090 read 1,902 ms by the datasheet peaks against project's 1,764 by MAMF), else the dense peak."""
    from trainprof.analysis.replay import device_rates
    from trainprof.hardware import load_catalog

    catalog = load_catalog()
    h100, rtx4090, h200 = (catalog.resolve(k) for k in ("h100-sxm", "rtx4090", "h200"))
    to_4090 = device_rates(h100, rtx4090)
    assert to_4090.compute == pytest.approx(h100.figure("mamf_bf16_tflops") / rtx4090.figure("mamf_bf16_tflops"))
    assert "MAMF (measured)" in to_4090.source
    assert h200.figure("mamf_bf16_tflops") is None  # the validated pair keeps the peaks
    to_h200 = device_rates(h100, h200)
    assert to_h200.compute == pytest.approx(1.0) and "bf16 dense peak (datasheet)" in to_h200.source
