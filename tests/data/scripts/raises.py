"""Raises after printing a line: `python -m trainprof.wrap` must exit non-zero with the traceback."""
print("raises is about to fail")
raise RuntimeError("boom from the wrapped script")
