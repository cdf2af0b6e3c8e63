"""Incremental detokenizers and stop strings: streamed text equals the whole decode; stop strings never leak.

Both detokenizers (the windowed decode and tokenizers' DecodeStream) run every detokenizer test."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from frontend.detokenizer import IncrementalDetokenizer, StopMatcher, StreamDetokenizer, make_detokenizer


@pytest.fixture(params=[IncrementalDetokenizer, StreamDetokenizer])
def detokenizer(request):
    """Each implementation in turn (the stream needs a fast tokenizer: every tokenizer here is one)."""
    return request.param


def stream(
    tokenizer, prompt_ids: list[int], ids: list[int], chunk: int = 1, cls=IncrementalDetokenizer, **kw
) -> list[str]:
    detok = cls(tokenizer, prompt_ids, **kw)
    deltas = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


TEXTS = [
    "I love 🦀 and 👍🏽!",
    "你好，世界！今天天气很好。",
    "Straße 日本語 한국어 😀😀😀 end",
    "def f(x):\n    return x ** 2  # 平方\n",
]


@pytest.mark.parametrize("chunk", [1, 2, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_join_to_the_full_decode(qwen_tokenizer, detokenizer, text, chunk):
    prompt = qwen_tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    ids = qwen_tokenizer.encode(text)
    deltas = stream(qwen_tokenizer, prompt, ids, chunk, detokenizer)
    assert "".join(deltas) == qwen_tokenizer.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_character_split_across_byte_tokens_is_held_until_complete(qwen_tokenizer, detokenizer):
    ids = qwen_tokenizer.encode(" 🦀")
    assert len(ids) == 3  # one emoji, three byte-level tokens
    detok = detokenizer(qwen_tokenizer, [])
    assert [detok.step([i]) for i in ids] == ["", "", " 🦀"]


def test_incomplete_character_at_the_end_comes_out_on_flush(qwen_tokenizer, detokenizer):
    ids = qwen_tokenizer.encode("ok 🦀")[:-1]
    detok = detokenizer(qwen_tokenizer, [])
    assert "".join(detok.step([i]) for i in ids) == "ok"
    assert detok.flush() == qwen_tokenizer.decode(ids)[len("ok") :]


def test_special_tokens_skipped_or_kept(qwen_tokenizer, detokenizer):
    ids = qwen_tokenizer.encode("Hi<|im_end|>")
    assert "".join(stream(qwen_tokenizer, [], ids, cls=detokenizer)) == "Hi"
    assert "".join(stream(qwen_tokenizer, [], ids, cls=detokenizer, skip_special_tokens=False)) == "Hi<|im_end|>"


def test_each_step_decodes_a_short_window_not_the_whole_sequence(qwen_tokenizer):
    windows = []

    class Counting:
        def decode(self, ids, **kw):
            windows.append(len(ids))
            return qwen_tokenizer.decode(ids, **kw)

    ids = qwen_tokenizer.encode("滴水穿石 🦀 " * 200)
    deltas = stream(Counting(), list(range(100, 600)), ids)
    assert "".join(deltas) == qwen_tokenizer.decode(ids)
    assert len(ids) > 1000 and max(windows) <= 8


def test_checkpoint_tokenizer_streams_like_its_decode(tiny_ckpt, detokenizer):
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    ids = tok.encode("Hello world! The quick brown fox jumps over the lazy dog.")
    assert "".join(stream(tok, ids[:4], ids[4:], cls=detokenizer)) == tok.decode(ids[4:])


def test_the_stream_serves_fast_tokenizers_that_decode_without_clean_up(qwen_tokenizer):
    assert isinstance(make_detokenizer(qwen_tokenizer, []), StreamDetokenizer)

    class Slow:  # no Rust backend: the windowed decode
        decode = qwen_tokenizer.decode

    assert isinstance(make_detokenizer(Slow(), []), IncrementalDetokenizer)


def feed_all(matcher: StopMatcher, deltas: list[str]) -> tuple[list[str], str | None]:
    out = []
    for d in deltas:
        emit, hit = matcher.feed(d)
        out.append(emit)
        if hit is not None:
            return out, hit
    out.append(matcher.flush())
    return out, None


def test_stop_string_across_delta_boundaries_is_never_emitted():
    out, hit = feed_all(StopMatcher(["STOP"]), ["Hello S", "T", "O", "P and more"])
    assert hit == "STOP" and "".join(out) == "Hello "
    assert out == ["Hello ", "", "", ""]  # no piece of the stop string ever went out


def test_held_prefix_is_released_when_the_stop_does_not_complete():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("ab ST") == ("ab ", None)
    assert matcher.feed("Ox") == ("STOx", None)
    assert matcher.feed("yz S") == ("yz ", None)
    assert matcher.flush() == "S"
    assert matcher.flush() == ""


def test_earliest_stop_wins_and_text_after_it_is_dropped():
    out, hit = feed_all(StopMatcher(["world", "lo w", "\n\n"]), ["Hel", "lo world\n\nmore"])
    assert hit == "lo w" and "".join(out) == "Hel"
    assert StopMatcher(["b", "abc"]).feed("xabc") == ("x", "abc")


def test_after_a_stop_nothing_more_is_emitted():
    matcher = StopMatcher(["."])
    assert matcher.feed("one. two") == ("one", ".")
    assert matcher.feed("three") == ("", ".")


def test_overlapping_prefixes_hold_the_longest_possible_start():
    matcher = StopMatcher(["aab"])
    assert matcher.feed("xa") == ("x", None)
    assert matcher.feed("a") == ("", None)
    assert matcher.feed("a") == ("a", None)  # "aaa": only the last "aa" can still start "aab"
    assert matcher.feed("b!") == ("", "aab")


def test_unchecked_text_keeps_its_stops_but_a_stop_completed_later_matches():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("a STOP b ST", check=False) == ("a STOP b ", None)  # before min_tokens: no stop
    assert matcher.feed("OP c") == ("", "STOP")  # its start was held, and the checked delta completes it


def test_a_stop_completed_while_unchecked_does_not_match_later_like_vllm():
    matcher = StopMatcher(["ab", "abcd"])
    assert matcher.feed("x ab", check=False) == ("x ", None)  # "ab" may still start "abcd": held
    assert matcher.feed("z") == ("abz", None)  # vLLM checks only new text once min_tokens is reached


def test_kept_stop_string_ends_the_text_and_nothing_is_held_back():
    matcher = StopMatcher(["STOP", "S!"], keep_stop=True)
    assert [matcher.feed(d) for d in ["Hello S", "T", "O", "P and more"]] == [
        ("Hello S", None),
        ("T", None),
        ("O", None),
        ("P", "STOP"),
    ]
    assert StopMatcher(["lo w", "world"], keep_stop=True).feed("Hello world!") == ("Hello w", "lo w")


def test_no_stop_strings_passes_text_straight_through():
    matcher = StopMatcher(None)
    assert matcher.feed("any text") == ("any text", None)
    assert matcher.flush() == ""


def test_stop_string_in_streamed_detokenized_text(qwen_tokenizer, detokenizer):
    ids = qwen_tokenizer.encode("Answer: 42\n\nUser: next question")
    detok, matcher = detokenizer(qwen_tokenizer, []), StopMatcher(["\nUser:"])
    out, hit = feed_all(matcher, [detok.step([i]) for i in ids])
    assert hit == "\nUser:" and "".join(out) == "Answer: 42\n"
