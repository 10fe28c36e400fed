"""scripts/memory_at_peak.py's replay of an allocator history (the CUDA run itself is in the GPU program)."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("memory_at_peak", Path(__file__).parents[1] / "scripts/memory_at_peak.py")
memory_at_peak = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory_at_peak)

F = "/x/site-packages/torch/nn/modules/linear.py"


def frame(filename, line=1, name="f"):
    return {"filename": filename, "line": line, "name": name}


def test_live_at_peak_finds_the_peak_and_charges_blocks_past_torch_internals():
    ds = frame("/x/site-packages/deepspeed/runtime/zero/stage3.py", 10, "step")
    mine = frame("/repo/trainprof/engines/torch_engine.py", 5, "forward")
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [frame(F), mine]},
        {"action": "alloc", "addr": 2, "size": 300, "frames": [ds]},
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "free_completed", "addr": 1, "size": 100},  # 300 live
        {"action": "alloc", "addr": 3, "size": 250, "frames": [ds]},  # 550: the peak
        {"action": "free_requested", "addr": 2, "size": 300, "frames": [frame(F), mine]},
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "free_completed", "addr": 3, "size": 250},  # 0 of the history's own left
    ]
    # 1000 bytes were live before the history began and still are at the end
    result = memory_at_peak.live_at_peak(trace, allocated_at_end=1000)
    assert result["peak_allocated_bytes"] == 1550
    assert result["allocated_before_history"] == 1000
    assert result["peak_event"] == 4
    [row] = result["live_at_peak"]
    assert row == {"where": "deepspeed/runtime/zero/stage3.py:10 step", "bytes": 550, "blocks": 2,
                   "freed_at": [{"where": "trainprof/engines/torch_engine.py:5 forward", "bytes": 300},
                                {"where": "(no frames)", "bytes": 250}]}
    assert memory_at_peak._where([frame(F), mine]) == "trainprof/engines/torch_engine.py:5 forward"


def test_the_peak_is_sought_from_the_first_step_and_frameless_blocks_group_by_size():
    step = frame("/repo/trainprof/run.py", 170, "run_steps")
    trace = [
        {"action": "alloc", "addr": 1, "size": 900},  # building the model: higher than any step
        {"action": "free_completed", "addr": 1, "size": 900},
        {"action": "alloc", "addr": 2, "size": 64},
        {"action": "alloc", "addr": 3, "size": 64},
        {"action": "alloc", "addr": 4, "size": 10, "frames": [step]},  # the first step: 138 live
        {"action": "free_completed", "addr": 4, "size": 10},
    ]
    result = memory_at_peak.live_at_peak(trace, allocated_at_end=128)
    assert (result["training_from_event"], result["peak_event"], result["peak_allocated_bytes"]) == (4, 4, 138)
    assert result["live_at_peak"][0] == {"where": "(no frames) blocks of 64 bytes", "bytes": 128, "blocks": 2,
                                         "freed_at": [{"where": "not freed in the history", "bytes": 128}]}
