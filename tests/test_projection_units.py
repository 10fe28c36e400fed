"""Projection pieces that need no training run: the catalog, prices and NCCL's latency model, the
parameter census, the GEMM work of a shape, the change-kind table, and the step model's arithmetic on
hand-made measurements (its assumptions read as data)."""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import pytest
import torch

from conftest import QUICKSTART, REPO
from trainprof.hardware import CatalogError, find_accelerator, load_catalog
from trainprof.projection.calibrate import bus_factor, collective_ms, fit_alpha_beta
from trainprof.projection.census import census, zero3_settings, zero3_traffic
from trainprof.projection.comm import CommTarget, Link, NcclLatency
from trainprof.projection.compute import EngineProbe, Machine, Parts, StepProbe, task_ops
from trainprof.projection.gemm import GemmRate, Work
from trainprof.projection.measured import Measured, PhaseOps, measured_from_profile
from trainprof.projection.prices import check_prices_name_targets, load_prices, price_for
from trainprof.projection.stepmodel import Change, Inputs, predict_phases, residual_ms
from trainprof.recipe import load_recipe
from trainprof.shapes import SHAPES

QUICK = REPO / "recipes" / "quickstart_cpu.yaml"
DATA = REPO / "tests" / "data"


def _values(notes, kind):
    """The values of the one assumption of `kind` among a prediction's records."""
    (found,) = [a.values for a in notes if a.kind == kind]
    return found


# ---------------------------------------------------------------------------------------------
# The catalog, prices and links
# ---------------------------------------------------------------------------------------------

def test_every_catalog_figure_has_a_source_and_names_resolve():
    cat = load_catalog()
    # the research's platforms and the common buys
    for key in ("a800-80g", "rtx4090", "rtx3090", "h100-sxm", "h100-pcie", "h200", "b200", "a100-40g-sxm",
                "a100-80g-sxm", "a100-40g-pcie", "a100-80g-pcie", "a800-80g-pcie", "l40s", "a30", "mi300x", "gaudi2"):
        target = cat.resolve(key)
        assert target.figure("peak_bf16_dense_tflops") and target.figure("memory_gb") and target.figure("memory_gbps")
        for name, fig in target.accelerator.items():
            if isinstance(fig, dict):
                assert fig["source"], (key, name)
    for key in ("nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "pcie4-nvlink-bridge", "ib-hdr", "ib-ndr",
                "roce-200", "roce-400"):
        assert cat.links[key]["gbps_per_direction"]["source"] and cat.links[key]["class"] in ("nvlink", "pcie", "net")
    node = cat.resolve("rtx3090-8x-nvlink")
    assert node.gpus_per_node == 8 and node.intra_node_link.key == "pcie4-nvlink-bridge"
    assert find_accelerator(cat, "NVIDIA H100 80GB HBM3") == "h100-sxm"
    # one device name, one entry: a PCIe A800 is not read as the SXM4 one (NVLink, MAMF)
    matches = [name for acc in cat.accelerators.values() for name in acc.get("match") or []]
    assert len(matches) == len(set(matches))
    assert find_accelerator(cat, "NVIDIA A800 80GB PCIe") == "a800-80g-pcie"
    assert cat.resolve("a800-80g-pcie").intra_node_link.key == "pcie4"
    assert cat.base_latency_us()[0] == 8.4 and "tuning.cc" in cat.base_latency_us()[1]
    with pytest.raises(CatalogError, match="not in the catalog.*h100-sxm"):
        cat.resolve("h1OO")


def test_the_profiler_reads_its_peaks_from_the_same_catalog():
    from trainprof.hardware import dense_peak, memory_bandwidth

    peak, _ = dense_peak("NVIDIA H100 80GB HBM3", "cuda", "bf16")
    assert peak["tflops"] == load_catalog().resolve("h100-sxm").figure("peak_bf16_dense_tflops")
    assert dense_peak("NVIDIA H100 80GB HBM3", "cuda", "tf32")[0]["tflops"] == 494.5
    bw, _ = memory_bandwidth("NVIDIA H200", "cuda")
    assert bw["gbps"] == 4800.0
    none, why = dense_peak("x86_64", "cpu", "bf16")
    assert none is None and "CPU" in why
    assert dense_peak("Some GPU", "cuda", "bf16") == (None, dense_peak("Some GPU", "cuda", "bf16")[1])


