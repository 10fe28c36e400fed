"""Turning recorded profiler events into numbers: step breakdown and closure, aggregation over steps and
the module tree, and the merge of per-rank profiles."""
