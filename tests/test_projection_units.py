"""Projection pieces that need no training run: the catalog and prices, the α-β collective model, and
the step model's arithmetic on hand-made measurements."""

from __future__ import annotations

import math

import pytest

from trainprof.projection.calibrate import bus_factor, collective_ms, fit_alpha_beta
from trainprof.projection.catalog import CatalogError, find_accelerator, load_catalog, load_prices
from trainprof.projection.stepmodel import (Change, EngineProbe, Link, Machine, Measured, StepProbe,
                                           derives_ddp_collectives, derives_zero_collectives, predict_phases,
                                           residual_ms, task_change_not_derived)

from conftest import REPO


def test_every_catalog_figure_has_a_source_and_names_resolve():
    cat = load_catalog()
    # the research's platforms and the common buys
    for key in ("a800-80g", "rtx4090", "rtx3090", "h100-sxm", "h100-pcie", "h200", "b200", "a100-40g-sxm",
                "a100-80g-sxm", "a100-40g-pcie", "a100-80g-pcie", "l40s", "a30", "mi300x", "gaudi2"):
        target = cat.resolve(key)
        assert target.figure("peak_bf16_dense_tflops") and target.figure("memory_gb") and target.figure("memory_gbps")
        for name, fig in target.accelerator.items():
            if isinstance(fig, dict):
                assert fig["source"], (key, name)
    for key in ("nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "pcie4-nvlink-bridge", "ib-hdr", "ib-ndr",
                "roce-200", "roce-400"):
        assert cat.links[key]["gbps_per_direction"]["source"]
    node = cat.resolve("rtx3090-8x-nvlink")
    assert node.gpus_per_node == 8 and node.intra_node_link["key"] == "pcie4-nvlink-bridge"
    assert find_accelerator(cat, "NVIDIA H100 80GB HBM3") == "h100-sxm"
    with pytest.raises(CatalogError, match="not in the catalog.*h100-sxm"):
        cat.resolve("h1OO")


