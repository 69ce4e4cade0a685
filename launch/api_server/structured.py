"""A request's structured output from the HTTP fields that ask for one: OpenAI's `response_format` (`json_object`,
`json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; and a chat's forced tool call (tool_choice
`required` or a named function: launch/api_server/tools/choice.py).

At most one of them may be set. The grammar is checked here, without the vocabulary (llguidance compiles it the
way the engine core will), so an invalid schema, regex or grammar is a 400 naming the field; the engine core
compiles it again over the model's vocabulary (engine_core/structured_output/). A `json_schema` is enforced
whether `strict` is true or not, as vLLM does.
"""

import json

import msgspec

from engine_core.structured_output import GrammarError, check
from launch.api_server.errors import ApiError
from launch.api_server.tools.choice import tool_choice
from protocol import StructuredOutputsParams
from protocol.config import ServerConfig

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
KINDS = ("json", "regex", "choice", "grammar", "json_object")
WHAT = {"json": "JSON schema", "regex": "regular expression", "choice": "choice list", "grammar": "grammar",
        "json_object": "JSON object"}


def request_structured_outputs(req: object) -> StructuredOutputsParams | None:
    """The one structured output the request asks for (checked), or None; 400 naming the field otherwise."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        params = from_response_format(response_format)
        if params is not None:
            found.append(("response_format", params))
    vllm = getattr(req, "structured_outputs", None)
    if vllm is not None:
        found.append(("structured_outputs", from_vllm(vllm)))
    for name, kind in GUIDED.items():
        value = getattr(req, name, None)
        if value is not None:
            found.append((name, make(name, **{kind: schema_text(name, value) if kind == "json" else value})))
    choice = getattr(req, "tool_choice", None)
    if choice == "required" or isinstance(choice, dict):  # a forced call (tools/choice.py)
        tools = tool_choice(getattr(req, "tools", None), choice, getattr(req, "parallel_tool_calls", None),
                            ServerConfig())
        forced = None if tools is None else tools.forced_output()
        if forced is not None:
            found.append(("tool_choice", forced))
    if len(found) > 1:
        raise ApiError(400, f"{found[1][0]} asks for a structured output and so does {found[0][0]}: give one",
                       found[1][0])
    if not found:
        return None
    name, params = found[0]
    try:
        check(params)
    except GrammarError as e:
        if name == "tool_choice":  # the schema is a tool's parameters
            raise ApiError(400, f"tools: a forced call's parameters are not a valid JSON schema: {e.detail}",
                           "tools") from None
        raise ApiError(400, f"{name}: not a valid {WHAT[e.kind]}: {e.detail}", name) from None
    return params


def from_response_format(value: object) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (None), json_object, or json_schema with its schema."""
    name = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ApiError(400, "response_format is an object with a 'type'", name)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return make(name, json_object=True)
    if kind != "json_schema":
        raise ApiError(400, f"response_format type {kind!r} is not supported: text, json_object or json_schema", name)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ApiError(400, "response_format json_schema needs a 'json_schema' object with its 'schema'", name)
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ApiError(400, f"response_format.json_schema has unknown fields: {', '.join(unknown)}", name)
    return make(name, json=schema_text(name, spec["schema"]))


def from_vllm(value: object) -> StructuredOutputsParams:
    """vLLM's structured_outputs object: exactly one of its kinds; any other field of vLLM's is refused by name."""
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise ApiError(400, "structured_outputs is an object", name)
    unknown = sorted(set(value) - set(KINDS))
    if unknown:
        raise ApiError(400, f"structured_outputs.{unknown[0]} is not supported: give one of {', '.join(KINDS)}",
                       name)
    fields = {k: v for k, v in value.items() if v is not None and v is not False}
    if "json" in fields:
        fields["json"] = schema_text(name, fields["json"])
    return make(name, **fields)


def schema_text(name: str, schema: object) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ApiError(400, f"{name}: the schema is not JSON: {e}", name) from None
    if not isinstance(schema, dict | bool):
        raise ApiError(400, f"{name}: a JSON schema is an object", name)
    return json.dumps(schema)


def make(name: str, **fields: object) -> StructuredOutputsParams:
    """The params from named fields, types checked (the struct travels array-like: fields in declaration order)."""
    order = StructuredOutputsParams.__struct_fields__
    try:
        return msgspec.convert([fields.get(f, None if f != "json_object" else False) for f in order],
                               StructuredOutputsParams)
    except (msgspec.ValidationError, ValueError) as e:
        raise ApiError(400, f"{name}: {e}", name) from None
