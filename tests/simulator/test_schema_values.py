"""Tool-call arguments drawn from a tool's JSON schema are valid against it (checked by
the `jsonschema` library), over the schema forms agent clients send."""

import json
import random
from pathlib import Path

import jsonschema
import pytest

from kvgate.simulator.schema_values import sample_arguments

SCHEMAS = {
    name: schema
    for name, schema in json.loads((Path(__file__).parent / "data" / "agent_tool_schemas.json").read_text()).items()
    if not name.startswith("_")
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_arguments_are_valid_against_agent_tool_schemas(name):
    schema = SCHEMAS[name]
    validator = jsonschema.validators.validator_for(schema)(schema)
    seen = set()
    for seed in range(200):
        arguments = sample_arguments(schema, random.Random(seed))
        errors = [error.message for error in validator.iter_errors(arguments)]
        assert not errors, f"seed {seed}: {arguments} -> {errors}"
        seen.add(json.dumps(arguments, sort_keys=True))
    # optional properties come and go, enums vary: the arguments are not one fixed value
    assert len(seen) > 1 or name == "no_arguments"


def test_same_seed_same_arguments_and_required_always_present():
    schema = SCHEMAS["Grep"]
    first = sample_arguments(schema, random.Random(7))
    assert first == sample_arguments(schema, random.Random(7))
    assert all("pattern" in sample_arguments(schema, random.Random(seed)) for seed in range(50))


def test_recursive_schema_ends():
    tree = {
        "$defs": {
            "node": {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
        },
        "$ref": "#/$defs/node",
    }
    for seed in range(50):
        jsonschema.validate(sample_arguments(tree, random.Random(seed)), tree)


def test_pattern_string_takes_the_schemas_example():
    schema = {
        "type": "object",
        "properties": {"ref": {"type": "string", "pattern": "^v[0-9]+$", "examples": ["v12"]}},
        "required": ["ref"],
    }
    assert sample_arguments(schema, random.Random(0)) == {"ref": "v12"}
