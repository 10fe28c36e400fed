"""The hardware catalog projection predicts for: accelerators, links and node templates, every figure
with its source, merged with a user's own file; and prices, which are never invented.

    cat = load_catalog(user_file=None)           # package catalog.yaml (+ the user's, entry by entry)
    target = cat.resolve("h100-sxm")             # -> Target(accelerator, intra/inter-node links, gpus/node)
    prices = load_prices(file=None, cli=["h100-sxm=2.5"])
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from pathlib import Path
from typing import Any

from trainprof.io import read_yaml

CATALOG_FILE = Path(__file__).with_name("catalog.yaml")
THIS = "this"  # `--to this`: the machine the source run was measured on


class CatalogError(ValueError):
    """A bad catalog or price entry, or an unknown name: one line naming the entry and what to do."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """One hardware target: an accelerator and how its GPUs are wired."""

    key: str
    accelerator: dict[str, Any]
    intra_node_link: dict[str, Any] | None
    inter_node_link: dict[str, Any] | None
    gpus_per_node: int | None  # None: take --gpus-per-node

    def figure(self, name: str) -> float | None:
        """The value of one accelerator figure (e.g. "memory_gbps"), None when the catalog lacks it."""
        fig = self.accelerator.get(name)
        return float(fig["value"]) if isinstance(fig, dict) and fig.get("value") is not None else None

    def source(self, name: str) -> str | None:
        fig = self.accelerator.get(name)
        return fig.get("source") if isinstance(fig, dict) else None


@dataclasses.dataclass(kw_only=True)
class Catalog:
    accelerators: dict[str, dict[str, Any]]
    links: dict[str, dict[str, Any]]
    nodes: dict[str, dict[str, Any]]
    default_inter_node_link: str
    files: list[str]

    def names(self) -> list[str]:
        return sorted(self.accelerators) + sorted(self.nodes)

    def resolve(self, name: str) -> Target:
        """An accelerator key or a node template key -> Target.

        Raises:
            CatalogError: the name is in neither table (the message lists the known names).
        """
        if name in self.nodes:
            node = self.nodes[name]
            acc_key = node["accelerator"]
            return Target(key=name, accelerator=self._accelerator(acc_key, f"node '{name}'"),
                          intra_node_link=self._link(node.get("intra_node_link"), name),
                          inter_node_link=self._link(node.get("inter_node_link") or self.default_inter_node_link, name),
                          gpus_per_node=int(node["gpus_per_node"]))
        if name in self.accelerators:
            acc = self.accelerators[name]
            return Target(key=name, accelerator=acc, intra_node_link=self._link(acc.get("intra_node_link"), name),
                          inter_node_link=self._link(self.default_inter_node_link, name), gpus_per_node=None)
        raise CatalogError(f"hardware '{name}' is not in the catalog ({', '.join(self.files)}); known: "
                           f"{', '.join(self.names())}; add it with --catalog FILE")

    def _accelerator(self, key: str, where: str) -> dict[str, Any]:
        if key not in self.accelerators:
            raise CatalogError(f"{where}: accelerator '{key}' is not in the catalog; add it under accelerators:")
        return self.accelerators[key]

    def _link(self, key: str | None, where: str) -> dict[str, Any] | None:
        if key is None:
            return None
        if key not in self.links:
            raise CatalogError(f"'{where}': link '{key}' is not in the catalog's links:; add it or fix the name")
        return {"key": key, **self.links[key]}


def _check_figures(entry: dict[str, Any], where: str) -> None:
    for key, fig in entry.items():
        if key.endswith(("_tflops", "_gbps", "_gb")) and key != "name":
            if not (isinstance(fig, dict) and "value" in fig and fig.get("source")):
                raise CatalogError(f"{where}.{key}: every figure needs {{value, source}}; add the datasheet source")


def load_catalog(user_file: str | Path | None = None) -> Catalog:
    """The package catalog, with a user's file merged over it entry by entry.

    Args:
        user_file: a YAML file with the same sections (accelerators, links, nodes).
    Returns:
        The merged catalog.
    Raises:
        CatalogError: a figure without a source, or a file that is not a catalog.
    """
    data = read_yaml(CATALOG_FILE, what="catalog file", hint="reinstall trainprof", error=CatalogError)
    files = [str(CATALOG_FILE.name)]
    if user_file is not None:
        user = read_yaml(user_file, what="catalog file", hint="pass a YAML file with accelerators:/links:/nodes:",
                         error=CatalogError)
        if not isinstance(user, dict) or not set(user) & {"accelerators", "links", "nodes"}:
            raise CatalogError(f"catalog file '{user_file}' has none of accelerators:, links:, nodes:; "
                               "see trainprof/projection/catalog.yaml for the layout")
        for section in ("accelerators", "links", "nodes"):
            data.setdefault(section, {}).update(user.get(section) or {})
        files.append(str(user_file))
    for section in ("accelerators", "links"):
        for key, entry in data[section].items():
            _check_figures(entry, f"{section}.{key}")
    return Catalog(accelerators=data["accelerators"], links=data["links"], nodes=data.get("nodes") or {},
                   default_inter_node_link=data.get("default_inter_node_link", "ib-ndr"), files=files)


def find_accelerator(catalog: Catalog, device_name: str) -> str | None:
    """The catalog key whose `match` list holds a torch device name, None when none does."""
    for key, entry in catalog.accelerators.items():
        if device_name in (entry.get("match") or []):
            return key
    return None


# ---------------------------------------------------------------------------------------------
# Prices: a file with a source and a date per entry, or --price NAME=USD_PER_GPU_HOUR
# ---------------------------------------------------------------------------------------------

def load_prices(file: str | Path | None = None, cli: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """USD per GPU-hour by catalog key, each with where it came from.

    A price file is YAML: `prices: {h100-sxm: {usd_per_gpu_hour: 2.99, source: "...", date: 2026-11-01}}`.
    `--price NAME=USD` entries win over the file and are labelled as given on the command line.

    Raises:
        CatalogError: an entry without a source or a date, or a malformed --price.
    """
    prices: dict[str, dict[str, Any]] = {}
    if file is not None:
        data = read_yaml(file, what="price file", hint="pass a YAML file with prices: {NAME: {usd_per_gpu_hour, "
                         "source, date}}", error=CatalogError)
        for key, entry in ((data or {}).get("prices") or {}).items():
            if not isinstance(entry, dict) or entry.get("usd_per_gpu_hour") is None:
                raise CatalogError(f"price file '{file}': prices.{key} needs usd_per_gpu_hour")
            if not entry.get("source") or not entry.get("date"):
                raise CatalogError(f"price file '{file}': prices.{key} needs a source and a date (prices are never "
                                   "taken without them)")
            prices[key] = {"usd_per_gpu_hour": float(entry["usd_per_gpu_hour"]), "source": str(entry["source"]),
                           "date": str(entry["date"])}
    for item in cli or []:
        name, sep, value = item.partition("=")
        try:
            usd = float(value)
        except ValueError:
            usd = -1.0
        if not sep or not name or usd <= 0:
            raise CatalogError(f"--price '{item}': write NAME=USD_PER_GPU_HOUR, e.g. --price h100-sxm=2.99")
        prices[name] = {"usd_per_gpu_hour": usd, "source": "--price on the command line",
                        "date": dt.date.today().isoformat()}
    return prices
