"""Reports: summary.md and CSV tables of a profile (plots and TensorBoard writers live beside them)."""
