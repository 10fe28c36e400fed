"""`trainprof project RUN_DIR [key=value ...]`: predict step time, throughput, memory and cost on other
hardware, world sizes, model sizes and settings from one measured run (each call kept in its own folder
under RUN_DIR/projections/); `--best` searches the settings per target, `--table zhang2023` predicts the
research's tables; `trainprof hardware` lists the catalog."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from trainprof.commands.run import positive_int, positive_ints

TABLES = ("zhang2023",)


def _tokens(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive token count, e.g. 2e10")
    return value


def _command_line(args: argparse.Namespace) -> str:
    """The call, rebuilt from its parsed arguments (so it reads the same however it was launched)."""
    parts = ["trainprof", "project", str(args.run_dir), *args.overrides, "--to", args.to]
    if args.to != "this":
        parts += ["--nodes", ",".join(map(str, args.nodes)), "--gpus-per-node", str(args.gpus_per_node)]
    for flag, value in (("--nproc", ",".join(map(str, args.nproc or [])) or None), ("--threads", args.threads),
                        ("--tokens", args.tokens), ("--prices", args.prices), ("--catalog", args.catalog),
                        ("--table", args.table)):
        if value is not None:
            parts += [flag, str(value)]
    for price in args.price:
        parts += ["--price", price]
    parts += (["--best"] if args.best else []) + (["--no-probe"] if args.no_probe else [])
    return " ".join(shlex.quote(x) for x in parts)


def _out_dir(args: argparse.Namespace, targets: list[str]) -> Path:
    from trainprof.projection.report import new_projection_dir

    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        return Path(args.out)
    extra = ["best"] if args.best else ([args.table] if args.table else [])
    return new_projection_dir(Path(args.run_dir), targets, [*extra, *args.overrides])


def _refresh_report(args: argparse.Namespace, paths: list[Path]) -> None:
    """The run's report.html lists every projection kept in the run dir."""
    if args.out:
        return
    from trainprof.report.run_report import write_reports

    paths.append(write_reports(args.run_dir, scalars=False)["html"])


def _project(args: argparse.Namespace) -> int:
    from trainprof.errors import UserError
    from trainprof.hardware import CatalogError, load_catalog
    from trainprof.projection.prices import check_prices_name_targets, load_prices
    from trainprof.projection.source import ProjectionError

    if args.advice:
        return _advice(args)
    targets = list(dict.fromkeys(t.strip() for t in args.to.split(",") if t.strip()))  # one set of rows a target
    try:
        catalog = load_catalog(args.catalog)
        _check_world_options(args, targets, catalog)
        prices = load_prices(args.prices, args.price)
        check_prices_name_targets(prices, targets, catalog)
        if args.best:
            return _best(args, targets, prices)
        if args.table:
            return _tables(args, targets, prices)
        from trainprof.projection.project import project

        result = project(args.run_dir, targets=targets, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         nproc=args.nproc, overrides=args.overrides, tokens=args.tokens, catalog_file=args.catalog,
                         prices=prices, threads=args.threads, probe=not args.no_probe, progress=not args.json)
    except (CatalogError, ProjectionError) as err:
        raise UserError(str(err)) from None
    from trainprof.projection.report import render_short, write_projection

    out = _out_dir(args, targets)
    paths = write_projection(result, out, title=f"Projection to {', '.join(targets)}"
                             + (f" with {' '.join(args.overrides)}" if args.overrides else ""),
                             command=_command_line(args))
    _refresh_report(args, paths)
    _print(args, result, render_short(result), paths)
    return 0


def _check_world_options(args: argparse.Namespace, targets: list[str], catalog: Any) -> None:
    """Refuse a world-size option no target takes (it was silently ignored: `--to h100-sxm --nproc 4` showed
    8 GPUs), then fill in the defaults."""
    from trainprof.errors import UserError
    from trainprof.projection.changes import THIS

    here, there = THIS in targets, [t for t in targets if t != THIS]
    if not here and (args.nproc or args.threads):
        raise UserError("--nproc and --threads size the run's own machine (--to this); for catalog targets use "
                        "--nodes and --gpus-per-node")
    if not there and (args.nodes or args.gpus_per_node):
        raise UserError("--nodes and --gpus-per-node size catalog targets (--to h100-sxm,...); for the run's own "
                        "machine use --nproc")
    if args.gpus_per_node:
        for t in there:
            own = catalog.resolve(t).gpus_per_node  # unknown names fail here, one line, before any work
            if own and own != args.gpus_per_node:
                raise UserError(f"--to {t} is a node of {own} GPUs; --gpus-per-node {args.gpus_per_node} does not "
                                f"apply to it: name its GPU ({catalog.accelerator_key(catalog.resolve(t))}) to choose "
                                "the GPUs per node")
    if args.table and args.nodes and len(args.nodes) > 1:
        raise UserError("--table predicts one platform size: pass one node count (--nodes 1)")
    args.nodes, args.gpus_per_node = args.nodes or [1], args.gpus_per_node or 8


