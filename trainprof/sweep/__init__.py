"""Sweeps, max-batch searches and scaling reports: many runs of one recipe, each a process
(torchrun for several ranks).

    spec.py      sweep files -> cells (a base recipe plus overrides, a world size), validated up front
    launch.py    one cell as a process tree (torchrun's, or one rank): own session, timeout, signals, no orphans
    outcome.py   what a finished cell left behind: a metrics row from profile.json or a failure record
    state.py     the resumable state file (atomic after every cell)
    runner.py    runs cells in order with a progress bar; skips finished ones; SIGINT-safe
    report.py    the sweep table (one row per cell) and its bar chart (drawn with report/tables.py, report/plots.py)
    maxbatch.py  the largest micro batch that fits: doubling, then bisection
    scaling.py   throughput and scaling efficiency per world size, and where the lost part went
"""
