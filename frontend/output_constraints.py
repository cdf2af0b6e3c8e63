"""The OpenAI and vLLM request fields that constrain the output, as one SamplingParams.structured_outputs."""

from __future__ import annotations

from frontend.tool_formats import HERMES, ToolFormat
from protocol.config import InvalidParam


def one_constraint(given: list[tuple[str, dict | None]]) -> tuple[str | None, dict | None]:
    """(field, structured_outputs) of the one field that constrains; two are an error naming the second."""
    given = [(name, spec) for name, spec in given if spec is not None]
    if len(given) > 1:
        raise InvalidParam(given[1][0], f"{given[0][0]} and {given[1][0]} both constrain the output: send one")
    return given[0] if given else (None, None)


def response_format_spec(fmt: dict | None) -> dict | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema with its schema."""
    kind, schema = (fmt or {}).get("type", "text"), (fmt or {}).get("json_schema")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema" and isinstance(schema, dict) and isinstance(schema.get("schema"), dict):
        return {"json": schema["schema"]}
    if kind != "text":
        raise InvalidParam(
            "response_format",
            f'response_format={fmt} is invalid: use {{"type": "text"}}, '
            '{"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name": ..., '
            '"schema": {...}}}',
        )
    return None


def tool_choice_spec(
    tools: list[dict], choice: str | dict | None, fmt: ToolFormat = HERMES, parallel: bool = True
) -> dict | None:
    """required and a named function are a grammar over the tools' calls in the format (required: one call unless
    parallel); auto and none constrain nothing."""
    if choice in (None, "auto", "none"):
        return None
    names = [t["function"]["name"] for t in tools]
    if choice == "required" and names:
        return fmt.grammar(tools, names, not parallel)
    named = choice if isinstance(choice, dict) and choice.get("type") == "function" else {}
    name = (named.get("function") or {}).get("name")
    if name not in names:
        raise InvalidParam(
            "tool_choice",
            f"tool_choice={choice!r} is invalid: name one of the tools {names} as "
            '{"type": "function", "function": {"name": ...}}, or use "auto", "none" or "required" '
            "(with tools)",
        )
    return fmt.grammar(tools, [name], True)
