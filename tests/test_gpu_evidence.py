"""Every GPU figure the project states, recomputed on a CPU from what profiles/ keeps (issue 27): closure,
MFU against the catalog peak, the GPU's busy share, NVML telemetry, the traced step, the profiler's
overhead on a GPU and the H100 -> H200 projection error of every recipe measured on both kinds. Nothing
stated about a GPU may depend on a GPU being present later.

Where profiles/ does not hold a kind of evidence yet, its test skips and names what the GPU program
(scripts/gpu_check.sh --program ...) must produce."""

from __future__ import annotations

import json
import statistics

import pytest

from helpers.evidence import (CLOSURE_MISSES, PROFILES, PROGRAM, check_overhead_config, check_telemetry,
                              gpu_folders, known_miss, load, used_steps)
from test_plan_gpu_reference import KNOWN_MISSES as KNOWN_PLAN_MISSES
from trainprof.analysis.gpu_busy import gpu_busy_fields, phase_busy, trace_device_time
from trainprof.profiler.ops import KERNEL_PREFIX, counted_again

GPU = gpu_folders()
IDS = [f.name for f in GPU]
TRACE_MAX_BYTES = 8 * 2**20  # "a few MB at most" per traced step
VALIDATION = json.loads((PROFILES.parent / "trainprof" / "projection" / "validation_gpu.json").read_text())


def test_profiles_hold_the_gpu_runs():
    kinds = {f.name.split("-")[0] for f in GPU}
    assert {"h100", "h200"} <= kinds, [f.name for f in GPU]


@pytest.mark.parametrize("folder", [known_miss(CLOSURE_MISSES, f.name, f) for f in GPU])
def test_closure_recomputed_from_the_steps(folder):
    doc = load(folder)
    for s in doc["steps"]:
        assert sum(s["phases_ms"].values()) + s["unattributed_ms"] == pytest.approx(s["wall_ms"], abs=1e-6)
    steps = used_steps(doc)
    assert len(steps) == doc["summary"]["steps_used"]
    fracs = [s["unattributed_ms"] / s["wall_ms"] for s in steps]
    assert statistics.median(fracs) == pytest.approx(doc["summary"]["unattributed_frac"], rel=1e-9)
    assert abs(statistics.median(fracs)) <= 0.02
    assert statistics.median(s["wall_ms"] for s in steps) == pytest.approx(doc["summary"]["step_ms"]["median"])


@pytest.mark.parametrize("folder", GPU, ids=IDS)
def test_mfu_recomputed_against_the_catalog_peak(folder):
    from trainprof.hardware import dense_peak

    doc = load(folder)
    s = doc["summary"]
    dtype = {"peak_bf16_dense_tflops": "bf16", "peak_fp16_dense_tflops": "fp16", "peak_tf32_dense_tflops": "tf32",
             "peak_fp32_tflops": "fp32"}[s["peak"]["key"]]
    peak, reason = dense_peak(doc["env"]["device"], "cuda", dtype)
    assert peak is not None, reason
    assert peak["tflops"] == s["peak"]["tflops"], "the catalog's peak changed since this run: its MFU is stale"
    step_s = statistics.median(st["wall_ms"] for st in used_steps(doc)) / 1e3
    mfu = s["model_flops_per_step"] / step_s / 1e12 / peak["tflops"]
    assert mfu == pytest.approx(s["mfu"], rel=1e-9)
    assert 0 < mfu < 1
    # the counted FLOPs against PaLM's 6N + 12LHQT of the same step
    assert 0.9 <= s["measured_over_analytic"] <= 1.1


@pytest.mark.parametrize("folder", GPU, ids=IDS)
def test_gpu_busy_share_recomputed_from_the_operator_table(folder):
    doc = load(folder)
    rows, reason = phase_busy(doc)
    assert rows is not None, reason
    step = rows[0]
    assert step.wall_ms == doc["summary"]["step_ms"]["median"]
    traced = len(doc["ops_info"]["steps"])
    assert step.device_ms == pytest.approx(sum(r["self_ms"] for r in doc["ops"]) / traced)
    assert 0 < step.busy_frac <= 1
    if "gpu_busy" in doc:  # written by the profiler since issue 27: the same figures (summed in another order)
        assert _rounded(doc["gpu_busy"]) == _rounded(gpu_busy_fields(doc)["gpu_busy"])
    for case in VALIDATION["cases"]:  # the table's "GPU busy at the source"
        if case["source_step_ms"] == pytest.approx(doc["summary"]["step_ms"]["median"], abs=0.05) \
                and folder.name.startswith("h100"):
            assert round(step.busy_frac, 2) == case["source_gpu_busy_frac"], case["case"]


