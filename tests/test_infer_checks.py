"""What `trainprof infer` accepts before it measures: infer's own refusals first, no training engine's rules,
the machine rules of `trainprof run` that apply to serving, and an unusable output dir, each in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "quickstart_cpu.yaml"  # trains with DeepSpeed ZeRO-3


def one_line(out) -> str:
    """The command's only stderr line, which must be a trainprof error (no traceback)."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("trainprof: "), out.stderr
    return lines[0]


def test_infer_refuses_before_the_training_engine_rules(cli) -> None:
    """The recipe's ZeRO-3 engine is not what infer runs: model.compile is not refused for it, and qlora gets
    infer's own refusal, not DeepSpeed's ZeRO-stage rule, even where another training rule also applies."""
    compiled = one_line(cli("infer", RECIPE, "model.compile=true", "--warmup", "0"))
    assert compiled.startswith("trainprof: --warmup 0 with model.compile=true") and "ZeRO" not in compiled
    for extra in ((), ("model.compile=true",)):
        qlora = one_line(cli("infer", RECIPE, "task.kind=qlora", *extra))
        assert "task.kind=qlora is not supported by infer" in qlora and "ZeRO" not in qlora, extra


@pytest.mark.skipif(torch.cuda.is_available(), reason="flash2 is refused for want of CUDA")
def test_flash2_on_cpu_is_one_line(cli, tmp_path) -> None:
    """check_environment's rule, as `trainprof run` applies it: flash2 needs a CUDA GPU (no transformers
    ImportError traceback from inside the model build)."""
    line = one_line(cli("infer", RECIPE, "model.attention=flash2", "--batch", "1", "--output-dir", tmp_path))
    assert "recipe key 'model.attention': flash2 needs a CUDA GPU; use model.attention=sdpa" in line
    assert not list(tmp_path.iterdir())  # refused before a run dir was made


def test_an_unusable_output_dir_is_one_line(cli, tmp_path) -> None:
    """A file, an unwritable dir, or a path the filesystem refuses (/proc: root's permission bits allow it):
    one line naming --output-dir (or output.dir) before the model is built."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    for path in (a_file, "/proc/nope"):
        line = one_line(cli("infer", RECIPE, "--batch", "1", "--output-dir", path))
        assert line.startswith(f"trainprof: --output-dir: cannot write run dirs to '{path}': "), line
        assert line.endswith("pass --output-dir <a writable directory>")
    line = one_line(cli("infer", RECIPE, f"output.dir={a_file}", "--batch", "1"))
    assert line.startswith(f"trainprof: recipe key 'output.dir': cannot write run dirs to '{a_file}'")
