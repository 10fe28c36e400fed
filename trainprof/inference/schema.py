"""The JSON Schema of inference.json (trainprof/inference_schema.json) and a validator for it."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).resolve().parents[1] / "inference_schema.json"


@functools.lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    return json.loads(SCHEMA_FILE.read_text())


def validate_inference(doc: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError if `doc` is not a valid inference.json."""
    import jsonschema

    jsonschema.validate(doc, load_schema(), cls=jsonschema.Draft202012Validator)
