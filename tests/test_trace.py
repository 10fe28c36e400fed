"""Kineto traces: the streaming reader against json.load, what the recorded 2-rank traces carry
(ProfilerStep markers, distributedInfo, module and phase ranges named as in profile.json), that they
stay valid Chrome/Perfetto JSON, and Holistic Trace Analysis loading them."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

from trainprof.analysis import trace as T

DATA = Path(__file__).parent / "data"
RUN = DATA / "zero3_2rank"
TRACES = sorted((RUN / "tb").glob("*.pt.trace.json.gz"))
PROFILE = json.loads((RUN / "profile.json").read_text())


def _load(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_streaming_reader_matches_json_load_at_any_chunk_size(tmp_path, monkeypatch):
    doc = _load(TRACES[0])
    small = {**doc, "traceEvents": doc["traceEvents"][:300]}
    path = tmp_path / "small.pt.trace.json"
    path.write_text(json.dumps(small, indent=1))
    for chunk in (17, 1000, 1 << 20):  # values split across refills, incl. numbers cut mid-digit
        monkeypatch.setattr(T, "CHUNK_CHARS", chunk)
        assert list(T.iter_events(path)) == small["traceEvents"]
        assert {k: v for k, v in T.iter_trace(path) if k != "event"} == \
            {k: v for k, v in small.items() if k != "traceEvents"}
    monkeypatch.setattr(T, "CHUNK_CHARS", 1 << 20)
    assert list(T.iter_events(TRACES[0])) == doc["traceEvents"]  # gzip, streamed


@pytest.mark.parametrize("text, where", [('{"traceEvents": [{"ph": "X"}, {"ph"', "truncated"),
                                         ('[{"ph": "X"}]', "expected '{'"),
                                         ('{"traceEvents": [1 2]}', "expected ',' or ']'")])
def test_reader_names_what_is_wrong(tmp_path, text, where):
    path = tmp_path / "bad.pt.trace.json"
    path.write_text(text)
    with pytest.raises(T.TraceFormatError, match=where):
        list(T.iter_trace(path))


def test_a_cut_short_or_undecodable_gzip_trace_is_a_format_error(tmp_path):
    """A .gz cut mid-stream (a copy stopped early) and one that is not gzip at all are TraceFormatErrors naming
    the file, as a cut-short JSON trace is, not EOFError or OSError."""
    cut, foreign = tmp_path / "rank0.2.pt.trace.json.gz", tmp_path / "rank0.3.pt.trace.json.gz"
    cut.write_bytes(TRACES[0].read_bytes()[:3000])
    foreign.write_text("x")
    for path in (cut, foreign):
        with pytest.raises(T.TraceFormatError, match=f"{path}: the gzip stream is cut short or damaged"):
            list(T.iter_trace(path))


def test_each_rank_has_a_trace_in_the_plugin_layout_with_steps_and_distributed_info():
    assert [p.name.split(".")[0] for p in TRACES] == ["rank0", "rank1"]  # worker = rank<N>, span = timestamp
    traced = PROFILE["ops_info"]["trace_steps"]
    assert traced == [1, 2] and PROFILE["ops_info"]["schedule"] == {"wait": 0, "warmup": 1, "active": 2,
                                                                    "first_step": 0}
    for rank, path in enumerate(TRACES):
        s = T.summarize_trace(path)
        assert (s.rank, s.world_size) == (rank, 2)
        assert s.distributed_info["backend"] == "gloo"
        assert sorted(s.steps) == traced  # ProfilerStep#N uses profile.json's step numbers
        assert s.metadata["trainprof"]["steps"] == traced
        assert s.bytes_per_step == pytest.approx(path.stat().st_size / 2)


def test_module_and_phase_ranges_are_named_as_in_profile_json():
    s = T.summarize_trace(TRACES[0])
    ranges = {T.parse_range_name(n) for n in s.ranges_ms}
    for m in PROFILE["modules"]:
        if m["calls"]:
            assert ("forward", m["name"]) in ranges, m["name"]
        if m["backward_ms"] > 0 and m["params_trainable"]:
            assert ("backward", m["name"]) in ranges, m["name"]
    assert {("backward", None), ("optimizer", None), ("data_wait", None)} <= ranges
    # the trace agrees with the profile on where the time goes: the model's forward range per step
    # is within 50% of its profiled forward time (traced steps are slower; the profile excludes them)
    per_step = s.ranges_ms["trainprof::forward::<model>"] / len(s.steps)
    root = next(m for m in PROFILE["modules"] if m["name"] == "")
    assert 0.5 * root["forward_ms"] < per_step < 3 * root["forward_ms"]


def test_traces_are_valid_chrome_trace_json():
    for path in TRACES:
        doc = _load(path)
        assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
        for ev in doc["traceEvents"]:
            assert isinstance(ev["name"], str) and ev["ph"] in {"X", "B", "E", "i", "I", "M", "s", "f", "t", "C"}
            assert isinstance(ev["pid"], (int, str)) and isinstance(ev["tid"], (int, str))
            if ev["ph"] == "X":
                assert isinstance(ev["ts"], (int, float)) and isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
        assert doc["displayTimeUnit"] in ("ms", "ns")


def test_find_traces_and_absent_tb(tmp_path):
    assert T.find_traces(RUN) == TRACES
    assert T.find_traces(tmp_path) == []


@pytest.mark.filterwarnings("ignore")  # HTA (0.5 and 0.6) calls pandas APIs that pandas 3 deprecates
def test_holistic_trace_analysis_loads_the_two_rank_trace(tmp_path):
    """HTA parses both ranks (rank from distributedInfo) and finds the ProfilerStep iterations. Its
    GPU-kernel analyses need CUDA kernels, which a CPU-only trace does not have: they fail, and the
    test pins down how, so a change in that behaviour is noticed."""
    # HTA is published as `traceinsight` (>= 0.6; `holistictraceanalysis` <= 0.5); both import as `hta`
    hta = pytest.importorskip("hta.trace_analysis", reason="HTA is not installed (pip install traceinsight)")
    tb = tmp_path / "tb"
    shutil.copytree(RUN / "tb", tb)
    # HTA leaves out the last ProfilerStep by default (it may be incomplete): ask for both traced steps
    analysis = hta.TraceAnalysis(trace_dir=str(tb), include_last_profiler_step=True)
    assert sorted(analysis.t.traces) == [0, 1]
    assert analysis.get_profiler_steps() == [1, 2]
    df = analysis.t.get_trace(1)
    assert {1, 2} <= set(int(i) for i in df["iteration"].unique())
    assert analysis.t.meta_data[1]["distributedInfo"]["rank"] == 1
    kernels, _ = analysis.get_gpu_kernel_breakdown(visualize=False)
    assert kernels.empty  # CPU only: no GPU kernels to break down
    with pytest.raises(IndexError):  # temporal breakdown indexes the first GPU kernel: there is none
        analysis.get_temporal_breakdown(visualize=False)
    with pytest.raises(ValueError, match="No objects to concatenate"):  # idle time per GPU stream: none
        analysis.get_idle_time_breakdown(visualize=False)




def _two_matmuls(x):
    return (x @ x) @ x


def _fork_and_wait(x):
    return torch.jit.wait(torch.jit.fork(_two_matmuls, x))


def test_ops_of_another_thread_count_for_the_step_they_ran_in():
    """On CUDA the autograd engine runs backward on its own device thread, outside the thread that holds
    the `ProfilerStep#N` marker (seen on an H100: the backward matmuls were missing from ops.csv). A
    TorchScript fork runs on an inter-op thread with the profiler on, the same situation on CPU: its ops
    count for the step whose span holds them."""
    from trainprof.profiler.ops import aggregate_events

    run = torch.jit.script(_fork_and_wait)
    a = torch.randn(128, 128)
    run(a)
    traced = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=torch.profiler.schedule(wait=0, warmup=1, active=2),
                                on_trace_ready=lambda p: traced.append(p.events())) as prof:
        for _ in range(3):
            torch.add(a, a)
            run(a)
            prof.step()
    events = traced[0]
    forked = [e for e in events if e.name == "aten::mm"]
    assert forked and {e.thread for e in forked}.isdisjoint({e.thread for e in events if e.name == "aten::add"})
    per_step = aggregate_events(events, {}, cuda=False, by_step=True)
    assert len(per_step) == 2
    for rows in per_step.values():
        assert [r["calls"] for r in rows if r["name"] == "aten::mm"] == [2]
        assert [r["calls"] for r in rows if r["name"] == "aten::add"] == [1]


def test_kernels_no_operator_launched_get_rows_of_their_own():
    """bitsandbytes' dequantize and DeepSpeed's fused Adam call the CUDA driver themselves: Kineto links
    their kernels to the innermost profiler range (a trainprof module range) instead of an aten op. On an
    H200 QLoRA step they were 88.6 of 290.4 device ms, missing from the ops table. The events here are
    a real CPU trace's; the kernels are appended as Kineto's parser appends them on a GPU."""
    from trainprof.analysis.records import RANGE_PREFIX
    from trainprof.profiler.ops import KERNEL_PREFIX, aggregate_events

    name = RANGE_PREFIX + "model.layers.0.fwd"
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function(name):
            torch.mm(a, a)
    events = prof.events()
    rng = next(e for e in events if e.name == name)
    mm = next(e for e in events if e.name == "aten::mm")
    for ev in events:
        ev.use_device = "cuda"
    rng.append_kernel("kDequantizeBlockwise", 0, 300.0)  # us, as FunctionEvent keeps durations
    mm.append_kernel("nvjet_gemm", 0, 100.0)
    # the parser also links an op's kernels to non-op events (an H100 step's AdamW kernels, many times
    # over): a kernel name an aten op launched is the op's alone
    rng.append_kernel("nvjet_gemm", 0, 100.0)
    rows = aggregate_events(events, {name: ("model.layers.0", "forward")}, cuda=True)
    by_name = {r["name"]: r for r in rows}
    assert by_name[KERNEL_PREFIX + "kDequantizeBlockwise"]["self_ms"] == pytest.approx(0.3)
    assert by_name[KERNEL_PREFIX + "kDequantizeBlockwise"]["module"] == "model.layers.0"
    assert by_name[KERNEL_PREFIX + "kDequantizeBlockwise"]["phase"] == "forward"
    assert by_name["aten::mm"]["self_ms"] == pytest.approx(0.1)
    assert sum(r["self_ms"] for r in rows) == pytest.approx(0.4)  # nothing counted twice
    assert not any(r["name"].startswith(KERNEL_PREFIX) for r in aggregate_events(events, {}, cuda=False))


# -- trainprof replay: what it reads, and what it says beside its figures ----------------------------------------
PROFILES = Path(__file__).resolve().parents[1] / "profiles"


def _gpu_trace(name: str) -> Path:
    return next(PROFILES.joinpath(name).glob("rank0.*.pt.trace.json.gz"))


def test_replay_takes_any_trace_file_and_refuses_what_is_not_one_in_one_line(tmp_path, cli):
    """A trace file given by name is replayed whatever it is called; a file that is not a trace (Markdown, a
    stray line, a cut-short .gz) is one line naming it, exit 2."""
    renamed = tmp_path / "mytrace.pt.trace.json.gz"
    shutil.copy(_gpu_trace("h100-llama7b_lora"), renamed)
    out = cli("replay", renamed)
    assert out.returncode == 0 and out.stdout.startswith(f"{renamed}: host gaps x 0.5"), out.stderr
    stray, cut = tmp_path / "rank0.1.pt.trace.json", tmp_path / "rank0.2.pt.trace.json.gz"
    stray.write_text("x\n")
    cut.write_bytes(renamed.read_bytes()[:3000])
    for path in (PROFILES / "README.md", stray, cut):
        bad = cli("replay", path)
        assert bad.returncode == 2 and bad.stdout == "" and len(bad.stderr.splitlines()) == 1, bad.stderr
        assert str(path) in bad.stderr and "not a readable Kineto trace" in bad.stderr


def test_replay_confidence_is_the_runs_own_case_else_its_pairs_else_unvalidated():
    """From replay cases as validation_gpu.json keeps them: a run with its own case reads that case's error; a
    run of a validated pair of GPUs without one reads the pair's errors; any other pair is unvalidated."""
    from trainprof.analysis.replay import replay_confidence

    cases = [{"source": "h100-x", "target": "h200-x", "hardware": "h200", "predicted_step_ms": 120.0,
              "measured_step_ms": 100.0, "step_error_pct": 20.0},
             {"source": "h200-x", "target": "h100-x", "hardware": "h100-sxm", "predicted_step_ms": 90.0,
              "measured_step_ms": 100.0, "step_error_pct": -10.0},
             {"source": "h100-y", "target": "h200-y", "hardware": "h200", "predicted_step_ms": 95.0,
              "measured_step_ms": 100.0, "step_error_pct": -5.0},
             {"source": "h200-y", "target": "h100-y", "hardware": "h100-sxm", "predicted_step_ms": 100.0,
              "measured_step_ms": 100.0, "step_error_pct": 0.0}]
    own = replay_confidence(cases, "h100-x", "h100-sxm", "h200")
    assert own.label == "measured" and own.errors_pct == (20.0,) and own.measured_run == "h200-x"
    assert "replay's measured error on this run -> h200: +20.0%" in own.text
    pair = replay_confidence(cases, "h100-z", "h100-sxm", "h200")
    assert pair.label == "pair" and pair.errors_pct == (20.0, -5.0)
    assert "h100-sxm -> h200 measured on 2 other runs: -5.0% to +20.0%, mean |error| 12.5%" in pair.text
    other = replay_confidence(cases, "h100-x", "h100-sxm", "rtx4090")
    assert other.label == "unvalidated" and other.errors_pct == ()
    assert other.text.startswith("unvalidated: h100-sxm -> rtx4090 never validated")
    assert "h100-sxm and h200" in other.text


