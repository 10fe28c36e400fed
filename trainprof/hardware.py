"""The hardware catalog (hardware.yaml, every figure with its source): accelerators, links and node
templates, and NCCL's latency model for collectives. The profiler reads it for MFU and decode
bandwidth; projection predicts for its entries.

    cat = load_catalog(user_file=None)             # hardware.yaml (+ the user's, entry by entry)
    target = cat.resolve("h100-sxm")               # -> Target(accelerator, intra/inter-node links, gpus/node)
    peak, why = dense_peak("NVIDIA H100 80GB HBM3", "cuda", "bf16")
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from trainprof.io import read_yaml

CATALOG_FILE = Path(__file__).with_name("hardware.yaml")

# compute dtype -> the peak key that applies (fp32 matmuls on tensor cores run as TF32 when allowed)
PEAK_KEYS = {"bf16": "peak_bf16_dense_tflops", "fp16": "peak_fp16_dense_tflops",
             "tf32": "peak_tf32_dense_tflops", "fp32": "peak_fp32_tflops"}


class CatalogError(ValueError):
    """A bad catalog entry or an unknown name: one line naming the entry and what to do."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """One interconnect: bandwidth per direction per GPU and the latency class of a ring step."""

    key: str
    name: str
    gbps: float
    gbps_source: str
    latency_class: str  # nvlink | pcie | net (collective_latency.step_us)
    joins_gpus: int | None = None  # a link that joins groups of this many GPUs (an NVLink bridge: pairs)
    between_groups: "Link | None" = None  # what a ring over more GPUs than a group also crosses


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """One hardware target: an accelerator and how its GPUs are wired."""

    key: str
    accelerator: dict[str, Any]
    intra_node_link: Link | None
    inter_node_link: Link | None
    gpus_per_node: int | None  # None: take --gpus-per-node

    def figure(self, name: str) -> float | None:
        """The value of one accelerator figure (e.g. "memory_gbps"), None when the catalog lacks it."""
        return figure_value(self.accelerator, name)

    def memory_bytes(self) -> float | None:
        return memory_bytes(self.accelerator)

    def source(self, name: str) -> str | None:
        fig = self.accelerator.get(name)
        return fig.get("source") if isinstance(fig, dict) else None


def memory_bytes(entry: dict[str, Any]) -> float | None:
    """An accelerator's memory_gb in bytes. A GPU datasheet's GB of memory are binary: the H200 (141 GB) lent to
    this project offers about 139 GiB to CUDA, more than 141e9 bytes (131 GiB); an 80 GB A100 has 81,920 MiB."""
    gb = figure_value(entry, "memory_gb")
    return gb * 2**30 if gb else None


def figure_value(entry: dict[str, Any], name: str) -> float | None:
    fig = entry.get(name)
    return float(fig["value"]) if isinstance(fig, dict) and fig.get("value") is not None else None


@dataclasses.dataclass(kw_only=True)
class Catalog:
    accelerators: dict[str, dict[str, Any]]
    links: dict[str, dict[str, Any]]
    nodes: dict[str, dict[str, Any]]
    default_inter_node_link: str
    latency: dict[str, Any]
    files: list[str]
    host_us_per_op: dict[str, Any] = dataclasses.field(default_factory=dict)  # gpu_host_us_per_op: engine -> phase
    optimizer_bytes_per_param: dict[str, Any] = dataclasses.field(default_factory=dict)  # engine -> {value, source}
    ops_per_layer: dict[str, Any] = dataclasses.field(default_factory=dict)  # gpu_ops_per_layer: engine -> phase
    optimizer_host: dict[str, Any] = dataclasses.field(default_factory=dict)  # gpu_optimizer_host: host key -> figures

    def names(self) -> list[str]:
        return sorted(self.accelerators) + sorted(self.nodes)

    def accelerator_key(self, target: Target) -> str | None:
        """The catalog key of a target's accelerator (a node template's GPU: hgx-h100 -> h100-sxm)."""
        return next((k for k, v in self.accelerators.items() if v is target.accelerator or v == target.accelerator),
                    None)

    def resolve(self, name: str) -> Target:
        """An accelerator key or a node template key -> Target.

        Raises:
            CatalogError: the name is in neither table (the message lists the known names).
        """
        if name in self.nodes:
            node = self.nodes[name]
            return Target(key=name, accelerator=self._accelerator(node["accelerator"], f"node '{name}'"),
                          intra_node_link=self.link(node.get("intra_node_link"), name),
                          inter_node_link=self.link(node.get("inter_node_link") or self.default_inter_node_link, name),
                          gpus_per_node=int(node["gpus_per_node"]))
        if name in self.accelerators:
            acc = self.accelerators[name]
            return Target(key=name, accelerator=acc, intra_node_link=self.link(acc.get("intra_node_link"), name),
                          inter_node_link=self.link(self.default_inter_node_link, name), gpus_per_node=None)
        raise CatalogError(f"hardware '{name}' is not in the catalog ({', '.join(self.files)}); known: "
                           f"{', '.join(self.names())}; add it with --catalog FILE")

    def link(self, key: str | None, where: str) -> Link | None:
        if key is None:
            return None
        if key not in self.links:
            raise CatalogError(f"'{where}': link '{key}' is not in the catalog's links:; add it or fix the name")
        entry = self.links[key]
        return Link(key=key, name=entry["name"], gbps=float(entry["gbps_per_direction"]["value"]),
                    gbps_source=entry["gbps_per_direction"]["source"], latency_class=entry.get("class", "net"),
                    joins_gpus=entry.get("joins_gpus"),
                    between_groups=self.link(entry.get("between_groups"), f"links.{key}.between_groups"))

    def step_latency_us(self, latency_class: str) -> tuple[float, str]:
        fig = self.latency["step_us"][latency_class]
        return float(fig["value"]), fig["source"]

    def base_latency_us(self) -> tuple[float, str]:
        fig = self.latency["base_us"]
        return float(fig["value"]), fig["source"]

    def _accelerator(self, key: str, where: str) -> dict[str, Any]:
        if key not in self.accelerators:
            raise CatalogError(f"{where}: accelerator '{key}' is not in the catalog; add it under accelerators:")
        return self.accelerators[key]


# the keys each entry is read by without a default (Catalog.resolve / link, dense_peak, the hardware command)
REQUIRED_KEYS = {"accelerators": ("name",), "links": ("name", "gbps_per_direction"),
                 "nodes": ("accelerator", "gpus_per_node")}


def _check_figures(entry: dict[str, Any], where: str) -> None:
    for key, fig in entry.items():
        if key.endswith(("_tflops", "_gbps", "_gb", "_us")):
            if not (isinstance(fig, dict) and "value" in fig and fig.get("source")):
                raise CatalogError(f"{where}.{key}: every figure needs {{value, source}}; add the datasheet source")


def _check_entry(entry: Any, section: str, key: str, file: str) -> None:
    """One catalog entry: a mapping with its section's required keys and sourced figures (CatalogError, one
    line naming the entry, the key and the file it came from)."""
    where = f"{section}.{key}"
    if not isinstance(entry, dict):
        raise CatalogError(f"catalog file '{file}': {where} must be a mapping of keys (see trainprof/hardware.yaml), "
                           f"got {type(entry).__name__}")
    for required in REQUIRED_KEYS[section]:
        if entry.get(required) in (None, ""):
            raise CatalogError(f"catalog file '{file}': {where} has no '{required}:'; add it (see "
                               "trainprof/hardware.yaml for the layout)")
    if section != "nodes":
        try:
            _check_figures(entry, where)
        except CatalogError as err:
            raise CatalogError(f"catalog file '{file}': {err}") from None


def load_catalog(user_file: str | Path | None = None) -> Catalog:
    """The package catalog, with a user's file merged over it entry by entry.

    Args:
        user_file: a YAML file with the same sections (accelerators, links, nodes).
    Returns:
        The merged catalog.
    Raises:
        CatalogError: a figure without a source, or a file that is not a catalog.
    """
    data = dict(_package_catalog())
    files = [CATALOG_FILE.name]
    origin: dict[tuple[str, str], str] = {}  # (section, key) -> the user's file, for its entries' errors
    if user_file is not None:
        user = read_yaml(user_file, what="catalog file", hint="pass a YAML file with accelerators:/links:/nodes:",
                         error=CatalogError)
        if not isinstance(user, dict) or not set(user) & {"accelerators", "links", "nodes"}:
            raise CatalogError(f"catalog file '{user_file}' has none of accelerators:, links:, nodes:; "
                               "see trainprof/hardware.yaml for the layout")
        for section in ("accelerators", "links", "nodes"):
            entries = user.get(section) or {}
            if not isinstance(entries, dict):
                raise CatalogError(f"catalog file '{user_file}': {section}: must map names to entries, got "
                                   f"{type(entries).__name__}; see trainprof/hardware.yaml for the layout")
            data[section] = {**(data.get(section) or {}), **entries}
            origin.update({(section, key): str(user_file) for key in entries})
        files.append(str(user_file))
    for section in ("accelerators", "links", "nodes"):
        for key, entry in (data.get(section) or {}).items():
            _check_entry(entry, section, key, origin.get((section, key), str(CATALOG_FILE)))
    return Catalog(accelerators=data["accelerators"], links=data["links"], nodes=data.get("nodes") or {},
                   default_inter_node_link=data.get("default_inter_node_link", "ib-ndr"),
                   latency=data["collective_latency"], files=files,
                   host_us_per_op=data.get("gpu_host_us_per_op") or {},
                   optimizer_bytes_per_param=data.get("gpu_optimizer_bytes_per_param") or {},
                   ops_per_layer=data.get("gpu_ops_per_layer") or {},
                   optimizer_host=data.get("gpu_optimizer_host") or {})


@functools.lru_cache(maxsize=1)
def _package_catalog() -> dict[str, Any]:
    return read_yaml(CATALOG_FILE, what="hardware catalog", hint="reinstall trainprof", error=CatalogError)


def bf16_gemm_basis(accelerator: dict[str, Any]) -> str:
    """What a projection to the accelerator prices its bf16 GEMMs at (projection/machines.py
    machine_from_target): its measured GEMM curve, else its MAMF, else its datasheet dense peak."""
    if accelerator.get("gemm_bf16_curve_tflops"):
        return "measured curve"
    return "MAMF" if accelerator.get("mamf_bf16_tflops") else "datasheet peak"


def matmul_ratio_key(source: Target, target: Target, bf16: bool = True) -> str:
    """The figure by which one catalogued GPU's matmul rate is carried to another's: MAMF over MAMF where
    both have one (measured against measured), else the datasheet dense peak over the dense peak."""
    if bf16 and source.figure("mamf_bf16_tflops") and target.figure("mamf_bf16_tflops"):
        return "mamf_bf16_tflops"
    return "peak_bf16_dense_tflops" if bf16 else "peak_fp32_tflops"


def find_accelerator(catalog: Catalog, device_name: str) -> str | None:
    """The catalog key whose `match` list holds a torch device name, None when none does."""
    for key, entry in catalog.accelerators.items():
        if device_name in (entry.get("match") or []):
            return key
    return None


def _matching_entry(device_name: str) -> dict[str, Any] | None:
    catalog = load_catalog()
    key = find_accelerator(catalog, device_name)
    return catalog.accelerators[key] if key else None


def dense_peak(device_name: str, device_type: str, dtype: str) -> tuple[dict[str, Any] | None, str]:
    """The dense peak for a device and compute dtype, for MFU.

    Args:
        device_name: torch.cuda.get_device_name() on GPU, the processor name on CPU.
        device_type: "cuda" or "cpu".
        dtype: "bf16" | "fp16" | "tf32" | "fp32".
    Returns:
        ({tflops, key, source, accelerator} or None, reason when None else "").
    """
    if device_type != "cuda":
        return None, (f"no dense peak is known for the CPU '{device_name}' (it depends on SKU, clock and ISA); "
                      "achieved TFLOP/s is reported instead")
    key = PEAK_KEYS.get(dtype)
    entry = _matching_entry(device_name)
    if entry is None:
        return None, (f"device '{device_name}' is not in {CATALOG_FILE.name}; add its dense {dtype} peak with a "
                      "datasheet source to get MFU")
    value = figure_value(entry, key) if key else None
    if value is None:
        return None, f"{entry['name']} has no {key or dtype} figure in {CATALOG_FILE.name}"
    return {"tflops": value, "key": key, "source": entry[key]["source"], "accelerator": entry["name"]}, ""


def device_memory(device_name: str, device_type: str) -> tuple[dict[str, Any] | None, str]:
    """A GPU's memory from the catalog, for a profile that did not record the device's own (runs before it
    was recorded).

    Returns:
        ({bytes, source, accelerator} or None, reason when None else ""); memory_gb taken as binary
        (memory_bytes says why).
    """
    if device_type != "cuda":
        return None, f"the catalog holds no memory for the CPU '{device_name}'"
    entry = _matching_entry(device_name)
    if entry is None:
        return None, f"device '{device_name}' is not in {CATALOG_FILE.name}"
    total = memory_bytes(entry)
    if total is None:
        return None, f"{entry['name']} has no memory_gb figure in {CATALOG_FILE.name}"
    return {"bytes": total, "source": entry["memory_gb"]["source"], "accelerator": entry["name"]}, ""


def memory_bandwidth(device_name: str, device_type: str) -> tuple[dict[str, Any] | None, str]:
    """The device memory bandwidth for a device, for decode bandwidth utilization.

    Returns:
        ({gbps, source, accelerator} or None, reason when None else ""); gbps is 1e9 bytes/s.
    """
    if device_type != "cuda":
        return None, (f"no memory bandwidth is known for the CPU '{device_name}' (it depends on the DIMMs, "
                      "channels and sockets); achieved GB/s is reported instead")
    entry = _matching_entry(device_name)
    if entry is None:
        return None, (f"device '{device_name}' is not in {CATALOG_FILE.name}; add its memory_gbps with a datasheet "
                      "source to get bandwidth utilization")
    value = figure_value(entry, "memory_gbps")
    if value is None:
        return None, f"{entry['name']} has no memory_gbps figure in {CATALOG_FILE.name}"
    return {"gbps": value, "source": entry["memory_gbps"]["source"], "accelerator": entry["name"]}, ""
