"""`trainprof diff RUN_A RUN_B`: per-phase and per-module speedup of run B against run A (training run dirs),
or per-batch-size latencies and per-module prefill/decode time (inference run dirs)."""

from __future__ import annotations

import argparse
import sys


def noise_band(text: str) -> float:
    """--noise: a fraction (0.15) or a percentage (15%)."""
    try:
        value = float(text.rstrip("%")) / (100 if text.endswith("%") else 1)
    except ValueError:
        value = -1.0
    if not 0 <= value < 10:
        raise argparse.ArgumentTypeError(f"noise band must be a fraction like 0.15 or 15%, got '{text}'")
    return value


def min_ms(text: str) -> float:
    """--min-ms: a number of ms, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number of ms, 0 or more (0 judges every row), got '{text}'")
    return value


def _diff(args: argparse.Namespace) -> int:
    from trainprof.errors import UserError
    from trainprof.report.diff_report import FORMATS, check_out_dir, repeat_warning, run_diff, write_diff
    from trainprof.report.document import Document, render_markdown

    formats = tuple(f.strip() for f in args.format.split(",") if f.strip())
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise UserError(f"--format '{args.format}': choose one or more of {','.join(FORMATS)}")
    if args.out is not None:
        check_out_dir(args.out)  # before any output
    # without --out (or with csv alone) no file holds a plot, so none is made or linked
    plots = args.out is not None and bool({"md", "html"} & set(formats))
    # a RunDirError is the CLI's one-line error, exit 2
    d, doc = run_diff(args.run_a, args.run_b, stat=args.stat or "min", band=args.noise, min_ms=args.min_ms,
                      repeat=args.repeat, repeat_b=args.repeat_b, plots=plots)
    if args.stat is not None and d.stat == "p50":
        print(f"trainprof diff: warning: --stat {args.stat} does not apply to inference run dirs: their rows are p50s "
              "over requests (inference.json)", file=sys.stderr)
    for side, changes in d.repeat_changes.items():
        print(f"trainprof diff: warning: {repeat_warning(side, changes)}", file=sys.stderr)
    if args.out is None:
        print(render_markdown(doc))
        return 0
    # the files hold the tables; the terminal still says what was compared, on which machines
    print(render_markdown(Document(doc.title, doc.subtitle, sections=doc.sections[:1])))
    written = write_diff(d, doc, args.out, formats)
    print("trainprof diff: wrote " + ", ".join(str(p) for p in written.values()), file=sys.stderr)
    return 0


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("diff", help="per-phase and per-module speedup of run B against run A",
                       description="Compare two run dirs: step, phases, model parts and modules (matched by name) "
                       "with A ms, B ms, change, speedup and a verdict against a noise band (a row that changed by fewer "
                       "ms than the step's noise is within noise); beside them each side's collectives (calls, MiB, "
                       "exposed and issue-to-completion ms) and memory (peak, activations, model states: "
                       "diff.md/.html). Modules on one side only are listed. Two `trainprof infer` run dirs: p50 latencies and ms per output token "
                       "per batch size, memory, and modules' prefill and decode-step time. Prints Markdown, or "
                       "writes diff.md/.html/.csv with --out.")
    p.add_argument("run_a", metavar="RUN_A", help="baseline run dir")
    p.add_argument("run_b", metavar="RUN_B", help="run dir compared against the baseline")
    p.add_argument("--out", default=None, help="directory to write diff.md, diff.html, diff.csv into")
    p.add_argument("--format", default="md,html,csv", help="with --out: any of md,html,csv (default all)")
    p.add_argument("--stat", choices=("min", "median"), default=None,
                   help="min: each row's fastest measured step (default; time stolen by other processes only "
                        "adds); median: the profiles' own medians (training run dirs; inference ones compare p50s)")
    p.add_argument("--repeat", metavar="RUN_A2", default=None,
                   help="a repeat of RUN_A (same recipe, same machine): the noise band is measured from A vs A2")
    p.add_argument("--repeat-b", metavar="RUN_B2", default=None,
                   help="a repeat of RUN_B, measured the same way; with both, the wider band is taken (a slow "
                        "spell of the machine during one run shows only on its side)")
    p.add_argument("--noise", type=noise_band, default=None,
                   help="ratio counted as noise, e.g. 0.15 or 15%% (default: from --repeat and --repeat-b; else, for "
                        "two GPU runs, 1.5x the wider of their step-time spreads; else the default measured on CPU "
                        "runs, docs/reports.md, widened to 1.5x the wider step-time spread where that is more; a run "
                        "with under 4 steps has none, and the other's alone widens it)")
    p.add_argument("--min-ms", type=min_ms, default=None,
                   help="rows under this many ms in both runs are not judged (default 1 for training run dirs, 0 for "
                        "inference ones)")
    p.set_defaults(func=_diff)
    return p