def test_user_catalog_merges_and_figures_need_sources(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("accelerators:\n  my-gpu:\n    name: My GPU\n    match: []\n"
                    "    peak_bf16_dense_tflops: {value: 100, source: 'my datasheet'}\n"
                    "    memory_gb: {value: 16, source: 'my datasheet'}\n"
                    "    memory_gbps: {value: 500, source: 'my datasheet'}\n    intra_node_link: pcie4\n")
    cat = load_catalog(good)
    assert cat.resolve("my-gpu").figure("memory_gb") == 16 and "h100-sxm" in cat.accelerators
    bad = tmp_path / "bad.yaml"
    bad.write_text("accelerators:\n  x:\n    name: X\n    memory_gb: {value: 16}\n")
    with pytest.raises(CatalogError, match="accelerators.x.memory_gb.*source"):
        load_catalog(bad)


def test_prices_need_source_and_date(tmp_path):
    f = tmp_path / "prices.yaml"
    f.write_text("prices:\n  h100-sxm: {usd_per_gpu_hour: 2.5, source: 'quote from vendor X', date: 2026-11-01}\n")
    prices = load_prices(f, ["rtx4090=0.4"])
    assert prices["h100-sxm"]["usd_per_gpu_hour"] == 2.5 and prices["rtx4090"]["source"].startswith("--price")
    f.write_text("prices:\n  h100-sxm: {usd_per_gpu_hour: 2.5}\n")
    with pytest.raises(CatalogError, match="source and a date"):
        load_prices(f)
    with pytest.raises(CatalogError, match="NAME=USD_PER_GPU_HOUR"):
        load_prices(None, ["h100-sxm"])


def test_alpha_beta_fit_recovers_a_known_line_and_bus_factors():
    sizes = [2**12, 2**16, 2**20, 2**22]
    alpha, bw = 0.05, 2.0  # ms, GB/s
    ms = [alpha + s / (bw * 1e9) * 1e3 for s in sizes]
    a, b = fit_alpha_beta(sizes, ms)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bus_factor("all_gather_into_tensor", 8) == pytest.approx(7 / 8)
    assert collective_ms("all_reduce", 1e9, 1, {"alpha_ms": 1, "busbw_gbps": 1}) == 0.0
    # nccl-tests: time = size * factor / busbw
    assert collective_ms("all_reduce", 1e9, 2, {"alpha_ms": 0.0, "busbw_gbps": 100.0}) == pytest.approx(10.0)


def _measured(**kw) -> Measured:
    base = dict(step_ms=100.0, phases_ms={"data_wait": 1.0, "forward": 20.0, "backward": 40.0, "recompute": 0.0,
                                           "optimizer": 10.0, "comm_exposed": 25.0, "other": 0.0},
                unattributed_ms=4.0, flops_by_phase={"forward": 2e9, "backward": 4e9},
                comm=[{"op": "all_gather_into_tensor", "phase": "forward", "calls": 2, "bytes": 2e6,
                       "total_ms": 10.0, "exposed_ms": 5.0},
                      {"op": "reduce_scatter_tensor", "phase": "optimizer", "calls": 1, "bytes": 4e6,
                       "total_ms": 20.0, "exposed_ms": 20.0}],
                world_size=2, grad_accum=1, optimizer_state_elements=1000, peak_memory_bytes=10**9,
                forward_layers_ms=15.0)
    base.update(kw)
    return Measured(**base)


def _change(**kw) -> Change:
    base = dict(micro_batch=4, seq_len=256, grad_accum=1, recompute=False, attention="sdpa", zero_stage=3,
                engine="deepspeed", world_size=2, state_elements_per_rank=500.0, source_state_elements_per_rank=500.0)
    base.update(kw)
    return Change(**base)


def test_same_configuration_reproduces_the_measured_phases():
    m = _measured()
    phases, _ = predict_phases(m, _change(), probes=None, num_layers=2, source_machine=None, target_machine=None,
                               link=None, source_zero_stage=3)
    assert phases == m.phases_ms
    assert sum(phases.values()) + m.unattributed_ms == pytest.approx(m.step_ms)


def test_grad_accum_world_size_and_probes():
    m = _measured()
    phases, _ = predict_phases(m, _change(grad_accum=2), probes=None, num_layers=2, source_machine=None,
                               target_machine=None, link=None, source_zero_stage=3)
    assert (phases["forward"], phases["backward"], phases["optimizer"]) == (40.0, 80.0, 10.0)
    assert phases["comm_exposed"] == pytest.approx(5.0 * 2 + 20.0)  # forward gathers repeat per micro batch
    one, notes = predict_phases(m, _change(world_size=1, state_elements_per_rank=1000.0), probes=None, num_layers=2,
                                source_machine=None, target_machine=None, link=None, source_zero_stage=3)
    assert one["comm_exposed"] == 0.0 and one["optimizer"] == 20.0 and "one rank" in notes[-1]
    probe_s = {"layer_forward_ms": 5.0, "layer_backward_ms": 10.0, "model_forward_ms": 12.0, "model_backward_ms": 24.0}
    probe_t = {"layer_forward_ms": 9.0, "layer_backward_ms": 18.0, "model_forward_ms": 21.0, "model_backward_ms": 42.0}
    big, _ = predict_phases(m, _change(micro_batch=8, recompute=True), probes=(probe_s, probe_t), num_layers=2,
                            source_machine=None, target_machine=None, link=None, source_zero_stage=3)
    assert big["forward"] == pytest.approx(20.0 * (2 * 9.0 + 3.0) / (2 * 5.0 + 2.0))
    assert big["backward"] == pytest.approx(40.0 * (2 * 18.0 + 6.0) / (2 * 10.0 + 4.0))
    # recompute re-runs the decoder layers' measured forward (15 ms), x one layer's probed forward ratio
    assert big["recompute"] == pytest.approx(15.0 * 9.0 / 5.0)
    rowless, _ = predict_phases(_measured(forward_layers_ms=None), _change(micro_batch=8, recompute=True),
                                probes=(probe_s, probe_t), num_layers=2, source_machine=None, target_machine=None,
                                link=None, source_zero_stage=3)
    kappa = 20.0 / (2 * 5.0 + 2.0)  # without decoder-layer rows: measured over probed forward at the source shape
    assert rowless["recompute"] == pytest.approx(kappa * 2 * 9.0)


def test_the_engines_own_work_in_the_leaves_does_not_grow_with_the_shape():
    # leaves: 18 ms forward, 36 ms backward, of which the engine's per-call work is 6 and 12 ms; the bare
    # model probes 12 -> 24 ms forward and 24 -> 48 ms backward when the micro batch doubles
    m = _measured(leaf_ms=(18.0, 36.0))
    probe_s = {"layer_forward_ms": 5.0, "layer_backward_ms": 10.0, "model_forward_ms": 12.0, "model_backward_ms": 24.0}
    probe_t = {"layer_forward_ms": 10.0, "layer_backward_ms": 20.0, "model_forward_ms": 24.0, "model_backward_ms": 48.0}
    kept, notes = predict_phases(m, _change(micro_batch=8), probes=(probe_s, probe_t), num_layers=2,
                                 source_machine=None, target_machine=None, link=None, source_zero_stage=3,
                                 engine_overhead=(6.0, 12.0))
    # parents' 2 + 4 ms and the engine's 6 + 12 ms stay; the model's 12 + 24 ms double
    assert (kept["forward"], kept["backward"]) == pytest.approx((2.0 + 6.0 + 24.0, 4.0 + 12.0 + 48.0))
    assert any("6.00 ms forward and 12.00 ms backward per micro batch are the engine's own work" in n for n in notes)
    scaled, _ = predict_phases(m, _change(micro_batch=8), probes=(probe_s, probe_t), num_layers=2,
                               source_machine=None, target_machine=None, link=None, source_zero_stage=3)
    assert (scaled["forward"], scaled["backward"]) == pytest.approx((2.0 + 36.0, 4.0 + 72.0))  # without: all doubles


def test_an_engine_change_scales_the_whole_compute_phases_by_the_probed_engine_ratio():
    m = _measured()
    probe = {"layer_forward_ms": 5.0, "layer_backward_ms": 10.0, "model_forward_ms": 12.0, "model_backward_ms": 24.0}
    engine = EngineProbe(forward=0.75, backward=0.9, step=0.6,
                         target_step=StepProbe(step_ms=3.0, state_elements=1000.0))
    phases, notes = predict_phases(m, _change(zero_stage=2), probes=(probe, probe), num_layers=2,
                                   source_machine=None, target_machine=None, link=None, source_zero_stage=3,
                                   engine=engine)
    assert (phases["forward"], phases["backward"]) == pytest.approx((20.0 * 0.75, 40.0 * 0.9))
    assert any(n.startswith("engine change: forward x0.75, backward x0.90") for n in notes)
    # no bandwidth to re-price Adam's pass with: the probed step() ratio
    assert phases["optimizer"] == pytest.approx(10.0 * 0.6)
    assert any(n.startswith("engine change: optimizer step x0.60") for n in notes)
    # below ZeRO-3 the target's own probed step, Adam's pass moved from the probe's 1000 state elements
    # to this rank's 500 (28 B each at 0.01 GB/s: 2.8 ms per 1000 elements)
    below3, notes = predict_phases(m, _change(zero_stage=2), probes=(probe, probe), num_layers=2, source_machine=None,
                                   target_machine=None, link=None, source_zero_stage=3, engine=engine,
                                   memory_gbps=0.01)
    assert below3["optimizer"] == pytest.approx(3.0 - 2.8 + 1.4)
    assert any(n.startswith("optimizer: the target engine's step() probed in a group of one") for n in notes)
    # a ZeRO-3 target keeps the source's step (its gathers after the step) x the probed ratio
    to3, _ = predict_phases(m, _change(zero_stage=3), probes=(probe, probe), num_layers=2, source_machine=None,
                            target_machine=None, link=None, source_zero_stage=2, engine=engine, memory_gbps=0.01)
    assert to3["optimizer"] == pytest.approx(10.0 * 0.6)
    # the same ZeRO-3 engine on one rank: no gathers after the step, so its own probed step, all 1000
    # elements on the rank; on two ranks the source's measured step stays
    probed = StepProbe(step_ms=3.0, state_elements=1000.0)
    one, _ = predict_phases(m, _change(world_size=1, state_elements_per_rank=1000.0), probes=None, num_layers=2,
                            source_machine=None, target_machine=None, link=None, source_zero_stage=3,
                            step_probe=probed, memory_gbps=0.01)
    assert one["optimizer"] == pytest.approx(3.0)
    two, _ = predict_phases(m, _change(), probes=None, num_layers=2, source_machine=None, target_machine=None,
                            link=None, source_zero_stage=3, step_probe=probed, memory_gbps=0.01)
    assert two["optimizer"] == 10.0


def test_zero_stage_0_to_2_collectives_are_derived_from_the_trainable_parameters():
    """A ZeRO-3 source moved to stage 0-2: its per-module gathers go; DeepSpeed's bucketed, blocking
    gradient all_reduce (every micro batch at stage 2, once a step below) and the all-gather of the updated
    partitions after the step (stages 1/2, one call per parameter group) are priced by α-β; the source's
    small optimizer collectives (norm, overflow flag) stay as measured."""
    small = {"op": "all_reduce", "phase": "optimizer", "calls": 2, "bytes": 16, "total_ms": 0.8, "exposed_ms": 0.8}
    scatter = {"op": "reduce_scatter_tensor", "phase": "backward", "calls": 1, "bytes": 4e6, "total_ms": 8.0,
               "exposed_ms": 2.0}
    m = _measured(comm=[*_measured().comm, small, scatter], trainable_param_bytes=4e6, dtype_bytes=2)
    link = Link(alpha_ms=0.5, busbw_gbps=1.0, source="test link")
    reduce_ms, gather_ms = 0.5 + 4.0, 2 * (0.5 + 1.0)  # all_reduce bus factor 1 at n=2; all-gather 1/2, 2 MB a call
    for stage, expected in ((2, 2 * reduce_ms + gather_ms + 0.8), (1, reduce_ms + gather_ms + 0.8), (0, reduce_ms + 0.8)):
        phases, notes = predict_phases(m, _change(zero_stage=stage, grad_accum=2), probes=None, num_layers=2,
                                       source_machine=None, target_machine=None, link=link, source_zero_stage=3)
        assert phases["comm_exposed"] == pytest.approx(expected), stage
        assert any(f"ZeRO stage {stage}'s collectives derived" in n for n in notes)
    # a fit measured on this machine at the source's world size: each of the target's blocking calls (one
    # all_reduce a micro batch, two all-gathers) also waits what a blocking call of the source waited beyond
    # its price by that fit (the small all_reduces and the optimizer's 4 MB reduce-scatter; the backward
    # one was 3/4 hidden, so not blocking)
    here = Link(alpha_ms=0.5, busbw_gbps=1.0, source="gloo here", measured_here=True)
    wait = ((0.8 + 20.0) - (2 * 0.5 + (0.5 + 2.0))) / 3  # measured 0.8 + 20 ms; priced 2 x α and α + 4 MB x 1/2
    phases, notes = predict_phases(m, _change(zero_stage=2), probes=None, num_layers=2, source_machine=None,
                                   target_machine=None, link=here, source_zero_stage=3)
    assert phases["comm_exposed"] == pytest.approx(reduce_ms + gather_ms + 3 * wait + 0.8, rel=1e-4)  # + 16 B
    assert any(n.startswith(f"comm: + {wait:.2f} ms a blocking call waited in training") for n in notes)
    # overlap_comm: the reduction is exposed at the source's measured fraction of its backward reductions
    overlapped, _ = predict_phases(m, _change(zero_stage=2, overlap_comm=True), probes=None, num_layers=2,
                                   source_machine=None, target_machine=None, link=link, source_zero_stage=3)
    assert overlapped["comm_exposed"] == pytest.approx(reduce_ms * 2.0 / 8.0 + gather_ms + 0.8)
    # ZeRO-3 as the target keeps the ZeRO paper's volume ratio (its prefetched gathers are not derivable)
    to3, notes = predict_phases(m, _change(zero_stage=3), probes=None, num_layers=2, source_machine=None,
                                target_machine=None, link=None, source_zero_stage=2)
    assert to3["comm_exposed"] == pytest.approx(25.0 * 3.0 / 2.0) and "volume x1.50" in notes[-1]
    unpriced, notes = predict_phases(m, _change(zero_stage=2), probes=None, num_layers=2, source_machine=None,
                                     target_machine=None, link=None, source_zero_stage=3)
    assert math.isnan(unpriced["comm_exposed"]) and "no collective calibration" in notes[-1]


def test_a_task_change_derives_stage_0_2_collectives_from_the_adapters_and_refuses_zero3():
    """pretrain -> LoRA trains the adapters only: at ZeRO stage 0-2 the gradient all_reduce and the
    all-gather after the step carry the adapters' bytes, even at the source's own stage; under ZeRO-3 on
    several ranks the collectives are not derived (null with the reason), on one rank there are none."""
    m = _measured(trainable_param_bytes=4e6, dtype_bytes=2)
    link = Link(alpha_ms=0.5, busbw_gbps=1.0, source="test link")
    adapters = 2e3  # bytes: 1,000 trainable parameters in bf16
    lora = _change(zero_stage=2, trainable_param_bytes=adapters, param_groups=1)
    assert derives_zero_collectives(lora, 2) and not derives_zero_collectives(_change(zero_stage=2), 2)
    phases, notes = predict_phases(m, lora, probes=None, num_layers=2, source_machine=None, target_machine=None,
                                   link=link, source_zero_stage=2)
    # one all_reduce (bus factor 1 at n=2) and one all-gather (1/2) of 2 kB each, then the small optimizer rows
    # of the source (none here)
    assert phases["comm_exposed"] == pytest.approx((0.5 + adapters / 1e9 * 1e3) + (0.5 + adapters / 2 / 1e9 * 1e3))
    assert any("derived from the 0.002 MB of trainable parameters" in n for n in notes), notes
    zero3 = _change(zero_stage=3, trainable_param_bytes=adapters)
    why = task_change_not_derived(zero3)
    assert why and "under DeepSpeed ZeRO-3 is not derived" in why
    phases, notes = predict_phases(m, zero3, probes=None, num_layers=2, source_machine=None, target_machine=None,
                                   link=link, source_zero_stage=3)
    assert math.isnan(phases["comm_exposed"]) and notes[-1] == why
    assert task_change_not_derived(_change(zero_stage=3, trainable_param_bytes=adapters, world_size=1)) is None
    assert task_change_not_derived(_change(zero_stage=3)) is None  # no task change


def test_ddp_collectives_are_derived_with_the_last_bucket_exposed():
    """A change to PyTorch DDP: fp32 gradients in DDP's buckets (the first 1 MiB, then 25 MiB each, in
    reverse parameter order); all but the last hide behind the backward, the last (the remainder) is
    launched when the backward ends and is exposed whole, once a step."""
    m = _measured(trainable_param_bytes=4e6, dtype_bytes=2)  # 2e6 bf16 parameters: 8e6 bytes of fp32 gradients
    link = Link(alpha_ms=0.5, busbw_gbps=1.0, source="test link")
    ddp = _change(engine="torch", zero_stage=0, grad_accum=4)
    assert derives_ddp_collectives(ddp, 2)
    phases, notes = predict_phases(m, ddp, probes=None, num_layers=2, source_machine=None, target_machine=None,
                                   link=link, source_zero_stage=3)
    last = 8e6 - 2 ** 20  # one 1 MiB bucket, then the rest in one (< 25 MiB)
    assert phases["comm_exposed"] == pytest.approx(0.5 + last / 1e9 * 1e3)  # all_reduce bus factor 1 at n=2
    assert "2 bucket(s)" in notes[-2] and f"the last ({last / 1e6:.3g} MB)" in notes[-2]
    big = _measured(trainable_param_bytes=2 * 100e6, dtype_bytes=2)  # 100M parameters: 400 MB of gradients
    phases, notes = predict_phases(big, ddp, probes=None, num_layers=2, source_machine=None, target_machine=None,
                                   link=link, source_zero_stage=3)
    rest = 400e6 - 2 ** 20
    buckets = math.ceil(rest / (25 * 2 ** 20))
    assert phases["comm_exposed"] == pytest.approx(0.5 + (rest - 25 * 2 ** 20 * (buckets - 1)) / 1e6)
    assert f"{1 + buckets} bucket(s)" in notes[-2]
    # a DDP source at its own world keeps its recorded rows; from one rank, or with other trainable
    # parameters (a task change), DDP is derived; no calibration for the world: null with the reason
    assert not derives_ddp_collectives(_change(engine="torch", zero_stage=0, source_engine="torch"), 2)
    assert derives_ddp_collectives(_change(engine="torch", zero_stage=0, source_engine="torch"), 1)
    lora = _change(engine="torch", zero_stage=0, source_engine="torch", trainable_param_bytes=2e3)
    assert derives_ddp_collectives(lora, 2) and task_change_not_derived(lora) is None
    unpriced, notes = predict_phases(m, ddp, probes=None, num_layers=2, source_machine=None, target_machine=None,
                                     link=None, source_zero_stage=3)
    assert math.isnan(unpriced["comm_exposed"]) and "DDP's gradient all_reduce" in notes[-1]


def test_keys_the_step_model_does_not_rederive_are_named_and_step_neutral_ones_pass():
    from trainprof.projection.project import change_kinds, unmodelled_changes
    from trainprof.recipe import load_recipe

    quick = REPO / "recipes" / "quickstart_cpu.yaml"
    src = load_recipe(quick, [])
    assert unmodelled_changes(src, load_recipe(quick, ["optimizer.lr=0.1", "train.steps=5", "profile.ops=false",
                                                       "task.kind=lora", "engine.zero_stage=2",
                                                       "train.micro_batch_size=8"])) == []
    assert unmodelled_changes(src, load_recipe(quick, ["model.dtype=fp32", "model.name=llama2-small",
                                                       "optimizer.state_bits=8", "data.num_workers=2"])) == [
        "data.num_workers", "model.dtype", "model.name", "optimizer.state_bits"]
    kinds = change_kinds(src, load_recipe(quick, ["task.kind=qlora", "engine.zero_stage=2"]), 2, 2, "this")
    assert kinds == ["zero_stage", "task"]
    assert change_kinds(src, load_recipe(quick, ["task.lora.r=16"]), 2, 2, "this") == ["none"]  # still pretrain
    assert change_kinds(src, load_recipe(quick, ["engine.offload=optimizer"]), 2, 2, "this") == ["offload"]
    assert change_kinds(src, load_recipe(quick, ["engine.kind=torch", "engine.zero_stage=0"]), 2, 1, "this") == [
        "zero_stage", "engine", "world_size"]


def test_cross_machine_scales_matmul_by_rate_and_the_rest_by_bandwidth():
    m = _measured()
    src = Machine(name="src", matmul_tflops=1.0, memory_gbps=10.0)  # forward: 2e9 FLOPs -> 2 ms of matmul
    dst = Machine(name="dst", matmul_tflops=2.0, memory_gbps=40.0)
    link = Link(alpha_ms=0.0, busbw_gbps=1.0, source="test link")
    phases, _ = predict_phases(m, _change(), probes=None, num_layers=2, source_machine=src, target_machine=dst,
                               link=link, source_zero_stage=3)
    assert phases["forward"] == pytest.approx(2.0 / 2 + 18.0 / 4)
    assert phases["backward"] == pytest.approx(4.0 / 2 + 36.0 / 4)
    assert phases["optimizer"] == pytest.approx(10.0 / 4)
    # α-β per call x calls x exposed fraction: gathers 2 x 1 MB x 1/2 / 1 GB/s x 0.5; scatter 4 MB x 1/2 x 1.0
    assert phases["comm_exposed"] == pytest.approx(2 * 0.5 * 0.5 + 2.0 * 1.0)
    # recomputation turned on there: the decoder layers' measured forward (15 ms) moves as the forward does
    on, notes = predict_phases(m, _change(recompute=True), probes=None, num_layers=2, source_machine=src,
                               target_machine=dst, link=link, source_zero_stage=3)
    assert on["recompute"] == pytest.approx(15.0 * phases["forward"] / 20.0)
    assert any(n.startswith("recompute: one more forward of every decoder layer") for n in notes)
    with pytest.raises(ValueError, match="no decoder-layer rows"):
        predict_phases(_measured(forward_layers_ms=None), _change(recompute=True), probes=None, num_layers=2,
                       source_machine=src, target_machine=dst, link=link, source_zero_stage=3)

    # rates measured per phase (a CPU whose backward GEMM layouts do not thread): the forward's matmul
    # share follows the forward rate, the backward's its own, unchanged one
    src = Machine(name="1 thread", matmul_tflops=4.0, memory_gbps=10.0,
                  matmul_tflops_by_phase={"forward": 1.0, "backward": 0.5, "recompute": 1.0})
    dst = Machine(name="2 threads", matmul_tflops=4.0, memory_gbps=10.0,
                  matmul_tflops_by_phase={"forward": 2.0, "backward": 0.5, "recompute": 2.0})
    phases, _ = predict_phases(m, _change(), probes=None, num_layers=2, source_machine=src, target_machine=dst,
                               link=link, source_zero_stage=3)
    assert phases["forward"] == pytest.approx(2.0 / 2 + 18.0)  # 2e9 FLOPs at 1 TFLOP/s, then twice as fast
    assert phases["backward"] == pytest.approx(40.0)  # 4e9 FLOPs at 0.5 TFLOP/s: 8 ms of 40, at the same rate


def test_the_residual_scales_with_the_phases_so_a_faster_target_keeps_a_positive_step():
    # the median step (90 ms) is below the sum of per-phase medians (96 ms): a -6 ms residual
    m = _measured(step_ms=90.0, unattributed_ms=-6.0)
    assert residual_ms(m, dict(m.phases_ms)) == -6.0  # same phases: the measured step exactly
    fast = {k: v / 1000 for k, v in m.phases_ms.items()}  # a target 1000x faster in every phase
    assert residual_ms(m, fast) == pytest.approx(-0.006)
    assert sum(fast.values()) + residual_ms(m, fast) == pytest.approx(0.090)


def test_hardware_command_and_one_line_errors(cli):
    out = cli("hardware", "--sources")
    assert out.returncode == 0 and "h100-sxm" in out.stdout and "datasheet" in out.stdout
    bad = cli("project", REPO / "nope")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "profile.json" in bad.stderr


@pytest.mark.timed
def test_probe_models_times_each_shape_in_one_call():
    """Two shapes probed together (their models called in turn, as Projector.probe_pair does for a
    source and a target): four times the tokens take longer, each layer's share is a part of its
    model's time, and a probe of one gives the same keys."""
    from trainprof.projection.calibrate import ProbeShape, probe_model, probe_models
    from trainprof.recipe import Recipe

    recipe = Recipe()
    recipe.model.name, recipe.model.dtype, recipe.model.num_layers = "llama2-tiny", "fp32", 2
    small, large = ProbeShape(1, 32, "sdpa", False), ProbeShape(4, 32, "sdpa", False)
    s, t = probe_models([(recipe, small), (recipe, large)], threads=1, rounds=3)
    for probe in (s, t):
        assert 0 < probe["layer_forward_ms"] < probe["model_forward_ms"]
        assert 0 < probe["layer_backward_ms"] < probe["model_backward_ms"]
    assert t["model_forward_ms"] > 1.3 * s["model_forward_ms"] and t["model_backward_ms"] > 1.3 * s["model_backward_ms"]
    assert probe_model(recipe, small, threads=1, rounds=1).keys() == s.keys()


@pytest.mark.timed
def test_probe_engines_times_the_bare_model_beside_each_engine():
    """With `bare`, the engine probe also calls each recipe's bare model in the same rounds (what
    Projector.engine_overhead subtracts): ZeRO-3's parameter fetch and release at every module make its
    forward far slower than the bare model's, while the plain torch engine is the bare model."""
    from trainprof.projection.calibrate import probe_engines
    from trainprof.recipe import Recipe

    recipes = []
    for kind, stage in (("deepspeed", 3), ("torch", 0)):
        r = Recipe()
        r.model.name, r.model.dtype, r.model.num_layers = "llama2-tiny", "fp32", 2
        r.train.micro_batch_size, r.data.seq_len = 1, 32
        r.engine.kind, r.engine.zero_stage = kind, stage
        recipes.append(r)
    zero3, plain = probe_engines(recipes, threads=1, rounds=3, bare=True)
    for probe in (zero3, plain):
        assert set(probe) == {"engine_forward_ms", "engine_backward_ms", "engine_step_ms", "model_forward_ms",
                              "model_backward_ms"}
        assert all(v > 0 for v in probe.values())
    assert zero3["engine_forward_ms"] > 1.5 * zero3["model_forward_ms"]
    assert 0.6 < plain["engine_forward_ms"] / plain["model_forward_ms"] < 1.6
    assert set(probe_engines(recipes[1:], threads=1, rounds=1)[0]) == {"engine_forward_ms", "engine_backward_ms",
                                                                       "engine_step_ms"}
