"""`trainprof project RUN_DIR [key=value ...]`: predict step time, throughput, memory and cost on other
hardware, world sizes and settings from one measured run; `trainprof hardware` lists the catalog."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trainprof.commands.run import positive_int


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of positive integers, e.g. 1,2,4")
    return values


def _tokens(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a positive token count, e.g. 2e10")
    return value


def _project(args: argparse.Namespace) -> int:
    from trainprof.errors import UserError
    from trainprof.projection.catalog import CatalogError, load_prices
    from trainprof.projection.project import ProjectionError, project
    from trainprof.projection.report import render_short, write_projection

    if args.advice:
        return _advice(args)
    targets = [t.strip() for t in args.to.split(",") if t.strip()]
    try:
        prices = load_prices(args.prices, args.price)
        result = project(args.run_dir, targets=targets, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         nproc=args.nproc, overrides=args.overrides, tokens=args.tokens, catalog_file=args.catalog,
                         prices=prices, threads=args.threads, probe=not args.no_probe, progress=not args.json)
    except (CatalogError, ProjectionError) as err:
        raise UserError(str(err)) from None
    out_dir = Path(args.out) if args.out else Path(args.run_dir) / "projection"
    paths = write_projection(result, out_dir)
    if not args.out:  # the run's report.html gains the projected section
        from trainprof.report.run_report import write_reports

        paths.append(write_reports(args.run_dir, scalars=False)["html"])
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(render_short(result))
        print(f"\nwrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def _advice(args: argparse.Namespace) -> int:
    """`--advice`: project each of the advisor's recipe changes; RUN_DIR/projection/advice.json, which
    the run report's "What to change" table reads for its predicted gains."""
    from trainprof.errors import UserError
    from trainprof.io import atomic_write_json
    from trainprof.projection.project import ProjectionError, project_advice

    if args.overrides or args.to != "this":
        raise UserError("--advice projects the advisor's own changes on the run's machine; drop the overrides and --to")
    try:
        rows = project_advice(args.run_dir, probe=not args.no_probe, progress=not args.json)
    except ProjectionError as err:
        raise UserError(str(err)) from None
    out_dir = Path(args.out) if args.out else Path(args.run_dir) / "projection"
    atomic_write_json(out_dir / "advice.json", {"advice": rows})
    paths = [out_dir / "advice.json"]
    if not args.out:
        from trainprof.report.run_report import write_reports

        paths.append(write_reports(args.run_dir, scalars=False)["html"])
    if args.json:
        print(json.dumps({"advice": rows}, indent=2, default=str))
    else:
        for r in rows:
            gain = f"{100 * r['predicted_gain']:+.1f}% tokens/s" if r["predicted_gain"] is not None else r.get("reason")
            print(f"{r['rule']:<22} {' '.join(r['overrides']) or '-':<50} {gain}")
        if not rows:
            print("nothing triggered: no advice to project")
        print(f"\nwrote {', '.join(str(p) for p in paths)}", file=sys.stderr)
    return 0


