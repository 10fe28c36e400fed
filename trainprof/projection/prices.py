"""Prices for cost predictions: a file with a source and a date per entry, or --price NAME=USD on the
command line. Prices are never invented: without one, cost is null with the reason."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from trainprof.hardware import Catalog, CatalogError
from trainprof.io import read_yaml
from trainprof.projection.changes import THIS

COMMAND_LINE = "--price on the command line"


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
            if float(entry["usd_per_gpu_hour"]) <= 0:
                raise CatalogError(f"price file '{file}': prices.{key}.usd_per_gpu_hour must be > 0")
            if not entry.get("source") or not entry.get("date"):
                raise CatalogError(f"price file '{file}': prices.{key} needs a source and a date (prices are never "
                                   "taken without them)")
            prices[key] = {"usd_per_gpu_hour": float(entry["usd_per_gpu_hour"]), "source": str(entry["source"]),
                           "date": str(entry["date"])}
    # `--price a=1,b=2` as well as repeated `--price`: --to takes a comma list too
    for item in (part for arg in cli or [] for part in arg.split(",") if part.strip()):
        name, sep, value = item.strip().partition("=")
        try:
            usd = float(value)
        except ValueError:
            usd = -1.0
        if not sep or not name or not value.strip():
            raise CatalogError(f"--price '{item}': write NAME=USD_PER_GPU_HOUR, e.g. --price h100-sxm=2.99,rtx4090=0.69")
        if usd <= 0:
            raise CatalogError(f"--price '{item}': the price must be a number > 0 (USD per GPU-hour), e.g. "
                               f"--price {name}=2.99")
        prices[name] = {"usd_per_gpu_hour": usd, "source": COMMAND_LINE,
                        "date": dt.date.today().isoformat()}
    return prices


def check_prices_name_targets(prices: dict[str, dict[str, Any]], targets: list[str], catalog: Catalog) -> None:
    """A --price must name a --to target or its GPU: one that names neither (a typo, or h100 for h100-sxm) would
    leave every cost n/a without saying why. A price file may list more than one call needs.

    Raises:
        CatalogError: naming the price and the names it may take.
    """
    names = [*targets, *(catalog.accelerator_key(catalog.resolve(t)) for t in targets if t != THIS)]
    for name, entry in prices.items():
        if entry["source"] == COMMAND_LINE and name not in names:
            raise CatalogError(f"--price '{name}': not a --to target nor a target's GPU; price one of "
                               f"{', '.join(dict.fromkeys(n for n in names if n))} (per GPU-hour)")
        if name not in (*catalog.names(), THIS):  # a file may price more targets than one call has, but real ones
            raise CatalogError(f"price file: prices.{name} is not in the catalog ({', '.join(catalog.files)}), so no "
                               f"target takes it: name a catalog entry (trainprof hardware) or add it with --catalog")


def price_for(prices: dict[str, dict[str, Any]], machine: str, gpu: str | None) -> dict[str, Any] | None:
    """The price of a target by its own name, else by its GPU's (a node template such as hgx-h100 priced as
    h100-sxm: a price is per GPU-hour); the entry says which name it was given for."""
    for name in (machine, gpu):
        if name is not None and name in prices:
            return {**prices[name], "priced_as": name}
    return None
