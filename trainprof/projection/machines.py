"""The machines and links a prediction prices work on: a source's measured calibration, a catalog
target's figures (like divided by like when the source is a catalogued GPU), the gloo fit measured
here, a catalog link with NCCL's latency model, and a GPU host's time per operator call."""

from __future__ import annotations

import dataclasses
from typing import Any

from trainprof.hardware import Catalog, Target, bf16_gemm_basis, matmul_ratio_key
from trainprof.hardware import Link as HardwareLink
from trainprof.projection.assumptions import Assumption, assume
from trainprof.projection.comm import Link, NcclLatency
from trainprof.projection.compute import Machine
from trainprof.projection.gemm import GemmRate, curve_from_calibration

GEMM_PHASES = ("forward", "backward", "recompute")


def machine_from_calibration(cal: dict[str, Any], label: str, accelerator: str | None = None) -> Machine:
    """The rates a calibration.json measured: per phase, the GEMM curve of that phase's layouts
    (calibration version 2; version 1 timed one layout) and the copy bandwidth. `accelerator`: the
    catalog key of the GPU it was measured on, whose own elementwise share then applies."""
    mm, bw = cal["matmul"], float(cal["memory"]["gbps"])
    by_phase = mm.get("by_phase_tflops") or {}
    gemm = {ph: GemmRate(best_tflops=float(by_phase.get(ph) or mm["best_tflops"]), memory_gbps=bw,
                         curve=curve_from_calibration(cal, ph), source=f"{label}: measured GEMM curve")
            for ph in GEMM_PHASES}
    rates = (f"forward {by_phase['forward']:.3g}, backward {by_phase['backward']:.3g} TFLOP/s at best (a Linear's GEMM "
             f"layouts)" if by_phase else f"best {mm['best_tflops']:.3g} TFLOP/s")
    threads = "" if cal.get("device_type") == "cuda" else f", {cal.get('threads')} threads"
    return Machine(name=label, is_gpu=cal.get("device_type") == "cuda", gemm=gemm, memory_gbps=bw,
                   accelerator=accelerator, matmul_source=f"{label}: measured GEMMs over sizes, {rates}{threads}",
                   memory_source=f"{label}: measured copy {bw:.3g} GB/s")


