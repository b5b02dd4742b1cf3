"""Tool calls in model output: parsing, validation against the tools' JSON schemas, and
rendering (the inverse, for traces and tests).

Formats:
- hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. The JSON is
  decoded as JSON, so braces and tags inside argument strings are harmless.
- qwen3_coder: `<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nvalue\\n</parameter>\\n
  </function>\\n</tool_call>`. Values are raw text; each value runs to the LAST closing
  tag of its segment, so closing tags inside a value are harmless. Opening tags inside a
  value (`<tool_call>`, or `<parameter=` at a line start) are ambiguous in this format.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict

ToolCallFormat = Literal["hermes", "qwen3_coder"]
OPEN, CLOSE = "<tool_call>", "</tool_call>"


class ToolCallError(ValueError):
    """The model's output holds no valid action (mask tier 1)."""

    kind = "tool_call_error"


class NoToolCallError(ToolCallError):
    kind = "no_tool_call"


class MalformedToolCallError(ToolCallError):
    kind = "malformed"


class UnknownToolError(ToolCallError):
    kind = "unknown_tool"


class BadArgumentsError(ToolCallError):
    kind = "bad_arguments"


class TooManyToolCallsError(ToolCallError):
    kind = "too_many_calls"


class ToolCall(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    arguments: dict[str, Any]


def tool_schemas(tools: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, for OpenAI-style `{"type": "function", "function": {...}}`
    entries or bare `{"name": ..., "parameters": ...}` ones."""
    schemas = {}
    for tool in tools:
        spec = tool.get("function", tool)
        schemas[spec["name"]] = spec.get("parameters") or {"type": "object"}
    return schemas


def parse_tool_calls(
    text: str,
    fmt: ToolCallFormat = "hermes",
    tools: Sequence[dict[str, Any]] | None = None,
    max_calls: int | None = 1,
) -> list[ToolCall]:
    """Every tool call in `text`, validated against `tools` when given.

    Raises NoToolCallError, MalformedToolCallError, UnknownToolError, BadArgumentsError
    or TooManyToolCallsError (all ToolCallError).
    """
    if fmt == "hermes":
        calls = _parse_hermes(text)
    elif fmt == "qwen3_coder":
        calls = _parse_qwen3_coder(text, tool_schemas(tools or []))
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}: use 'hermes' or 'qwen3_coder'")
    if not calls:
        raise NoToolCallError(f"no {OPEN} in the output: write one tool call per turn")
    if max_calls is not None and len(calls) > max_calls:
        raise TooManyToolCallsError(f"{len(calls)} tool calls in one turn; at most {max_calls}")
    if tools is not None:
        schemas = tool_schemas(tools)
        for call in calls:
            _validate(call, schemas)
    return calls


def _validate(call: ToolCall, schemas: dict[str, dict[str, Any]]) -> None:
    if call.name not in schemas:
        raise UnknownToolError(
            f"unknown tool {call.name!r}; available: {', '.join(sorted(schemas)) or 'none'}"
        )
    try:
        jsonschema.validate(call.arguments, schemas[call.name])
    except jsonschema.ValidationError as err:
        where = "/".join(str(p) for p in err.absolute_path) or "arguments"
        raise BadArgumentsError(f"{call.name}: {where}: {err.message}") from None


def _parse_hermes(text: str) -> list[ToolCall]:
    decoder = json.JSONDecoder()
    calls = []
    position = text.find(OPEN)
    while position != -1:
        body_start = position + len(OPEN)
        stripped = len(text) - len(text[body_start:].lstrip())
        try:
            payload, end = decoder.raw_decode(text, stripped)
        except json.JSONDecodeError as err:
            raise MalformedToolCallError(f"tool call is not valid JSON: {err.msg}") from None
        rest = text[end:].lstrip()
        if rest and not rest.startswith(CLOSE):
            raise MalformedToolCallError(f"text after the tool call's JSON, before {CLOSE}")
        calls.append(_hermes_call(payload))
        after = len(text) - len(rest) + (len(CLOSE) if rest else 0)
        position = text.find(OPEN, after)
    return calls


def _hermes_call(payload: Any) -> ToolCall:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise MalformedToolCallError('a tool call must be {"name": <string>, "arguments": {...}}')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):  # some models double-encode the arguments
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            raise BadArgumentsError(f"{payload['name']}: arguments is not a JSON object") from None
    if not isinstance(arguments, dict):
        raise BadArgumentsError(f"{payload['name']}: arguments must be a JSON object")
    return ToolCall(name=payload["name"], arguments=arguments)


_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>")
_PARAMETER = re.compile(r"(?:^|\n)<parameter=([^>\n]+)>", re.MULTILINE)


def _parse_qwen3_coder(text: str, schemas: dict[str, dict[str, Any]]) -> list[ToolCall]:
    blocks = text.split(OPEN)[1:]
    calls = []
    for block in blocks:
        body = block[: block.rfind(CLOSE)] if CLOSE in block else block
        match = _FUNCTION.match(body)
        if not match:
            raise MalformedToolCallError(f"expected <function=NAME> after {OPEN}")
        name = match.group(1).strip()
        function_body = body[match.end() :]
        if "</function>" not in function_body:
            raise MalformedToolCallError(f"<function={name}> is not closed by </function>")
        function_body = function_body[: function_body.rfind("</function>")]
        properties = schemas.get(name, {}).get("properties", {})
        calls.append(
            ToolCall(name=name, arguments=_qwen3_parameters(name, function_body, properties))
        )
    return calls


def _qwen3_parameters(name: str, body: str, properties: dict[str, Any]) -> dict[str, Any]:
    starts = list(_PARAMETER.finditer(body))
    if body[: starts[0].start() if starts else len(body)].strip():
        raise MalformedToolCallError(f"{name}: text outside <parameter=...> blocks")
    arguments: dict[str, Any] = {}
    for index, start in enumerate(starts):
        segment_end = starts[index + 1].start() if index + 1 < len(starts) else len(body)
        segment = body[start.end() : segment_end]
        if "</parameter>" not in segment:
            raise MalformedToolCallError(f"{name}: <parameter={start.group(1)}> is not closed")
        value = segment[: segment.rfind("</parameter>")]
        value = value.removeprefix("\n").removesuffix("\n")
        key = start.group(1).strip()
        if key in arguments:
            raise BadArgumentsError(f"{name}: parameter {key!r} given twice")
        arguments[key] = _typed_value(value, properties.get(key, {}))
    return arguments


def _typed_value(raw: str, schema: dict[str, Any]) -> Any:
    """Parameter values are text; non-string schema types are read as JSON."""
    if schema.get("type", "string") == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw  # left as text: schema validation reports the wrong type


def render_tool_call(call: ToolCall, fmt: ToolCallFormat = "hermes") -> str:
    """The text a model writes for `call` (what the factory chat template renders)."""
    if fmt == "hermes":
        payload = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{OPEN}\n{payload}\n{CLOSE}"
    parameters = "".join(
        f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n"
        "</parameter>\n"
        for key, value in call.arguments.items()
    )
    return f"{OPEN}\n<function={call.name}>\n{parameters}</function>\n{CLOSE}"
