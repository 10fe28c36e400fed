"""`train.cpu_allocator`: with `cache`, glibc keeps what a CPU step frees, so the next step does not
page-fault its tensors in again (as a GPU's caching allocator keeps device memory); a run records the
allocator it ran with, and a projection probes with the one its source ran with."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

from conftest import QUICKSTART, REPO
from helpers.checks import retry_on_noise
from trainprof.projection.source import ran_allocator
from trainprof.recipe import load_recipe

# the quickstart's bare model (2 layers, micro batch 4, seq 256), called as a run's steps call it, in a
# fresh process under each allocator; prints the minor page faults of each call
STEPS = """
import json, resource, sys, torch
from trainprof.env import apply_host_allocator, host_allocator
from trainprof.projection.probes import ProbeShape, _forward_backward_ms, bare_model
from trainprof.recipe import load_recipe
torch.set_num_threads(1)
apply_host_allocator(torch.device("cpu"), sys.argv[2])
recipe = load_recipe(sys.argv[1], [])
model, batch = bare_model(recipe, ProbeShape.of(recipe), 2)
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _forward_backward_ms(model, batch)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
large = []  # a tensor past the largest mmap threshold glibc accepts (32 MiB), as a big vocabulary's logits
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(12 * 2**20)  # 48 MiB
    large.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": faults, "large": large, "allocator": host_allocator()}))
"""


def steps_under(mode: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", STEPS, str(QUICKSTART), mode], capture_output=True, text=True,
                          timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cache_stops_the_steps_page_faulting_their_tensors_in_again():
    """Fault counts are measured: memory pressure from the suite's other processes can fault a kept page in
    again, so a miss measures both allocators again."""

    def check() -> None:
        system, cache = steps_under("system"), steps_under("cache")
        assert system["allocator"]["mode"] == "system" and cache["allocator"]["mode"] == "cache", (system, cache)
        assert "M_TRIM_THRESHOLD" in cache["allocator"]["detail"]
        # The system allocator returns a step's large tensors and faults them in again (thousands of 4 KiB
        # pages a call) until glibc's dynamic mmap threshold has risen past them, after a few calls or many
        # (seen: 9868, 4353, 5280, 5216, 2720, then 0): the calls after the first, together, fault them in.
        # The cache keeps them from the first call on (the median call after 2 warm-up calls: a busy
        # machine's other processes can make it fault now and then).
        assert sum(system["faults"][1:]) > 1000, system["faults"]
        assert statistics.median(cache["faults"][2:]) < 100, cache["faults"]
        assert sum(cache["faults"][2:]) < sum(system["faults"][2:]) / 4, (cache["faults"], system["faults"])
        # a 48 MiB tensor: mapped fresh and faulted in at every call by the system's allocator (12,288 pages
        # of 4 KiB, fewer where the kernel backs it with huge pages), kept in the heap by the cache
        assert statistics.median(system["large"][1:]) > 1000, system["large"]
        assert statistics.median(cache["large"][1:]) < 100, cache["large"]

    retry_on_noise(check)


def test_a_projection_probes_with_the_allocator_its_source_ran_with():
    recipe = load_recipe(QUICKSTART, [])
    target = load_recipe(QUICKSTART, ["data.seq_len=128"])
    assert recipe.train.cpu_allocator == "cache"  # what a run gets by default
    old = {"env": {"device": "x86_64"}}  # a profile made before the allocator was recorded: the system's
    src, tgt = ran_allocator(old, recipe, target, ["data.seq_len=128"])
    assert (src.train.cpu_allocator, tgt.train.cpu_allocator) == ("system", "system")
    new = {"env": {"host_allocator": {"mode": "cache", "detail": "glibc mallopt"}}}
    src, tgt = ran_allocator(new, recipe, target, [])
    assert (src.train.cpu_allocator, tgt.train.cpu_allocator) == ("cache", "cache")
    # an override that names the allocator is the target's own (and a change the step model refuses)
    other = load_recipe(QUICKSTART, ["train.cpu_allocator=system"])
    src, tgt = ran_allocator(new, recipe, other, ["train.cpu_allocator=system"])
    assert (src.train.cpu_allocator, tgt.train.cpu_allocator) == ("cache", "system")
    src, tgt = ran_allocator(new, recipe, other, ["cpu_allocator=system"])  # the bare leaf name, as a CLI takes it
    assert (src.train.cpu_allocator, tgt.train.cpu_allocator) == ("cache", "system")
    from trainprof.projection.changes import unmodelled_changes
    assert unmodelled_changes(src, tgt) == ["train.cpu_allocator"]


# two steps traced at operator level, then three untraced ones, under the cache; prints resident MiB.
# argv[2] "keep": the tracer leaves the processing's memory where it is
TRACED = """
import json, sys, torch
import trainprof.profiler.ops
from trainprof.env import apply_host_allocator, peak_memory_bytes
from trainprof.profiler.ops import OpTracer
torch.set_num_threads(1)
apply_host_allocator(torch.device("cpu"), "cache")
if sys.argv[2] == "keep":
    trainprof.profiler.ops.forget_profiler_memory = lambda: None
def rss():
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmRSS"))) / 1024
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.LayerNorm(256))
                              for _ in range(40)])
optimizer, x = torch.optim.AdamW(model.parameters()), torch.randn(64, 256)
def step():
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
for _ in range(3):
    step()
before = rss()
tracer = OpTracer(cuda=False, trace_dir=sys.argv[1], rank=0, warmup=0, active=2, record_shapes=True)
for n in range(2):
    tracer.begin_step(n, [], [])
    step()
    tracer.end_step(n)
after, peak = rss(), peak_memory_bytes(torch.device("cpu")) / 2**20
for _ in range(3):
    step()
print(json.dumps({"before": before, "after": after, "peak": peak, "steps_after": rss(), "done": tracer.done}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, /proc")
def test_a_traces_processing_leaves_the_later_steps_memory_and_the_peak(tmp_path):
    """Turning Kineto's events into the trace file and the operator rows takes far more memory than the
    step; under the cache the freed blocks would stay resident and count in every later step's peak RSS,
    and the processing's high-water mark in the run's peak. The tracer hands them back and starts the
    peak window again when it closes."""
    def traced(mode: str) -> dict:
        proc = subprocess.run([sys.executable, "-c", TRACED, str(tmp_path / mode), mode], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    kept, forgotten = traced("keep"), traced("forget")
    assert kept["done"] and forgotten["done"]
    grown = kept["after"] - kept["before"]
    # seen: 341 -> 475 MiB, which stay resident under the cache and so in the peak (a high-water mark, at least
    # the resident size: it read 478.9 and 478.9 MiB once); the checks below can fail
    assert grown > 50, kept
    # seen here: before 341, after 345, three steps later 364 (the steps' own blocks again)
    assert forgotten["after"] - forgotten["before"] < grown / 4, (forgotten, kept)
    assert forgotten["steps_after"] - forgotten["before"] < grown / 4, (forgotten, kept)
    assert forgotten["peak"] - forgotten["before"] < grown / 4, (forgotten, kept)