def _rounded(value):
    """`value` with every float to 12 significant digits: sums of one set of numbers taken in another
    order differ in the last bits."""
    if isinstance(value, float):
        return float(f"{value:.12g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def test_every_validation_case_has_its_source_run_in_profiles():
    h100 = [load(f)["summary"]["step_ms"]["median"] for f in GPU if f.name.startswith("h100")]
    for case in VALIDATION["cases"]:
        assert any(case["source_step_ms"] == pytest.approx(ms, abs=0.05) for ms in h100), case["case"]


# -gpubound runs that kept the GPU busy less than 80%, with the share that profiles/README.md states for them
BELOW_GOAL = {"h200-llama1b_zero3_sdpa-gpubound": 0.68}


def test_gpu_bound_runs_keep_the_gpu_busy():
    """The GPU-bound configuration (issue 27) is one at which the GPU is busy >= 80% of the step; a run
    that fell short is listed with its share, which the README states."""
    bound = [f for f in GPU if f.name.endswith("-gpubound")]
    if not bound:
        pytest.skip(f"profiles/ has no <kind>-*-gpubound run yet: {PROGRAM} keeps them")
    readme = (PROFILES / "README.md").read_text()
    for folder in bound:
        rows, reason = phase_busy(load(folder))
        assert rows is not None, reason
        if folder.name in BELOW_GOAL:
            assert round(rows[0].busy_frac, 2) == BELOW_GOAL[folder.name], folder.name
            assert f"`{folder.name}`" in readme and f"busy {rows[0].busy_frac:.0%}" in readme, folder.name
        else:
            assert rows[0].busy_frac >= 0.8, f"{folder.name}: the GPU was busy {rows[0].busy_frac:.0%} of the step"


def test_telemetry_present_and_sane():
    with_telemetry = [f for f in GPU if load(f).get("telemetry")]
    if not with_telemetry:
        pytest.skip(f"no GPU run in profiles/ has NVML telemetry yet (profile.json `telemetry`): {PROGRAM} keeps "
                    "runs made with the profiler's telemetry on")
    for folder in with_telemetry:
        doc = load(folder)
        check_telemetry(doc["telemetry"])
        measured = [s["step"] for s in doc["steps"] if not s.get("warmup")]
        assert [s["step"] for s in doc["telemetry"]["steps"]] == measured, folder.name


def test_traced_steps_kept_and_consistent_with_the_operator_table():
    traced = [(f, t) for f in GPU for t in sorted(f.glob("*.pt.trace.json.gz"))]
    if not traced:
        pytest.skip(f"no GPU run in profiles/ keeps its traced step's Kineto trace (*.pt.trace.json.gz) yet: {PROGRAM} "
                    "copies rank 0's")
    for folder, path in traced:
        doc = load(folder)
        assert path.stat().st_size <= TRACE_MAX_BYTES, f"{path}: {path.stat().st_size / 2**20:.1f} MiB"
        t = trace_device_time(path)
        assert t.steps == doc["ops_info"]["steps"], (path, t.steps)
        # a kernel an aten op launched is the op's: no `kernel::` row counts it again (the kept tables
        # written before that rule were repaired from their traces: scripts/repair_kernel_rows.py)
        assert not counted_again(doc["ops"], t.op_kernels), path
        ops_ms = sum(r["self_ms"] for r in doc["ops"]) * len(t.steps)  # the table is per traced step
        # a table written before it kept the kernels that no operator launched (bitsandbytes' dequantize,
        # DeepSpeed's fused Adam: `kernel::` rows) holds the trace's device time less theirs
        kept_all = any(r["name"].startswith(KERNEL_PREFIX) for r in doc["ops"])
        expected = t.device_ms if kept_all else t.device_ms - t.outside_ops_ms
        assert expected == pytest.approx(ops_ms, rel=0.10), (path, t.device_ms, t.outside_ops_ms, ops_ms)
        assert t.union_ms <= t.device_ms + 1e-6


def _overhead_docs() -> list[tuple[str, dict]]:
    return [(p.parent.name, json.loads(p.read_text())) for p in sorted(PROFILES.glob("*/overhead.json"))]


def test_overhead_ratio_recomputed_from_its_pairs():
    docs = _overhead_docs()
    if not docs:
        pytest.skip(f"profiles/ has no <kind>-overhead/overhead.json yet (scripts/bench_overhead.py --device cuda): "
                    f"{PROGRAM} writes it")
    for name, doc in docs:
        configs = [c for c in doc["configs"] if "error" not in c]
        assert configs, f"{name}: every configuration failed: {[c['error'] for c in doc['configs']]}"
        for cfg in configs:
            ratios = check_overhead_config(cfg)
            assert 0.95 <= ratios["A/A control: unprofiled vs unprofiled"] <= 1.05, (name, cfg["name"])
            if cfg["gpu_busy_frac"] is None:
                assert cfg["gpu_busy_frac_reason"], (name, cfg["name"])
            else:
                assert 0 < cfg["gpu_busy_frac"] <= 1.0 + 1e-9, (name, cfg["name"])  # a union of intervals


def test_overhead_meets_the_goal_on_gpu_bound_steps():
    """Issue 27's goal: profiled / unprofiled <= 1.02 on a GPU-bound step (the GPU busy >= 80%)."""
    bound = [(name, doc["goal_ratio"], cfg) for name, doc in _overhead_docs() for cfg in doc["configs"]
             if "error" not in cfg and (_config_busy(name, cfg) or 0) >= 0.8]
    if not bound:
        pytest.skip(f"no GPU-bound configuration in profiles/*/overhead.json yet: {PROGRAM} runs the bench")
    for name, goal, cfg in bound:
        as_run = next(r for r in cfg["rows"] if r["mode"].startswith("one Profiler"))
        assert as_run["ratio_median"] <= goal, f"{name}: {cfg['name']}: ratio {as_run['ratio_median']:.3f}"


def _config_busy(name: str, cfg: dict) -> float | None:
    """A bench configuration's GPU busy share: its own, else that of the kept profile run of the same
    kind and configuration (model, engine, micro batch, seq_len)."""
    from trainprof.recipe import load_recipe

    if cfg["gpu_busy_frac"] is not None:
        return cfg["gpu_busy_frac"]
    want = load_recipe(PROFILES.parent / cfg["recipe"], cfg["overrides"])
    kind = name.split("-")[0]
    for folder in GPU:
        got = load_recipe(folder / "recipe.yaml")
        if folder.name.startswith(kind + "-") and (got.model, got.task, got.engine.kind, got.engine.zero_stage,
                                                   got.train.micro_batch_size, got.data.seq_len) == \
                (want.model, want.task, want.engine.kind, want.engine.zero_stage, want.train.micro_batch_size,
                 want.data.seq_len):
            rows, _ = phase_busy(load(folder))
            return rows[0].busy_frac if rows else None
    return None


# Strict: a source that gains its calibration makes the test fail until the entry goes.
UNCALIBRATED = {"h100-llama7b_qlora-v2": "no calibration.json: the run's 150 s limit stopped it in its calibration, "
                                         "after profile.json (docs/gpu_program.md); validation_gpu.json keeps the "
                                         "pair with a null step and its reason"}


def _kind_pairs() -> list:
    names = {f.name for f in GPU}
    pairs = [(f"h100-{n[5:]}", f"h200-{n[5:]}") for n in sorted(names)
             if n.startswith("h100-") and f"h200-{n[5:]}" in names]
    return [known_miss(UNCALIBRATED, h100, h100, h200, name=f"{h100}-{h200}") for h100, h200 in pairs]


def test_a_gpu_sources_dtype_change_is_refused_with_the_reason():
    """A GPU run's kernels and operator calls were recorded at its dtype: a change of model.dtype from it is
    null with the reason (a CPU source re-derives it: test_projection), and the plan still gives the memory."""
    from trainprof.projection.project import project

    source = next(f for f in GPU if (f / "calibration.json").is_file())
    out = project(source, targets=["h200"], gpus_per_node=1, probe=False, overrides=["model.dtype=fp32"])
    (pred,) = out["predictions"]
    assert "dtype" in pred["change_kinds"] and pred["step_ms"] is None
    assert "recorded at its model.dtype" in pred["reasons"]["step_ms"] and pred["memory_per_rank_bytes"] > 0


@pytest.mark.parametrize("source,target", _kind_pairs())
def test_h100_to_h200_projection_error_of_every_pair_is_the_table_s(source, target):
    """Each recipe measured on both kinds: the H100 folder projected to the H200 reproduces the error that
    trainprof/projection/validation_gpu.json (scripts/gpu_validation.py; docs/projection.md) states for it,
    the prediction cites that table's error and, for a host-bound source, says its confidence is low."""
    from trainprof.projection.project import project

    assert (PROFILES / source / "calibration.json").is_file(), f"{source}: no calibration.json to project from"
    for doc in (load(PROFILES / source), load(PROFILES / target)):
        # the operator table holds the backward kernels (the CUDA autograd thread's ops), and the
        # bf16-autocast torch engine's MFU uses the bf16 peak
        assert sum(r["self_ms"] for r in doc["ops"] if r["phase"] == "backward") > 10
        assert doc["summary"]["peak"]["key"] == "peak_bf16_dense_tflops"
    out = project(PROFILES / source, targets=["h200"], gpus_per_node=1, probe=False)
    (pred,) = out["predictions"]
    assert pred["change_kinds"] == ["hardware_gpu"]
    # a host-bound source cites the host-bound sources' error, a GPU-bound one the GPU-bound sources'
    kind = "hardware_gpu_host_bound" if pred["host_bound_source"] else "hardware_gpu"
    assert pred["expected_error_pct"] == VALIDATION["by_kind"][kind]["step_mape_pct"]
    assert pred["confidence"] == ("low" if pred["host_bound_source"] else "validated")
    measured = load(PROFILES / target)["summary"]["step_ms"]["median"]
    error_pct = (pred["step_ms"] - measured) / measured * 100
    cases = [c for c in VALIDATION["cases"] if c["measured_step_ms"] == pytest.approx(measured, abs=0.05)]
    assert cases, (f"{source} -> {target}: {error_pct:+.1f}% ({pred['step_ms']:.1f} ms predicted, {measured:.1f} "
                   "measured) is in no case of trainprof/projection/validation_gpu.json; add it there and to "
                   "docs/projection.md's GPU table")
    assert error_pct == pytest.approx(cases[0]["step_error_pct"], abs=0.1)
    assert pred["step_ms"] == pytest.approx(cases[0]["predicted_step_ms"], abs=0.05)


@pytest.mark.parametrize("case", VALIDATION.get("same_machine_cases") or [], ids=lambda c: c["target"])
def test_same_machine_cases_recomputed_from_profiles(case):
    """Each settings change between runs of one GPU session, projected on the source's machine (--to this,
    no probes), reproduces validation_gpu.json's figures; an engine change says why it is not predicted
    instead of guessing, and its memory is the plan's delta on the measured peak."""
    import gpu_validation

    again = gpu_validation.same_machine_case(case["source"], case["target"])
    assert again["overrides"] == case["overrides"] and again["change_kinds"] == case["change_kinds"]
    for key in ("predicted_step_ms", "step_error_pct", "predicted_memory_gib", "memory_error_pct"):
        assert again[key] == pytest.approx(case[key], abs=0.05), key
    if case["target"] not in KNOWN_PLAN_MISSES:  # a miss of the plan itself is held (strictly) there
        assert abs(case["memory_error_pct"]) <= 10  # issue 24's memory goal
    if {"engine", "zero_stage"} & set(case["change_kinds"]):
        assert case["predicted_step_ms"] is None and "probed on a CPU, not on a GPU" in case["step_reason"]
        assert "`--to h100-sxm` predicts it" in case["step_reason"] or "`--to h200` predicts it" in case["step_reason"]
    else:
        assert abs(case["step_error_pct"]) <= 15
        # MFU on the source's own GPU, against its datasheet peak, as the target run's MFU is; the run counts
        # its FLOPs (measured_over_analytic), the prediction takes PaLM's formula
        counted = load(PROFILES / case["target"])["summary"]["measured_over_analytic"]
        assert case["predicted_mfu"] == pytest.approx(case["measured_mfu"] / counted * case["measured_step_ms"]
                                                      / case["predicted_step_ms"], abs=2e-4)


def test_a_gpu_run_projected_on_its_own_machine_is_not_probed_on_its_cpu(tmp_path, monkeypatch):
    """`trainprof project` on the GPU machine a run was measured on: the timing probes time bare models and
    engines on the CPU, which says nothing of the GPU. A shape change is re-derived from the GEMMs at the GPU's
    measured rates, as projected anywhere else (the validation cases above), and an engine change is null with
    the reason, where the probes would have mixed CPU times into the GPU's."""
    import shutil

    from trainprof.projection import probes
    from trainprof.projection import project as projection
    from trainprof.projection import projector

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-torch-hostbound", run)

    def probe(*args, **kwargs):
        raise AssertionError("a GPU run's projection ran a CPU timing probe")

    monkeypatch.setattr(probes, "probe_parts", probe)
    monkeypatch.setattr(probes, "probe_engines", probe)
    for module in (projection, projector):  # as on the run's own machine
        monkeypatch.setattr(module, "same_machine_as_source", lambda source: True)
    shape = ["train.micro_batch_size=16", "data.seq_len=1024"]
    (here,) = projection.project(run, overrides=shape)["predictions"]
    (elsewhere,) = projection.project(run, overrides=shape, probe=False)["predictions"]
    assert here["step_ms"] is not None and here["step_ms"] == pytest.approx(elsewhere["step_ms"], rel=1e-9)
    (engine,) = projection.project(run, overrides=["engine.kind=deepspeed", "engine.zero_stage=3"])["predictions"]
    assert engine["step_ms"] is None and "probed on a CPU, not on a GPU" in engine["reasons"]["step_ms"]
    # no figure, so no expected error beside its n/a (the row claimed the kind's validated error)
    assert engine["confidence_text"] == "n/a: step not predicted" and engine["expected_error_pct"] is None
    assert not (run / "probes.json").exists()


def test_a_gpu_run_without_its_calibration_is_calibrated_on_its_gpu(tmp_path, monkeypatch):
    """A GPU run projected on its own machine without a calibration.json: the bandwidth that prices its
    optimizer's pass (ZeRO-3's state per GPU halves on two GPUs) is measured on its GPU, not on this host's
    memory (a GPU's Adam pass priced at a CPU's tens of GB/s reads a hundred times long)."""
    import shutil

    import torch

    from helpers.projection import kinds
    from trainprof.projection import calibrate as calibration
    from trainprof.projection import project as projection
    from trainprof.projection import projector
    from trainprof.projection import source as sources

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-hostbound", run)  # one H100, DeepSpeed ZeRO-3
    measured = json.loads((run / "calibration.json").read_text())
    (run / "calibration.json").unlink()
    asked = []

    def calibrate(device, **kwargs):  # what calibrate() measured on the run's machine: its GPU, and its host
        asked.append(torch.device(device).type)
        return measured if asked[-1] == "cuda" else {**measured, "memory": {"gbps": 40.0}}

    monkeypatch.setattr(calibration, "calibrate", calibrate)
    for module in (projection, projector, sources):  # as on the run's own machine, with its GPU
        monkeypatch.setattr(module, "same_machine_as_source", lambda source: True)
    monkeypatch.setattr(sources, "torch_device", lambda env: torch.device("cuda"))
    (pred,) = projection.project(run, nproc=[2])["predictions"]
    assert set(asked) == {"cuda"}, asked
    assert kinds(pred)["optimizer_fixed_plus_pass"]["memory_gbps"] == measured["memory"]["gbps"], kinds(pred).keys()


def test_a_gpu_run_at_another_world_size_on_its_machine_prices_its_gpus_links(tmp_path):
    """More GPUs of the source's machine (`--nproc`, no --to): the collectives cross the GPUs' own links,
    overlapping their compute as on the catalog's entry for that GPU, not gloo between this CPU's processes
    (which priced a 2-GPU ZeRO-3 step of this llama2-1b run at 7.7 s, 7.3 s of it exposed communication).
    `--threads`, a CPU run's intra-op threads, is refused for it (it re-derived the step from this CPU's rates)."""
    import shutil

    from helpers.projection import kinds
    from trainprof.projection.project import project

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-hostbound", run)  # one H100, DeepSpeed ZeRO-3
    measured = load(run)["summary"]["step_ms"]["median"]
    for gpus in (2, 8):
        (here,) = project(run, nproc=[gpus], probe=False)["predictions"]
        (there,) = project(run, targets=["h100-sxm"], nodes=[1], gpus_per_node=gpus, probe=False)["predictions"]
        assert kinds(here)["link_catalog"]["name"].startswith("NVLink 4"), kinds(here).keys()
        assert not any("gloo" in a["text"] for a in here["assumptions"])
        assert here["phases_ms"]["comm_exposed"] == pytest.approx(there["phases_ms"]["comm_exposed"], rel=1e-6)
        assert here["step_ms"] < 1.1 * measured  # a host-bound step whose collectives hide behind its compute
    # the CPU's intra-op threads are no change of a GPU run's step: refused, not re-derived from this CPU's rates
    (threads,) = project(run, threads=4, probe=False)["predictions"]
    assert threads["step_ms"] is None and "without --threads" in threads["reasons"]["step_ms"]


def test_a_node_template_is_its_gpu_times_its_gpus_per_node(tmp_path):
    """`hgx-h100` is 8 `h100-sxm` on NVLink 4: the same rows, the GPU's own measured elementwise share
    included (the template's lookup by its own key fell back to the all-GPU share: 474.7 against 438.4 ms)."""
    import shutil

    from trainprof.projection.project import project

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-torch-gpubound", run)
    gpu, node = project(run, targets=["h100-sxm", "hgx-h100"], gpus_per_node=8, probe=False)["predictions"]
    assert node["step_ms"] == pytest.approx(gpu["step_ms"], rel=1e-9) and node["world_size"] == gpu["world_size"] == 8
    shares = [next(a["text"] for a in p["assumptions"] if a["kind"] == "device_rerated") for p in (gpu, node)]
    assert all("of h100-sxm's datasheet bandwidth, measured on" in text for text in shares), shares


def test_a_scaling_efficiency_above_100_percent_says_why_on_the_terminal(tmp_path):
    """ZeRO-3 on 8 H100s against its 2-GPU baseline passes 100% (each GPU's share of the optimizer step
    shrinks); the printed table says so under the rows, not only the files' notes."""
    import shutil

    from trainprof.projection.project import project
    from trainprof.projection.report import notes, render_short

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-gpubound", run)
    result = project(run, targets=["h100-sxm"], overrides=["model.name=llama2-7b", "model.recompute=true"],
                     probe=False)
    (pred,) = result["predictions"]
    assert pred["scaling_efficiency"] > 1 and pred["scaling_base_gpus"] == 2
    # the phase that shrinks per GPU, from the baseline's time to this row's: the optimizer, not the compute
    why = pred["above_linear"]
    assert why.startswith("optimizer ") and "ZeRO share" in why and "forward" not in why, why
    line = f"h100-sxm x 8: scaling eff. {pred['scaling_efficiency']:.1%} against 2 ('vs GPUs'): per rank {why}"
    assert line in render_short(result)
    assert line in notes(result)  # projection.md and .html list the notes: the legend promises this line


def test_offload_says_the_host_memory_it_needs_beside_a_gpu_fit(tmp_path):
    """Offload's host side is planned (trainprof plan's host total) and said under the table: 'fits' counts
    GPU memory only, the catalog describing no node's host memory (70B with its optimizer offloaded read
    'fits: yes' with no word of the ~1.3 TiB a node it needs); without offload no such line."""
    import shutil

    from trainprof.plan import estimate_plan
    from trainprof.projection.project import project
    from trainprof.projection.report import render_short
    from trainprof.recipe import load_recipe

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-gpubound", run)
    big = ["model.name=llama2-70b", "model.recompute=true"]
    result = project(run, targets=["hgx-h100"], nodes=[8], overrides=[*big, "engine.offload=optimizer"], probe=False)
    (pred,) = result["predictions"]
    planned = estimate_plan(load_recipe(run / "recipe.yaml", big + ["engine.offload=optimizer"]), 64)
    assert pred["host_memory_per_rank_bytes"] == planned["gpu_memory"]["host_total"]["cpu_bytes"] > 2**30
    text = render_short(result)
    assert "hgx-h100 x 64: needs " in text and "GiB of host memory a GPU (" in text and "a node of 8)" in text
    plain = project(run, targets=["hgx-h100"], nodes=[8], overrides=big, probe=False)
    assert plain["predictions"][0]["host_memory_per_rank_bytes"] == 0
    assert "of host memory" not in render_short(plain)


def test_elementwise_share_recomputed_from_profiles():
    """The share of the datasheet bandwidth the non-GEMM operators reach, fitted on the 2026-11-23 runs'
    operator tables (over both GPUs, and per GPU), is what validation_gpu.json states, and the later runs'
    phases stay near it."""
    import gpu_validation

    block = gpu_validation.elementwise_block(gpu_validation.elementwise_rows())
    assert block["share_of_datasheet_bandwidth"] == VALIDATION["elementwise"]["share_of_datasheet_bandwidth"]
    assert block["held_out_error_pct"] == VALIDATION["elementwise"]["held_out_error_pct"]
    assert block["by_accelerator"] == VALIDATION["elementwise"]["by_accelerator"]
    # each GPU's own share predicts its held-out phases better than the share over both
    for own in block["by_accelerator"].values():
        assert own["held_out_error_pct"]["mean"] < block["held_out_error_pct"]["mean"]
    assert 0.3 <= block["share_of_datasheet_bandwidth"] <= 1.0
    assert block["held_out_error_pct"]["mean"] <= 20


@pytest.mark.parametrize("case", VALIDATION.get("cpu_to_gpu_cases") or [], ids=lambda c: f"{c['source']}->{c['target']}")
def test_cpu_to_gpu_cases_recomputed_from_profiles(case):
    """A CPU run projected to a GPU run's model and settings on its GPU: the table's figures again, the
    row marked unvalidated, the memory within issue 24's 10% (where the plan holds: not under recompute,
    ZeRO-3's and QLoRA's strict xfails of test_plan_gpu_reference); within the issue's 15% each run of 2026-11-26
    that kept its GPU busy (>= 80%: the 16 and 32 x 1024 ones), and each plain-PyTorch one of that day
    (their means are in docs/projection.md). The host-bound ZeRO-3 recipe measured 297 to 540 ms on three
    machines (and 498 ms at 16 x 1024 on the H200, 68% busy), the plain-PyTorch one 118 to 165 ms on two
    H200s, which a prediction from the host reference cannot know: those rows are kept, not held to it.
    A DeepSpeed ZeRO-0/1/2 target takes the ZeRO-2 runs' own host reference (`deepspeed-zero12`, not
    ZeRO-3's, whose module hooks are not in its host path). The host-bound Llama2-7B LoRA rows (ZeRO-2, held
    out of every catalog figure) are one prediction against one recipe measured on two machines 29% apart
    (248.9 and 320.5 ms): within 15% on their mean and 25% each. The host-bound ZeRO-2 pretraining row (37%
    busy) is kept, not held, as the other host-bound rows are; the QLoRA rows say that bitsandbytes' calls
    are left out and are kept, not held (docs/projection.md)."""
    import gpu_validation

    again = gpu_validation.cpu_to_gpu_case(case["source"], case["target"], case["hardware"])
    for key in ("predicted_step_ms", "step_error_pct", "predicted_memory_gib", "memory_error_pct",
                "target_gpu_busy_frac"):
        assert again[key] == pytest.approx(case[key], abs=0.05), key
    assert case["confidence"].startswith("unvalidated") and "hardware" in case["change_kinds"]
    if "model.recompute=True" not in case["overrides"]:
        assert abs(case["memory_error_pct"]) <= 10
    gpu_bound_of_the_day = "-gpubound" in case["target"] and case["target_gpu_busy_frac"] >= 0.8
    torch_run_of_the_day = case["target"].endswith(("-torch-gpubound", "-torch-hostbound"))
    if gpu_bound_of_the_day or torch_run_of_the_day:
        assert abs(case["step_error_pct"]) <= 15
    assert again["host_assumptions"] == case["host_assumptions"]
    assert "host_stand_in" not in case["host_assumptions"], case["host_assumptions"]  # every engine has its own
    # the table's "host-bound" (the predicted host time above the device's) against the GPU's measured busy
    # share: every target under 60% busy is marked, none at 90% or more (between, the kept rows go both ways)
    marked = "predicted host-bound" in case["confidence"]
    assert marked == ("host_bound_target" in case["host_assumptions"]), case
    if case["target_gpu_busy_frac"] < 0.6 or case["target_gpu_busy_frac"] >= 0.9:
        assert marked == (case["target_gpu_busy_frac"] < 0.6), (case["target"], case["target_gpu_busy_frac"])
    finetune = next((o.split("=")[1] for o in case["overrides"] if o.startswith("task.kind=")), None)
    assert ("gpu_ops_finetune" in case["host_assumptions"]) == (finetune is not None), case["host_assumptions"]
    assert ("host likely low" in case["confidence"]) == (finetune is not None), case["confidence"]  # in the table
    if finetune:  # with how far the kept rows of that task landed
        errors = [c["step_error_pct"] for c in VALIDATION["cpu_to_gpu_cases"] if f"task.kind={finetune}" in c["overrides"]]
        assert f"host likely low ({min(errors):+.0f}..{max(errors):+.0f}% on {len(errors)} GPU runs)" in case["confidence"]
    if finetune == "lora":
        assert abs(case["step_error_pct"]) <= 25
        rows = [c for c in VALIDATION["cpu_to_gpu_cases"] if c["target"].endswith("-llama7b_lora")]
        mean = statistics.mean(c["measured_step_ms"] for c in rows)
        assert len(rows) == 2 and abs(case["predicted_step_ms"] / mean - 1) <= 0.15


@pytest.mark.parametrize("case", VALIDATION.get("engine_change_cases") or [],
                         ids=lambda c: f"{c['source'].split('-', 1)[0]}-{c['target']}")
def test_engine_change_cases_recomputed_from_profiles(case):
    """A GPU ZeRO-3 run projected to ZeRO-2 on a GPU: the target engine's host calls (ZeRO-3's module hooks
    issue 182 calls a forward layer at 38 µs against ZeRO-2's 142 at 16 on the references) at the source
    host's pace. The table's figures again; the GPU-bound rows within the issue's 15%, the host-bound ones
    within 20% (their hosts, of other sessions than the sources', differ by 28-40%): the source engine's host
    work, kept before, read them 57-118% slow."""
    import gpu_validation

    again = gpu_validation.engine_case(case["source"], case["target"], case["hardware"])
    for key in ("predicted_step_ms", "step_error_pct", "predicted_memory_gib", "memory_error_pct"):
        assert again[key] == pytest.approx(case[key], abs=0.05), key
    assert case["overrides"] == ["engine.zero_stage=2"] and "host_engine_change" in case["host_assumptions"]
    assert abs(case["step_error_pct"]) <= (15 if case["target_gpu_busy_frac"] >= 0.8 else 20), case


@pytest.mark.parametrize("case", VALIDATION.get("size_cases") or [],
                         ids=lambda c: f"{c['kind']}-{c['target'].rsplit('-', 1)[-1]}")
def test_size_cases_recomputed_from_profiles(case):
    """A model-shape change (depth, GQA, vocabulary, 7B/13B/70B layers) projected from a llama2-1b run to
    the target shape measured on a GPU: the table's figures again, and the memory within issue 24's 10%."""
    import gpu_validation

    again = gpu_validation.size_case(case["source"], case["target"], None if case["hardware"] == "this"
                                      else case["hardware"], case["kind"])
    assert again["overrides"] == case["overrides"] and "model_size" in again["change_kinds"]
    for key in ("predicted_step_ms", "step_error_pct", "predicted_memory_gib", "memory_error_pct"):
        assert again[key] == pytest.approx(case[key], abs=0.05), key
    assert abs(case["memory_error_pct"]) <= 10
    if case["kind"].startswith("CPU to"):  # a CPU run projected to a GPU is never vouched for
        assert case["confidence"].startswith("unvalidated"), case["confidence"]
    else:  # the label carries the largest validated error among its kinds of change
        worst = max((VALIDATION["by_kind"][k] for k in case["change_kinds"]), key=lambda e: e["step_mape_pct"])
        assert case["confidence"] == (f"±{worst['step_mape_pct']:.1f}% mean, {worst['step_max_pct']:.1f}% max "
                                      f"over {worst['cases']} runs"), case["confidence"]


def test_size_changes_on_a_gpu_meet_the_issues_goal():
    """Issue 24's goal for model-size changes (mean <= 10%, max <= 15%), on the GPU, from each source: the
    same GPU kind's llama2-1b run, the other kind's (each GPU's non-GEMM work at the bandwidth share its own
    runs measured) and the CPU quickstart, to the seven shapes measured on the H100 and three on the H200."""
    import gpu_validation

    errors = VALIDATION["size_error"]
    assert errors == gpu_validation.size_summary(VALIDATION["size_cases"])
    # seven shapes measured on the H100, three of them on the H200
    shapes = {"same machine": 7, "H200 to H100": 7, "CPU to H100": 7, "same machine (H200)": 3, "H100 to H200": 3,
              "CPU to H200": 3}
    assert set(errors) == set(shapes)
    for kind, row in errors.items():
        assert row["cases"] >= shapes[kind] and row["step_mape_pct"] <= 10 and row["step_max_pct"] <= 15, (kind, row)


TRACES = sorted(p for f in GPU for p in f.glob("*.pt.trace.json.gz"))
# A replay counts each launch call's time as host work; when the launch queue is full a launch waits for the
# device instead. Strict: a replay that learns this makes the test fail until the entry goes.
REPLAY_MISSES = {
    "h100-llama1b_zero3_sdpa-gpubound32-v2": "replayed 1,061.5 ms against 1,022.4 measured (+3.8%): 297 kernel "
                                             "launches and event records over 100 us (94.3 ms; a launch takes 6 us), "
                                             "against 119 (46.6 ms) in the same recipe's first run, replayed +2.7%",
}


@pytest.mark.parametrize("path", [known_miss(REPLAY_MISSES, p.parent.name, p) for p in TRACES])
def test_a_replayed_trace_rebuilds_its_step_and_says_which_side_bounds_it(path):
    """analysis/replay.py rebuilds each kept traced step from its launches and kernels within 3%, and its
    what-ifs point the way the GPU busy share does. A twice-as-fast host takes at most half the step plus
    the device work that synchronizing calls expose; a step whose GPU is busy under half of it keeps at
    most half its busy share beyond half the step; a GPU-bound one (busy over 90%) gains at most its idle
    share from the host and speeds up with a faster GPU instead."""
    from trainprof.analysis.replay import load_steps, replay

    (step,) = load_steps(path)
    same = replay(step)
    assert same.step_ms == pytest.approx(step.measured_ms, rel=0.03)
    faster_host, faster_gpu = replay(step, host_scale=0.5), replay(step, device_scale=lambda op: 0.5)
    assert faster_host.step_ms <= same.step_ms + 1e-6 and faster_gpu.step_ms <= same.step_ms + 1e-6
    busy = same.device_busy_ms / same.step_ms
    assert same.step_ms / 2 * 0.99 <= faster_host.step_ms <= same.step_ms / 2 + same.device_busy_ms
    if busy < 0.5:  # the host-bound step nearly halves: what stays is device work a synchronizing call waited on
        assert faster_host.step_ms <= (0.5 + busy / 2) * same.step_ms
    if busy > 0.9:
        assert faster_host.step_ms >= max(0.99 * same.device_busy_ms, (1 - 1.05 * (1 - busy)) * same.step_ms)
        assert faster_gpu.step_ms <= 0.9 * same.step_ms


def _rows(out: str) -> list[str]:
    """The replay table's step rows."""
    return [ln for ln in out.splitlines() if ln.split() and ln.split()[0].isdigit()]


def test_replay_command_names_the_side_that_bounds_a_step(cli, tmp_path):
    lora = cli("replay", PROFILES / "h200-llama7b_lora")
    assert lora.returncode == 0 and _rows(lora.stdout)[-1].endswith("host"), lora.stdout
    assert "host x0.5 ms" in lora.stdout and "GPU x0.5 ms" in lora.stdout  # the columns name their what-if
    dense = cli("replay", PROFILES / "h200-llama1b_zero3_sdpa-torch-gpubound")
    assert dense.returncode == 0 and _rows(dense.stdout)[-1].endswith("GPU"), dense.stdout
    # the verdict is the traced step's busy share, not whichever what-if came out faster: a host-bound step (18%
    # busy) stays host-bound when both sides are made 2x slower (the GPU's what-if is then the faster one)
    slower = cli("replay", PROFILES / "h100-llama1b_zero3_sdpa-hostbound", "--host-scale", "2", "--device-scale", "2")
    row = _rows(slower.stdout)[-1].split()
    assert slower.returncode == 0 and row[-1] == "host" and float(row[-2]) < float(row[-3]), slower.stdout
    assert "stops at the traced host" not in slower.stdout  # no 'no faster GPU' floor for a slower GPU
    missing = cli("replay", tmp_path / "nope")
    assert missing.returncode == 2 and "does not exist" in missing.stderr and len(missing.stderr.splitlines()) == 1
    cpu = cli("replay", PROFILES / "cpu-x86_64-quickstart_cpu")
    assert cpu.returncode == 2 and "no rank 0 trace" in cpu.stderr
    (tmp_path / "infer").mkdir()
    (tmp_path / "infer" / "inference.json").write_text("{}")
    infer = cli("replay", tmp_path / "infer")
    assert infer.returncode == 2 and "is a `trainprof infer` run" in infer.stderr and len(infer.stderr.splitlines()) == 1


@pytest.mark.parametrize("case", VALIDATION.get("replay_cases") or [], ids=lambda c: f"{c['source']}->{c['hardware']}")
def test_replay_cases_recomputed_from_profiles(case):
    """Each recipe traced on both GPU kinds, replayed from one kind's trace with its kernels re-timed for the
    other (datasheet ratios, the host as fast as the source's), reproduces validation_gpu.json; the GPU-bound
    pair meets the H100 -> H200 goal of issue 27 (<= 10%)."""
    import gpu_validation

    again = gpu_validation.replay_case(case["source"], case["target"])
    for key in ("predicted_step_ms", "step_error_pct", "source_traced_busy_frac"):
        assert again[key] == pytest.approx(case[key], abs=0.05), key
    assert again["kernel_factors"] == case["kernel_factors"]
    if case["source_traced_busy_frac"] >= 0.9 and case["hardware"] == "h200":
        assert abs(case["step_error_pct"]) <= 10, case


def test_replay_to_another_gpu_prints_the_cases_prediction(cli):
    case = next(c for c in VALIDATION["replay_cases"] if c["source"] == "h100-llama1b_zero3_sdpa-torch-gpubound")
    out = cli("replay", PROFILES / case["source"], "--to", "h200")
    assert out.returncode == 0, out.stderr
    assert f"on h200: {case['predicted_step_ms']:.1f} ms a step" in out.stdout
    assert "memory bandwidth" in out.stdout and "host as fast" in out.stdout  # how it was derived, where it is read
    bad = cli("replay", PROFILES / case["source"], "--to", "nope")
    assert bad.returncode == 2 and "'nope' is not in the catalog" in bad.stderr and len(bad.stderr.splitlines()) == 1


REPLAYED = PROFILES / "h100-llama1b_zero3_sdpa-gpubound"  # 57.6 GiB measured peak; traced 49% slower than untraced


def _step_on(out: str, name: str) -> float:
    line = next(ln for ln in out.splitlines() if ln.startswith(f"on {name}"))
    return float(line.split(": ", 1)[1].split(" ms a step")[0])


def test_replay_refuses_an_unknown_target_before_any_output(cli):
    bad = cli("replay", REPLAYED, "--to", "h300")
    assert bad.returncode == 2 and bad.stdout == "", bad.stdout
    assert len(bad.stderr.splitlines()) == 1 and "'h300' is not in the catalog" in bad.stderr
    assert "`trainprof hardware`" in bad.stderr  # where the keys are


def test_replay_to_a_node_template_replays_its_gpu_and_says_so(cli):
    """hgx-h100 is 8 x h100-sxm: replayed as one h100-sxm (as projection/prices.py prices a node per GPU), and
    the line says which GPU it took."""
    node, gpu = cli("replay", REPLAYED, "--to", "hgx-h100"), cli("replay", REPLAYED, "--to", "h100-sxm")
    assert node.returncode == 0 and gpu.returncode == 0, node.stderr + gpu.stderr
    assert "on hgx-h100, taken as its GPU h100-sxm (a node template of 8;" in node.stdout
    assert "h100-sxm -> h100-sxm" in node.stdout
    assert _step_on(node.stdout, "hgx-h100") == _step_on(gpu.stdout, "h100-sxm")


def test_replay_says_when_the_measured_peak_does_not_fit_the_target(cli):
    """The source run's measured peak against the target's catalog memory_gb, as measured (no memory model):
    57.6 GiB does not fit an RTX 4090's 24 GB, fits an H200's 141 GB."""
    from trainprof.hardware import load_catalog
    from trainprof.report.rundir import run_peak_memory

    peak = run_peak_memory(load(REPLAYED)["summary"])
    capacity = load_catalog().resolve("rtx4090").memory_bytes()
    small, big = cli("replay", REPLAYED, "--to", "rtx4090"), cli("replay", REPLAYED, "--to", "h200")
    assert small.returncode == 0 and big.returncode == 0, small.stderr + big.stderr
    line = next(ln for ln in small.stdout.splitlines() if ln.startswith("on rtx4090:"))
    assert f"ms a step, does not fit: measured peak {peak / 2**30:.1f} GiB > {capacity / 2**30:.1f} GiB" in line
    assert "57.6 GiB > 24.0 GiB" in line  # the 4090's 24 GB are binary
    assert "catalog memory_gb" in small.stdout and "max_memory_allocated" in small.stdout  # how it was compared
    assert "does not fit" not in big.stdout and "memory:" not in big.stdout


def test_replay_says_its_verdict_is_the_traced_steps(cli):
    """The traced step (slowed by tracing) against the untraced median, both from profile.json, beside the
    table whose 'bound by' describes the traced one."""
    doc = load(REPLAYED)
    (traced,) = [s["wall_ms"] for s in doc["steps"] if s["step"] in doc["ops_info"]["steps"]]
    untraced, busy = doc["summary"]["step_ms"]["median"], doc["gpu_busy"]["step"]["busy_frac"]
    out = cli("replay", REPLAYED)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    note = next(ln for ln in lines if ln.startswith("'bound by' is the traced step's"))
    legend = lines[lines.index(_rows(out.stdout)[-1]) + 1]  # right under the table's rows, then the note
    assert legend.startswith("traced ms: the trace's ProfilerStep span; bound by: GPU where") and "80%" in legend
    assert lines.index(note) == lines.index(legend) + 1
    assert f"{traced:.1f} ms, +49% on the untraced median {untraced:.1f} ms of 8 measured steps" in note
    assert f"GPU is busy {busy:.1%}" in note and "89.0%" in note and "tracing slows the host" in note
    assert _rows(out.stdout)[-1].endswith("host") and note.endswith("GPU-bound")  # traced 61% busy, untraced 89%


@pytest.mark.parametrize("name", ["h100-llama7b_qlora", "h100-llama7b_lora"])
def test_a_finetuning_runs_projection_counts_mfu_and_fit_as_its_run_does(name, tmp_path):
    """On its own GPU, unchanged, a LoRA/QLoRA run's predicted MFU is its report's: model FLOPs with 4N for
    the frozen base, not PaLM's 6N as if every weight trained (which read 2.4% beside the report's 1.6%),
    and whether a setting fits is judged against its GPU's memory, not left n/a."""
    import shutil

    from trainprof.projection import project as projection

    run = tmp_path / "run"
    shutil.copytree(PROFILES / name, run)
    summary = load(run)["summary"]
    (same,) = projection.project(run, probe=False)["predictions"]
    measured_ms = summary["step_ms"]["median"]
    assert same["mfu"] == pytest.approx(summary["mfu"] / summary["measured_over_analytic"] * measured_ms
                                        / same["step_ms"], rel=0.02), (same["mfu"], summary["mfu"])
    assert "4N for a LoRA/QLoRA frozen base" in same["mfu_convention"]
    assert same["fits"] is True
    # the GPU's 80 GB less what an allocator peak leaves out: micro batch 1,024 at the recipe's sequence does not
    (big,) = projection.project(run, overrides=["train.micro_batch_size=1024"], probe=False)["predictions"]
    assert big["memory_per_rank_bytes"] > 80e9 and big["fits"] is False
    assert big["time_to_train_s"] is None and "does not fit" in big["reasons"]["cost_per_million_tokens_usd"]
    if name != "h100-llama7b_qlora":
        return
    # Llama2-70B's 4-bit base on two 24 GB cards: the advice names only settings the recipe rules accept (QLoRA
    # refuses ZeRO-3), and no "more GPUs", which do not shrink a replicated base (37.2 GiB on one, 36.8 on two)
    from trainprof.projection.report import notes

    result = projection.project(run, targets=["rtx4090"], gpus_per_node=2, overrides=["model.name=llama2-70b"],
                                probe=False)
    (card,) = result["predictions"]
    advice = card["fits"] is False and card["fit_advice"]
    assert advice and all("engine.zero_stage=3" not in t["overrides"] for t in advice["tried"]), advice
    assert any("qlora with ZeRO stage 3" in why for why in advice["refused"].values())
    assert advice["more_gpus"]["gpus"] is None and advice["more_gpus"]["bytes"] > 24 * 2**30
    (line,) = [n for n in notes(result) if "does not fit" in n]
    assert "more GPUs do not bring it under 24.00 GiB" in line and line.endswith("a GPU with more memory or a smaller "
                                                                                 "model"), line
    assert "nor with ZeRO-3" not in line and "the recipe rules refuse the other settings tried" in line


def test_a_change_on_its_own_gpu_keeps_the_optimizers_measured_host_part(tmp_path):
    """A micro-batch change moves no optimizer state: on the run's own GPU its optimizer is the measured phase
    (kernels moved with the state per rank, the host's calls and waits as measured), not its kernels alone.
    The H100 QLoRA run's optimizer is 56.3 ms, its kernels about 13: re-derived alone, micro batch 2 read a
    step shorter than the measured micro batch 1's, twice the work in less time."""
    import shutil

    from trainprof.projection import project as projection

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama7b_qlora", run)
    measured = load(run)["summary"]
    (two,) = projection.project(run, overrides=["train.micro_batch_size=2"], probe=False)["predictions"]
    (own,) = [a["values"] for a in two["assumptions"] if a["kind"] == "optimizer_own_gpu"]
    assert two["phases_ms"]["optimizer"] == pytest.approx(own["measured_ms"], rel=1e-9)  # the same state
    assert own["measured_ms"] == pytest.approx(measured["phases_ms"]["optimizer"], rel=0.05)  # the step model's pick
    assert own["kernels_ms"] < own["measured_ms"] / 3
    (same,) = projection.project(run, probe=False)["predictions"]
    # host-bound: the step holds, twice the tokens (the unchanged row is the measured step, which the step model
    # reproduces within 0.1%; the re-derived optimizer read micro batch 2 1.9% shorter)
    assert two["step_ms"] >= 0.995 * same["step_ms"] and same["step_ms"] == measured["step_ms"]["median"]
    # the DeepSpeed ZeRO-3 run's optimizer (46.0 ms measured at micro batch 4 x 256) against the run at
    # 16 x 1024 of the same session (45.5 ms)
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-hostbound", tmp_path / "zero3")
    target = load(PROFILES / "h100-llama1b_zero3_sdpa-gpubound")["summary"]["phases_ms"]["optimizer"]
    (big,) = projection.project(tmp_path / "zero3", overrides=["train.micro_batch_size=16", "data.seq_len=1024"],
                                probe=False)["predictions"]
    assert big["phases_ms"]["optimizer"] == pytest.approx(target, rel=0.05)


def test_a_gpu_bound_run_projected_to_its_own_gpu_kind_keeps_its_hosts_pace(tmp_path):
    """The H100 ZeRO-3 run at micro batch 16 x 1024 (GPU busy 89%, its forward 82%) projected to `h100-sxm`
    from the catalog: a device-bound phase's host took at most the phase over its calls (33.1 µs a forward
    call), below the catalog's 38.1 µs reference, so the unchanged row is the measured step, not the +6% the
    reference read, and is not called host-bound (the GPU busy under 80% of the phases is what marks it)."""
    import shutil

    from trainprof.projection.project import project

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-gpubound", run)
    measured = load(run)["summary"]["step_ms"]["median"]
    own, other = project(run, targets=["h100-sxm", "h200"], gpus_per_node=1, probe=False)["predictions"]
    assert own["step_ms"] == pytest.approx(measured, rel=0.02), (own["step_ms"], measured)
    ceiling = next(a for a in own["assumptions"] if a["kind"] == "host_ceiling")
    assert ceiling["values"]["phases"].startswith("forward 33.1"), ceiling
    assert "host-bound" not in own["confidence_text"] and "host_bound_target" not in {a["kind"] for a in own["assumptions"]}
    # another GPU kind has another host: the catalog's reference per call, no ceiling from this one
    assert "host_ceiling" not in {a["kind"] for a in other["assumptions"]}
    # the run itself, as measured: its MFU by PaLM's formula (every row's) is not its summary's counted one, and the
    # notes say why the two differ (30.6% against 31.0%)
    from trainprof.projection.report import notes

    result = project(run, probe=False)
    (same,) = result["predictions"]
    summary = load(run)["summary"]
    assert same["mfu"] == pytest.approx(summary["mfu"] / summary["measured_over_analytic"], rel=1e-3)
    (why,) = [n for n in notes(result) if "(as measured): MFU" in n]
    assert "MFU 30.6% by PaLM's formula" in why and "summary says 31.0%, from the FLOPs it counted" in why, why


def test_rows_on_different_hosts_say_that_their_order_follows_the_host(tmp_path):
    """From the H100 ZeRO-3 run (GPU busy 89%), Llama2-7B at micro batch 4 x 1024 on 8 GPUs is host-bound on every
    target, and the source's own GPU kind keeps its host's pace (a ceiling of 33.1 µs a forward call) while the
    H200 takes the catalog's reference (38.1, the mean of hosts at 48.5 and 27.7): h100-sxm ranked first by the
    host it assumed, not by its GPU. The step model's figures stay; each row says its host and a note under the
    table, on the terminal and in projection.md, says the order follows it. The links each row crossed are said
    there too, at datasheet bandwidth (an upper bound); a target named twice is one row; with prices every figure
    is predicted and `reasons` is an empty dict, not missing."""
    import shutil

    from trainprof.projection.project import project
    from trainprof.projection.report import render_short, write_projection

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-gpubound", run)
    shape = ["model.name=llama2-7b", "model.recompute=true", "train.micro_batch_size=4", "data.seq_len=1024"]
    prices = {k: {"usd_per_gpu_hour": 2.0, "source": "test", "date": "2026-11-30"} for k in ("h100-sxm", "h200")}
    result = project(run, targets=["h100-sxm", "h200", "h100-sxm"], overrides=shape, prices=prices, probe=False)
    h100, h200 = result["predictions"]  # named twice, predicted once
    # presentation only: the step model's figures of the finding (729.5 and 782.8 ms)
    assert (round(h100["step_ms"], 1), round(h200["step_ms"], 1)) == (729.5, 782.8)
    assert h100["host_pace"]["basis"] == "ceiling" and round(h100["host_pace"]["us_per_call"], 1) == 33.1
    assert h200["host_pace"]["basis"] == "reference" and h200["host_pace"]["us_per_call"] == 38.1
    assert h200["host_pace"]["reference_hosts_us"] == [48.5, 27.7]
    assert all("predicted host-bound" in p["confidence_text"] for p in (h100, h200))
    assert h100["reasons"] == {} and h200["reasons"] == {}  # every figure predicted: still there, empty
    text = render_short(result)
    assert "this run's, at most 33.1 µs/call" in text and "reference 38.1 µs/call (2 hosts, 27.7-48.5)" in text
    note = next(line for line in text.splitlines() if "host: these rows assume different hosts" in line)
    assert "their order follows the host assumed, not the GPU" in note and "h100-sxm x 8 350.6, h200 x 8 335.0" in note
    links = next(line for line in text.splitlines() if "links assumed" in line)
    assert "NVLink 4 (H100/H200, via NVSwitch), 450 GB/s per direction per GPU" in links and "an upper bound" in links
    write_projection(result, tmp_path / "out", title="t", command="c")
    md = (tmp_path / "out" / "projection.md").read_text()
    assert "their order follows the host assumed, not the GPU" in md and "links assumed" in md
    assert "reference 38.1 µs/call (2 hosts, 27.7-48.5)" in md


def test_a_run_without_calibration_names_the_folder_that_has_one(tmp_path):
    """The kept H100 QLoRA v2 run stopped before its calibration (profiles/README.md): its rows to other GPUs
    cannot be re-rated here, and the reason names what to do: the folder beside it calibrated on the same GPU, or
    a calibration made on that GPU (profile.calibrate=true), not only 'run where the run was made'."""
    import shutil

    from trainprof.projection.project import project

    for name in ("h100-llama7b_qlora-v2", "h100-llama7b_qlora"):
        shutil.copytree(PROFILES / name, tmp_path / name, ignore=shutil.ignore_patterns("*.trace.json.gz"))
    (pred,) = project(tmp_path / "h100-llama7b_qlora-v2", targets=["a100-80g-sxm"], gpus_per_node=1,
                      overrides=["model.name=llama2-70b"], probe=False)["predictions"]
    why = pred["reasons"]["step_ms"]
    assert pred["step_ms"] is None and "no calibration.json" in why, why
    assert "h100-llama7b_qlora beside it calibrated the same NVIDIA H100 80GB HBM3" in why
    assert "copy its calibration.json" in why and "profile.calibrate=true" in why


def test_a_deeper_models_host_bound_row_names_the_calls_it_stands_on(tmp_path):
    """The host time of a changed model scales its decoder layers' calls by its depth: the host-bound verdict of
    Llama2-70B (80 layers) from the 22-layer H100 run names the target's calls, which its host ms divide into at
    the source's pace, not the source's 14,141 (which gave 539 ms against the 1,252.5 ms it stated)."""
    import shutil

    from trainprof.projection.project import project

    run = tmp_path / "run"
    shutil.copytree(PROFILES / "h100-llama1b_zero3_sdpa-torch-gpubound", run)
    rows = {}
    for name in ("llama2-1b", "llama2-70b"):
        (row,) = project(run, overrides=[f"model.name={name}", "engine.kind=deepspeed", "engine.zero_stage=3",
                               "data.seq_len=350", "train.micro_batch_size=1"], targets=["a800-80g"], gpus_per_node=1,
                         probe=False)["predictions"]
        rows[name] = {a["kind"]: a for a in row["assumptions"]}
    small, large = (rows[n]["host_bound_target"] for n in ("llama2-1b", "llama2-70b"))
    assert small["values"]["layers"] == 22 and large["values"]["layers"] == 80
    per_call = [b["values"]["host_ms"] / b["values"]["calls"] for b in (small, large)]
    assert per_call[0] == pytest.approx(per_call[1], rel=0.02)  # one pace: the calls carry the depth
    assert large["values"]["calls"] > 3 * small["values"]["calls"] * 0.9
    assert f"the host's {large['values']['calls']:,.0f} operator calls (80 decoder layers'" in large["text"]
    assert "in the source's trace" in rows["llama2-70b"]["host_time"]["text"]
