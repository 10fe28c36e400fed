"""Every checked-in reference profile (profiles/*/profile.json) is valid profile.json and closes."""

from __future__ import annotations

import json

import pytest

from conftest import REPO
from trainprof.profiler.schema import validate_profile

PROFILES = sorted((REPO / "profiles").glob("*/profile.json"))


def test_there_is_a_reference_profile():
    assert any(p.parent.name == "cpu-x86_64-quickstart_cpu" for p in PROFILES)


@pytest.mark.parametrize("path", PROFILES, ids=[p.parent.name for p in PROFILES])
def test_reference_profile_valid_and_closes(path):
    doc = json.loads(path.read_text())
    validate_profile(doc)
    assert (path.parent / "summary.md").is_file()
    assert not (path.parent / "tb").exists()  # no traces in profiles/
    frac = doc["summary"]["unattributed_frac"]
    assert frac is not None and 0 <= abs(frac) <= 0.02, f"{path}: unattributed_frac {frac} > 2%"
    assert doc["modules"] and doc["steps"]


GPU_PAIRS = [("h100-llama1b_zero3_sdpa", "h200-llama1b_zero3_sdpa"),
             ("h100-llama1b_zero3_sdpa-torch", "h200-llama1b_zero3_sdpa-torch")]


@pytest.mark.parametrize("source,target", GPU_PAIRS)
def test_gpu_validation_table_is_what_the_reference_profiles_give(source, target):
    """trainprof/projection/validation_gpu.json (the H100 -> H200 check on lent GPUs) is reproduced by
    projecting the checked-in H100 profile and comparing with the checked-in H200 one, so a change to the
    step model that moves these errors must rewrite the table."""
    from trainprof.projection.catalog import load_catalog
    from trainprof.projection.project import GPU_VALIDATION_FILE, Projector, load_source, load_validation

    src, h200 = REPO / "profiles" / source, json.loads((REPO / "profiles" / target / "profile.json").read_text())
    for doc in (json.loads((src / "profile.json").read_text()), h200):
        # the operator table holds the backward kernels (the CUDA autograd thread's ops), and the
        # bf16-autocast torch engine's MFU uses the bf16 peak
        assert sum(r["self_ms"] for r in doc["ops"] if r["phase"] == "backward") > 10
        assert doc["summary"]["peak"]["key"] == "peak_bf16_dense_tflops"
    source_doc, target_recipe = load_source(src)
    pred = Projector(source_doc, load_catalog(), validation=load_validation(), probe=False).predict(
        target_recipe, machine="h200", world=1, gpus_per_node=1)
    measured = h200["summary"]["step_ms"]["median"]
    error = (pred["step_ms"] - measured) / measured * 100
    table = json.loads(GPU_VALIDATION_FILE.read_text())
    (case,) = [c for c in table["cases"] if c["measured_step_ms"] == pytest.approx(measured, abs=0.05)]
    assert error == pytest.approx(case["step_error_pct"], abs=0.1)
    assert pred["expected_error_pct"] == table["by_kind"]["hardware_gpu"]["step_mape_pct"]
    assert pred["change_kinds"] == ["hardware_gpu"]
