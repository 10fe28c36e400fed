"""Every checked-in reference profile (profiles/*/profile.json, gzipped for the GPU runs) is a valid profile
and closes."""

from __future__ import annotations


import pytest

from conftest import REPO
from trainprof.io import kept_profiles, read_json
from trainprof.profiler.schema import validate_profile

PROFILES = kept_profiles(REPO / "profiles")


def test_there_is_a_reference_profile():
    assert any(p.parent.name == "cpu-x86_64-quickstart_cpu" for p in PROFILES)


@pytest.mark.parametrize("path", PROFILES, ids=[p.parent.name for p in PROFILES])
def test_reference_profile_valid_and_closes(path):
    doc = read_json(path)
    validate_profile(doc)
    assert (path.parent / "summary.md").is_file()
    assert not (path.parent / "tb").exists()  # no traces in profiles/
    frac = doc["summary"]["unattributed_frac"]
    assert frac is not None and 0 <= abs(frac) <= 0.02, f"{path}: unattributed_frac {frac} > 2%"
    assert doc["modules"] and doc["steps"]