def _hardware(args: argparse.Namespace) -> int:
    from trainprof.errors import UserError
    from trainprof.projection.catalog import CatalogError, load_catalog

    try:
        cat = load_catalog(args.catalog)
    except CatalogError as err:
        raise UserError(str(err)) from None
    if args.json:
        print(json.dumps({"accelerators": cat.accelerators, "links": cat.links, "nodes": cat.nodes,
                          "files": cat.files}, indent=2))
        return 0
    keys = ("peak_bf16_dense_tflops", "mamf_bf16_tflops", "memory_gb", "memory_gbps")
    print(f"{'key':<16} {'name':<28} {'bf16 dense TF':>13} {'MAMF TF':>8} {'mem GB':>7} {'mem GB/s':>9}  link")
    for key, acc in sorted(cat.accelerators.items()):
        vals = [acc.get(k, {}).get("value") if isinstance(acc.get(k), dict) else None for k in keys]
        cells = [f"{v:g}" if v is not None else "n/a" for v in vals]
        print(f"{key:<16} {acc['name'][:28]:<28} {cells[0]:>13} {cells[1]:>8} {cells[2]:>7} {cells[3]:>9}  "
              f"{acc.get('intra_node_link', '')}")
    print("\nlinks (GB/s per direction):")
    for key, link in sorted(cat.links.items()):
        print(f"  {key:<24} {link['gbps_per_direction']['value']:>7g}  {link['name']}")
    print("\nnodes: " + ", ".join(f"{k} ({v['gpus_per_node']}x {v['accelerator']})" for k, v in sorted(cat.nodes.items())))
    if args.sources:
        print("\nsources:")
        for section in (cat.accelerators, cat.links):
            for key, entry in sorted(section.items()):
                for fig_key, fig in entry.items():
                    if isinstance(fig, dict) and "source" in fig:
                        print(f"  {key}.{fig_key} = {fig['value']}: {fig['source']}")
    else:
        print("\n(every figure has a source: trainprof hardware --sources)")
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("project", help="predict other hardware, world sizes and settings from one measured run",
                       description="Predict step time, tokens/s, MFU, scaling efficiency, per-rank memory and fit, "
                       "time and cost to train, from one measured run dir, for catalog hardware (--to) and recipe "
                       "changes (key=value). Each prediction states its expected error and assumptions. Writes "
                       "projection.json/md/csv/html/png to RUN_DIR/projection/.")
    p.add_argument("run_dir", help="a run dir written by `trainprof run` (profile.json + recipe.yaml)")
    p.add_argument("overrides", nargs="*",
                   help="recipe changes as dotted key=value, e.g. train.micro_batch_size=8; re-derived: micro batch, "
                        "seq_len, grad_accum, recompute, attention, engine (ZeRO stage, offload, kind) and task "
                        "(pretrain/LoRA/QLoRA); the step is null, with the reason, for other keys that change a step "
                        "(model size or dtype, optimizer kind, ...)")
    p.add_argument("--to", default="this", help="comma-separated catalog keys (see `trainprof hardware`) or 'this' "
                   "(the machine the run was measured on; default)")
    p.add_argument("--nodes", type=_int_list, default=[1], help="node counts for catalog targets, e.g. 1,2,4 (default 1)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node for catalog targets (default 8)")
    p.add_argument("--nproc", type=_int_list, default=None, help="world sizes for --to this (default: the run's)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="for --to this: intra-op threads of the target, a different CPU calibrated here")
    p.add_argument("--tokens", type=_tokens, default=None, help="tokens to train, for time and cost (e.g. 2e10)")
    p.add_argument("--price", action="append", default=[], metavar="NAME=USD_PER_GPU_HOUR",
                   help="price of a catalog entry per GPU-hour (repeatable)")
    p.add_argument("--prices", default=None, help="price file: prices: {NAME: {usd_per_gpu_hour, source, date}}")
    p.add_argument("--catalog", default=None, help="your own catalog YAML, merged over the shipped one")
    p.add_argument("--out", default=None, help="output dir (default RUN_DIR/projection)")
    p.add_argument("--no-probe", action="store_true", help="do not time the model's layers on this machine")
    p.add_argument("--advice", action="store_true",
                   help="project the advisor's recipe changes (report's 'What to change') on this machine: "
                        "RUN_DIR/projection/advice.json, and predicted gains in report.html")
    p.add_argument("--json", action="store_true", help="print projection.json to stdout")
    p.set_defaults(func=_project)

    h = sub.add_parser("hardware", help="list the hardware catalog, every number with its source",
                       description="The accelerators, links and node templates `trainprof project` knows.")
    h.add_argument("--catalog", default=None, help="your own catalog YAML, merged over the shipped one")
    h.add_argument("--sources", action="store_true", help="print the source of every figure")
    h.add_argument("--json", action="store_true", help="print the catalog as JSON")
    h.set_defaults(func=_hardware)
    return p
