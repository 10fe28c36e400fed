"""Print the recipe key reference (markdown) from trainprof/recipe.py's dataclasses and comments.

    python scripts/recipe_reference.py > /tmp/ref.md   # paste into README.md's "Recipe reference"
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing

from trainprof.recipe import Recipe, _type_name


def field_comments(cls: type) -> dict[str, str]:
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): .*?#\s*(.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2).strip()
    return comments


def rows(cls: type = Recipe, prefix: str = "") -> list[tuple[str, str, str, str]]:
    out = []
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.extend(rows(tp, f"{prefix}{f.name}."))
            continue
        default = getattr(defaults, f.name)
        out.append((f"{prefix}{f.name}", _type_name(tp), "`{}`".format(default if default != {} else "{}"),
                    comments.get(f.name, "")))
    return out


def main() -> None:
    print("| key | type | default | meaning |")
    print("|---|---|---|---|")
    for key, tp, default, comment in rows():
        print(f"| `{key}` | {tp.replace('|', '/')} | {default} | {comment.replace('|', '/')} |")


if __name__ == "__main__":
    main()