def test_user_catalog_merges_and_figures_need_sources(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text("accelerators:\n  my-gpu:\n    name: My GPU\n    match: []\n"
                    "    peak_bf16_dense_tflops: {value: 100, source: 'my datasheet'}\n"
                    "    memory_gb: {value: 16, source: 'my datasheet'}\n"
                    "    memory_gbps: {value: 500, source: 'my datasheet'}\n    intra_node_link: pcie4\n")
    cat = load_catalog(good)
    assert cat.resolve("my-gpu").figure("memory_gb") == 16 and "h100-sxm" in cat.accelerators
    assert "my-gpu" not in load_catalog().accelerators  # the package's cached catalog is not changed
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
    # a comma list, as --to takes one; a later entry wins
    listed = load_prices(None, ["h100-sxm=2.5, rtx4090=0.4", "rtx4090=0.5"])
    assert {k: v["usd_per_gpu_hour"] for k, v in listed.items()} == {"h100-sxm": 2.5, "rtx4090": 0.5}
    with pytest.raises(CatalogError, match="'rtx4090'"):
        load_prices(None, ["h100-sxm=2.5,rtx4090"])
    # a zero or negative price is well written but no price: said so, not "write NAME=USD_PER_GPU_HOUR"
    for bad in ("0", "-1"):
        with pytest.raises(CatalogError, match=r"must be a number > 0") as err:
            load_prices(None, [f"h100-sxm={bad}"])
        assert "NAME=USD_PER_GPU_HOUR" not in str(err.value)


def test_a_price_names_a_target_or_its_gpu(cli, tmp_path):
    """A command-line price that names no --to target would leave every cost n/a unexplained (h100 for
    h100-sxm): refused with the names it may take. A node template is priced by its GPU's price (per GPU-hour)
    where it has none of its own; a price file may list more machines than one call projects to."""
    catalog = load_catalog()
    given = load_prices(None, ["h100=2.5"])
    with pytest.raises(CatalogError, match=r"--price 'h100': .* h100-sxm, hgx-h100, rtx4090"):
        check_prices_name_targets(given, ["h100-sxm", "hgx-h100", "rtx4090"], catalog)
    check_prices_name_targets(load_prices(None, ["h100-sxm=2.5"]), ["hgx-h100"], catalog)  # its GPU
    check_prices_name_targets(load_prices(None, ["this=0.1"]), ["this"], catalog)
    filed = {"a100-80g-sxm": {"usd_per_gpu_hour": 1.8, "source": "quote", "date": "2026-11-01"}}
    check_prices_name_targets(filed, ["h100-sxm"], catalog)
    # ... but only machines the catalog has: an unknown name in a file is refused as --price refuses one
    with pytest.raises(CatalogError, match=r"prices.rtx9999 is not in the catalog"):
        check_prices_name_targets({"rtx9999": filed["a100-80g-sxm"]}, ["h100-sxm"], catalog)
    prices = load_prices(None, ["h100-sxm=2.5,hgx-h100=2.8"])
    assert price_for(prices, "hgx-h100", "h100-sxm")["usd_per_gpu_hour"] == 2.8  # its own price first
    assert price_for(prices, "hgx-a100", "a100-80g-sxm") is None
    assert price_for({"h100-sxm": prices["h100-sxm"]}, "hgx-h100", "h100-sxm")["priced_as"] == "h100-sxm"
    # the command says so in one line, before it reads the run
    said = cli("project", tmp_path, "--to", "h100-sxm", "--price", "h100=2.5")
    assert said.returncode == 2 and said.stderr.strip().count("\n") == 0 and "--price 'h100'" in said.stderr, said


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


def test_catalog_links_take_nccl_latency_and_the_slowest_hop():
    """A catalog link prices a collective with NCCL's ring latency (tuning.cc: 8.4 us + per step 3.4 us on
    NVLink, 14 us between nodes) and, across nodes, the network's bandwidth, so the same bytes cost more
    over 2 nodes than over 1."""
    from trainprof.projection.machines import catalog_link

    cat = load_catalog()
    one = catalog_link(cat, cat.resolve("h100-sxm"), 8, 8)
    two = catalog_link(cat, cat.resolve("h100-sxm"), 16, 8)
    assert one.busbw_gbps == 450 and two.busbw_gbps == 50
    assert one.latency.alpha_ms("all_reduce", 8) == pytest.approx((8.4 + 14 * 3.4) / 1e3)
    # 2 nodes: all_reduce has 2 x nodes network steps of its 2(n-1), the rest inside a node
    assert two.latency.alpha_ms("all_reduce", 16) == pytest.approx((8.4 + 26 * 3.4 + 4 * 14.0) / 1e3)
    assert two.latency.alpha_ms("all_gather_into_tensor", 16) == pytest.approx((8.4 + 14 * 3.4 + 14.0) / 1e3)
    assert two.ms("all_reduce", 1e9, 16) > 8 * one.ms("all_reduce", 1e9, 8)
    assert one.described.kind == "link_catalog" and one.described.values["base_us"] == 8.4
    assert catalog_link(cat, cat.resolve("h100-sxm"), 1, 8) is None
    # the RTX 3090's NVLink bridge joins pairs: two GPUs ring over it, eight also cross PCIe between the pairs
    pair, eight = (catalog_link(cat, cat.resolve("rtx3090-8x-nvlink"), n, 8) for n in (2, 8))
    assert pair.busbw_gbps == 56.25 and eight.busbw_gbps == catalog_link(cat, cat.resolve("rtx3090-8x"), 8, 8).busbw_gbps
    assert eight.latency.intra_us == 5.7 and "also crosses PCIe 4.0 x16" in eight.source
    lat = NcclLatency(base_us=10.0, intra_us=1.0, net_us=5.0, nodes=1, source="t")
    assert Link(busbw_gbps=1.0, source="t", latency=lat).ms("all_reduce", 0.0, 4) == pytest.approx((10 + 6) / 1e3)


# ---------------------------------------------------------------------------------------------
# The model's parameters and work
# ---------------------------------------------------------------------------------------------

def test_census_counts_the_parameters_and_zero3s_persistent_ones():
    """The quickstart's tiny model: 19 tensors at most 1e5 elements (DeepSpeed's default persistence
    threshold; the q/k/v/o and MLP matrices and norms of 2 layers, and the final norm) that ZeRO-3 gathers
    after each step, and 2 partitioned ones (embedding and LM head); LoRA on q,v at r=8 adds 8 small
    adapters (27 persistent, as a real LoRA run issued 27 all-gathers after its step)."""
    from trainprof.plan import analytic_params
    from trainprof.models import resolve_shape

    src = load_recipe(QUICK)
    c = census(src)
    assert c.total == analytic_params(resolve_shape(src.model), src)["total"] == 664_192
    tr = zero3_traffic(c, zero3_settings(src))
    assert (tr.persistent_calls, tr.gather_calls) == (19, 2)
    assert tr.gather_elements == 2 * 1024 * 128 and not tr.regathered_in_backward
    lora = census(load_recipe(QUICK, ["task.kind=lora"]))
    assert zero3_traffic(lora, zero3_settings(src)).persistent_calls == 27
    assert lora.trainable == 2 * 2 * (8 * 128 + 128 * 8)
    big = census(load_recipe(QUICK, ["model.name=llama2-7b"]))
    assert big.total == analytic_params(SHAPES["llama2-7b"], src)["total"]
    assert zero3_traffic(big, zero3_settings(src)).regathered_in_backward  # 6.7e9 > stage3_max_reuse_distance
    zero = load_recipe(QUICK, ["deepspeed.zero_optimization.stage3_param_persistence_threshold=0"])
    assert zero3_traffic(c, zero3_settings(zero)).persistent_calls == 0


def test_a_shapes_gemms_follow_the_flop_convention():
    """Llama2-7B's forward GEMMs are 2 FLOPs per parameter per token (the embedding is a lookup) plus the
    attention's 4 s h per token per layer; a backward is twice the forward; a frozen base (LoRA) skips its
    weight gradients."""
    w = Work(shape=SHAPES["llama2-7b"], micro_batch=2, seq_len=350, attention="sdpa", dtype="bf16")
    tokens, s = 700, SHAPES["llama2-7b"]
    non_embedding = 6_738_415_616 - s.vocab_size * s.hidden_size - s.hidden_size * (2 * s.num_layers + 1)
    attention = 4 * s.num_layers * s.hidden_size * 350
    forward = sum(g.flops for g in w.gemms("forward")) / tokens
    assert forward == pytest.approx(2 * non_embedding + attention, rel=1e-6)
    assert sum(g.flops for g in w.gemms("backward")) == pytest.approx(2 * forward * tokens)
    lora = dataclasses.replace(w, frozen=True)
    assert sum(g.flops for g in lora.gemms("backward")) < 0.6 * sum(g.flops for g in w.gemms("backward"))
    assert sum(g.flops for g in w.gemms("recompute")) == pytest.approx(
        forward * tokens - 2 * s.hidden_size * s.vocab_size * tokens)  # the layers only: no LM head


def test_gemm_rates_follow_the_curve_and_the_roofline():
    rate = GemmRate(best_tflops=800.0, memory_gbps=3000.0, curve=((2048, 400.0), (8192, 800.0)))
    from trainprof.projection.gemm import Gemm

    assert rate.tflops(Gemm(8192, 8192, 8192)) == pytest.approx(800.0)
    assert rate.tflops(Gemm(4096, 4096, 4096)) == pytest.approx(math.sqrt(400.0 * 800.0))  # log-log midpoint
    # a skinny GEMM (one token) is bandwidth-bound: 2mnk / (2 B x (mk + kn + mn)) FLOP/B x 3 TB/s
    skinny = Gemm(1, 8192, 8192)
    intensity = 2 * 8192 * 8192 / (2 * (8192 + 8192 * 8192 + 8192))
    assert rate.tflops(skinny) == pytest.approx(intensity * 3000.0 / 1e3)


def test_a_target_rated_by_its_measured_curve_or_mamf_is_not_called_datasheet_rated():
    """The catalog's H200 has a GEMM curve measured on a lent H200 and no published MAMF: its GEMMs follow
    the curve, and no note says they run at the (optimistic) datasheet peak; the B200 has neither."""
    from trainprof.projection.machines import machine_from_target

    cat = load_catalog()
    h200, notes = machine_from_target(cat.resolve("h200"), "bf16")
    assert "measured GEMM curve" in h200.matmul_source and not [n for n in notes if n.kind == "datasheet_peak"]
    assert h200.gemm["forward"].curve and h200.gemm["forward"].best_tflops <= 989.5
    _, notes = machine_from_target(cat.resolve("h100-sxm"), "bf16")
    assert not [n for n in notes if n.kind == "datasheet_peak"]
    b200, notes = machine_from_target(cat.resolve("b200"), "bf16")
    assert [n.kind for n in notes] == ["datasheet_peak"] and "datasheet dense peak 2250" in b200.matmul_source


def test_fused_attention_is_priced_without_its_scores_and_counted_bytes_widen_in_fp32():
    """A flash/SDPA kernel never writes its s x s scores: its attention GEMMs run at the curve's rate (the
    trace: cuDNN attention forward 4.5 ms on an H100 and an H200 alike), where eager attention's stay
    capped by the scores' bytes over the bandwidth. The non-GEMM bytes double in fp32 activations."""
    from trainprof.projection.gemm import Gemm

    rate = GemmRate(best_tflops=700.0, memory_gbps=3350.0)
    scores = 2 * 1024 * 1024 * 64 / (2 * (1024 * 64 + 64 * 1024 + 1024 * 1024))  # FLOP per byte, eager
    assert rate.tflops(Gemm(1024, 1024, 64)) == pytest.approx(scores * 3350.0 / 1e3)  # about 190 TFLOP/s
    assert rate.tflops(Gemm(1024, 1024, 64, fused=True)) == pytest.approx(700.0)
    assert rate.tflops(Gemm(1024, 64, 1024, fused=True)) == pytest.approx(700.0)  # P V: P stays on chip too
    w = Work(shape=SHAPES["llama2-7b"], micro_batch=2, seq_len=1024, attention="sdpa", dtype="bf16")
    eager = dataclasses.replace(w, attention="eager")
    attention = [g for g in w.gemms("forward") if SHAPES["llama2-7b"].head_dim in (g.k, g.n)]
    assert len(attention) == 2 and all(g.fused for g in attention)
    assert not any(g.fused for g in eager.gemms("forward"))
    assert dataclasses.replace(w, dtype="fp32").device_bytes("forward") == pytest.approx(2 * w.device_bytes("forward"))


def test_a_gpu_source_prices_its_elementwise_work_at_its_own_share():
    """Like for like on GPUs, the non-GEMM work moves by the two GPUs' reached bandwidths: each its
    datasheet figure times the share its own runs measured (validation_gpu.json `elementwise`), the
    source's by its catalog key, not by the all-GPU share its name ('source') would get."""
    from trainprof.projection.compute import reached_gbps
    from trainprof.projection.validation import elementwise_share

    h100, h200, pooled = (elementwise_share(k)[0] for k in ("h100-sxm", "h200", "source"))
    assert h100 != pooled and h200 != pooled
    source = Machine(name="source", is_gpu=True, gemm={}, memory_gbps=3350.0, accelerator="h100-sxm")
    assert reached_gbps(source) == pytest.approx(3350.0 * h100)
    assert reached_gbps(dataclasses.replace(source, accelerator=None)) == pytest.approx(3350.0 * pooled)


# ---------------------------------------------------------------------------------------------
# The change-kind table
# ---------------------------------------------------------------------------------------------

def test_keys_the_step_model_does_not_rederive_are_named_and_step_neutral_ones_pass():
    from trainprof.projection.changes import change_kinds, modelled_key, reshapes, unmodelled_changes

    src = load_recipe(QUICK, [])
    assert unmodelled_changes(src, load_recipe(QUICK, ["optimizer.lr=0.1", "train.steps=5", "profile.ops=false",
                                                       "task.kind=lora", "engine.zero_stage=2",
                                                       "train.micro_batch_size=8", "model.name=llama2-small",
                                                       "model.num_kv_heads=2"])) == []
    assert unmodelled_changes(src, load_recipe(QUICK, ["model.dtype=fp32", "optimizer.state_bits=8",
                                                       "data.num_workers=2"])) == [
        "data.num_workers", "optimizer.state_bits"]
    assert change_kinds(src, load_recipe(QUICK, ["model.dtype=fp32"]), 2, 2, "this") == ["dtype"]
    assert change_kinds(src, load_recipe(QUICK, ["task.kind=qlora", "engine.zero_stage=2"]), 2, 2, "this") == [
        "zero_stage", "task"]
    assert change_kinds(src, load_recipe(QUICK, ["task.lora.r=16"]), 2, 2, "this") == ["none"]  # still pretrain
    assert change_kinds(src, load_recipe(QUICK, ["engine.offload=optimizer"]), 2, 2, "this") == ["offload"]
    assert change_kinds(src, load_recipe(QUICK, ["engine.kind=torch", "engine.zero_stage=0"]), 2, 1, "this") == [
        "zero_stage", "engine", "world_size"]
    # a model size is the resolved shape: its name or its dims, not how they are spelled
    assert change_kinds(src, load_recipe(QUICK, ["model.num_layers=4", "model.vocab_size=4096"]), 2, 2, "h100-sxm") == [
        "model_size", "hardware"]
    assert change_kinds(src, load_recipe(QUICK, ["model.num_layers=2", "model.max_position_embeddings=512"]), 2, 2,
                        "this") == ["none"]
    assert reshapes(src, load_recipe(QUICK, ["model.num_heads=8"])) and not reshapes(
        src, load_recipe(QUICK, ["engine.zero_stage=2"]))
    assert modelled_key("model.hidden_size") and not modelled_key("optimizer.state_bits") and modelled_key("output.dir")


# ---------------------------------------------------------------------------------------------
# The step model on hand-made measurements
# ---------------------------------------------------------------------------------------------

TINY = SHAPES["llama2-tiny"]


def _measured(**kw) -> Measured:
    base = dict(step_ms=100.0, phases_ms={"data_wait": 1.0, "forward": 20.0, "backward": 40.0, "recompute": 0.0,
                                           "optimizer": 10.0, "comm_exposed": 25.0, "other": 0.0},
                unattributed_ms=4.0, flops_by_phase={"forward": 2e9, "backward": 4e9},
                comm=[{"op": "all_gather_into_tensor", "phase": "forward", "calls": 2, "bytes": 2e6,
                       "total_ms": 10.0, "exposed_ms": 5.0},
                      {"op": "reduce_scatter_tensor", "phase": "optimizer", "calls": 1, "bytes": 4e6,
                       "total_ms": 20.0, "exposed_ms": 20.0}],
                world_size=2, grad_accum=1, optimizer_state_elements=1000, peak_memory_bytes=10**9,
                forward_layers_ms=15.0,
                # decoder layers 12 of the forward's 20 ms and 30 of the backward's 40; the model call 18 / 36
                parts_ms={"forward": (12.0, 18.0), "backward": (30.0, 36.0), "recompute": (0.0, 0.0)})
    base.update(kw)
    return Measured(**base)


def _work(**kw) -> Work:
    return Work(**{**dict(shape=TINY, micro_batch=4, seq_len=256, attention="sdpa", dtype="bf16"), **kw})


def _change(*, work: Work | None = None, grad_accum: int = 1, recompute: bool = False, world_size: int = 2,
            engine: str = "deepspeed", zero_stage: int = 3, state: float = 500.0, **comm) -> Change:
    c = CommTarget(engine=engine, zero_stage=zero_stage, world_size=world_size, grad_accum=grad_accum,
                   source_engine=comm.pop("source_engine", "deepspeed"),
                   source_zero_stage=comm.pop("source_zero_stage", 3),
                   trainable_param_bytes=comm.pop("trainable_param_bytes", None), **comm)
    return Change(work=work or _work(), source_work=_work(), grad_accum=grad_accum, recompute=recompute,
                  state_elements_per_rank=state, source_state_elements_per_rank=500.0, comm=c)


def _two_rank_profile(*, with_means: bool = True) -> dict:
    """Two ZeRO ranks that met in collectives: rank 0 computed 30 ms, rank 1 24 ms and waited 6 ms more in
    its collectives; rank 1's median step is the slowest (100.5 against 100); their module figures differ."""
    def rank(r: int, fwd: float, bwd: float, comm: float, step: float) -> dict:
        phases = {"data_wait": 1.0, "forward": fwd, "backward": bwd, "recompute": 0.0, "optimizer": 9.0,
                  "comm_exposed": comm, "pipeline_bubble": 0.0, "other": 0.0}
        entry = {"rank": r, "step_ms_median": step, "busy_ms_median": step - comm - 1.0, "phases_ms": phases}
        if with_means:  # skewed waits: the mean of a phase above its median; the means add up to the mean step
            means = {**phases, "comm_exposed": comm + 4.0}
            entry.update(phases_ms_mean=means, unattributed_ms_mean=0.5, step_ms_mean=sum(means.values()) + 0.5)
        return entry

    ranks = [rank(0, 12.0, 18.0, 50.0, 100.0), rank(1, 10.0, 14.0, 56.0, 100.5)]
    root = {"name": "", "depth": 0, "forward_ms": 10.0, "backward_ms": 15.0, "recompute_ms": 0.0,
            "ranks_spread": {"forward_ms": {"min": 9.0, "median": 10.0, "max": 11.0, "by_rank": [11.0, 9.0]},
                             "backward_ms": {"min": 13.0, "median": 15.0, "max": 17.0, "by_rank": [17.0, 13.0]}}}
    layer = {"name": "model.layers.0", "depth": 2, "forward_ms": 6.0, "backward_ms": 9.0, "recompute_ms": 0.0,
             "ranks_spread": {"forward_ms": {"min": 5.0, "median": 6.0, "max": 7.0, "by_rank": [7.0, 5.0]}}}
    return {"summary": {"step_ms": {"median": 100.0}}, "ranks": ranks, "modules": [root, layer],
            "env": {"world_size": 2}, "recipe": {"model": {"dtype": "bf16"}, "train": {"grad_accum": 1}}}


def test_the_busiest_rank_splits_the_slowest_step_by_means_that_add_up():
    """The step is the slowest rank's median; its split is the busiest rank's (the one the other waited
    for: rank 0 here, whose collectives hold no wait for the other's compute), by phase means scaled to the
    step, so the unattributed rest is the per-step gap, not the difference between a sum of medians and a
    median; the module figures are that rank's own, moved with their phase."""
    m = measured_from_profile(_two_rank_profile())
    assert m.step_ms == 100.5
    k = 100.5 / (1.0 + 12.0 + 18.0 + 9.0 + 54.0 + 0.5)  # the slowest median step over rank 0's mean step
    assert m.phases_ms["forward"] == pytest.approx(12.0 * k) and m.phases_ms["comm_exposed"] == pytest.approx(54.0 * k)
    assert m.unattributed_ms == pytest.approx(0.5 * k)
    assert m.parts_ms["forward"] == pytest.approx((7.0 * k, 11.0 * k))  # rank 0's layer and root, x its phase's k
    assert m.parts_ms["backward"] == pytest.approx((9.0 * k, 17.0 * k))  # no per-rank layer figure: the median
    # a profile made before means were kept: the busiest rank's medians, the rest unattributed
    old = measured_from_profile(_two_rank_profile(with_means=False))
    assert old.phases_ms["forward"] == 12.0 and old.phases_ms["comm_exposed"] == 50.0
    assert old.unattributed_ms == pytest.approx(100.5 - 90.0)
    assert m.ranks_busy_ms == {0: 49.0, 1: 43.5}  # each rank's step less its collectives and data wait


def test_fewer_ranks_than_an_uneven_source_are_told_the_slowest_ranks_pace_is_kept(tmp_path):
    """A source whose ranks computed unevenly (the test data's 2 ranks: 39.2 and 27.2 ms busy a step) is
    predicted at its slowest rank's pace; a prediction for fewer ranks says so, one for as many does not."""
    import shutil

    from trainprof.projection.project import project

    run = tmp_path / "zero3_2rank"
    shutil.copytree(DATA / "zero3_2rank", run)
    one, two = project(run, nproc=[1, 2], probe=False)["predictions"]
    (note,) = [a["values"] for a in one["assumptions"] if a["kind"] == "ranks_uneven"]
    assert note["slowest_rank"] == 0 and note["world"] == 1
    assert note["spread"] == pytest.approx(39.204385 / 27.24824 - 1)
    assert "source ranks +44% apart: slowest kept" in one["confidence_text"]  # in the table's cell too
    assert "ranks_uneven" not in {a["kind"] for a in two["assumptions"]}


def test_a_wrapped_runs_peak_memory_is_its_highest_phase_peak():
    """The runner writes its step peak (peak_memory_bytes_max); a wrapped script's loop has no runner, so
    the source's memory is the highest of the profiler's per-phase peaks, and a projection has memory."""
    profile = _two_rank_profile()
    assert measured_from_profile(profile).peak_memory_bytes is None
    profile["summary"]["peak_memory_bytes"] = {"forward": 5 * 2**20, "backward": 7 * 2**20, "optimizer": None}
    assert measured_from_profile(profile).peak_memory_bytes == 7 * 2**20
    profile["summary"]["peak_memory_bytes_max"] = 8 * 2**20  # the runner's, where there is one
    assert measured_from_profile(profile).peak_memory_bytes == 8 * 2**20


def test_same_configuration_reproduces_the_measured_phases():
    m = _measured()
    phases, _ = predict_phases(m, _change(), Inputs())
    assert phases == m.phases_ms
    assert sum(phases.values()) + m.unattributed_ms == pytest.approx(m.step_ms)


def test_a_changed_models_optimizer_adds_the_probed_pass_over_its_elements_per_rank():
    """A model-size change keeps the measured optimizer phase (10 ms: the engine's step machinery and its
    pass) and adds the change of a mixed-precision AdamW pass, each shape's probed cost per element times
    its elements per rank: 500 at 2 ns -> 2e6 at 3 ns."""
    m = _measured()
    same = {"forward": 1.0, "backward": 1.0}
    parts = Parts(layer_source=same, layer_target=same, rest_source=same, rest_target=same, layers_probed=2,
                  step_ns=(2.0, 3.0))
    phases, notes = predict_phases(m, _change(state=2e6), Inputs(parts=parts, memory_gbps=40.0))
    assert phases["optimizer"] == pytest.approx(10.0 + (3.0 * 2e6 - 2.0 * 500) / 1e6)
    assert _values(notes, "optimizer_probed_pass") == {"source_elements": 500.0, "target_elements": 2e6,
                                                       "source_ns": 2.0, "target_ns": 3.0}


def test_a_noisy_probe_is_said_beside_the_row():
    """The probed layers' time is the median of paired rounds (k layers minus none, in one round); its
    standard error comes from their interquartile range: rounds 9, 10, 10, 11 ms a layer pair (IQR 1.5,
    statistics.quantiles' default) give 1.2533 * 1.5 / 1.349 / sqrt(4) / 10 = 7.0%, beyond the 5% the row
    notes; a quiet probe is not noted."""
    from trainprof.projection.probes import paired_error

    zeros = {"forward": [0.0] * 4, "backward": [0.0] * 4}
    rounds = {"forward": [3.0, 4.0, 3.0, 4.0], "backward": [6.0, 6.0, 7.0, 7.0]}
    assert paired_error(rounds, zeros) == pytest.approx(1.2533 * 1.5 / 1.349 / 2 / 10, rel=1e-3)
    # a slow spell that hits both models of a round cancels: the same diffs, whatever the rest took
    slow = {"forward": [x + 50.0 for x in rounds["forward"]], "backward": rounds["backward"]}
    assert paired_error(slow, {"forward": [50.0] * 4, "backward": [0.0] * 4}) == pytest.approx(paired_error(rounds, zeros))
    assert paired_error({"forward": [1.0] * 3, "backward": [1.0] * 3}, {"forward": [0.0] * 3, "backward": [0.0] * 3}) is None
    same = {"forward": 1.0, "backward": 1.0}
    for error, noted in ((0.07, True), (0.02, False), (None, False)):
        parts = Parts(layer_source=same, layer_target=same, rest_source=same, rest_target=same, layers_probed=2,
                      error=error)
        _, notes = predict_phases(_measured(), _change(), Inputs(parts=parts))
        assert ("probes_noisy" in [a.kind for a in notes]) is noted, error
    assert _values(predict_phases(_measured(), _change(), Inputs(parts=dataclasses.replace(parts, error=0.07)))[1],
                   "probes_noisy")["error"] == 0.07


def test_a_probe_slower_than_the_run_is_said_and_one_that_would_leave_no_layer_refuses():
    """The run measured 6 ms a decoder layer forward (15 backward) with its hooks: a bare layer of the same
    shape probed at 10 ms (1.7x) was timed while the machine ran slower than during the run, which the row
    says; one probed at 40 ms (the scale finding: 362 ms against the run's 92.4 ms, a half-width target at
    155.7 ms, predicted a forward 36x faster) would leave a layer of 6 + 8 - 40 < 0 ms, and is refused with
    both figures instead of predicting a layer of no time."""
    m = _measured()
    deeper = _work(shape=dataclasses.replace(TINY, num_layers=4, intermediate_size=2 * TINY.intermediate_size))

    def parts(source_forward: float) -> Parts:
        return Parts(layer_source={"forward": source_forward, "backward": 10.0},
                     layer_target={"forward": 8.0, "backward": 16.0}, rest_source={"forward": 2.0, "backward": 3.0},
                     rest_target={"forward": 2.0, "backward": 3.0}, layers_probed=2)

    _, quiet = predict_phases(m, _change(work=deeper), Inputs(parts=parts(5.0)))
    assert "probe_slower_than_run" not in [a.kind for a in quiet]
    phases, notes = predict_phases(m, _change(work=deeper), Inputs(parts=parts(10.0)))
    assert phases["forward"] == pytest.approx((6.0 + 8.0 - 10.0) * 4 + 6.0 + 2.0)
    assert _values(notes, "probe_slower_than_run") == {"phase": "forward", "ratio": pytest.approx(10.0 / 6.0),
                                                       "limit": 1.5}
    with pytest.raises(ValueError, match=r"took 40\.0 ms a bare decoder layer forward .* measured 6\.0 ms"):
        predict_phases(m, _change(work=deeper), Inputs(parts=parts(40.0)))
    # a change of depth alone does not use the probed figures: neither the mark nor the refusal stands on them
    only_deeper = _work(shape=dataclasses.replace(TINY, num_layers=4))
    for slow in (10.0, 40.0):
        phases, notes = predict_phases(m, _change(work=only_deeper), Inputs(parts=parts(slow)))
        assert "probe_slower_than_run" not in [a.kind for a in notes]
        assert phases["forward"] == pytest.approx(6.0 * 4 + 6.0 + 2.0)


def test_grad_accum_and_world_size():
    m = _measured()
    phases, _ = predict_phases(m, _change(grad_accum=2), Inputs())
    assert (phases["forward"], phases["backward"], phases["optimizer"]) == (40.0, 80.0, 10.0)
    assert phases["comm_exposed"] == pytest.approx(5.0 * 2 + 20.0)  # forward gathers repeat per micro batch
    one, notes = predict_phases(m, _change(world_size=1, state=1000.0), Inputs())
    assert one["comm_exposed"] == 0.0 and one["optimizer"] == 20.0
    assert [a.kind for a in notes][-1] == "comm_one_rank"
    assert _values(notes, "optimizer_scaled")["ratio"] == 2.0


def test_probed_parts_add_the_work_they_change_and_keep_what_the_measurement_holds_beyond_it():
    """Each decoder layer's measured time plus the change of one bare layer's probed work, x the target's
    layer count; the rest of the model's measured time plus its probed change; the time outside the model
    (forward 20 - 18, backward 40 - 36) as measured. Turning recompute on re-runs the target's layers'
    forward; ZeRO-3's copies of the gathered parameters add their bytes at the memory bandwidth."""
    m = _measured()  # layers 12 of the forward's 20 ms (2 layers: 6 each), the model call 18; backward 30 / 36
    parts = Parts(layer_source={"forward": 5.0, "backward": 10.0}, layer_target={"forward": 8.0, "backward": 16.0},
                  rest_source={"forward": 2.0, "backward": 3.0}, rest_target={"forward": 4.0, "backward": 3.0},
                  layers_probed=2)
    wider = dataclasses.replace(TINY, num_layers=4, hidden_size=2 * TINY.hidden_size)
    phases, notes = predict_phases(m, _change(work=_work(shape=wider), recompute=True), Inputs(parts=parts))
    assert phases["forward"] == pytest.approx((6.0 + 8.0 - 5.0) * 4 + (6.0 + 4.0 - 2.0) + 2.0)
    assert phases["backward"] == pytest.approx((15.0 + 16.0 - 10.0) * 4 + (6.0 + 3.0 - 3.0) + 4.0)
    assert phases["recompute"] == pytest.approx((6.0 + 8.0 - 5.0) * 4)
    assert _values(notes, "parts_probed")["target_layers"] == 4
    assert _values(notes, "recompute_on")["layers_forward_ms"] == pytest.approx(36.0)
    # a change of depth alone: the same layer and rest, whose probed change (the same shape timed twice) is
    # noise, so each layer's measured time carries over (a spell once probed such a layer at 6.48 then 4.42 ms)
    deeper = _work(shape=dataclasses.replace(TINY, num_layers=4))
    phases, notes = predict_phases(m, _change(work=deeper), Inputs(parts=parts))
    assert phases["forward"] == pytest.approx(6.0 * 4 + 6.0 + 2.0)
    assert phases["backward"] == pytest.approx(15.0 * 4 + 6.0 + 4.0)
    assert "measured time kept" in next(a.text for a in notes if a.kind == "parts_probed")
    # ZeRO-3 gathers 1e9 -> 3e9 bytes a forward; its copies move 2 B per byte at 1000 GB/s: +4 ms
    same = Parts(layer_source={"forward": 5.0, "backward": 10.0}, layer_target={"forward": 5.0, "backward": 10.0},
                 rest_source={"forward": 2.0, "backward": 3.0}, rest_target={"forward": 2.0, "backward": 3.0},
                 layers_probed=2)
    moved, notes = predict_phases(m, _change(), Inputs(parts=same, zero3_bytes=(1e9, 3e9), memory_gbps=1000.0))
    assert moved["forward"] == pytest.approx(20.0 + 4.0) and moved["backward"] == pytest.approx(40.0)
    assert _values(notes, "parts_probed")["copies_ms"] == pytest.approx(4.0)
    with pytest.raises(ValueError, match="no decoder-layer rows"):
        predict_phases(_measured(parts_ms=None), _change(), Inputs(parts=same))
    # a change of threads: each shape's parts probed at its own count; the machines, calibrated at each
    # count, re-rate only the optimizer's memory traffic (10 ms at 10 -> 20 GB/s)
    threaded = dataclasses.replace(same, layer_target={"forward": 4.0, "backward": 7.0},
                                   rest_target={"forward": 1.5, "backward": 2.0}, threads=(1, 2))
    one, two = _machine("1 thread", gpu=False, tflops=0.1, gbps=10.0), _machine("2", gpu=False, tflops=0.2, gbps=20.0)
    phases, notes = predict_phases(m, _change(), Inputs(parts=threaded, source_machine=one, target_machine=two))
    assert phases["forward"] == pytest.approx((6.0 + 4.0 - 5.0) * 2 + (6.0 + 1.5 - 2.0) + 2.0)
    assert phases["backward"] == pytest.approx((15.0 + 7.0 - 10.0) * 2 + (6.0 + 2.0 - 3.0) + 4.0)
    assert phases["optimizer"] == pytest.approx(5.0)
    assert "the target's at 2" in next(a.text for a in notes if a.kind == "parts_probed")


def test_an_engine_change_scales_the_whole_compute_phases_by_the_probed_engine_ratio():
    m = _measured()
    engine = EngineProbe(forward=0.75, backward=0.9, step=0.6, target_step=StepProbe(step_ms=3.0, state_elements=1000.0))
    phases, notes = predict_phases(m, _change(zero_stage=2, source_zero_stage=3), Inputs(engine=engine,
                                                                                        link=_link()))
    assert (phases["forward"], phases["backward"]) == pytest.approx((20.0 * 0.75, 40.0 * 0.9))
    assert _values(notes, "engine_change") == {"forward": 0.75, "backward": 0.9}
    # no bandwidth to re-price Adam's pass with: the probed step() ratio
    assert phases["optimizer"] == pytest.approx(10.0 * 0.6)
    assert _values(notes, "optimizer_engine_ratio")["ratio"] == 0.6
    # below ZeRO-3 the target's own probed step, Adam's pass moved from the probe's 1000 state elements
    # to this rank's 500 (28 B each at 0.01 GB/s: 2.8 ms per 1000 elements)
    below3, notes = predict_phases(m, _change(zero_stage=2), Inputs(engine=engine, memory_gbps=0.01, link=_link()))
    assert below3["optimizer"] == pytest.approx(3.0 - 2.8 + 1.4)
    assert _values(notes, "optimizer_probed_step")["step_ms"] == 3.0
    # a ZeRO-3 target keeps the source's step (its gathers after the step) x the probed ratio
    to3, _ = predict_phases(m, _change(zero_stage=3, source_zero_stage=2), Inputs(engine=engine, memory_gbps=0.01))
    assert to3["optimizer"] == pytest.approx(10.0 * 0.6)
    # the same ZeRO-3 engine on one rank: no gathers after the step, its own probed step with all 1000
    # elements on the rank; on two ranks the source's measured step stays
    probed = StepProbe(step_ms=3.0, state_elements=1000.0)
    one, _ = predict_phases(m, _change(world_size=1, state=1000.0), Inputs(step_probe=probed, memory_gbps=0.01))
    assert one["optimizer"] == pytest.approx(3.0)
    two, _ = predict_phases(m, _change(), Inputs(step_probe=probed, memory_gbps=0.01))
    assert two["optimizer"] == 10.0


def _link(**kw) -> Link:
    return Link(**{**dict(alpha_ms=0.5, busbw_gbps=1.0, source="test link"), **kw})


def test_zero_stage_0_to_2_collectives_are_derived_from_the_trainable_parameters():
    """A ZeRO-3 source moved to stage 0-2: its per-module gathers go; DeepSpeed's bucketed, blocking
    gradient all_reduce (every micro batch at stage 2, once a step below) and the all-gather of the updated
    partitions after the step (stages 1/2, one call per parameter group) are priced by α-β; the source's
    small optimizer collectives (norm, overflow flag) stay as measured."""
    small = {"op": "all_reduce", "phase": "optimizer", "calls": 2, "bytes": 16, "total_ms": 0.8, "exposed_ms": 0.8}
    scatter = {"op": "reduce_scatter_tensor", "phase": "backward", "calls": 1, "bytes": 4e6, "total_ms": 8.0,
               "exposed_ms": 2.0}
    m = _measured(comm=[*_measured().comm, small, scatter], trainable_param_bytes=4e6, dtype_bytes=2)
    reduce_ms, gather_ms = 0.5 + 4.0, 2 * (0.5 + 1.0)  # all_reduce bus factor 1 at n=2; all-gather 1/2, 2 MB a call
    for stage, expected in ((2, 2 * reduce_ms + gather_ms + 0.8), (1, reduce_ms + gather_ms + 0.8), (0, reduce_ms + 0.8)):
        phases, notes = predict_phases(m, _change(zero_stage=stage, grad_accum=2), Inputs(link=_link()))
        assert phases["comm_exposed"] == pytest.approx(expected), stage
        assert _values(notes, "comm_zero_derived")["stage"] == stage
    # a fit measured on this machine at the source's world size: each of the target's blocking calls (one
    # all_reduce a micro batch, two all-gathers) also waits what a blocking call of the source waited beyond
    # its price by that fit (the small all_reduces and the optimizer's 4 MB reduce-scatter; the backward
    # one was 3/4 hidden, so not blocking)
    here = _link(measured_here=True)
    wait = ((0.8 + 20.0) - (2 * 0.5 + (0.5 + 2.0))) / 3  # measured 0.8 + 20 ms; priced 2 x α and α + 4 MB x 1/2
    phases, notes = predict_phases(m, _change(zero_stage=2), Inputs(link=here))
    assert phases["comm_exposed"] == pytest.approx(reduce_ms + gather_ms + 3 * wait + 0.8, rel=1e-4)  # + 16 B
    assert _values(notes, "comm_wait")["wait_ms"] == pytest.approx(wait)
    # overlap_comm: the reduction is exposed at the source's measured fraction of its backward reductions
    overlapped, _ = predict_phases(m, _change(zero_stage=2, overlap_comm=True), Inputs(link=_link()))
    assert overlapped["comm_exposed"] == pytest.approx(reduce_ms * 2.0 / 8.0 + gather_ms + 0.8)
    # ZeRO-3 as the target of a stage-2 source at its own world size keeps the ZeRO paper's volume ratio
    to3, notes = predict_phases(m, _change(zero_stage=3, source_zero_stage=2), Inputs())
    assert to3["comm_exposed"] == pytest.approx(25.0 * 3.0 / 2.0)
    assert _values(notes, "comm_zero_volume")["ratio"] == 1.5
    unpriced, notes = predict_phases(m, _change(zero_stage=2), Inputs())
    assert math.isnan(unpriced["comm_exposed"]) and "no collective calibration" in notes[-1].values["why"]


def test_zero3_collectives_follow_the_census_on_a_model_or_task_change():
    """A ZeRO-3 target of another model or task re-derives each of the source's rows: the after-step
    gathers follow the persistent parameters (19 -> 27 with LoRA's adapters), the forward gathers the
    partitioned ones, the reduce-scatter the trainable ones, each keeping the exposed time the source
    measured, scaled by the link's price of the target's calls over the source's."""
    src, lora = load_recipe(QUICK), load_recipe(QUICK, ["task.kind=lora"])
    after = {"op": "all_gather_into_tensor", "phase": "optimizer", "calls": 19, "bytes": 19 * 4000.0,
             "total_ms": 19.0, "exposed_ms": 9.5}
    m = _measured(comm=[after], trainable_param_bytes=2 * 664_192, dtype_bytes=2)
    c = _change(census=census(lora), source_census=census(src), zero3=zero3_settings(lora),
                source_zero3=zero3_settings(src), trainable_param_bytes=2 * census(lora).trainable)
    phases, notes = predict_phases(m, c, Inputs(link=_link()))
    s, t = (zero3_traffic(x, zero3_settings(src)) for x in (census(src), census(lora)))
    elements = 19 * 4000.0 / 2 * t.persistent_elements / s.persistent_elements
    price = (27 * _link().ms("all_gather_into_tensor", 2 * elements / 27, 2)
             / (19 * _link().ms("all_gather_into_tensor", 4000.0, 2)))
    assert phases["comm_exposed"] == pytest.approx(9.5 * price) and price > 1.3  # 27 calls for 19
    assert _values(notes, "comm_zero3_derived")["persistent"] == 27


def test_a_dtype_change_moves_the_collectives_bytes_but_not_ddps_fp32_gradients():
    """bf16 -> fp32: ZeRO's collectives carry the parameters in the model's dtype (twice the bytes, the
    same elements and buckets); a ZeRO-3 source's rows are re-derived (not re-timed as they were) with each
    large row's bytes doubled and the small ones (norms, flags) kept; DDP's gradients were fp32 already,
    so a DDP source's rows are re-timed as measured; an FSDP2 source's gathers double, its fp32
    reduce-scatters do not."""
    m = _measured(trainable_param_bytes=4e6, dtype_bytes=2)  # 2e6 parameters
    for stage in (2, 0):  # from ZeRO-3: derived either way
        _, bf16 = predict_phases(m, _change(zero_stage=stage), Inputs(link=_link()))
        _, fp32 = predict_phases(m, _change(zero_stage=stage, dtype_bytes=4), Inputs(link=_link()))
        assert _values(fp32, "comm_zero_derived")["mbytes"] == 2 * _values(bf16, "comm_zero_derived")["mbytes"] == 8.0
    zero2 = dict(zero_stage=2, source_zero_stage=2)  # a ZeRO-2 source: re-timed in bf16, derived in fp32
    _, bf16 = predict_phases(m, _change(**zero2), Inputs(link=_link()))
    _, fp32 = predict_phases(m, _change(**zero2, dtype_bytes=4), Inputs(link=_link()))
    assert "comm_retimed" in [a.kind for a in bf16] and _values(fp32, "comm_zero_derived")["mbytes"] == 8.0
    _, bf16 = predict_phases(m, _change(engine="torch", zero_stage=0), Inputs(link=_link()))
    _, fp32 = predict_phases(m, _change(engine="torch", zero_stage=0, dtype_bytes=4), Inputs(link=_link()))
    assert _values(fp32, "comm_ddp_derived") == _values(bf16, "comm_ddp_derived")
    ddp = dict(engine="torch", zero_stage=0, source_engine="torch", source_zero_stage=0)  # a DDP source: as measured
    for dtype_bytes in (None, 4):
        _, notes = predict_phases(m, _change(**ddp, dtype_bytes=dtype_bytes), Inputs(link=_link()))
        assert "comm_retimed" in [a.kind for a in notes], dtype_bytes
    # an FSDP2 source re-times its rows: the gathers at twice the bytes, the fp32 reduce-scatter as it was
    fsdp = dict(engine="fsdp", zero_stage=0, source_engine="fsdp", source_zero_stage=0)
    phases, notes = predict_phases(m, _change(**fsdp, dtype_bytes=4), Inputs(link=_link()))
    gather = _measured().comm[0]
    wider = _link().ms(gather["op"], 2 * gather["bytes"] / 2, 2) / _link().ms(gather["op"], gather["bytes"] / 2, 2)
    assert "comm_retimed" in [a.kind for a in notes] and phases["comm_exposed"] == pytest.approx(5.0 * wider + 20.0)
    src = load_recipe(QUICK)
    small = {"op": "all_reduce", "phase": "optimizer", "calls": 2, "bytes": 16.0, "total_ms": 0.8, "exposed_ms": 0.8}
    z3 = _measured(comm=[*_measured().comm, small], dtype_bytes=2)
    same = dict(census=census(src), source_census=census(src), zero3=zero3_settings(src),
                source_zero3=zero3_settings(src))
    kept, notes = predict_phases(z3, _change(**same), Inputs(link=_link()))
    assert "comm_retimed" in [a.kind for a in notes]
    wider, notes = predict_phases(z3, _change(**same, dtype_bytes=4), Inputs(link=_link()))
    assert "comm_rows_repriced" in [a.kind for a in notes]
    link = _link()
    doubled = sum(c["exposed_ms"] * link.ms(c["op"], 2 * c["bytes"] / c["calls"], 2)
                  / link.ms(c["op"], c["bytes"] / c["calls"], 2) for c in _measured().comm)
    assert wider["comm_exposed"] == pytest.approx(doubled + 0.8) and wider["comm_exposed"] > kept["comm_exposed"]


def test_retimed_collectives_keep_their_measured_exposure_and_scale_with_the_ranks():
    """A change that keeps the collectives (the same engine and model) at the source's world size exposes
    what the source measured (5 + 20 ms), however long an asynchronous gather's recorded span (its 10 ms include
    waiting on the handle); at 4 ranks each row scales by its alpha-beta price at 4 over that at 2."""
    from trainprof.projection.comm import recorded_ms

    m, link = _measured(), _link()
    phases, notes = predict_phases(m, _change(), Inputs(link=link))
    assert phases["comm_exposed"] == pytest.approx(25.0) and "comm_retimed" in [a.kind for a in notes]
    four, _ = predict_phases(m, _change(world_size=4), Inputs(link=link))
    scaled = [c["exposed_ms"] * recorded_ms(c, 4, link) / recorded_ms(c, 2, link) for c in m.comm]
    assert four["comm_exposed"] == pytest.approx(sum(scaled))
    assert four["comm_exposed"] > 25.0


def test_ddp_collectives_are_derived_with_the_last_bucket_exposed():
    """A change to PyTorch DDP: fp32 gradients in DDP's buckets (the first 1 MiB, then 25 MiB each, in
    reverse parameter order); the last (the remainder) is launched when the backward ends and is exposed
    whole, once a step. The others are launched during the backward: on a GPU they hide behind its compute;
    on the source's CPU gloo reduces them on the cores the ranks compute on, so they are charged whole."""
    m = _measured(trainable_param_bytes=4e6, dtype_bytes=2)  # 2e6 bf16 parameters: 8e6 bytes of fp32 gradients
    ddp = _change(engine="torch", zero_stage=0, grad_accum=4)
    phases, notes = predict_phases(m, ddp, Inputs(link=_link()))
    last = 8e6 - 2 ** 20  # one 1 MiB bucket, then the rest in one (< 25 MiB)
    first = 0.5 + 2 ** 20 / 1e6  # all_reduce bus factor 1 at n=2
    assert phases["comm_exposed"] == pytest.approx(0.5 + last / 1e9 * 1e3 + first)
    assert _values(notes, "comm_ddp_derived")["buckets"] == 2
    gpu = _change(engine="torch", zero_stage=0, grad_accum=4, cross_machine=True)  # 160 ms of backward to hide in
    assert predict_phases(m, gpu, Inputs(link=_link()))[0]["comm_exposed"] == pytest.approx(0.5 + last / 1e6)
    big = _measured(trainable_param_bytes=2 * 100e6, dtype_bytes=2)  # 100M parameters: 400 MB of gradients
    phases, notes = predict_phases(big, ddp, Inputs(link=_link()))
    rest = 400e6 - 2 ** 20
    buckets = math.ceil(rest / (25 * 2 ** 20))
    tail = rest - 25 * 2 ** 20 * (buckets - 1)
    assert phases["comm_exposed"] == pytest.approx(0.5 + tail / 1e6 + 0.5 + (400e6 - tail) / 1e6)
    assert _values(notes, "comm_ddp_derived")["buckets"] == 1 + buckets
    # a DDP source at its own world keeps its recorded rows (re-timed); no calibration for the world: null
    same = _change(engine="torch", zero_stage=0, source_engine="torch", source_zero_stage=0)
    _, notes = predict_phases(m, same, Inputs(link=_link()))
    assert "comm_retimed" in [a.kind for a in notes]
    unpriced, notes = predict_phases(m, ddp, Inputs())
    assert math.isnan(unpriced["comm_exposed"])


def _machine(name: str, *, gpu: bool, tflops: float, gbps: float) -> Machine:
    rate = GemmRate(best_tflops=tflops, memory_gbps=gbps)
    return Machine(name=name, is_gpu=gpu, gemm={ph: rate for ph in ("forward", "backward", "recompute")},
                   memory_gbps=gbps)


def test_another_machine_rerates_like_with_like_and_a_gpu_waits_for_its_host():
    """GPU -> GPU: each phase's GEMM kernel time x the GEMM-time ratio, its other kernels x the bandwidth
    ratio; a host-bound phase (kernels under 80% of it) keeps its host time: operator calls x the host's
    time per call, and the phase is the longer of host and device."""
    ops = {"forward": PhaseOps(layer_calls=100.0, rest_calls=20.0, matmul_ms=8.0, other_ms=8.0),
           "backward": PhaseOps(layer_calls=200.0, rest_calls=40.0, matmul_ms=10.0, other_ms=10.0)}
    m = _measured(ops=ops, device_type="cuda")
    src, dst = _machine("a", gpu=True, tflops=100.0, gbps=1000.0), _machine("b", gpu=True, tflops=200.0, gbps=4000.0)
    inputs = Inputs(source_machine=src, target_machine=dst, host_us_per_op={"forward": 50.0, "backward": 100.0},
                    link=_link())
    phases, notes = predict_phases(m, _change(), inputs)
    # forward: device 8 x 0.5 + 8 x 0.25 = 6 ms; host 120 calls x 50 us = 6 ms -> 6; backward: device 7.5, host 24
    assert phases["forward"] == pytest.approx(6.0) and phases["backward"] == pytest.approx(24.0)
    assert "device_rerated" in [a.kind for a in notes]
    # a CPU source: the GPU's device work from the target's shapes alone (its efficiency says nothing of a
    # GPU's): GEMMs at the GPU's rates, the other operators' counted bytes at the share of its bandwidth
    # that the GPU runs measured
    from trainprof.projection.validation import elementwise_share

    cpu = _machine("cpu", gpu=False, tflops=0.1, gbps=10.0)
    w = _work()
    analytic = dst.gemm["forward"].ms(w.gemms("forward")) + w.device_bytes("forward") / (
        4000e9 * elementwise_share(dst.name)[0]) * 1e3
    phases, notes = predict_phases(_measured(ops=ops), _change(), Inputs(source_machine=cpu, target_machine=dst,
                                                                         host_us_per_op={"forward": 1e-6,
                                                                                         "backward": 1e-6},
                                                                         link=_link()))
    assert phases["forward"] == pytest.approx(analytic) and "device_analytic" in [a.kind for a in notes]
    # a CPU run without an operator trace (a wrapped script's): its layers' calls as GPU runs of the engine
    # issue them (plus the target task's), at a GPU host's time per call, still bound the phase; the rest of
    # the model's calls are not known and not counted
    slow_host = Inputs(source_machine=cpu, target_machine=dst, host_us_per_op={"forward": 1000.0, "backward": 1000.0},
                       ops_per_layer={"forward": 100.0, "backward": 200.0}, link=_link())
    phases, _ = predict_phases(_measured(ops=None), _change(), slow_host)
    assert phases["forward"] == pytest.approx(100 * TINY.num_layers) and phases["forward"] > analytic  # 1 ms a call
    lora = _work(frozen=True, lora_targets=("q_proj", "v_proj"), lora_r=8)
    phases, _ = predict_phases(_measured(ops=None), _change(work=lora), slow_host)
    assert phases["backward"] == pytest.approx((200 + task_ops(lora)) * TINY.num_layers) and task_ops(lora) > 0
    # CPU -> CPU (another thread count): device and host add up on one thread of control
    cpu2 = _machine("cpu2", gpu=False, tflops=0.2, gbps=10.0)
    phases, _ = predict_phases(_measured(ops=ops), _change(), Inputs(source_machine=cpu, target_machine=cpu2,
                                                                     link=_link()))
    g = cpu.gemm["forward"].ms(w.gemms("forward"))
    assert phases["forward"] == pytest.approx(8.0 * cpu2.gemm["forward"].ms(w.gemms("forward")) / g + 8.0 + 4.0)


def test_a_gpu_hosts_time_per_call_follows_the_engines_host_path():
    """DeepSpeed's host path depends on its ZeRO stage: ZeRO-3's module hooks are in the catalog's
    `deepspeed` figures, ZeRO-0/1/2's own runs in `deepspeed-zero12`; a catalog without the latter lets
    plain PyTorch's figures stand in for the model's phases (ZeRO-0/1/2 hook only the root module; the
    optimizer step stays ZeRO-3's), and the prediction says so; FSDP takes PyTorch's, and an engine without
    references ZeRO-3's, each said too."""
    import dataclasses

    from trainprof.projection.machines import gpu_host

    cat = load_catalog()
    figure = {key: {ph: fig["value"] for ph, fig in block.items()} for key, block in cat.host_us_per_op.items()}
    zero3, _, why = gpu_host(cat, "deepspeed", 3)
    assert why is None and zero3["forward"] == figure["deepspeed"]["forward"] == zero3["recompute"]
    zero2, source, why = gpu_host(cat, "deepspeed", 2)
    assert why is None and zero2["forward"] == figure["deepspeed-zero12"]["forward"] != figure["deepspeed"]["forward"]
    assert "-zero2-hostbound" in source
    without = {k: v for k, v in cat.host_us_per_op.items() if k != "deepspeed-zero12"}
    older = dataclasses.replace(cat, host_us_per_op=without)
    zero2, source, why = gpu_host(older, "deepspeed", 2)
    assert (zero2["forward"], zero2["backward"]) == (figure["torch"]["forward"], figure["torch"]["backward"])
    assert zero2["optimizer"] == figure["deepspeed"]["optimizer"] and "stands in" in why and "-torch" in source
    assert gpu_host(cat, "fsdp", 0)[:2] == gpu_host(cat, "torch", 0)[:2] and gpu_host(cat, "torch", 0)[2] is None
    assert "no GPU host reference for fsdp: torch's" in gpu_host(cat, "fsdp", 0)[2]
    other, _, why = gpu_host(cat, "megatron", 0)
    assert other["forward"] == figure["deepspeed"]["forward"] and "no GPU host reference for megatron" in why


def test_the_residual_scales_with_the_phases_so_a_faster_target_keeps_a_positive_step():
    # the median step (90 ms) is below the sum of per-phase medians (96 ms): a -6 ms residual
    m = _measured(step_ms=90.0, unattributed_ms=-6.0)
    assert residual_ms(m, dict(m.phases_ms)) == -6.0  # same phases: the measured step exactly
    fast = {k: v / 1000 for k, v in m.phases_ms.items()}  # a target 1000x faster in every phase
    assert residual_ms(m, fast) == pytest.approx(-0.006)
    assert sum(fast.values()) + residual_ms(m, fast) == pytest.approx(0.090)


def test_confidence_labels_what_was_never_validated():
    from trainprof.projection.validation import confidence

    table = {"by_kind": {"micro_batch": {"step_mape_pct": 2.5}},
             "by_kind_gpu": {"hardware_gpu": {"step_mape_pct": 61.5}, "micro_batch": {"step_mape_pct": 6.8}}}
    assert confidence(["none"], table, host_bound=False).text == "as measured"
    assert confidence(["micro_batch"], table, host_bound=False).text == "±2.5%"
    cpu_to_gpu = confidence(["micro_batch", "hardware"], table, host_bound=False)
    assert cpu_to_gpu.label == "unvalidated" and cpu_to_gpu.expected_error_pct is None
    low = confidence(["hardware_gpu"], table, host_bound=True, source_device="cuda")
    assert low.label == "low" and low.expected_error_pct == 61.5 and "host-bound" in low.text
    # where the table has the kind's error over host-bound sources, a host-bound source cites that one
    table["by_kind_gpu"]["hardware_gpu_host_bound"] = {"step_mape_pct": 36.6}
    assert confidence(["hardware_gpu"], table, host_bound=True, source_device="cuda").expected_error_pct == 36.6
    assert confidence(["hardware_gpu"], table, host_bound=False, source_device="cuda").text == "±61.5%"
    assert confidence(["model_size"], table, host_bound=False).text == "unvalidated: model_size"
    marked = dataclasses.replace(confidence(["micro_batch"], table, host_bound=False), marks=("host-bound",))
    assert marked.text == "±2.5%; host-bound"  # a mark shows beside any label
    # each table vouches for sources of its own device type only
    assert confidence(["micro_batch"], table, host_bound=False, source_device="cuda").text == "±6.8%"
    assert confidence(["model_size"], table, host_bound=False,
                      source_device="cuda").text == "unvalidated: model_size from a GPU run"
    assert confidence(["hardware_gpu"], table, host_bound=False).label == "unvalidated"
    # another GPU's error vouches only for the GPUs its pairs ran on
    table["by_kind_gpu"]["hardware_gpu"]["between"] = ["h100-sxm", "h200"]
    assert confidence(["hardware_gpu"], table, host_bound=False, source_device="cuda",
                      gpus=("h200", "h100-sxm")).text == "±61.5%"
    a800 = confidence(["hardware_gpu"], table, host_bound=False, source_device="cuda", gpus=("h100-sxm", "a800-80g"))
    assert a800.text == "unvalidated: h100-sxm -> a800-80g never validated"
    assert "between h100-sxm and h200 only" in a800.reason
    # a mean is shown with its worst run beside it, so that it does not read as a bound
    table["by_kind"].update(spread={"step_mape_pct": 2.8, "step_max_pct": 15.5, "cases": 17},
                            one={"step_mape_pct": 8.8, "step_max_pct": 8.8, "cases": 1})
    assert confidence(["spread"], table, host_bound=False).text == "±2.8% mean, 15.5% max over 17 runs"
    assert confidence(["one"], table, host_bound=False).text == "±8.8% (1 run)"
    assert confidence(["one", "spread"], table, host_bound=False).text == "±8.8% (1 run)"  # the larger mean's kind
    table["by_kind_gpu"]["hardware_gpu_host_bound"].update(step_max_pct=77.6, cases=7)
    assert confidence(["hardware_gpu"], table, host_bound=True, source_device="cuda").text == (
        "low: host-bound source (validated: ±36.6% mean, 77.6% max over 7 runs)")
    assert confidence(["hardware_gpu"], table, host_bound=True, source_device="cuda",
                      gpus=(None, "h200")).text == "low: a GPU not in the catalog -> h200 never validated"


def test_assumptions_are_records_whose_text_renders_from_their_values():
    from trainprof.projection.assumptions import TEMPLATES, assume

    a = assume("engine_change", forward=0.75, backward=0.9)
    assert a.to_dict() == {"kind": "engine_change", "values": {"forward": 0.75, "backward": 0.9},
                           "text": TEMPLATES["engine_change"].format(forward=0.75, backward=0.9)}
    with pytest.raises(KeyError):
        assume("engine_change", forward=0.75)  # a value the template needs is missing
    with pytest.raises(KeyError):
        assume("no_such_kind")


def test_hardware_command_and_one_line_errors(capsys, tmp_path):
    from trainprof.cli import main

    assert main(["hardware", "--sources"]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "datasheet" in out and "tuning.cc" in out
    h200 = next(line for line in out.splitlines() if line.startswith("h200 "))
    assert "measured curve" in h200  # the rate its GEMMs are priced at, though it has no MAMF
    # a reader that stops early (`trainprof hardware | head -1`) gets no traceback
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "trainprof", "hardware", "--sources"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO, bufsize=0)
    proc.stdout.close()  # before it prints: its 13 kB would otherwise fit the pipe's buffer
    assert proc.wait(timeout=60) == 141 and b"Traceback" not in proc.stderr.read()
    assert main(["project", str(REPO / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{REPO / 'nope'}' does not exist" in err
    (tmp_path / "inference.json").write_text("{}")  # a `trainprof infer` run dir: told what it is
    assert main(["project", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is an inference run" in err
    (tmp_path / "profile.json").write_text('{"summary": 1')  # a run stopped while writing it
    assert main(["project", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'profile.json'}: not valid JSON (line 1 col 14)" in err
    (tmp_path / "profile.json").write_text("[1, 2]")  # valid JSON, not a profile
    assert main(["project", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{tmp_path / 'profile.json'}' is not a trainprof profile" in err
    # a world-size option no target takes is refused, not ignored (--to h100-sxm --nproc 4 showed 8 GPUs), before
    # the run dir is read
    run = REPO / "profiles" / "h100-llama7b_qlora"
    for argv, said in ((["--to", "h100-sxm", "--nproc", "4"], "--nproc and --threads size the run's own machine"),
                       (["--threads", "4", "--to", "rtx4090"], "--nproc and --threads size the run's own machine"),
                       (["--nodes", "4"], "--nodes and --gpus-per-node size catalog targets"),
                       (["--to", "hgx-h100", "--gpus-per-node", "4"],
                        "--to hgx-h100 is a node of 8 GPUs; --gpus-per-node 4 does not apply to it: name its GPU "
                        "(h100-sxm)"),
                       (["--table", "zhang2023", "--to", "rtx4090", "--nodes", "1,2"], "pass one node count")):
        assert main(["project", str(run), *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, (argv, err)


@pytest.mark.timed
def test_probe_parts_times_each_shape_in_one_call():
    """Shapes probed together (their models called in turn): sixteen times the tokens take longer in the
    layers and in the rest of the model, and a layer is timed from the difference of 0 and k layers. A
    probe given its own thread count runs with it (a change of threads is probed like one of shape), and
    the caller's count is restored."""
    from trainprof.projection.probes import probe_parts

    small = load_recipe(QUICK, ["model.dtype=fp32", "train.micro_batch_size=1", "data.seq_len=32"])
    # 16x the tokens: at 4x a call is ~1 ms of mostly fixed cost, and a busy CI worker beside it made the
    # two shapes' sums differ by less than 1.3x
    large = load_recipe(QUICK, ["model.dtype=fp32", "train.micro_batch_size=4", "data.seq_len=128"])
    before = torch.get_num_threads()
    s, t, t2 = probe_parts([small, large, large], threads=[1, 1, 2], rounds=3)
    assert torch.get_num_threads() == before
    for probe in (s, t, t2):
        assert probe.layer_forward_ms > 0 and probe.rest_forward_ms > 0 and probe.layers_probed == 2
        assert probe.layer_backward_ms > 0 and probe.rest_backward_ms > 0
    assert t.layer_forward_ms + t.rest_forward_ms > 1.3 * (s.layer_forward_ms + s.rest_forward_ms)
    # what a second thread is worth is left to scripts/bench_projection.py's threads case (interleaved
    # repeats): at this shape it was 0.6-0.95x here, too noisy to bound in a test
    assert (s.threads, t.threads, t2.threads) == (1, 1, 2)
    assert s.step_ns_per_element is None  # steps are timed only when asked (a changed model)


def test_a_layer_no_slower_than_none_is_probed_again(monkeypatch):
    """Where a slow spell makes the model without layers read as slow as the one with k (noise larger than
    the layers' time), the probe takes more rounds before it gives a layer's time; a spell that never ends
    leaves it at 0 ms after UNRESOLVED_EXTRA more sets. The clock here is the stand-in: which calls a spell
    hits cannot be chosen on a real one."""
    from trainprof.projection import probes

    small = load_recipe(QUICK, ["model.dtype=fp32", "train.micro_batch_size=1", "data.seq_len=32"])
    calls: list[bool] = []

    def clock(spell_calls: int):
        def forward_backward_ms(model, batch, stepper):
            with_layers = len(model.model.layers) > 0
            calls.append(with_layers)
            spell = not with_layers and calls.count(False) <= spell_calls
            return (10.0 if spell else 5.0) if not with_layers else 8.0, 8.0 if with_layers else 4.0, None
        return forward_backward_ms

    monkeypatch.setattr(probes, "_forward_backward_ms", clock(spell_calls=2 + 3))  # warm-up and every timed round
    probe, = probes.probe_parts([small], threads=1, rounds=3)
    # one more set: the none-layer model's median is 7.5 ms over the six rounds, k = 2 layers 8 ms
    assert len(calls) == 2 * (2 + 3 + 3) and probe.layers_probed == 2 and probe.layer_forward_ms == pytest.approx(0.25)
    calls.clear()
    monkeypatch.setattr(probes, "_forward_backward_ms", clock(spell_calls=10**6))
    probe, = probes.probe_parts([small], threads=1, rounds=3)
    assert len(calls) == 2 * (2 + 3 * (1 + probes.UNRESOLVED_EXTRA)) and probe.layer_forward_ms == 0.0
    assert probe.layer_backward_ms == pytest.approx(2.0)


def test_probe_parts_times_a_changed_models_optimizer_pass_per_element():
    """A model-size change has each shape's mixed-precision AdamW step timed over its bare models; the
    decoder layers' step, over their elements, is the cost per element (no duration compared: not timed)."""
    from trainprof.projection.probes import probe_parts

    small = load_recipe(QUICK, ["model.dtype=fp32", "train.micro_batch_size=1", "data.seq_len=32"])
    wide = load_recipe(QUICK, ["model.dtype=fp32", "train.micro_batch_size=1", "data.seq_len=32",
                               "model.hidden_size=256", "model.intermediate_size=1408"])
    s, w = probe_parts([small, wide], threads=1, rounds=3, steps=True)
    assert s.step_ns_per_element > 0 and w.step_ns_per_element > 0


@pytest.mark.timed
def test_probe_engines_times_the_bare_model_beside_each_engine():
    """With `bare`, the engine probe also calls each recipe's bare model in the same rounds: ZeRO-3's
    parameter fetch and release at every module make its forward far slower than the bare model's, while the
    plain torch engine is the bare model, though it is called right after ZeRO-3's optimizer step (which
    made it read up to 2.6x its bare model's time while each call inherited its predecessor's caches)."""
    from trainprof.projection.probes import probe_engines

    recipes = [load_recipe(QUICK, ["model.dtype=fp32", "train.micro_batch_size=1", "data.seq_len=32",
                                   f"engine.kind={kind}", f"engine.zero_stage={stage}"])
               for kind, stage in (("deepspeed", 3), ("torch", 0))]
    zero3, plain = probe_engines(recipes, threads=1, bare=True)  # the default 8 rounds: 3 let one spell decide
    for probe in (zero3, plain):
        assert set(probe) == {"engine_forward_ms", "engine_backward_ms", "engine_step_ms", "model_forward_ms",
                              "model_backward_ms"}
        assert all(v > 0 for v in probe.values())
    assert zero3["engine_forward_ms"] > 1.5 * zero3["model_forward_ms"]
    assert 0.6 < plain["engine_forward_ms"] / plain["model_forward_ms"] < 1.6
    assert set(probe_engines(recipes[1:], threads=1, rounds=1)[0]) == {"engine_forward_ms", "engine_backward_ms",
                                                                       "engine_step_ms"}


def test_a_busy_neighbour_that_dies_fails_the_probe_instead_of_leaving_it_alone():
    from trainprof.projection.probes import Neighbours

    recipe = load_recipe(QUICK, ["data.seq_len=32"])
    broken = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, num_layers=-1))
    pool = Neighbours()
    try:
        with pytest.raises(ValueError, match=r"a busy neighbour of the probe exited \(code 1\) before its model ran"):
            with pool.busy(broken, 1, threads=1):
                pass
    finally:
        pool.close()


def test_where_cuda_is_available_an_engine_probe_is_a_fresh_interpreter(monkeypatch):
    """The warm server's imports ask whether CUDA is available, which can leave a process forked from it unable to
    use CUDA: on a CUDA machine (stood in for here) each probe is spawned, and still measures."""
    from trainprof.projection.probes import probe_engines, warm_up

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # in this process only: the probe runs on the CPU
    assert warm_up().get_start_method() == "spawn"
    recipe = load_recipe(QUICK, ["train.micro_batch_size=1", "data.seq_len=32", "engine.kind=torch",
                                 "engine.zero_stage=0"])
    (probe,) = probe_engines([recipe], threads=1, rounds=1)
    assert probe["engine_forward_ms"] > 0 and probe["engine_backward_ms"] > 0


def test_probes_from_a_script_read_on_stdin_say_what_to_run_instead(monkeypatch):
    """A probe's process is forked from multiprocessing's forkserver, which imports the caller's main module in
    it: a script read from stdin cannot be, so the probe says so (the projection puts it in the step's reason)."""
    import types

    from trainprof.projection.probes import warm_up

    stdin_main = types.ModuleType("__main__")
    stdin_main.__file__ = "<stdin>"
    monkeypatch.setitem(sys.modules, "__main__", stdin_main)
    with pytest.raises(ValueError, match=r"not a file \(<stdin>\): run the projection from `trainprof project`"):
        warm_up()


def test_an_engine_probe_that_fails_says_why_in_the_parents_error():
    """The forked probe's stderr goes to a file its parent reads: the error it died of, not `no output`."""
    from trainprof.projection.probes import probe_engines

    recipe = load_recipe(QUICK, ["data.seq_len=32"])
    broken = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, num_layers=-1))
    with pytest.raises(ValueError, match=r"the engine probe failed \(trainprof\.recipe\.RecipeError: .*num_layers"):
        probe_engines([broken], threads=1, rounds=1)


def test_busy_neighbours_are_kept_across_probes_stopped_between_them_and_die_with_the_projection():
    """A Projector's neighbours start with its first probe, are stopped (SIGSTOP) between probes, so that
    nothing else a projection times shares the machine with them, run again at once for the next probe,
    and are killed at close(), or by the kernel when the process that started them exits without it (they are
    forked from its warm server, which ends with it)."""
    import subprocess

    import psutil

    from helpers.processes import descendants_alive, wait_for_status
    from trainprof.projection.probes import Neighbours

    recipe = load_recipe(QUICK, ["train.micro_batch_size=1", "data.seq_len=32"])
    pool = Neighbours()
    try:
        with pool.busy(recipe, 1, threads=1):
            (pid,) = pool.pids()
            proc = psutil.Process(pid)
            assert wait_for_status(proc, psutil.STATUS_RUNNING) == psutil.STATUS_RUNNING
        assert wait_for_status(proc, psutil.STATUS_STOPPED) == psutil.STATUS_STOPPED
        t0 = time.monotonic()
        with pool.busy(recipe, 1, threads=1):
            assert time.monotonic() - t0 < 1.0  # no second start
            assert pool.pids() == [pid]
            assert wait_for_status(proc, psutil.STATUS_RUNNING) == psutil.STATUS_RUNNING
    finally:
        pool.close()
    assert not proc.is_running() and pool.pids() == []

    # a projection killed before its close(): its stopped neighbour does not outlive it
    code = ("import os, sys; from trainprof.recipe import load_recipe; "
            "from trainprof.projection.probes import Neighbours; pool = Neighbours(); "
            f"busy = pool.busy(load_recipe({str(QUICK)!r}, ['data.seq_len=32']), 1, threads=1); "
            "busy.__enter__(); busy.__exit__(None, None, None); print(*pool.pids(), flush=True); "
            "sys.stdin.readline(); os._exit(0)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        (neighbour,) = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
        assert wait_for_status(neighbour, psutil.STATUS_STOPPED, timeout=120) == psutil.STATUS_STOPPED
        parent.communicate("exit\n", timeout=60)
        deadline = time.monotonic() + 10
        while descendants_alive([neighbour.pid]):  # killed by the kernel, not left stopped for good
            assert time.monotonic() < deadline, neighbour.status()
            time.sleep(0.05)
    finally:
        parent.kill()


def test_the_research_tables_rows_are_the_sweep_files_cells():
    """--table zhang2023 predicts the rows recipes/sweeps/*_gpu.yaml measure: the two lists stay one."""
    import yaml

    from trainprof.projection import tables

    for name, rows in (("pretrain_methods_gpu", tables.METHODS), ("pretrain_maxbatch_gpu", tables.MAXBATCH_METHODS)):
        spec = yaml.safe_load((REPO / "recipes" / "sweeps" / f"{name}.yaml").read_text())
        assert [(c["name"], c["overrides"]) for c in spec["cells"]] == [(n, o) for n, o in rows], name
        assert spec["overrides"] == tables.METHODS_BASE
    finetune = yaml.safe_load((REPO / "recipes" / "sweeps" / "finetune_gpu.yaml").read_text())
    assert finetune["overrides"] == tables.FINETUNE_BASE
    assert finetune["matrix"] == {"model.name": list(tables.MODEL_SIZES), "task.kind": ["lora", "qlora"]}


def test_fsdp2_collectives_are_derived_per_fully_shard_unit():
    """FSDP2 (engine.kind fsdp): one unit per decoder layer and one for the root; each unit's parameters
    gathered in the compute dtype before its forward and, a resharded layer's, again before its backward (the
    root stays gathered: FSDP2's rule, which the engine leaves alone); its fp32 gradients reduce-scattered
    every micro batch. On the source's machine (gloo) all of it blocks; on a catalog link what outlasts each
    phase's compute is exposed."""
    src = load_recipe(QUICK)
    c = census(src)
    layer = sum(x.numel for x in c.tensors if x.in_layer) / c.layers
    units = [layer] * c.layers + [c.total - layer * c.layers]
    link = _link()
    gather = sum(link.ms("all_gather_into_tensor", 2 * u, 2) for u in units)
    regather = sum(link.ms("all_gather_into_tensor", 2 * u, 2) for u in units[:-1])  # the layers, not the root
    scatter = sum(link.ms("reduce_scatter_tensor", 4 * u, 2) for u in units)
    m = _measured(trainable_param_bytes=2 * c.total, dtype_bytes=2, comm=[])
    here = _change(engine="fsdp", zero_stage=0, census=c, source_census=c, grad_accum=2)
    phases, notes = predict_phases(m, here, Inputs(link=link))
    assert phases["comm_exposed"] == pytest.approx(2 * (gather + regather + scatter))
    assert _values(notes, "comm_fsdp_derived")["units"] == c.layers + 1
    kept = _change(engine="fsdp", zero_stage=0, census=c, source_census=c, reshard_after_forward=False)
    phases, _ = predict_phases(m, kept, Inputs(link=link))
    assert phases["comm_exposed"] == pytest.approx(gather + scatter)
    there = _change(engine="fsdp", zero_stage=0, census=c, source_census=c, cross_machine=True)
    phases, _ = predict_phases(m, there, Inputs(link=link))
    # forward 20 ms and backward 40 ms of compute hide what they can
    assert phases["comm_exposed"] == pytest.approx(max(gather - 20.0, 0) + max(regather + scatter - 40.0, 0))


def test_a_probe_is_kept_in_the_run_dir_per_machine(tmp_path, monkeypatch):
    """A probe's result is kept beside the run (probes.json) with when it was timed, and served to later
    projections of that run on the same machine; another machine, another key or a damaged file probes
    again."""
    from types import SimpleNamespace

    from trainprof.projection import source as src_mod

    run = SimpleNamespace(run_dir=tmp_path)
    made = []

    def make(value):
        return lambda: made.append(value) or {"ms": value}

    assert src_mod.kept_probe(run, "('parts', 1)", make(1.0)) == ({"ms": 1.0}, None)
    result, when = src_mod.kept_probe(run, "('parts', 1)", make(2.0))  # kept: not probed again
    assert result == {"ms": 1.0} and when[:4].isdigit()
    assert src_mod.kept_probe(run, "('parts', 2)", make(3.0)) == ({"ms": 3.0}, None)
    assert made == [1.0, 3.0] and (tmp_path / src_mod.PROBES_FILE).is_file()
    monkeypatch.setattr(src_mod, "machine_fingerprint", lambda: "another host")
    assert src_mod.kept_probe(run, "('parts', 1)", make(4.0)) == ({"ms": 4.0}, None)
    (tmp_path / src_mod.PROBES_FILE).write_text("{not json")
    assert src_mod.kept_probe(run, "('parts', 1)", make(5.0)) == ({"ms": 5.0}, None)
    assert src_mod.kept_probe(run, "('parts', 1)", make(6.0))[0] == {"ms": 5.0}


def test_a_cpu_prediction_with_larger_logits_says_the_heap_keeps_more_than_the_plan_sees():
    from trainprof.projection.projector import heap_kept

    src = load_recipe(QUICK, [])  # vocab 1,024, micro batch 4, seq 256: 4 MiB of fp32 logits
    big = load_recipe(QUICK, ["model.vocab_size=16384"])
    note = heap_kept("cpu", src, big)
    assert note is not None and (note.values["source_logits_mib"], note.values["target_logits_mib"]) == (4, 64)
    assert "train.cpu_allocator: cache" in note.text
    # not where the logits do not grow, on a GPU (its allocator's reserve is not what the meter reads), or
    # under the system allocator (which returns the freed blocks)
    assert heap_kept("cpu", src, load_recipe(QUICK, ["model.num_layers=4"])) is None
    assert heap_kept("cuda", src, big) is None
    assert heap_kept("cpu", src, load_recipe(QUICK, ["model.vocab_size=16384", "train.cpu_allocator=system"])) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/status")
def test_a_spawned_process_reads_its_own_peak_not_the_one_of_the_process_that_spawned_it():
    """The engine memory probe's figure, a run's peak and the CPU memory cap: Linux carries ru_maxrss over
    exec, so a probe or a single-rank run spawned by a large process (a pytest worker, a notebook) would
    report its parent's peak; VmHWM is its own. Once the process outgrows its parent, both agree."""
    import subprocess

    held = bytearray(1024 * 2**20)
    held[::4096] = b"\x01" * len(held[::4096])  # touched: resident
    code = ("import resource, torch; from trainprof.env import peak_memory_bytes, vm_hwm_bytes\n"
            "cpu = torch.device('cpu')\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, vm_hwm_bytes(), peak_memory_bytes(cpu))\n"
            "grown = bytearray(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 + 2**26)\n"
            "grown[::4096] = b'\\x01' * len(grown[::4096])\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, peak_memory_bytes(cpu))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    first, grown = out.stdout.splitlines()
    maxrss, hwm, peak = map(int, first.split())
    assert maxrss >= 1024 * 2**20 > 2 * hwm and peak == hwm, (maxrss, hwm, peak)
    floor = maxrss  # the spawning process's peak (this test's process, whatever else it holds)
    maxrss, peak = map(int, grown.split())
    assert peak == maxrss > floor + 2**26, (maxrss, peak, floor)
    del held


@pytest.mark.parametrize("amp,kv_heads", [(False, 5), (True, 5), (True, 1)], ids=["bf16", "amp", "amp-gqa"])
def test_counted_elementwise_bytes_match_the_models_own_operators(amp, kv_heads):
    """gemm.ELEMENTWISE_BYTES and REST_BYTES, fitted by scripts/count_traffic.py on a grid of shapes,
    predict the bytes the HF model's non-GEMM operators move at a shape off that grid (a TorchDispatchMode
    over the real forward and backward), GQA's narrower keys and values included; a change of HF's Llama
    code that moves more shows here."""
    sys.path.insert(0, str(REPO / "scripts"))
    from count_traffic import count

    dims = ["model.hidden_size=320", "model.intermediate_size=896", "model.num_heads=5",
            f"model.num_kv_heads={kv_heads}", "model.vocab_size=1536", "train.micro_batch_size=3", "data.seq_len=96"]
    engine = ["engine.kind=torch", "engine.zero_stage=0"] if amp else []
    work = Work.of(load_recipe(QUICKSTART, dims + engine))
    for layers in (1, 2):
        counted = count(dims, amp=amp, micro_batch=3, seq_len=96, layers=layers)
        w = dataclasses.replace(work, shape=dataclasses.replace(work.shape, num_layers=layers))
        for phase, got in zip(("forward", "backward"), counted):
            assert w.device_bytes(phase) == pytest.approx(got, rel=0.03), (layers, phase)


def test_elementwise_share_is_the_gpus_own_where_its_runs_measured_it():
    """The non-GEMM operators' share of the datasheet bandwidth: an accelerator's own where the GPU runs
    measured it (the H100 reached more of its bandwidth than the H200), the share over all runs elsewhere,
    and the source says which."""
    import json

    from trainprof.projection.validation import GPU_VALIDATION_FILE, elementwise_share

    block = json.loads(GPU_VALIDATION_FILE.read_text())["elementwise"]
    h100, h200, other = elementwise_share("h100-sxm"), elementwise_share("h200"), elementwise_share("rtx4090")
    assert h100[0] == block["by_accelerator"]["h100-sxm"]["share"] and "h100-sxm's datasheet" in h100[1]
    assert h200[0] == block["by_accelerator"]["h200"]["share"] and h100[0] > h200[0]
    assert other[0] == block["share_of_datasheet_bandwidth"] and "not on this GPU" in other[1]


def test_deepspeeds_optimizer_on_a_gpu_is_its_kernels_plus_its_host_calls():
    """A CPU run projected to DeepSpeed ZeRO-2 on an H100: the optimizer is the kernels (parameters x the
    catalog's bytes per parameter over the bandwidth) plus the catalog's calls per trainable tensor x the
    target's tensors x µs per call, added (DeepSpeed's step waits for its kernels). Plain PyTorch's
    asynchronous step takes the longer of the two, which is its kernels: every reference run's optimizer was
    device-bound, so the catalog has no host figure for it."""
    from trainprof.projection.project import project

    cat = load_catalog()
    host = cat.optimizer_host["deepspeed-zero12"]
    size = ["model.name=llama2-1b", "train.micro_batch_size=8", "data.seq_len=350"]
    source = REPO / "profiles" / "cpu-x86_64-quickstart_cpu"
    (pred,) = project(source, overrides=[*size, "engine.zero_stage=2"], targets=["h100-sxm"], gpus_per_node=1,
                      probe=False)["predictions"]
    def kernels_ms(notes: dict) -> float:
        kernels = notes["optimizer_gpu_bytes"]
        return kernels["target_elements"] * kernels["bytes_per_param"] / (kernels["memory_gbps"] * 1e9) * 1e3

    notes = {a["kind"]: a["values"] for a in pred["assumptions"]}
    calls = host["calls_per_tensor"]["value"] * 201  # llama2-1b's trainable tensors: 22 layers x 9 + 3
    assert notes["optimizer_host_added"]["calls"] == pytest.approx(calls)
    host_ms = calls * host["us_per_call"]["value"] / 1e3
    assert pred["phases_ms"]["optimizer"] == pytest.approx(kernels_ms(notes) + host_ms)
    assert "world size" not in notes["optimizer_host_added"]["source"]
    # the catalog's counts are one GPU's: at 8 the row says so (DeepSpeed's calls per rank move with the world)
    (eight,) = project(source, overrides=[*size, "engine.zero_stage=2"], targets=["h100-sxm"], gpus_per_node=8,
                       probe=False)["predictions"]
    added = next(a["values"] for a in eight["assumptions"] if a["kind"] == "optimizer_host_added")
    assert "counted at 1 rank and used at 8" in added["source"] and "measured on CPU only" in added["source"]
    (torch_pred,) = project(REPO / "profiles" / "cpu-x86_64-quickstart_cpu-torch", overrides=size,
                            targets=["h100-sxm"], gpus_per_node=1, probe=False)["predictions"]
    notes = {a["kind"]: a["values"] for a in torch_pred["assumptions"]}
    assert "optimizer_host_added" not in notes and "optimizer" not in cat.host_us_per_op["torch"]
    assert torch_pred["phases_ms"]["optimizer"] == pytest.approx(kernels_ms(notes))


# ---------------------------------------------------------------------------------------------
# The research's tables as text
# ---------------------------------------------------------------------------------------------

def test_research_tables_give_each_reason_once_as_a_footnote(tmp_path):
    """A cell that cannot be predicted is `n/a [k]`, its reason written once under the tables (the same
    number in every table, terminal and files alike); Table IV keeps the micro batch it found."""
    from trainprof.projection.report import render_tables, write_tables_doc
    from trainprof.projection.tables import MAX_MICRO_BATCH

    offload = "engine.offload on a GPU moves the optimizer step to the host CPU"
    cell = {"tokens_per_s": 4287.0, "memory_gib": 103.6, "fits": False, "confidence": "unvalidated", "reason": None}
    refused = {"tokens_per_s": None, "memory_gib": 18.0, "fits": True, "confidence": None, "reason": offload}
    result = {
        "targets": ["a800-80g", "rtx4090"], "world_size": {"a800-80g": 8, "rtx4090": 8},
        "defaults": ["data.seq_len=350"], "source": {"run_dir": "runs/x"},
        "table_iii": [{"model": "llama2-7b", "method": "naive DP", "a800-80g": cell,
                       "rtx4090": {**cell, "confidence": "unvalidated: CPU run -> GPU; predicted comm-bound (62% of the step)",
                                   "bound_by": "comm"}},
                      {"model": "llama2-7b", "method": "ZeRO-3 + offload", "a800-80g": refused, "rtx4090": refused}],
        "table_iv": [{"model": "llama2-7b", "method": "ZeRO-3 + offload",
                      "a800-80g": {**refused, "micro_batch": 16, "capped": False},
                      "rtx4090": {"micro_batch": None, "tokens_per_s": None, "reason": "micro batch 1 does not fit"}},
                     {"model": "llama2-7b", "method": "ZeRO-3 + recompute",
                      "a800-80g": {"micro_batch": MAX_MICRO_BATCH, "tokens_per_s": 33264.0, "capped": True},
                      "rtx4090": {"micro_batch": 16, "tokens_per_s": 17540.0, "capped": False,
                                  "confidence": "unvalidated: CPU run -> GPU; predicted host-bound", "bound_by": "host"}}],
        "table_ix": [],
    }
    text = render_tables(result)
    # each figure carries its confidence as a mark, numbered with the reasons in the order cells give them
    assert "4,287, 103.6 GiB, does not fit [1]" in text and "[1] confidence: unvalidated\n" in text
    assert "[2] confidence: unvalidated: CPU run -> GPU\n" in text
    assert text.count(offload) == 1 and f"[3] {offload}" in text and "[4] micro batch 1 does not fit" in text
    assert "mb 16, tokens/s n/a [3]" in text and "n/a [4]" in text
    assert f"mb {MAX_MICRO_BATCH} (the search cap): 33,264 [5]" in text and "mb 16: 17,540, host-bound [2]" in text
    assert text.count(", host-bound") == 1  # the cell whose prediction is, and no other
    assert text.count(", comm-bound") == 1 and "4,287, 103.6 GiB, does not fit, comm-bound [2]" in text
    write_tables_doc(result, tmp_path, command="trainprof project runs/x --table zhang2023")
    md = (tmp_path / "tables.md").read_text()
    assert md.count(offload) == 1 and "| n/a [3] | n/a [3] |" in md and "mb 16, tokens/s n/a [3]" in md
    # each confidence once, as a footnote; what bounds a cell is said in the cell, and once below
    assert md.count("confidence: unvalidated: CPU run -> GPU") == 1, md
    assert "comm-bound: exposed communication is more than half" in md
    # host-bound cells of targets that assume different hosts: each footnote names its host, and a note says the
    # order of such cells follows the host, not the GPU
    own = {"basis": "ceiling", "us_per_call": 33.1, "reference_hosts_us": [48.5, 27.7],
           "by_phase": {"forward": {"basis": "ceiling", "us_per_call": 33.1}}}
    ref = {"basis": "reference", "us_per_call": 38.1, "reference_hosts_us": [48.5, 27.7],
           "by_phase": {"forward": {"basis": "reference", "us_per_call": 38.1}}}
    bound = {**cell, "fits": True, "confidence": "unvalidated; predicted host-bound", "bound_by": "host"}
    hosts = {**result, "table_iii": [{"model": "llama2-7b", "method": "ZeRO-3", "a800-80g": {**bound, "host_pace": own},
                                      "rtx4090": {**bound, "host_pace": ref}}], "table_iv": []}
    text = render_tables(hosts)
    assert "confidence: unvalidated; host: this run's, at most 33.1 µs/call" in text
    assert "confidence: unvalidated; host: reference 38.1 µs/call (2 hosts, 27.7-48.5)" in text
    assert "so their order follows the host assumed, not the GPU" in text


def test_a_cpu_targets_rows_count_ranks_not_gpus():
    """The table's world-size columns say what they count: a CPU source projected on its own machine has
    ranks, a catalog target GPUs, a table of both says both."""
    from trainprof.projection.report import columns

    def headers(*hardware: str, device_type: str = "cpu") -> list[str]:
        preds = [{"hardware": h, "ordered_by": "tokens_per_s"} for h in hardware]
        return [c.header for c in columns({"predictions": preds, "source": {"device_type": device_type}})]

    cpu = set(headers("this (x86_64)"))
    assert {"ranks (nodes x per node)", "tokens/s (all ranks)", "vs ranks", "memory/rank GiB"} <= cpu
    assert {"GPUs (nodes x per node)", "memory/GPU GiB"} <= set(headers("h100-sxm"))
    assert "GPUs (nodes x per node)" in headers("this (NVIDIA H100 80GB HBM3)", device_type="cuda")
    assert "GPUs / ranks (nodes x per node)" in headers("this (x86_64)", "h100-sxm")


def test_best_prints_each_runner_up_on_its_own_line_as_overrides():
    """`--best` in the terminal: the winner, then one runner-up a line, each a setting that pastes as
    recipe overrides, with its tokens/s; no price, no cheapest setting (never invented)."""
    from trainprof.projection.report import render_best

    def setting(zero: int, mb: int, tps: float) -> dict:
        return {"setting": f"engine.kind=deepspeed engine.zero_stage={zero}", "micro_batch": mb, "tokens_per_s": tps,
                "memory_per_rank_bytes": 2**30, "time_to_train_s": None, "cost_to_train_usd": None,
                "confidence_text": "unvalidated: CPU run -> GPU"}

    result = {"source": {"run_dir": "runs/x"}, "best": [{
        "hardware": "a800-80g", "world_size": 8, "best_throughput": setting(3, 32, 41125.0), "best_cost": None,
        "runners_up_throughput": [setting(3, 16, 39590.0), setting(2, 8, 30000.0)], "tried": 11}]}
    lines = render_best(result).splitlines()
    assert "engine.zero_stage=3 train.micro_batch_size=32  (41,125 tokens/s, unvalidated" in lines[2]
    assert "no price" in lines[3]
    assert lines[4].split() == ["runners-up", "engine.kind=deepspeed", "engine.zero_stage=3",
                                "train.micro_batch_size=16", "(39,590", "tokens/s)"]
    assert lines[5].split() == ["engine.kind=deepspeed", "engine.zero_stage=2", "train.micro_batch_size=8",
                                "(30,000", "tokens/s)"]
    # with a price, the cheapest setting's line carries its own confidence too
    cheap = {**setting(2, 8, 30000.0), "cost_per_million_tokens_usd": 0.055}
    priced = render_best({**result, "best": [{**result["best"][0], "best_cost": cheap}]}).splitlines()
    assert priced[3].endswith("$0.055 / M tokens (unvalidated: CPU run -> GPU)"), priced[3]


def test_best_searches_deepspeed_from_any_engine_and_says_why_nothing_ranks():
    """From a DDP or FSDP source the search tries DeepSpeed's ZeRO stages (and the source's own engine),
    each with the engine kind that makes it a valid recipe; a target where only unpredictable settings
    fit, or nothing fits, says which and by how much instead of an empty row."""
    from trainprof.projection import best
    from trainprof.projection.report import best_rows, render_best

    torch_recipe = load_recipe(QUICKSTART, ["engine.kind=torch", "engine.zero_stage=0"])
    found = [c.overrides for c in best.settings(torch_recipe, same_machine=False)]
    assert ("model.recompute=false",) in found and len(found) == 2 * 7
    assert all("engine.kind=deepspeed" in o for o in found if any(k.startswith("engine.zero_stage") for k in o))
    ds = [c.overrides for c in best.settings(load_recipe(QUICKSTART), same_machine=False)]
    assert len(ds) == 2 * 6 and all(o[0] == "engine.kind=deepspeed" for o in ds)
    # an fp32 run is also searched in bf16, unless the user chose its dtype
    fp32 = load_recipe(QUICKSTART, ["model.dtype=fp32"])
    both = [c.overrides for c in best.settings(fp32, same_machine=False)]
    assert len(both) == 2 * len(ds) and sum("model.dtype=bf16" in o for o in both) == len(ds)
    assert len(best.settings(fp32, same_machine=False, dtype_given=True)) == len(ds)
    assert len(best.settings(fp32, same_machine=True)) == 2

    offload_only = "engine.offload on a GPU ..."

    def predict(overrides: list[str]) -> dict:
        mb = int(overrides[-1].split("=")[1])
        offload = "engine.offload=optimizer" in overrides
        return {"memory_per_rank_bytes": (10e9 if offload else 90e9) * mb, "tokens_per_s": None if offload else 1.0,
                "step_ms": None, "reasons": {"step_ms": offload_only} if offload else {},
                "host_memory_per_rank_bytes": 194.36 * 2**30 if offload else 0}

    cands = [best.Setting(overrides=("engine.zero_stage=3", "engine.offload=none")),
             best.Setting(overrides=("engine.zero_stage=3", "engine.offload=optimizer"))]
    out = best.search(predict, 80e9, [], cands)
    assert out["best_throughput"] is None and out["tried"] == 0 and out["least_memory_bytes"] == 10e9
    assert out["not_predicted"] == [{"setting": "engine.zero_stage=3 engine.offload=optimizer", "micro_batch": 1,
                                     "memory_per_rank_bytes": 10e9, "host_memory_per_rank_bytes": 194.36 * 2**30,
                                     "reason": offload_only}]
    result = {"source": {"run_dir": "runs/x"}, "best": [{"hardware": "h100-sxm", "world_size": 8, "gpus_per_node": 8,
                                                          "unit": "GPU", "capacity_bytes": 80e9, **out}]}
    line = render_best(result).splitlines()[2]
    # offload fits GPU memory by moving it to the host: how much, a GPU and a node, beside the setting
    assert "only settings whose step is not predicted fit, e.g. engine.zero_stage=3 engine.offload=optimizer " \
           "train.micro_batch_size=1 (9.31 GiB; host memory 194.36 GiB a GPU, 1,554.88 GiB a node of 8, plan" \
           in line, line
    # the reason it points to is on the terminal too, not only in best.md
    assert ("h100-sxm x 8: fits but not predicted: engine.zero_stage=3 engine.offload=optimizer train.micro_batch_size=1"
            f": {offload_only}") in render_best(result) and "why: below" in line
    # nothing fits at the smallest micro batch: said from the plan alone, before any step is predicted (one on the
    # source's machine probes for minutes), a CPU's per rank, a small cap with its digits
    def never(overrides: list[str]) -> dict:
        raise AssertionError("a step was predicted for a search that cannot succeed")

    cpu = best.search(never, 0.001 * 2**30, [], cands, planned=lambda o: 0.52 * 2**30)
    assert cpu["tried"] == 0 and cpu["checked_before_predicting"] and cpu["least_memory_bytes"] == 0.52 * 2**30
    (row,) = best_rows({"best": [{"hardware": "this", "world_size": 2, "unit": "rank",
                                  "capacity_bytes": 0.001 * 2**30, **cpu}]})
    assert row["throughput_setting"] == "n/a: nothing fits: the smallest setting plans 0.52 GiB a rank, over 90% of " \
                                        "0.001 GiB"
    # runners-up are other settings at their best micro batch, not the winner again at a smaller one
    fast = {"engine.zero_stage=2": 3.0, "engine.zero_stage=3": 2.0, "engine.zero_stage=1": 1.0}
    ranked = best.search(lambda o: {"memory_per_rank_bytes": 1e9 * int(o[-1].split("=")[1]), "step_ms": 1.0,
                                    "tokens_per_s": fast[o[0]] * int(o[-1].split("=")[1])},
                         8e9, [], [best.Setting(overrides=(k,)) for k in fast])
    assert (ranked["best_throughput"]["setting"], ranked["best_throughput"]["micro_batch"]) == ("engine.zero_stage=2", 4)
    assert [(r["setting"], r["micro_batch"]) for r in ranked["runners_up_throughput"]] == [
        ("engine.zero_stage=3", 4), ("engine.zero_stage=1", 4)]
    nothing = best.search(predict, 80e9, [], cands[:1])
    (row,) = best_rows({"best": [{"hardware": "h100-sxm", "world_size": 8, "capacity_bytes": 80e9, **nothing}]})
    assert row["throughput_setting"] == "n/a: nothing fits: the smallest setting plans 83.82 GiB a GPU, over 90% " \
                                        "of 74.51 GiB" and row["cost_setting"] == "n/a"


def test_a_target_nothing_fits_says_so_in_the_notes():
    """A row that does not fit either names the changes that would make it fit (plan) or, where not even
    ZeRO-3 with recomputation and full offload at micro batch 1 does, says that."""
    from trainprof.projection.report import notes

    src = {"run_dir": "runs/x", "device": "x86_64", "world_size": 2, "timer": "host", "step_ms": 60.0}
    preds = [{"hardware": "rtx4090", "world_size": 1, "fits": False, "memory_per_rank_bytes": 30 * 2**30,
              "fit_suggestion": ["engine.zero_stage=3", "model.recompute=true"]},
             {"hardware": "rtx3090", "world_size": 1, "fits": False, "memory_per_rank_bytes": 300 * 2**30},
             {"hardware": "h100-sxm", "world_size": 8, "fits": True, "memory_per_rank_bytes": 30 * 2**30}]
    preds[1]["fit_advice"] = {"tried": [{"overrides": ["engine.zero_stage=3"], "bytes": 40 * 2**30}], "refused": {},
                              "least": {"overrides": ["engine.zero_stage=3"], "bytes": 40 * 2**30},
                              "capacity_bytes": 24 * 2**30, "more_gpus": {"gpus": 4, "bytes": 20 * 2**30}}
    # a QLoRA base is replicated: more GPUs do not help, and the rules refuse ZeRO-3 for it
    qlora = {"tried": [{"overrides": ["engine.offload=optimizer"], "bytes": 36.36 * 2**30}],
             "refused": {"engine.zero_stage=3": "qlora with ZeRO stage 3 is not supported"},
             "least": {"overrides": ["engine.offload=optimizer"], "bytes": 36.36 * 2**30}, "capacity_bytes": 24 * 2**30,
             "more_gpus": {"gpus": None, "bytes": 36.36 * 2**30, "tried_up_to": 4096}}
    preds.append({"hardware": "a30", "world_size": 2, "fits": False, "memory_per_rank_bytes": 36.79 * 2**30,
                  "fit_advice": qlora})
    lines = [n for n in notes({"source": src, "predictions": preds}) if "does not fit" in n]
    assert lines == ["rtx4090 x 1: does not fit; would fit with engine.zero_stage=3 model.recompute=true (plan)",
                     "rtx3090 x 1: does not fit (300.00 GiB a GPU, plan), nor with engine.zero_stage=3 (40.00): more GPUs "
                     "(20.00 GiB a GPU at 4 with engine.zero_stage=3) or a smaller model",
                     "a30 x 2: does not fit (36.79 GiB a GPU, plan), nor with engine.offload=optimizer (36.36) (the recipe "
                     "rules refuse the other settings tried: qlora with ZeRO stage 3 is not supported); more GPUs do not "
                     "bring it under 24.00 GiB (36.36 GiB a GPU at 4,096 with engine.offload=optimizer: what is not "
                     "partitioned stays on every GPU): a GPU with more memory or a smaller model"]


def test_time_and_cost_to_train_read_at_their_size():
    # a column takes one unit, from its values: "3.4 days" beside "40.2 h" read as the same size
    from trainprof.projection.report import _fmt_usd, duration_unit, fmt_in

    column = [3.4 * 86400, 40.2 * 3600, 3067.7 * 86400, None]
    name, per = duration_unit(column)
    assert name == "days" and [fmt_in(per)(s) for s in column] == ["3.4", "1.7", "3,068", "n/a"]
    assert duration_unit([9.4 * 3600, 30 * 3600])[0] == "h" and duration_unit([3 * 365.25 * 86400])[0] == "years"
    assert [_fmt_usd(x) for x in (None, 0.034, 35.2, 3_536_000)] == ["n/a", "$0.03", "$35.20", "$3,536,000"]


def test_a_world_size_change_here_computes_at_the_threads_a_launched_run_gets(monkeypatch):
    """A 1-rank source ran at torch's default threads (2 on a 2-core machine); its 2-rank target, launched by
    torchrun, runs each rank at 1 unless OMP_NUM_THREADS says otherwise: the prediction probes that."""
    from trainprof.env import threads_when_launched

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_when_launched(2, one_process=2)[0] == 1 and "torchrun" in threads_when_launched(2, 2)[1]
    assert threads_when_launched(1, one_process=2) == (2, "one process without torchrun: torch's default")
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads_when_launched(2, one_process=2) == (3, "OMP_NUM_THREADS=3")
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert threads_when_launched(4, one_process=2)[0] == 1


def test_a_scaling_efficiency_above_100_percent_names_the_phases_that_shrank_per_rank():
    """Past 100% a rank must spend less time somewhere than at the baseline: each such phase, with what
    shortens it, and the row's own confidence marks (a CPU 2-rank projection read 152% from a probe that timed
    1 thread faster than 2 on a busy machine, under a note that blamed ZeRO's optimizer share)."""
    from trainprof.projection.project import above_linear

    base = {"phases_ms": {"forward": 322.7, "backward": 600.0, "optimizer": 12.0}, "confidence_marks": []}
    row = {"phases_ms": {"forward": 77.8, "backward": 600.0, "optimizer": 6.0, "comm_exposed": 40.0},
           "confidence_marks": ["probed on a busy machine (±12%)"]}
    assert above_linear(row, base) == (
        "forward 322.7 -> 77.8 ms (a rank's compute predicted faster: the probe timed it so at the threads a rank "
        "gets); optimizer 12.0 -> 6.0 ms (each rank steps its ZeRO share of the states); "
        "probed on a busy machine (±12%)")
    # a mark the baseline carries too is not this row's; a row with no phase shorter says so
    same = {**base, "confidence_marks": ["probed on a busy machine (±12%)"]}
    assert above_linear(same, {**base, "confidence_marks": same["confidence_marks"]}) == "no phase shorter per rank"


def test_the_plan_says_what_n_counts_in_its_flops():
    """Llama2-7B's 6N + 12LHQT: N is every matmul's parameters, the untied LM head included (6.607e9, 4.019e10
    FLOPs a token at seq 350), not the non-embedding count without the head (6.476e9)."""
    from trainprof.plan import estimate_plan

    flops = estimate_plan(load_recipe(QUICKSTART, ["model.name=llama2-7b"]), 1)["flops"]
    n = flops["non_embedding_params"]["value"]
    assert round(n / 1e9, 3) == 6.607 and "untied LM head counts" in flops["per_token_6n"]["source"]
    assert "non-embedding" not in flops["per_token_6n"]["source"]


def test_a_node_larger_than_the_catalogs_and_a_gpu_without_links_are_said():
    """--gpus-per-node 16 on h100-sxm (its node template holds 8): one warning line; a catalog GPU with no link
    between its GPUs: the key to add, not 'no collective calibration for 8 ranks'."""
    from trainprof.projection.machines import missing_link
    from trainprof.projection.project import node_size_warnings

    catalog = load_catalog()
    (warned,) = node_size_warnings(catalog, ["h100-sxm", "hgx-h100"], 16)
    assert warned.startswith("warning: --gpus-per-node 16 on h100-sxm") and "hgx-h100: 8" in warned
    assert node_size_warnings(catalog, ["h100-sxm"], 8) == []
    mine = dataclasses.replace(catalog.resolve("h100-sxm"), key="mygpu", intra_node_link=None)
    why = missing_link(catalog, mine, 8, 8)
    assert "mygpu has no link between its GPUs" in why and "add intra_node_link: KEY under" in why and "pcie4" in why
    assert missing_link(catalog, mine, 1, 8) is None and missing_link(catalog, catalog.resolve("h100-sxm"), 16, 8) is None


def test_a_cpu_runs_gpu_rows_say_what_carries_over_and_what_they_assume(tmp_path):
    """The kept CPU quickstart to 8 and 16 RTX 4090s at Llama2-7B: the header and projection.md do not present
    the CPU step as what the GPU rows scale (a 2,911.6 ms and a 68.2 ms run of one recipe read 566.7 and 568.5 ms
    on 8 H100s); the links each row assumes are said, the inter-node one as the catalog's default for a GPU named
    alone beside its node template's RoCE; the time to train takes one unit for its column; a scaling efficiency
    that has no baseline says why in its cell and under the table."""
    import shutil

    from trainprof.projection.project import project
    from trainprof.projection.report import render_short, write_projection

    run = tmp_path / "run"
    shutil.copytree(REPO / "profiles" / "cpu-x86_64-quickstart_cpu", run)
    result = project(run, targets=["rtx4090"], nodes=[1, 2], overrides=["model.name=llama2-7b"], tokens=2e12,
                     probe=False)
    eight, sixteen = result["predictions"]
    text = render_short(result)
    head, header = text.splitlines()[:2]
    assert "on its CPU; the GPU rows are derived, not scaled from it" in head, head
    assert "time to train 2e+12 tokens (years)" in header and "host assumed" in header
    assert "not scaled from the measured CPU step" in text and "as measured" in text
    assert eight["scaling_efficiency"] is None and "n/a (fewer do not fit)" in text
    assert "rtx4090 x 8: scaling eff. n/a: the same settings do not fit one GPU" in text
    links = next(line for line in text.splitlines() if "links assumed" in line)
    assert "InfiniBand NDR 400 Gb/s (one NIC per GPU), 50 GB/s (the catalog's default_inter_node_link" in links
    assert "rtx4090-8x uses RoCE v2, 200 GbE per GPU" in links and "PCIe 4.0 x16, 32 GB/s" in links
    assert sixteen["links"]["inter_node_is_default"] and sixteen["links"]["inter_node"]["key"] == "ib-ndr"
    if "predicted comm-bound" in sixteen["confidence_text"]:
        assert "its links at datasheet bandwidth: an upper bound" in sixteen["confidence_text"]
    write_projection(result, tmp_path / "out", title="t", command="c")
    md = (tmp_path / "out" / "projection.md").read_text()
    assert "Predicted from one measured CPU run: the GPU rows take its recipe" in md
    assert "Predicted from one measured run;" not in md


def test_a_cpu_best_search_counts_ranks_in_its_headers():
    from trainprof.projection.report import best_columns

    def headers(unit: str) -> list[str]:
        return [c.header for c in best_columns({"best": [{"unit": unit}], "tokens": None})]

    assert "ranks" in headers("rank") and "memory/rank GiB" in headers("rank") and "GPUs" not in headers("rank")
    assert "GPUs" in headers("GPU") and "memory/GPU GiB" in headers("GPU")


def test_the_probes_noise_is_said_before_the_validated_error():
    """A row probed on a busy machine led with '±2.7% mean' and said '(±27%)' after it, where a buyer had stopped
    reading (a real run was 60% off): what outweighs the validated error comes first in the cell."""
    from trainprof.projection.validation import Confidence

    conf = Confidence(label="validated", expected_error_pct=2.7, max_error_pct=6.0, cases=11, why="", reason="",
                      marks=("predicted host-bound",), leading=("probed on a busy machine (±27%)",))
    assert conf.text == "probed on a busy machine (±27%); ±2.7% mean, 6.0% max over 11 runs; predicted host-bound"
