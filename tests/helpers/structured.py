"""The structured-output tests' JSON schema and the `json` constraint that asks for it."""

from __future__ import annotations

import json

from compiled_engine.sampling_params import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 1, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "tags", "ok"],
}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
