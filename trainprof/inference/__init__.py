"""Inference profiling (`trainprof infer`): serving metrics and a prefill/decode breakdown of HF generate."""
