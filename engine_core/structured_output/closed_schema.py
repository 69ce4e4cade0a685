"""A JSON schema's objects closed to properties it does not list, and its tuples to items it does not list, as vLLM's
default grammar backend (xgrammar, strict mode) generates them: JSON Schema lets an object that lists `properties`
carry any others unless it says `additionalProperties`, and a model then adds keys no caller asked for (a tool call's
arguments with parameters its function does not take); likewise an array of `prefixItems` without `items`. A schema
that says `additionalProperties` / `unevaluatedProperties` (`items` / `unevaluatedItems`) keeps what it says.

Objects that combine with siblings (`allOf` and its members, `$ref` beside `properties`) stay open: closing one part
of an intersection would refuse the properties another part lists.
"""

from typing import Any

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
SCHEMA_VALUES = ("items", "additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems",
                 "contains", "propertyNames", "not", "if", "then", "else")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


def closed_objects(schema: Any, combined: bool = False) -> Any:
    """A copy of schema with `additionalProperties: false` on each object that lists properties and says nothing of
    others (`items: false` on such a tuple); combined: schema is an `allOf` member (left open, its own subschemas
    are not)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in SCHEMA_VALUES:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub, combined=key == "allOf") for sub in out[key]]
    lists = "properties" in out or "patternProperties" in out
    says = "additionalProperties" in out or "unevaluatedProperties" in out
    open_ok = not combined and "allOf" not in out and "$ref" not in out
    if lists and not says and open_ok:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out and open_ok:
        out["items"] = False
    return out