def _best(args: argparse.Namespace, targets: list[str], prices: dict[str, Any]) -> int:
    from trainprof.projection.project import best
    from trainprof.projection.report import render_best, write_best

    result = best(args.run_dir, targets=targets, nodes=args.nodes, gpus_per_node=args.gpus_per_node, nproc=args.nproc,
                  overrides=args.overrides, catalog_file=args.catalog, prices=prices, probe=not args.no_probe,
                  tokens=args.tokens, progress=not args.json)
    paths = write_best(result, _out_dir(args, targets), command=_command_line(args))
    _refresh_report(args, paths)
    _print(args, result, render_best(result), paths)
    return 0


def _tables(args: argparse.Namespace, targets: list[str], prices: dict[str, Any]) -> int:
    from trainprof.errors import UserError
    from trainprof.projection.project import research_tables
    from trainprof.projection.report import render_tables, write_tables_doc

    if targets == ["this"]:
        raise UserError("--table zhang2023 predicts the research's 8-GPU platforms: name them with --to, e.g. "
                        "--to a800-80g,rtx4090,rtx3090")
    result = research_tables(args.run_dir, targets=targets, nodes=args.nodes[0], gpus_per_node=args.gpus_per_node,
                             overrides=args.overrides, catalog_file=args.catalog, prices=prices,
                             progress=not args.json)
    paths = write_tables_doc(result, _out_dir(args, targets), command=_command_line(args))
    _refresh_report(args, paths)
    _print(args, result, render_tables(result), paths)
    return 0


def _print(args: argparse.Namespace, result: dict[str, Any], text: str, paths: list[Path]) -> None:
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(text)
        print(f"\nwrote {', '.join(str(p) for p in paths)}", file=sys.stderr)


def _advice(args: argparse.Namespace) -> int:
    """`--advice`: project each of the advisor's recipe changes; RUN_DIR/projections/advice.json, which
    the run report's "What to change" table reads for its predicted gains."""
    from trainprof.errors import UserError
    from trainprof.io import atomic_write_json
    from trainprof.projection.project import project_advice
    from trainprof.report.projections import PROJECTIONS_DIR
    from trainprof.projection.source import ProjectionError

    if args.overrides or args.to != "this":
        raise UserError("--advice projects the advisor's own changes on the run's machine; drop the overrides and --to")
    try:
        rows = project_advice(args.run_dir, probe=not args.no_probe, progress=not args.json)
    except ProjectionError as err:
        raise UserError(str(err)) from None
    out_dir = Path(args.out) if args.out else Path(args.run_dir) / PROJECTIONS_DIR
    atomic_write_json(out_dir / "advice.json", {"advice": rows})
    paths = [out_dir / "advice.json"]
    _refresh_report(args, paths)
    _print(args, {"advice": rows}, "\n".join(advice_lines(rows)) or "nothing triggered: no advice to project", paths)
    return 0


def advice_lines(rows: list[dict]) -> list[str]:
    """What `--advice` prints: per advice its change and predicted gain, with the gain's expected error."""
    lines = []
    for r in rows:
        err = r.get("expected_error_text")
        gain = (f"{100 * r['predicted_gain']:+.1f}% tokens/s "
                + (f"(validated step error {err})" if err is not None else "(error not validated)")
                if r["predicted_gain"] is not None else r.get("reason"))
        lines.append(f"{r['rule']:<22} {' '.join(r['overrides']) or '-':<50} {gain}")
    return lines