def test_replay_to_another_gpu_says_its_confidence_on_the_prediction_line(cli):
    """The LoRA run's own case (+28.8% in docs/projection.md) is on its --to h200 line; an RTX 4090, which no
    replay case ran on, reads unvalidated, as `trainprof project` does."""
    from trainprof.projection.validation import GPU_VALIDATION_FILE

    case = next(c for c in json.loads(GPU_VALIDATION_FILE.read_text())["replay_cases"]
                if c["source"] == "h100-llama7b_lora" and c["hardware"] == "h200")
    out = cli("replay", PROFILES / "h100-llama7b_lora", "--to", "h200")
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("on h200:"))
    assert f"ms a step; replay's measured error on this run -> h200: {case['step_error_pct']:+.1f}%" in line
    assert "+28.8%" in line
    far = cli("replay", PROFILES / "h200-llama1b_zero3_sdpa-torch-gpubound", "--to", "rtx4090")
    line = next(ln for ln in far.stdout.splitlines() if ln.startswith("on rtx4090:"))
    assert "unvalidated: h200 -> rtx4090 never validated" in line


def test_replay_says_a_faster_gpu_stops_at_the_traced_host_and_how_much_tracing_inflated_it(cli):
    """H100 ZeRO-3 (traced step +49% on the untraced one): a GPU 10x as fast replays to the traced host's time,
    and the line says so, with tracing's inflation of that host bounded by the untraced median step."""
    from trainprof.analysis.replay import load_steps, replay
    from trainprof.io import profile_file, read_json

    run = PROFILES / "h100-llama1b_zero3_sdpa-gpubound"
    (step,) = load_steps(_gpu_trace(run.name))
    floored = replay(step, device_scale=lambda op: 0.1)
    assert floored.step_ms == floored.host_ms  # the what-if stopped at the host
    untraced = read_json(profile_file(run))["summary"]["step_ms"]["median"]
    out = cli("replay", run, "--device-scale", "0.1")
    assert out.returncode == 0, out.stderr
    note = next(ln for ln in out.stdout.splitlines() if ln.startswith("'GPU x0.1' stops at the traced host"))
    assert f"it took {floored.host_ms:.1f} ms (step {step.step})" in note
    assert f"tracing inflated that host by at least {floored.host_ms / untraced - 1:+.0%}" in note and "+46%" in note
