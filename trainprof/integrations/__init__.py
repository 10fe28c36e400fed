"""Profile training that trainprof does not drive: HF Trainer and Lightning callbacks, DeepSpeed engine
instrumentation, and the session they share (one optimizer step = one profiled step; run dir on exit)."""