def machine_from_target(target: Target, dtype: str, *, source: Target | None = None, measured: Machine | None = None,
                        accelerator: str | None = None) -> tuple[Machine, list[Assumption]]:
    """The target's rates. With `source` (the catalogued accelerator the run was measured on) and its
    `measured` calibration, like is divided by like: the measured curve x target figure / source figure
    (MAMF over MAMF when both have one, else dense peak over dense peak; datasheet bandwidth over
    bandwidth), so the efficiency measured at the source carries over and a measured rate is never
    compared with a datasheet one. Otherwise the target's own figures: its measured GEMM curve where
    the catalog has one, else its MAMF (or dense peak) under the roofline of each GEMM's bytes.
    `accelerator`: the catalog key of its GPU (a node template's: hgx-h100 -> h100-sxm), whose own measured
    figures (the elementwise share) then apply as they do to that GPU named alone."""
    bf16 = dtype in ("bf16", "fp16")
    peak_key = "peak_bf16_dense_tflops" if bf16 else "peak_fp32_tflops"
    bw = target.figure("memory_gbps")
    if source is not None and measured is not None and measured.matmul_tflops and measured.memory_gbps:
        key = matmul_ratio_key(source, target, bf16)
        if not (target.figure(key) and source.figure(key) and bw and source.figure("memory_gbps")):
            return Machine(name=target.key, is_gpu=True, gemm={}, memory_gbps=None), []
        f, b = target.figure(key) / source.figure(key), bw / source.figure("memory_gbps")
        gemm = {ph: GemmRate(best_tflops=g.best_tflops * f, memory_gbps=g.memory_gbps * b,
                             curve=tuple((n, r * f) for n, r in g.curve)) for ph, g in measured.gemm.items()}
        note = assume("rates_from_source", target=target.key, source=source.key, key=key, target_figure=target.figure(key),
                      source_figure=source.figure(key), target_gbps=bw, source_gbps=source.figure("memory_gbps"))
        return Machine(name=target.key, is_gpu=True, gemm=gemm, memory_gbps=measured.memory_gbps * b,
                       accelerator=accelerator,
                       matmul_source=f"{measured.matmul_source} x {target.source(key)} / {source.source(key)}",
                       memory_source=f"{measured.memory_source} x {target.source('memory_gbps')} / "
                                     f"{source.source('memory_gbps')}"), [note]
    notes: list[Assumption] = []
    mamf = target.figure("mamf_bf16_tflops") if bf16 else None
    rate = mamf or target.figure(peak_key)
    if rate is None or bw is None:
        return Machine(name=target.key, is_gpu=True, gemm={}, memory_gbps=None), notes
    curve_fig = target.accelerator.get("gemm_bf16_curve_tflops") if bf16 else None
    curve = tuple((int(n), float(r)) for n, r in curve_fig["value"]) if curve_fig else ()
    if not bf16 or bf16_gemm_basis(target.accelerator) == "datasheet peak":
        notes.append(assume("datasheet_peak", target=target.key))
    src = (f"measured GEMM curve ({curve_fig['source']})" if curve else
           f"{'MAMF' if mamf else 'datasheet dense peak'} {rate:g} TFLOP/s "
           f"({target.source('mamf_bf16_tflops' if mamf else peak_key)}) under each GEMM's roofline")
    gemm = {ph: GemmRate(best_tflops=rate, memory_gbps=bw, curve=curve, source=src) for ph in GEMM_PHASES}
    return Machine(name=target.key, is_gpu=True, gemm=gemm, memory_gbps=bw, accelerator=accelerator, matmul_source=src,
                   memory_source=f"{bw:g} GB/s ({target.source('memory_gbps')})"), notes


