"""DeepSpeed's CPU op builders get their compiler flags from py-cpuinfo, which answers from a child
interpreter in about a second; trainprof.engines.cpu_info asks it once per CPU (a file keyed by
/proc/cpuinfo), and DeepSpeed derives the same flags from the kept answer."""

from __future__ import annotations

import cpuinfo
import pytest


def test_deepspeed_derives_the_same_flags_from_one_answer_kept_per_cpu(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder.cpu.fused_adam import FusedAdamBuilder

    from trainprof.engines import cpu_info

    flags = FusedAdamBuilder().cxx_args()  # DeepSpeed asking py-cpuinfo itself, twice
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    asked = []
    ask = cpuinfo.get_cpu_info

    def counted():
        asked.append(1)
        return ask()

    monkeypatch.setattr(cpuinfo, "get_cpu_info", counted)  # py-cpuinfo's own answer, counted
    cpu_info.ask_once()
    cpu_info.ask_once()
    assert FusedAdamBuilder().cxx_args() == flags
    assert FusedAdamBuilder().cxx_args() == flags
    assert len(asked) == 1
    if cpu_info.cpu_key() is None:
        pytest.skip("no /proc/cpuinfo: the answer is kept for the process only")
    (kept,) = (tmp_path / "trainprof").glob("cpuinfo-*.json")
    # another process reads the file and asks nothing
    again = cpu_info.cached_cpu_info(lambda: pytest.fail("py-cpuinfo asked again for the same CPU"))
    answer = ask()
    assert (again["arch"], again["flags"]) == (answer["arch"], answer["flags"])
    kept.write_text("{truncated")  # a damaged file is asked around, and rewritten whole
    assert cpu_info.cached_cpu_info(lambda: {"arch": "X86_64", "flags": []}) == {"arch": "X86_64", "flags": []}
    assert cpu_info.cached_cpu_info(lambda: pytest.fail("asked")) == {"arch": "X86_64", "flags": []}