def _hardware(args: argparse.Namespace) -> int:
    from trainprof.errors import UserError
    from trainprof.hardware import CatalogError, bf16_gemm_basis, load_catalog

    try:
        cat = load_catalog(args.catalog)
    except CatalogError as err:
        raise UserError(str(err)) from None
    if args.json:
        print(json.dumps({"accelerators": cat.accelerators, "links": cat.links, "nodes": cat.nodes,
                          "collective_latency": cat.latency, "gpu_host_us_per_op": cat.host_us_per_op,
                          "files": cat.files}, indent=2))
        return 0
    keys = ("peak_bf16_dense_tflops", "mamf_bf16_tflops", "memory_gb", "memory_gbps")
    print(f"{'key':<16} {'name':<28} {'bf16 dense TF':>13} {'MAMF TF':>8} {'mem GB':>7} {'mem GB/s':>9}  "
          f"{'bf16 GEMMs at':<15} link")
    for key, acc in sorted(cat.accelerators.items()):
        vals = [acc.get(k, {}).get("value") if isinstance(acc.get(k), dict) else None for k in keys]
        cells = [f"{v:g}" if v is not None else "n/a" for v in vals]
        gemms = bf16_gemm_basis(acc)
        print(f"{key:<16} {acc['name'][:28]:<28} {cells[0]:>13} {cells[1]:>8} {cells[2]:>7} {cells[3]:>9}  "
              f"{gemms:<15} {acc.get('intra_node_link', '')}")
    print("\nlinks (GB/s per direction, latency class):")
    for key, link in sorted(cat.links.items()):
        print(f"  {key:<24} {link['gbps_per_direction']['value']:>7g}  {link.get('class', 'net'):<7} {link['name']}")
    print("\nnodes: " + ", ".join(f"{k} ({v['gpus_per_node']}x {v['accelerator']})" for k, v in sorted(cat.nodes.items())))
    if args.sources:
        print("\nsources:")
        for section in (cat.accelerators, cat.links, {"collective_latency": cat.latency["step_us"]}):
            for key, entry in sorted(section.items()):
                for fig_key, fig in entry.items():
                    if isinstance(fig, dict) and "source" in fig:
                        print(f"  {key}.{fig_key} = {fig['value']}: {fig['source']}")
    else:
        print("\n(every figure has a source: trainprof hardware --sources)")
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("project", help="predict other hardware, world sizes, model sizes and settings from one run",
                       description="Predict step time, tokens/s, MFU, scaling efficiency, per-GPU memory and fit, "
                       "time and cost to train, from one measured run dir, for catalog hardware (--to) and recipe "
                       "changes (key=value, model sizes included). Each prediction shows its confidence (validated "
                       "with an expected error, unvalidated, or low) and lists its assumptions. Every call writes "
                       "projection.json/md/csv/html/png to its own folder RUN_DIR/projections/<UTC time>-<label>/, "
                       "and the run's report.html lists them all.")
    p.add_argument("run_dir", help="a run dir written by `trainprof run`, `trainprof wrap` or a trainprof callback")
    p.add_argument("overrides", nargs="*",
                   help="recipe changes as dotted key=value, e.g. model.name=llama2-70b train.micro_batch_size=8; "
                        "re-derived: micro batch, seq_len, grad_accum, recompute, attention, model size "
                        "(model.name and its dims), engine (ZeRO stage, offload, kind), task (pretrain/LoRA/QLoRA) "
                        "and, from a CPU run, model.dtype; the step is null, with the reason, for other keys that "
                        "change a step (optimizer kind, ...)")
    p.add_argument("--to", default="this", help="comma-separated catalog keys (see `trainprof hardware`) or 'this' "
                   "(the machine the run was measured on; default)")
    p.add_argument("--nodes", type=positive_ints, default=None, help="node counts for catalog targets, e.g. 1,2,4 (default 1)")
    p.add_argument("--gpus-per-node", type=positive_int, default=None,
                   help="GPUs per node for catalog GPU targets (default 8; a node template such as hgx-h100 has its own)")
    p.add_argument("--nproc", type=positive_ints, default=None, help="world sizes for --to this (default: the run's)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="for --to this: intra-op threads of the target, a different CPU calibrated here")
    p.add_argument("--tokens", type=_tokens, default=None,
                   help="tokens to train, e.g. 2e12: adds the time to train and (with prices) total cost to the table")
    p.add_argument("--price", action="append", default=[], metavar="NAME=USD_PER_GPU_HOUR",
                   help="price of a catalog entry per GPU-hour (repeatable, or a comma list: h100-sxm=2.99,rtx4090=0.69)")
    p.add_argument("--prices", default=None, help="price file: prices: {NAME: {usd_per_gpu_hour, source, date}}")
    p.add_argument("--catalog", default=None, help="your own catalog YAML, merged over the shipped one")
    p.add_argument("--out", default=None, help="output dir (default: a new RUN_DIR/projections/<UTC time>-<label>/)")
    p.add_argument("--no-probe", action="store_true",
                   help="do not time the model's parts or engines on this machine (changed shapes are re-derived from "
                        "their GEMMs; engine and task changes on this machine are not predicted)")
    p.add_argument("--best", action="store_true",
                   help="per target and size, search micro batch (up to what fits with 10%% headroom), ZeRO stage, "
                        "recompute and offload (LoRA vs QLoRA for finetuning): the highest tokens/s and the lowest "
                        "$/M tokens, with runners-up (--to this searches micro batch and recompute and needs "
                        "train.memory_cap_gb)")
    p.add_argument("--table", choices=TABLES, default=None,
                   help="zhang2023: predicted versions of Zhang et al.'s (arXiv 2311.03687) Tables III (methods x "
                        "model size), IV (largest micro batch per method) and IX (LoRA/QLoRA) for the --to targets")
    p.add_argument("--advice", action="store_true",
                   help="project the advisor's recipe changes (report's 'What to change') on this machine: "
                        "RUN_DIR/projections/advice.json, and predicted gains in report.html")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_project)

    h = sub.add_parser("hardware", help="list the hardware catalog, every number with its source",
                       description="The accelerators, links and node templates `trainprof project` knows.")
    h.add_argument("--catalog", default=None, help="your own catalog YAML, merged over the shipped one")
    h.add_argument("--sources", action="store_true", help="print the source of every figure")
    h.add_argument("--json", action="store_true", help="print the catalog as JSON")
    h.set_defaults(func=_hardware)
    return p
