"""Every checked-in reference profile (profiles/*/profile.json, gzipped for the GPU runs) is a valid profile
and closes, and the catalog's GPU host figures are what the runs they name give."""

from __future__ import annotations

import re
import sys

import pytest

from conftest import REPO
from helpers.evidence import CLOSURE_MISSES, known_miss
from trainprof.hardware import load_catalog
from trainprof.io import kept_profiles, read_json
from trainprof.profiler.schema import validate_profile

PROFILES = kept_profiles(REPO / "profiles")


def test_there_is_a_reference_profile():
    assert any(p.parent.name == "cpu-x86_64-quickstart_cpu" for p in PROFILES)


@pytest.mark.parametrize("path", [known_miss(CLOSURE_MISSES, p.parent.name, p) for p in PROFILES])
def test_reference_profile_valid_and_closes(path):
    doc = read_json(path)
    validate_profile(doc)
    assert (path.parent / "summary.md").is_file()
    assert not (path.parent / "tb").exists()  # no traces in profiles/
    frac = doc["summary"]["unattributed_frac"]
    assert frac is not None and 0 <= abs(frac) <= 0.02, f"{path}: unattributed_frac {frac} > 2%"
    assert doc["modules"] and doc["steps"]


def _named_runs(source: str) -> set[str]:
    """The profiles/ folders a catalog figure's source names: '(profiles/ a: 48.5; b: 27.7)' or '(profiles/ a, b)'."""
    named = re.search(r"\(profiles/ ([^()]*)\)$", source)
    assert named, source
    return {run.split(":")[0].strip() for run in re.split(r"[;,] ", named.group(1))}


def test_the_catalogs_gpu_host_figures_are_what_the_runs_they_name_give():
    """gpu_host_us_per_op, gpu_optimizer_bytes_per_param and gpu_ops_per_layer (trainprof/hardware.yaml),
    recomputed by scripts/host_reference.py from the very runs each figure names: none drifts from its
    runs, and the finetuning runs stay out (they are the held-out targets of gpu_validation's CPU -> GPU
    rows)."""
    sys.path.insert(0, str(REPO / "scripts"))
    import host_reference

    cat = load_catalog()
    for block, compute in (("host_us_per_op", host_reference.reference_values),
                           ("ops_per_layer", host_reference.ops_values)):
        for key, phases in getattr(cat, block).items():
            for phase, fig in phases.items():
                runs = _named_runs(fig["source"])
                value, names = compute(runs=runs)[key][phase]
                assert value == pytest.approx(fig["value"], abs=0.05), (block, key, phase)
                assert set(names) == runs, (block, key, phase)
                if block == "host_us_per_op":  # each run's own, which the projection shows beside the mean
                    assert fig["hosts"] == pytest.approx(names, abs=0.05), (key, phase)
    for key, fig in cat.optimizer_bytes_per_param.items():
        value, names = host_reference.optimizer_values(runs=_named_runs(fig["source"]))[key]
        assert value == pytest.approx(fig["value"], abs=0.05), key
    for key, figs in cat.optimizer_host.items():
        for name, fig in figs.items():
            value, names = host_reference.optimizer_host_values(runs=_named_runs(fig["source"]))[key][name]
            assert value == pytest.approx(fig["value"], abs=0.05), (key, name)
    assert not any("lora" in run for fig in cat.host_us_per_op["deepspeed"].values()
                   for run in _named_runs(fig["source"]))


def test_deepspeeds_optimizer_calls_scale_with_trainable_tensors():
    """The catalog's ZeRO-2 optimizer calls per trainable tensor, from llama2-1b pretraining (201 tensors),
    give the held-out Llama2-7B LoRA and QLoRA runs' calls (256 adapters) within 2%; and in every DeepSpeed
    GPU run the optimizer phase is its kernels plus its calls' host time, each call 3-9 µs beside the
    kernels (hostref.optimizer_host), where the longer of the two would leave 17-64 ms unexplained."""
    sys.path.insert(0, str(REPO / "scripts"))
    import host_reference

    from trainprof.projection.hostref import optimizer_host
    from trainprof.projection.measured import measured_from_profile

    per_tensor = load_catalog().optimizer_host["deepspeed-zero12"]["calls_per_tensor"]["value"]
    finetune, deepspeed = 0, 0
    for path in PROFILES:
        profile = read_json(path)
        if profile["env"].get("device_type") != "cuda" or profile["recipe"]["engine"]["kind"] != "deepspeed":
            continue
        deepspeed += 1
        calls, us = optimizer_host(profile)
        if profile["recipe"]["task"]["kind"] != "pretrain":
            finetune += 1
            expected = per_tensor * host_reference.trainable_tensors(profile)
            assert calls == pytest.approx(expected, rel=0.02), path.parent.name
        m = measured_from_profile(profile)
        ops = m.ops["optimizer"]
        assert 3.0 <= us <= 9.0, (path.parent.name, us)
        assert m.phases_ms["optimizer"] - (ops.matmul_ms + ops.other_ms) > 15, path.parent.name
    assert finetune >= 5
    assert deepspeed >= 12


@pytest.mark.parametrize("path", [p for p in PROFILES if read_json(p)["summary"].get("mfu") is not None],
                         ids=lambda p: p.parent.name)
def test_the_answers_mfu_names_the_figures_it_divides(path):
    """The report's answer gives the model FLOP rate and the dense peak its MFU divides (with recompute the
    executed rate is higher, and a datasheet quotes sparse peaks): the quoted figures give the quoted MFU."""
    from trainprof.report.rundir import load_run
    from trainprof.report.sections import headline_facts

    text = dict(headline_facts(load_run(path.parent)))["achieved TFLOP/s"]
    found = re.search(r"MFU ([\d.]+)% \(([\d.]+) TFLOP/s of model FLOPs / the bf16 dense peak ([\d.]+) TFLOP/s: ", text)
    assert found, text
    mfu, model, peak = map(float, found.groups())
    assert 100 * model / peak == pytest.approx(mfu, abs=0.05 + 0.01 * mfu), text


def test_the_model_state_table_holds_bytes_only():
    """The report's model-state table is in MiB: the state's element count (33,554,432 on the H100 QLoRA
    run) is not a size and is not among its rows (it read as 32.00 MiB)."""
    from trainprof.report.document import Document, Table
    from trainprof.report.rundir import load_run
    from trainprof.report.sections import memory_section

    run = load_run(REPO / "profiles" / "h100-llama7b_qlora")
    doc = Document("t")
    memory_section(doc, run)
    (table,) = [b for sec in doc.sections for b in sec.blocks if isinstance(b, Table) and b.id == "model-state-table"]
    state = run.profile["model_state_bytes"]
    assert [row[0] for row in table.rows] == ["params", "grads", "optimizer_states", "master_params", "total"]
    assert table.rows[-1][1] == pytest.approx(state["total"] / 2**20)


def test_the_trace_fact_says_where_the_traces_are():
    """A folder kept in profiles/ holds its rank 0 trace beside profile.json; a run dir writes them under tb/."""
    from trainprof.report.rundir import load_run
    from trainprof.report.sections import headline_facts

    def trace_fact(path) -> str:
        return dict(headline_facts(load_run(path)))["trace per step"]

    assert trace_fact(REPO / "profiles" / "h100-llama1b_zero3_sdpa-gpubound").endswith("on rank 0; beside profile.json)")
    assert trace_fact(REPO / "tests" / "data" / "zero3_2rank").endswith("on rank 0; tb/)")
