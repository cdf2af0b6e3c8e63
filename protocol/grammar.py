"""A structured_outputs spec as an xgrammar Grammar: the one build the frontend checks (a 400 naming the field) and
the scheduler compiles against the vocabulary. xgrammar is imported on first use: it loads torch."""

from __future__ import annotations

import json
import re

from protocol.config import InvalidParam

# xgrammar 0.2.9 writes a JSON string with minLength or maxLength as repeats of this rule, which lets raw control
# characters (a tab, \x12) into the string, where JSON forbids them. Its plain string rule excludes \0-\x1f: so do we.
_LENGTH_CHARS = re.compile(r'^(\S+_characters ::= \(\(\[\^)(\\"\\\\\\r\\n\]\)\))$', re.MULTILINE)
_JSON_KINDS = ("json", "json_object", "structural_tag")


def build_grammar(spec: dict) -> object:
    """xgrammar.Grammar of a checked SamplingParams.structured_outputs; InvalidParam naming the kind if it is bad."""
    import xgrammar as xgr

    kind = next(k for k in spec if k not in ("any_whitespace", "after"))
    try:
        grammar = _grammar(xgr, kind, spec[kind], spec["any_whitespace"])
        if kind in _JSON_KINDS:
            grammar = _json_safe(xgr, grammar)
        if spec.get("after"):  # free text up to the first `after`, then the grammar
            free = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": spec["after"]}
            grammar = xgr.Grammar.concat(xgr.Grammar.from_structural_tag(json.dumps({"format": free})), grammar)
        return grammar
    except Exception as e:  # xgrammar raises RuntimeError, ValueError or its own types; the message says what
        reason = re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip())  # its C++ prefix: time and source line
        raise InvalidParam("structured_outputs", f"structured_outputs.{kind} is invalid: {reason}") from None


def _json_safe(xgr, grammar: object) -> object:
    text = str(grammar)
    safe = _LENGTH_CHARS.sub(r"\g<1>\\0-\\x1f\g<2>", text)
    return grammar if safe == text else xgr.Grammar.from_ebnf(safe)


def _grammar(xgr, kind: str, value: object, any_whitespace: bool) -> object:
    if kind == "json":
        return xgr.Grammar.from_json_schema(value, any_whitespace=any_whitespace)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=any_whitespace, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(value)
    if kind == "choice":
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(value)
    return xgr.Grammar.from_structural_tag(value)
