"""A JSON schema's objects take only the properties they list unless they say otherwise (as vLLM's default backend,
xgrammar in strict mode, generates them): the rewrite itself, and what the compiled grammar then lets a request
write, through the engine core's GrammarCompiler over the built-in model's byte-level vocabulary."""

import copy
import json

import pytest

from engine_core.structured_output.closed_schema import closed_objects
from engine_core.structured_output.grammar import GrammarCompiler
from protocol import StructuredOutputsParams
from protocol.model.builtin_tokenizer import builtin_tokenizer

TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TEXT = builtin_tokenizer()
COMPILER = GrammarCompiler(None, 1024, [2])


def accepts(schema: dict, text: str) -> bool:
    """The grammar of schema lets a request write exactly text (every token allowed, and the grammar complete)."""
    matcher = COMPILER.compile(StructuredOutputsParams(json=json.dumps(schema)))
    tokens = TEXT.encode(text, add_special_tokens=False).ids
    return matcher.validate_tokens(tokens) == len(tokens) and matcher.consume_tokens(tokens) and matcher.is_accepting()


def test_an_object_that_lists_properties_is_closed_at_every_depth():
    schema = {"type": "object", "properties": {
        "owner": {"type": "object", "properties": {"age": {"type": "integer"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "pair": {"type": "array", "prefixItems": [{"type": "object", "properties": {"a": {}}}]},
        "either": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]},
        "ref": {"$ref": "#/$defs/thing"}},
        "$defs": {"thing": {"type": "object", "properties": {"t": {}}}}}
    before = copy.deepcopy(schema)
    out = closed_objects(schema)
    assert schema == before  # the request's own schema is not changed
    props = out["properties"]
    assert out["additionalProperties"] is False
    assert props["owner"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["pair"]["prefixItems"][0]["additionalProperties"] is False
    assert props["pair"]["items"] is False  # a tuple takes only the items it lists
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert out["$defs"]["thing"]["additionalProperties"] is False
    assert "additionalProperties" not in props["ref"]  # a bare $ref: its target is closed in $defs


@pytest.mark.parametrize("says", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                  {"unevaluatedProperties": True}, {"additionalProperties": False}])
def test_an_object_that_says_what_else_it_takes_keeps_it(says):
    assert closed_objects({**TOOL, **says}) == {**TOOL, **says}


@pytest.mark.parametrize("says", [{"items": True}, {"items": {"type": "integer"}}, {"unevaluatedItems": True}])
def test_a_tuple_that_says_what_else_it_takes_keeps_it(says):
    pair = {"type": "array", "prefixItems": [{"type": "string"}], **says}
    assert closed_objects(pair) == pair


def test_intersections_and_names_are_left_as_they_are():
    """allOf's members and its parent stay open (closing one would refuse the others' properties), as does an object
    beside a $ref; a property named "properties" is a name, not a schema keyword."""
    all_of = {"allOf": [TOOL, {"type": "object", "properties": {"unit": {"type": "string"}}}],
              "properties": {"note": {"type": "string"}}}
    assert closed_objects(all_of) == all_of
    beside_ref = {"$ref": "#/$defs/x", "properties": {"y": {}}, "$defs": {"x": {"type": "object"}}}
    assert closed_objects(beside_ref) == beside_ref
    named = {"type": "object", "properties": {"properties": {"type": "string"}}}
    assert closed_objects(named)["properties"] == {"properties": {"type": "string"}}
    assert closed_objects(True) is True and closed_objects({}) == {}


def test_the_grammar_refuses_a_property_the_schema_does_not_list():
    """The tool call's arguments of the issue: a key the function does not take is refused; the listed one, and
    an extra key where the schema allows it, are written."""
    assert accepts(TOOL, '{"city": "Paris"}')
    assert not accepts(TOOL, '{"city": "Paris", "currency": "EUR"}')
    assert accepts({**TOOL, "additionalProperties": True}, '{"city": "Paris", "currency": "EUR"}')
    nested = {"type": "object", "properties": {"where": TOOL}, "required": ["where"]}
    assert accepts(nested, '{"where": {"city": "Rome"}}')
    assert not accepts(nested, '{"where": {"city": "Rome", "zip": 1}}')
    pair = {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]}
    assert accepts(pair, '["a", 1]') and not accepts(pair, '["a", 1, 2]')
