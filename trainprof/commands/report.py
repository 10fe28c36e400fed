"""`trainprof report RUN_DIR...`: write report.md, report.html and the TensorBoard scalars of runs."""

from __future__ import annotations

import argparse
import sys
import time


def _report(args: argparse.Namespace) -> int:
    """Each run dir in turn; a part that cannot be made (a package missing) is one line and exit 2, after
    the other parts and the other run dirs are written."""
    from trainprof.report.run_report import TRACE_SCAN_BYTES, ReportIncomplete, write_reports

    code = 0
    for run_dir in args.run_dirs:  # a RunDirError is the CLI's one-line error, exit 2
        start = time.perf_counter()
        try:
            written = write_reports(run_dir, scalars=not args.no_scalars,
                                    trace_scan_bytes=2**62 if args.scan_traces else TRACE_SCAN_BYTES)
        except ReportIncomplete as err:
            print(f"trainprof: {err}", file=sys.stderr)
            code = 2
            continue
        took = time.perf_counter() - start
        names = ", ".join(str(p) for k, p in written.items() if k in ("md", "html"))
        refreshed = [f"{written['summary'].name} and the CSV tables"] if "summary" in written else []
        refreshed += [f"the TensorBoard scalars in {written['scalars']}"] if "scalars" in written else []
        also = f"; refreshed {' and '.join(refreshed)}" if refreshed else ""
        print(f"trainprof report: wrote {names}{also} ({took:.1f} s)", file=sys.stderr)
    return code


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("report", help="report.md + self-contained report.html of a run dir",
                       description="Write report.md (plots in report_plots/) and a self-contained report.html "
                       "(no network needed to view it) into each run dir, and refresh its TensorBoard scalars "
                       "in tb/. Parts a run dir lacks are named in the report.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (runs/<name>-<timestamp>/)")
    p.add_argument("--no-scalars", action="store_true", help="do not (re)write the TensorBoard scalars in tb/")
    p.add_argument("--scan-traces", action="store_true",
                   help="read every trace under tb/ (streaming) even when over 32 MiB; slower on GB traces")
    p.set_defaults(func=_report)
    return p
