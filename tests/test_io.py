"""trainprof.io: a profile read from a run dir or from a kept, gzipped folder alike."""
import gzip
import json

import pytest

from trainprof.io import atomic_write_json, kept_profiles, profile_file, read_profile


def test_a_gzipped_profile_reads_as_the_plain_one_and_is_written_byte_stable(tmp_path):
    doc = {"summary": {"step_ms": {"median": 12.5}}, "steps": [1, 2]}
    plain, kept = tmp_path / "run", tmp_path / "kept"
    atomic_write_json(plain / "profile.json", doc)
    atomic_write_json(kept / "profile.json.gz", doc)
    assert read_profile(plain) == read_profile(kept) == doc
    assert profile_file(kept).name == "profile.json.gz"
    assert json.loads(gzip.decompress((kept / "profile.json.gz").read_bytes())) == doc
    first = (kept / "profile.json.gz").read_bytes()
    atomic_write_json(kept / "profile.json.gz", doc)  # no timestamp in the gzip header: same data, same bytes
    assert (kept / "profile.json.gz").read_bytes() == first
    assert sorted(p.name for p in kept.iterdir()) == ["profile.json.gz"]  # no temp file left behind
    with pytest.raises(FileNotFoundError, match="no profile.json"):
        read_profile(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    # one file a folder that holds a profile, either form, sorted
    assert kept_profiles(tmp_path) == [kept / "profile.json.gz", plain / "profile.json"]
