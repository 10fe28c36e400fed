"""What is live on the GPU when a run's allocated memory peaks, summed by the code that allocated it.

    python3 -m torch.distributed.run --nproc_per_node 1 scripts/memory_at_peak.py [--no-stacks] OUT.json RECIPE [KEY=VALUE...]

`trainprof plan` misses some GPU peaks (docs/memory.md: QLoRA, LoRA, ZeRO-3 with recompute). This runs the
recipe in this process with the CUDA caching allocator's history on (torch.cuda.memory._record_memory_history,
Python frames), then finds the moment the allocated bytes peaked and writes the blocks live then, grouped by
the innermost frames outside torch's own internals (DeepSpeed, bitsandbytes, peft, transformers, trainprof,
torch.optim...), each group with where its blocks were freed afterwards (what held them). The peak is
sought from the first step on (model building can peak higher, e.g. 4-bit
quantization on the GPU). --no-stacks records no frames (blocks are then grouped by size): torch 2.11's
history with Python stacks fails DeepSpeed ZeRO-3 under activation checkpointing (pytorch#179536).
Without CUDA it writes nothing and exits 2 with the reason.
"""
from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

# torch internals say where, not why: a block is charged to the first frame outside them
_INTERNAL = ("/torch/nn/modules/", "/torch/autograd/", "/torch/_tensor", "/torch/utils/_", "/torch/_ops",
             "/torch/functional", "/torch/nn/functional", "/torch/_refs", "/torch/_prims", "/torch/cuda/",
             "/torch/overrides", "/torch/_compile", "/torch/_dynamo", "<frozen", "/runpy.py", "/contextlib.py",
             "/functools.py", "/threading.py")
TOP = 40


def _where(frames: list[dict], depth: int = 3) -> str:
    """The innermost `depth` frames outside torch internals, innermost first ("?" when none were recorded)."""
    kept = [f for f in frames if not any(s in f.get("filename", "") for s in _INTERNAL)]
    if not kept:
        kept = frames
    return " < ".join(f"{_short(f['filename'])}:{f['line']} {f['name']}" for f in kept[:depth]) or "?"


def _short(filename: str) -> str:
    for root in ("site-packages/", "dist-packages/", "/trainprof/"):
        if root in filename:
            return filename.split(root, 1)[1] if root != "/trainprof/" else "trainprof/" + filename.split(root, 1)[1]
    return filename


TRAINING = "run_steps"  # trainprof.run's step loop: a frame with this name marks the training window


def _key(event: dict) -> str:
    frames = event.get("frames") or []
    return _where(frames) if frames else f"(no frames) blocks of {event['size']:,} bytes"


def live_at_peak(trace: list[dict], allocated_at_end: int) -> dict:
    """Replay one device's allocator history: the allocated bytes' peak and the blocks live then.

    The peak is sought from the first event inside trainprof's step loop, where frames say so (else over
    the whole history). The history may start after some blocks were allocated (a full ring buffer); those
    are reported as `allocated_before_history`. `allocated_at_end` anchors the absolute level."""
    start = next((i for i, e in enumerate(trace)
                  if any(f.get("name") == TRAINING for f in e.get("frames") or [])), 0)
    level = peak = 0
    peak_index = -1
    for i, event in enumerate(trace):
        action = event["action"]
        if action == "alloc":
            level += event["size"]
        elif action == "free_completed":
            level -= event["size"]
        else:
            continue
        if i >= start and (peak_index < 0 or level > peak):
            peak, peak_index = level, i
    offset = allocated_at_end - level  # bytes live throughout that the history never saw allocated
    live: dict[int, tuple[int, str]] = {}  # replayed again to the peak: the blocks live there
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _key(event))
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    # where each of those blocks was let go after the peak (the frames of its free request: where its last
    # reference went, so what held it); "not freed" when the history ends first
    freed = {addr: "not freed in the history" for addr in live}
    for event in trace[peak_index + 1:]:
        if event["action"] in ("free_requested", "free_completed") and \
                freed.get(event["addr"]) == "not freed in the history":
            freed[event["addr"]] = _where(event["frames"]) if event.get("frames") else "(no frames)"
    groups: dict[str, list] = defaultdict(lambda: [0, 0, defaultdict(int)])
    for addr, (size, where) in live.items():
        groups[where][0] += size
        groups[where][1] += 1
        groups[where][2][freed[addr]] += size
    rows = sorted(({"where": w, "bytes": b, "blocks": n,
                    "freed_at": [{"where": f, "bytes": fb} for f, fb in sorted(sites.items(), key=lambda x: -x[1])[:3]]}
                   for w, (b, n, sites) in groups.items()), key=lambda r: -r["bytes"])
    return {"peak_allocated_bytes": peak + offset, "allocated_before_history": offset,
            "events": len(trace), "training_from_event": start, "peak_event": peak_index,
            "peak_event_where": _key(trace[peak_index]) if peak_index >= 0 else None,
            "live_at_peak": rows[:TOP], "live_at_peak_other_bytes": sum(r["bytes"] for r in rows[TOP:])}


def main(argv: list[str]) -> int:
    stacks = "python"
    if argv[:1] == ["--no-stacks"]:
        stacks, argv = None, argv[1:]
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    out, run_args = Path(argv[0]), argv[1:]
    import torch

    if not torch.cuda.is_available():
        print("memory_at_peak: no CUDA device; the allocator history is a CUDA feature")
        return 2
    if stacks:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks=stacks)
    else:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)
    from trainprof.run import main as run_main

    rc = run_main(run_args)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    at_end = sum(b["size"] for seg in snapshot["segments"] if seg["device"] == device
                 for b in seg["blocks"] if b["state"] == "active_allocated")
    result = live_at_peak(snapshot["device_traces"][device], at_end)
    result.update(run_rc=rc, run_args=run_args,
                  method=f"torch.cuda.memory._record_memory_history(stacks={stacks!r}); live blocks at the "
                         "allocated peak (from the first step on), grouped by their innermost frames outside "
                         "torch internals (by size without frames)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    gib = 2.0 ** 30
    print(f"peak allocated {result['peak_allocated_bytes'] / gib:.2f} GiB; live then:")
    for row in result["live_at_peak"][:15]:
        print(f"  {row['bytes'] / gib:7.2f} GiB {row['blocks']:6d}  {row['where']}")
        print(f"  {'':7s}     freed at: {row['freed_at'][0]['where']}")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
