"""The docs stay true: README's reference lists every recipe key; .ci/run runs the README's test command."""

from __future__ import annotations

import re

from trainprof.recipe import leaf_keys

from conftest import REPO


def test_readme_reference_lists_every_recipe_key():
    readme = (REPO / "README.md").read_text()
    missing = [k for k in leaf_keys() if f"`{k}`" not in readme]
    assert not missing, f"README recipe reference lacks {missing}; rerun scripts/recipe_reference.py"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    quickstart = re.search(r"## Quickstart.*?```bash\n(.*?)```", readme, re.S).group(1).strip().splitlines()
    assert len(quickstart) == 2, "the Quickstart is exactly two commands"
    assert "trainprof.run recipes/quickstart_cpu.yaml" in quickstart[0]
    assert quickstart[1] in (REPO / ".ci" / "run").read_text()


def test_every_recipe_opens_with_its_run_command():
    for path in sorted((REPO / "recipes").glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first.startswith("# torchrun --nproc_per_node ") and first.endswith(f"recipes/{path.name}"), path
