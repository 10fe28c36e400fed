"""Helpers for the profiler tests: synthetic models with known costs and scripts launched by torchrun."""