def catalog_link(catalog: Catalog, target: Target, world: int, gpus_per_node: int) -> Link | None:
    """The link a target's collectives cross: NVLink/PCIe inside a node; across nodes the slower of the
    node's link and the network (a ring's bandwidth is its slowest hop), with NCCL's latency model."""
    if world <= 1:
        return None
    nodes = max(1, -(-world // gpus_per_node))
    intra, inter = target.intra_node_link, target.inter_node_link
    if intra is None or (nodes > 1 and inter is None):
        return None
    if intra.between_groups is not None and min(world, gpus_per_node) > (intra.joins_gpus or world):
        intra = _ring_over_groups(intra)
    base_us, base_src = catalog.base_latency_us()
    intra_us, intra_src = catalog.step_latency_us(intra.latency_class)
    net_us, _ = catalog.step_latency_us("net")
    gbps = intra.gbps if nodes == 1 else min(intra.gbps, inter.gbps)
    name = intra.name if nodes == 1 else f"{inter.name} between {nodes} nodes ({intra.name} inside)"
    described = assume("link_catalog", name=name, gbps=gbps,
                       gbps_source=intra.gbps_source if gbps == intra.gbps else inter.gbps_source,
                       inter_text="" if nodes == 1 else f", {gpus_per_node} GPUs a node",
                       base_us=base_us, intra_us=intra_us, net_us=net_us,
                       latency_source=f"{base_src}; {intra_src}")
    return Link(busbw_gbps=gbps, source=name, latency=NcclLatency(base_us=base_us, intra_us=intra_us, net_us=net_us,
                                                                  nodes=nodes, source=base_src), described=described)


def missing_link(catalog: Catalog, target: Target, world: int, gpus_per_node: int) -> str | None:
    """Why a target's collectives cannot be priced, naming the catalog key to add; None where its links are
    there (or one GPU needs none)."""
    if world <= 1:
        return None
    gpu = catalog.accelerator_key(target) or target.key
    links = ", ".join(sorted(catalog.links))
    if target.intra_node_link is None:
        where = f"nodes.{target.key}" if target.gpus_per_node else f"accelerators.{gpu}"
        return (f"{target.key} has no link between its GPUs in the catalog: add intra_node_link: KEY under {where} "
                f"(--catalog FILE; links: {links}), or project one GPU (--gpus-per-node 1)")
    if world > gpus_per_node and target.inter_node_link is None:
        return (f"{target.key} has no link between nodes in the catalog: add inter_node_link: KEY under "
                f"nodes.{target.key} or default_inter_node_link (links: {links})")
    return None


# a ring step's latency classes (collective_latency), fastest first; an unknown one counts as a network's
LATENCY_ORDER = {"nvlink": 0, "pcie": 1, "net": 2}


def _ring_over_groups(link: HardwareLink) -> HardwareLink:
    """A ring over more GPUs than a link joins (an NVLink bridge joins pairs) alternates its hops with the
    link between the groups: its bandwidth is the slower of the two, each step's latency the slower class."""
    other = link.between_groups
    assert other is not None
    slow = min((link, other), key=lambda x: x.gbps)
    return dataclasses.replace(
        link, name=f"{link.name}; a ring over more than {link.joins_gpus} GPUs also crosses {other.name}",
        gbps=slow.gbps, gbps_source=slow.gbps_source,
        latency_class=max(link.latency_class, other.latency_class, key=lambda c: LATENCY_ORDER.get(c, 2)))


def measured_link(fits: dict[str, Any], world: int) -> Link:
    """The gloo fit measured on this machine: the median alpha and bus bandwidth of its collectives."""
    usable = [f for f in fits.values() if f]
    alpha = sorted(f["alpha_ms"] for f in usable)[len(usable) // 2]
    busbw = sorted(f["busbw_gbps"] for f in usable)[len(usable) // 2]
    return Link(alpha_ms=alpha, busbw_gbps=busbw, source=f"gloo over {world} local processes", measured_here=True,
                described=assume("link_measured", world=world, alpha_ms=alpha, busbw_gbps=busbw, fits=len(usable)))


# engines without GPU reference runs of their own, and the measured engine closest to them: FSDP2 runs
# torch's AdamW and hooks only at its fully_shard units
REFERENCE_ENGINE = {"fsdp": "torch"}


def reference_engine(engine: str) -> str:
    return REFERENCE_ENGINE.get(engine, engine)


def gpu_ops_per_layer(catalog: Catalog, engine: str, zero_stage: int = 3) -> tuple[dict[str, float], str]:
    """Operator calls per decoder layer and micro batch that a GPU run of the engine issues, per phase, from
    the catalog's reference runs: a CPU run of the same code issues more (CPU autocast and attention
    decompose into more aten ops: 279 against 194 a forward layer for the torch engine). Empty where the
    catalog has no reference for the engine. DeepSpeed's ZeRO-0/1/2 take their own where kept (ZeRO-3's
    parameter hooks issue more: 182 against 142 a forward layer)."""
    return _per_phase(by_host_path(catalog.ops_per_layer, engine, zero_stage) or {})


def by_host_path(block: dict[str, Any], engine: str, zero_stage: int) -> Any:
    """A catalog block's entry for the engine's host path (host_key), else for its reference engine."""
    return block.get(host_key(engine, zero_stage)) or block.get(reference_engine(engine))


def host_key(engine: str, zero_stage: int) -> str:
    """The catalog key of an engine's GPU host figures. DeepSpeed's host path depends on its ZeRO stage:
    ZeRO-3 fetches and releases parameters in hooks on every module (deepspeed/runtime/zero/
    parameter_offload.py); ZeRO-0/1/2 hook only the root module in the forward (runtime/engine.py) and the
    gradients (runtime/zero/stage_1_and_2.py)."""
    if engine == "deepspeed":
        return "deepspeed" if zero_stage >= 3 else "deepspeed-zero12"
    return engine


def gpu_host(catalog: Catalog, engine: str, zero_stage: int = 3) -> tuple[dict[str, float], str, str | None]:
    """Host µs per operator call on a GPU machine for an engine, per phase, from the catalog's reference
    runs; their sources; and, where the engine has no reference runs of its own, what stands in and why."""
    block, stand_in = _host_block(catalog, engine, zero_stage)
    return (*_per_phase(block), stand_in)


def reference_hosts(catalog: Catalog, engine: str, zero_stage: int, phase: str = "forward") -> list[float]:
    """The reference hosts' own µs per call behind gpu_host's figure for `phase` (the catalog's `hosts`)."""
    return list(_host_block(catalog, engine, zero_stage)[0].get(phase, {}).get("hosts", {}).values())


def _host_block(catalog: Catalog, engine: str, zero_stage: int) -> tuple[dict[str, dict], str | None]:
    """gpu_host's catalog figures ({phase: {value, hosts, source}}), and what stands in for them and why."""
    key = host_key(engine, zero_stage)
    refs = catalog.host_us_per_op
    if refs.get(key):
        return refs[key], None
    if key == "deepspeed-zero12" and refs.get("torch") and refs.get("deepspeed"):
        # the model's phases run as plain PyTorch's do; the optimizer is DeepSpeed's own step()
        stand_in = {**{ph: fig for ph, fig in refs["torch"].items() if ph != "optimizer"},
                    **{ph: fig for ph, fig in refs["deepspeed"].items() if ph == "optimizer"}}
        return stand_in, ("DeepSpeed ZeRO-0/1/2 hook only the root module in the forward, so plain PyTorch's host "
                          "time per call stands in for the model's phases and ZeRO-3's for DeepSpeed's optimizer "
                          "step (no ZeRO-1/2 GPU reference run is kept)")
    if key in REFERENCE_ENGINE and refs.get(REFERENCE_ENGINE[key]):
        closest = REFERENCE_ENGINE[key]
        return refs[closest], (f"no GPU host reference for {engine}: {closest}'s, the closest host path measured, "
                               "stands in (FSDP2 adds hooks at its fully_shard units only)")
    return refs.get("deepspeed") or {}, (f"no GPU host reference for {engine}: DeepSpeed ZeRO-3's, the slowest host "
                                         "path measured, stands in")


def _per_phase(ref: dict[str, dict]) -> tuple[dict[str, float], str]:
    """A catalog block of per-phase figures ({phase: {value, source}}) as values, recompute taking the
    forward's (a recomputation re-runs forwards), and their sources in one line."""
    values = {ph: float(fig["value"]) for ph, fig in ref.items()}
    if "forward" in values:
        values["recompute"] = values["forward"]
    return values, "; ".join(f"{ph} {fig['source']}" for ph, fig in ref.items())


def host_pace(values: dict[str, float], basis: dict[str, str], reference: dict[str, float], reference_hosts: list[float],
              stand_in: str | None, phase: str = "forward") -> dict[str, Any]:
    """Whose host a GPU prediction's operator calls run at, per phase (`basis`: "own", a host-bound phase of the
    source measured; "ceiling", a device-bound one's bound on the source's own GPU kind; "reference", the
    catalog's mean over its reference hosts; "paced", the reference for another host path at the source host's
    pace), with `phase`'s figures for the row's one-line summary: the µs per call, the reference's and the
    reference hosts' own (machines.reference_hosts)."""
    return {"phase": phase, "basis": basis.get(phase), "us_per_call": values.get(phase),
            "reference_us_per_call": reference.get(phase), "reference_hosts_us": reference_hosts,
            "stand_in": stand_in is not None,
            "by_phase": {ph: {"basis": basis[ph], "us_per_call": values[ph]} for ph in values if ph in basis}}
