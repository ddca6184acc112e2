"""A value valid against a tool's JSON schema, drawn from a seeded `random.Random`.

This is not a JSON-schema engine: it covers the subset agent tool schemas use
(docs/decisions/simulated-tool-calls.md): `type` (one or a list), `enum`, `const`,
`default`, objects (`properties`, `required`; no extra keys are ever added, so
`additionalProperties: false` holds), arrays (`items`, `minItems`, `maxItems`,
`uniqueItems` by distinct draws), strings (`minLength`, `maxLength`, a few `format`s),
numbers and integers (`minimum`, `maximum`, their exclusive forms, integer
`multipleOf`), `anyOf` / `oneOf` (one branch), `allOf` of object schemas (merged), and
local `$ref`s (`#/$defs/...`, `#/definitions/...`, as Pydantic writes them).

Invariant: the same schema and the same generator state give the same value. Required
properties are always present; optional ones appear at random, and not at all below
`MAX_DEPTH` so recursive schemas end. A string `pattern` cannot be honoured: such a
string takes the schema's `default` or first `examples` entry when it has one, and an
optional property with neither is left out (a required one gets a word, which may not
match).
"""

from __future__ import annotations

import random
from typing import Any

MAX_DEPTH = 6
WORDS = ("alpha", "beta", "gamma", "delta", "notes", "main", "src", "docs", "readme", "test", "build", "data")
FORMATS = {
    "uri": "https://example.invalid/docs",
    "url": "https://example.invalid/docs",
    "email": "agent@example.invalid",
    "date": "2026-01-01",
    "date-time": "2026-01-01T00:00:00Z",
    "uuid": "00000000-0000-4000-8000-000000000000",
}


class SchemaValues:
    """Draws values for one tool's schema; `root` resolves the schema's local `$ref`s."""

    def __init__(self, root: Any, rng: random.Random) -> None:
        self.root = root
        self.rng = rng

    def value(self, schema: Any, depth: int = 0) -> Any:
        schema = self._resolve(schema)
        if not isinstance(schema, dict):
            return self._word()  # `true` or an empty schema: anything goes
        if "const" in schema:
            return schema["const"]
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return self.rng.choice(schema["enum"])
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list) and schema[key]:
                return self.value(self._branch(schema[key]), depth)
        if isinstance(schema.get("allOf"), list):
            return self.value(self._merged(schema), depth)
        if "pattern" in schema and ("default" in schema or schema.get("examples")):
            return schema["default"] if "default" in schema else schema["examples"][0]
        return self._typed(self._type(schema), schema, depth)

    # -- keywords --------------------------------------------------------------------------

    def _resolve(self, schema: Any, hops: int = 0) -> Any:
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and hops < 32:
            ref = schema["$ref"]
            if not ref.startswith("#/"):
                return {}
            target: Any = self.root
            for part in ref[2:].split("/"):
                target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
            schema, hops = target if target is not None else {}, hops + 1
        return schema

    def _branch(self, branches: list) -> Any:
        # Prefer a non-null branch: `anyOf: [X, {type: null}]` is how optional values are written.
        useful = [b for b in branches if not (isinstance(b, dict) and b.get("type") == "null")]
        return self.rng.choice(useful or branches)

    def _merged(self, schema: dict) -> dict:
        merged = {key: value for key, value in schema.items() if key != "allOf"}
        for part in schema["allOf"]:
            part = self._resolve(part)
            if isinstance(part, dict):
                merged["properties"] = {**merged.get("properties", {}), **part.get("properties", {})}
                merged["required"] = [*merged.get("required", []), *part.get("required", [])]
                for key, value in part.items():
                    merged.setdefault(key, value)
        return merged

    def _type(self, schema: dict) -> str:
        kind = schema.get("type")
        if isinstance(kind, list):
            choices = [k for k in kind if k != "null"] or kind
            kind = self.rng.choice(choices) if choices else None
        if isinstance(kind, str):
            return kind
        if "properties" in schema:
            return "object"
        if "items" in schema:
            return "array"
        return "string"

    def _typed(self, kind: str, schema: dict, depth: int) -> Any:
        if kind == "object":
            return self._object(schema, depth)
        if kind == "array":
            return self._array(schema, depth)
        if kind in ("integer", "number"):
            return self._number(schema, kind == "integer")
        if kind == "boolean":
            return self.rng.random() < 0.5
        if kind == "null":
            return None
        return self._string(schema)

    def _object(self, schema: dict, depth: int) -> dict:
        properties = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        result = {}
        for name, sub in properties.items():
            if name in required:
                result[name] = self.value(sub, depth + 1)
            elif depth < MAX_DEPTH and self.rng.random() < 0.5 and self._honoured(sub):
                result[name] = self.value(sub, depth + 1)
        for name in sorted(required - set(properties)):  # required but undescribed: any value
            result[name] = self._word()
        return result

    def _honoured(self, schema: Any) -> bool:
        """False for a string `pattern` with no default or example: an optional property
        the sampler cannot promise to satisfy is left out."""
        schema = self._resolve(schema)
        return not (
            isinstance(schema, dict) and "pattern" in schema and "default" not in schema and not schema.get("examples")
        )

    def _array(self, schema: dict, depth: int) -> list:
        low = int(schema.get("minItems", 0))
        high = int(schema.get("maxItems", max(low, 3)))
        count = low if depth >= MAX_DEPTH else self.rng.randint(low, max(low, min(high, low + 3)))
        items = schema.get("items", {})
        values: list = []
        for _ in range(count * 4 if schema.get("uniqueItems") else count):
            if len(values) == count:
                break
            value = self.value(items, depth + 1)
            if not schema.get("uniqueItems") or value not in values:
                values.append(value)
        return values

    def _number(self, schema: dict, integer: bool) -> int | float:
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is None:
            low = 0 if high is None or high >= 0 else high - 100
        if high is None:
            high = low + 100
        exclusive_low, exclusive_high = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
        if isinstance(exclusive_low, (int, float)) and not isinstance(exclusive_low, bool):
            low = max(low, exclusive_low + (1 if integer else 1e-3))
        if isinstance(exclusive_high, (int, float)) and not isinstance(exclusive_high, bool):
            high = min(high, exclusive_high - (1 if integer else 1e-3))
        if integer:
            low, high = int(-(-low // 1)), int(high // 1)
            step = schema.get("multipleOf")
            if isinstance(step, int) and step > 0:
                first = -(-low // step) * step
                return first + step * self.rng.randint(0, max(0, (high - first) // step))
            return self.rng.randint(low, max(low, high))
        return round(self.rng.uniform(low, max(low, high)), 3) if high > low else low

    def _string(self, schema: dict) -> str:
        if schema.get("format") in FORMATS:
            return FORMATS[schema["format"]]
        low = int(schema.get("minLength", 1))
        high = int(schema.get("maxLength", max(low, 40)))
        text = self._word()
        while len(text) < low:
            text += "_" + self._word()
        return text[: max(high, 0)]

    def _word(self) -> str:
        return self.rng.choice(WORDS)


def sample_arguments(schema: Any, rng: random.Random) -> dict:
    """Arguments for a tool whose parameters are `schema`: an object, as every API's tool
    call carries (a schema that is not an object schema gets `{}`)."""
    value = SchemaValues(schema, rng).value(schema)
    return value if isinstance(value, dict) else {}
