"""Reports: everything rendered from a run dir. rundir.py reads it; sections.py builds the sections that
summary.md (summary.py), report.md/html (run_report.py) and the terminal summary share; document.py
renders them; tables.py and plots.py draw row tables and charts for sweeps, scaling and projections;
tensorboard.py writes the scalars; diff_report.py and pipeline.py add their own sections."""
