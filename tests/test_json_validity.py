"""Every JSON-constrained answer is JSON: over generated schemas (string-heavy: lengths, enums, arrays, nesting) and
seeds, each answer that ends with "stop" parses with a strict json.loads and validates. Checked on xgrammar's masks
directly (a walk that takes a control character whenever the mask lets one through) and through the engine."""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend import LLM, SamplingParams
from protocol.grammar import build_grammar

NAMES = st.sampled_from(["a", "b", "name", "note", "tab"])
# Enum values of ASCII and characters from U+0100: xgrammar 0.2.9 writes U+0080..U+00FF as "\\xNN", so "\\xa0" and a
# hex digit after it read back as one character (U+0A00); an upstream bug that these tests leave aside.
WORDS = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cc", "Cs"], exclude_characters=[chr(c) for c in range(128, 256)]),
    max_size=4,
)


def _lengths(draw) -> dict:
    low = draw(st.integers(0, 4))
    bounds = draw(st.sampled_from([{}, {"minLength": low}, {"maxLength": low + 3}, {"minLength": low, "maxLength": 8}]))
    return {"type": "string", **bounds}


@st.composite
def schemas(draw, depth: int = 0) -> dict:
    leaves = [
        st.builds(dict, type=st.just("string")),
        st.composite(_lengths)(),
        st.builds(dict, enum=st.lists(WORDS, min_size=1, max_size=3, unique=True)),
        st.builds(dict, type=st.sampled_from(["integer", "number", "boolean", "null"])),
    ]
    kind = draw(st.integers(0, 5 if depth < 2 else 3))
    if kind == 4:
        return {"type": "array", "items": draw(schemas(depth + 1)), "maxItems": 3}
    if kind == 5:
        props = draw(st.dictionaries(NAMES, schemas(depth + 1), min_size=1, max_size=3))
        required = sorted(draw(st.sets(st.sampled_from(sorted(props)))))
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    return draw(leaves[kind])


def _check(text: str, schema: dict) -> None:
    """Strict JSON always; the schema too unless the bytes were not UTF-8: xgrammar takes a surrogate's or an overlong
    encoding's bytes as one character, which Python decodes to several U+FFFD (a length then looks exceeded)."""
    value = json.loads(text)
    if "\ufffd" not in text:
        jsonschema.validate(value, schema)


def _object(schema: dict) -> dict:
    return {"type": "object", "properties": {"x": schema}, "required": ["x"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(tiny_ckpt):
    import xgrammar as xgr
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=512, stop_token_ids=[tokenizer.eos_token_id])
    control = np.array([any(b < 0x20 for b in piece) for piece in info.decoded_vocab])
    return xgr.GrammarCompiler(info, max_threads=1), tokenizer, control


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), seed=st.integers(0, 2**16), any_whitespace=st.booleans())
def test_masks_never_let_a_control_character_into_a_json_string(compiler, schema, seed, any_whitespace):
    import xgrammar as xgr

    xgr_compiler, tokenizer, control = compiler
    schema = _object(schema)
    matcher = xgr.GrammarMatcher(
        xgr_compiler.compile_grammar(build_grammar({"json": json.dumps(schema), "any_whitespace": any_whitespace}))
    )
    rng, mask, ids = random.Random(seed), xgr.allocate_token_bitmask(1, 512), []
    while not matcher.is_terminated() and len(ids) < 80:
        matcher.fill_next_token_bitmask(mask)
        allowed = np.unpackbits(mask[0].numpy().view(np.uint8), bitorder="little")[:512].astype(bool)
        risky = np.flatnonzero(allowed & control)  # whitespace between values, or a leak into a string
        pool = risky if len(risky) and rng.random() < 0.5 else np.flatnonzero(allowed)
        ids.append(int(rng.choice(pool)))
        assert matcher.accept_token(ids[-1])
    if matcher.is_terminated():
        _check(tokenizer.decode(ids[:-1]), schema)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu", max_num_seqs=16) as engine:
        yield engine


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=schemas(), first_seed=st.integers(0, 2**16), sampling=st.sampled_from([{}, {"top_k": 40}]))
def test_every_constrained_answer_that_stops_parses_strictly_and_validates(llm, schema, first_seed, sampling):
    schema = _object(schema)
    params = [
        SamplingParams(
            temperature=1.0, seed=first_seed + i, max_tokens=60, structured_outputs={"json": schema}, **sampling
        )
        for i in range(8)
    ]
    for out in llm.generate([[5, 6, 7]] * len(params), params, use_tqdm=False):
        o = out.outputs[0]
        if o.finish_reason == "stop":
            _check(o.text, schema)
