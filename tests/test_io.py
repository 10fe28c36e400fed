"""trainprof.io: a profile read from a run dir or from a kept, gzipped folder alike."""
import gzip
import json

import pytest

from trainprof.errors import UserError
from trainprof.io import atomic_write_json, kept_profiles, profile_file, read_json, read_profile


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


def test_json_cut_short_is_a_one_line_user_error_naming_the_file(tmp_path):
    """What a process stopped mid-write leaves: plain, gzipped, or cut inside a UTF-8 character."""
    text = json.dumps({"summary": {"note": "é"}, "steps": [1, 2]}, ensure_ascii=False)
    files = {"plain.json": text[:20].encode(), "cut.json.gz": gzip.compress(text.encode())[:25],
             "mid_char.json": text.encode()[:text.encode().index("é".encode()) + 1]}
    said = {"plain.json": "line 1 col 21", "cut.json.gz": "gzip stream is cut short", "mid_char.json": "not UTF-8"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(UserError) as err:
            read_json(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}: not valid JSON (") and said[name] in str(err.value)
        assert "\n" not in str(err.value)


def test_written_files_get_the_mode_open_would_give_them(tmp_path):
    """0666 less the umask, as TensorBoard's own files: mkstemp's 0600 left a run's report unreadable to a
    teammate on a shared cluster. Charts go through the same writer."""
    import os
    import stat

    from trainprof.io import _UMASK, atomic_write_text
    from trainprof.report.plots import pyplot, save_figure

    atomic_write_text(tmp_path / "summary.md", "x")
    save_figure(pyplot().figure(), tmp_path / "chart.png")
    with open(tmp_path / "control.txt", "w") as f:
        f.write("x")
    want = stat.S_IMODE(os.stat(tmp_path / "control.txt").st_mode)
    assert want == 0o666 & ~_UMASK  # 0644 under the usual umask 022
    for name in ("summary.md", "chart.png"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == want, name
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
