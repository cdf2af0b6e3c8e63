"""The tokenizer loader: a checkpoint's own files, and Qwen2.5's real tokenizer rebuilt offline from its BPE ranks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from conftest import offline_cache_root, offline_tokenizer
from transformers import AutoTokenizer

from frontend.tokenizer import QWEN2_PATTERN, load_tokenizer, read_qwen_ranks, tokenizer_dir

REPO = Path(__file__).resolve().parents[1]


def test_a_qwen2_tokenizer_is_autotokenizers_own_class_without_importing_torch(qwen_tokenizer, qwen_cache_root):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICO_VLLM_CACHE", str(qwen_cache_root))
        auto = AutoTokenizer.from_pretrained(tokenizer_dir("qwen2.5-1.5b", None))
    assert type(qwen_tokenizer) is type(auto)
    texts = ["Hello world", "<|im_start|>user\nhi<|im_end|>\n", "12345 + 678"]
    assert [qwen_tokenizer.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    messages = [{"role": "user", "content": "hi"}]
    assert qwen_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    code = (
        "import sys; from frontend.tokenizer import load_tokenizer; load_tokenizer('qwen2.5-1.5b', None); "
        "print('torch' in sys.modules)"
    )
    env = {**os.environ, "PICO_VLLM_CACHE": str(qwen_cache_root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr


# Pinned with the offline build; "Hello world", the ChatML ids and the per-digit split are Qwen2's known values.
PINNED = {
    "Hello world": [9707, 1879],
    "The quick brown fox jumps over the lazy dog.": [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13],
    "你好，世界！今天天气很好。": [108386, 3837, 99489, 6313, 100644, 104307, 101243, 1773],
    "def add(a, b):\n    return a + b\n": [750, 912, 2877, 11, 293, 982, 262, 470, 264, 488, 293, 198],
    "12345 + 678 = 13023": [16, 17, 18, 19, 20, 488, 220, 21, 22, 23, 284, 220, 16, 18, 15, 17, 18],
    "I love 🦀 and 👍🏽!": [40, 2948, 11162, 99, 222, 323, 61804, 235, 145375, 0],
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n": [
        151644,
        8948,
        198,
        2610,
        525,
        264,
        10950,
        17847,
        13,
        151645,
        198,
    ],
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>": [151644, 872, 198, 6023, 151645, 198, 151643],
    "<tool_call>\n{}\n</tool_call>": [151657, 198, 16094, 151658],
}


@pytest.mark.parametrize("text", list(PINNED))
def test_offline_qwen_encodes_pinned_ids_and_decodes_back(qwen_tokenizer, text):
    ids = qwen_tokenizer.encode(text)
    assert ids == PINNED[text]
    assert qwen_tokenizer.decode(ids) == text


def test_offline_qwen_splits_digits_one_per_token(qwen_tokenizer):
    ids = qwen_tokenizer.encode("2024")
    assert [qwen_tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_offline_qwen_normalizes_to_nfc(qwen_tokenizer):
    decomposed = "cafe\u0301"
    assert qwen_tokenizer.encode(decomposed) == qwen_tokenizer.encode(unicodedata.normalize("NFC", decomposed))


def test_offline_qwen_has_qwen25_special_tokens_eos_and_pad(qwen_tokenizer):
    names = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|object_ref_start|>",
        "<|object_ref_end|>",
        "<|box_start|>",
        "<|box_end|>",
        "<|quad_start|>",
        "<|quad_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|vision_pad|>",
        "<|image_pad|>",
        "<|video_pad|>",
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    ]
    assert qwen_tokenizer.convert_tokens_to_ids(names) == list(range(151643, 151665))
    assert len(qwen_tokenizer) == 151665
    assert (qwen_tokenizer.eos_token_id, qwen_tokenizer.pad_token_id) == (151645, 151643)
    # Chat markers are special (skipped when decoding), tool-call markers are text the caller parses.
    assert qwen_tokenizer.decode([151644, 872, 151645, 151657], skip_special_tokens=True) == "user<tool_call>"


def test_offline_qwen_matches_tiktoken_on_mixed_text(qwen_tokenizer):
    """Merges recovered from the ranks give exactly tiktoken's BPE (which is how Qwen defines its tokenizer)."""
    tiktoken = pytest.importorskip("tiktoken")
    enc = tiktoken.Encoding("qwen", pat_str=QWEN2_PATTERN, mergeable_ranks=read_qwen_ranks(), special_tokens={})
    text = (
        "import numpy as np\n\n\nclass Foo:\n\tdef __init__(self):  # 初始化\n        self.x = 3.14159\r\n"
        "Straße naïve façade — «quotes» 'll 's 've ПРИВЕТ мир 日本語のテキスト 한국어 😀👍🏽🦀 \u00a0 end  \n\n"
    )
    assert qwen_tokenizer.encode(text) == enc.encode_ordinary(text)


CONVERSATION = [
    {"role": "system", "content": "You are a pirate."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Arr, hello."},
]


def test_chat_template_renders_system_user_assistant_as_qwen25(qwen_tokenizer):
    text = qwen_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nArr, hello.<|im_end|>\n"
    )


def test_chat_template_adds_default_system_prompt_and_generation_prompt(qwen_tokenizer):
    text = qwen_tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_template_renders_tools_tool_calls_and_tool_results(qwen_tokenizer):
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "22C"},
    ]
    text = qwen_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        'signatures within <tools></tools> XML tags:\n<tools>\n{"type": "function", "function": '
        '{"name": "get_weather", "description": "Weather in a city", "parameters": {"type": '
        '"object", "properties": {}}}}\n</tools>\n\nFor each function call, return a json object with '
        'function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
        '<function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_short_names_load_the_cached_build(qwen_tokenizer, qwen_cache_root, monkeypatch):
    monkeypatch.setenv("PICO_VLLM_CACHE", str(qwen_cache_root))
    instruct = load_tokenizer("qwen2.5-1.5b", None)
    base = load_tokenizer("Qwen2.5-7B-Base", None)
    assert instruct.encode("Hello world") == base.encode("Hello world") == [9707, 1879]
    assert (instruct.eos_token_id, base.eos_token_id) == (151645, 151643)
    assert "You are a helpful assistant." in base.apply_chat_template(CONVERSATION[1:2], tokenize=False)


def test_checkpoint_directory_tokenizer_is_loaded_from_its_files(tiny_ckpt):
    tok = load_tokenizer("qwen2.5-0.5b", str(tiny_ckpt))  # files win over the short-name fallback
    reference = AutoTokenizer.from_pretrained(tiny_ckpt)
    text = "Hello world! The quick brown fox."
    assert tok.encode(text) == reference.encode(text)
    assert len(tok) == len(reference) < 1000
    assert (
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        == "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_tokenizer_dir_names_the_files_load_tokenizer_read(
    tiny_ckpt, qwen_tokenizer, qwen3_tokenizer, llama_tokenizer, qwen_cache_root, llama_cache_root, monkeypatch
):
    """What the scheduler's grammars load: the model's own files, else the short name's offline build."""
    assert tokenizer_dir("qwen2.5-0.5b", str(tiny_ckpt)) == str(tiny_ckpt)
    assert tokenizer_dir("my-model", None) is None
    for short, tok, root in [
        ("qwen2.5-1.5b", qwen_tokenizer, qwen_cache_root),
        ("qwen3-1.7b", qwen3_tokenizer, qwen_cache_root),
        ("llama-3.2-1b", llama_tokenizer, llama_cache_root),
    ]:
        monkeypatch.setenv("PICO_VLLM_CACHE", str(root))
        assert tokenizer_dir(short, None) == str(tok.name_or_path)
        assert AutoTokenizer.from_pretrained(tokenizer_dir(short, None)).encode("Hi there") == tok.encode("Hi there")


@pytest.mark.parametrize("model_dir", [None, "empty"])
def test_unknown_model_without_tokenizer_files_is_a_clear_error(tmp_path, model_dir):
    with pytest.raises(ValueError, match="no tokenizer for model 'my-model'.*qwen2.5-1.5b"):
        load_tokenizer("my-model", None if model_dir is None else str(tmp_path))


def test_missing_bpe_ranks_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install dashscope"):
        read_qwen_ranks()


# ---- Qwen3 and Llama 3 ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def llama_cache_root(tmp_path_factory):
    return offline_cache_root(tmp_path_factory, "llama_models", "pip install llama-models", "pico-vllm-llama-cache")


@pytest.fixture(scope="session")
def llama_tokenizer(llama_cache_root):
    return offline_tokenizer(llama_cache_root, "llama-3.2-1b")


def test_offline_qwen3_is_qwen25_plus_tool_response_and_think_tokens(qwen3_tokenizer, qwen_tokenizer):
    assert len(qwen3_tokenizer) == 151669 and qwen3_tokenizer.eos_token_id == 151645
    assert qwen3_tokenizer.convert_tokens_to_ids(["<tool_response>", "</tool_response>", "<think>", "</think>"]) == [
        151665,
        151666,
        151667,
        151668,
    ]
    for text in PINNED:
        assert qwen3_tokenizer.encode(text) == PINNED[text]
    # Thinking markers are text the caller parses, not specials that decoding drops.
    assert qwen3_tokenizer.decode([151667, 6023, 151668], skip_special_tokens=True) == "<think>hi</think>"


def test_offline_llama3_matches_tiktoken_and_puts_bos_first(llama_tokenizer):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    from frontend.tokenizer import LLAMA3_PATTERN, llama3_ranks_file

    assert llama_tokenizer.encode("Hello world") == [128000, 9906, 1917]
    enc = tiktoken.Encoding(
        "llama3", pat_str=LLAMA3_PATTERN, special_tokens={}, mergeable_ranks=load_tiktoken_bpe(str(llama3_ranks_file()))
    )
    text = (
        "import numpy as np\n\n\nclass Foo:\n\tdef __init__(self):  # 初始化\n        self.x = 3.14159\r\n"
        "Straße naïve — «quotes» 'll 's ПРИВЕТ 日本語 한국어 😀👍🏽🦀 \u00a0 end  \n\n 1234567 .:.:.:"
    )
    assert llama_tokenizer.encode(text, add_special_tokens=False) == enc.encode_ordinary(text)
    assert llama_tokenizer.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    ) == [128000, 128001, 128006, 128008, 128009, 128010]
    assert len(llama_tokenizer) == 128256 and llama_tokenizer.eos_token_id == 128009


def test_llama3_short_names_pick_eos_and_template_by_version_and_kind(llama_tokenizer, llama_cache_root, monkeypatch):
    monkeypatch.setenv("PICO_VLLM_CACHE", str(llama_cache_root))
    base, llama31 = load_tokenizer("llama-3.2-3b-base", None), load_tokenizer("llama-3.1-8b", None)
    assert (base.eos_token_id, llama31.eos_token_id) == (128001, 128009)
    assert "builtin_tools" in llama31.chat_template and "strftime_now" in llama_tokenizer.chat_template


def test_qwen3_template_renders_thinking_switch_and_drops_old_reasoning(qwen3_tokenizer):
    turn = [{"role": "user", "content": "Hi!"}]
    assert (
        qwen3_tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
        == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (
        qwen3_tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    history = [
        {"role": "system", "content": "Be brief."},
        *turn,
        {"role": "assistant", "content": "<think>\nGreet back.\n</think>\n\nHello."},
        {"role": "user", "content": "Bye!"},
    ]
    assert qwen3_tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello."
        "<|im_end|>\n<|im_start|>user\nBye!<|im_end|>\n<|im_start|>assistant\n"
    )


def test_llama3_template_renders_system_header_and_turns(llama_tokenizer):
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
    ]
    text = llama_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, date_string="26 Jul 2024"
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # The template writes BOS itself: encoding it adds no second one.
    assert llama_tokenizer.encode(text, add_special_tokens=False).count(128000) == 1


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Arr."},
        {"role": "user", "content": "Where is the gold?"},
    ],
    [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "22C"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


@pytest.mark.parametrize(
    "short,template",
    [("qwen3-1.7b", "qwen3"), ("qwen3-4b-base", "qwen3"), ("llama-3.2-1b", "llama32"), ("llama-3.1-8b", "llama31")],
)
def test_short_name_tokenizers_render_their_stored_template_as_transformers_does(
    short, template, qwen_cache_root, llama_cache_root, monkeypatch
):
    from frontend.tokenizer import chat_template

    monkeypatch.setenv("PICO_VLLM_CACHE", str(llama_cache_root if short.startswith("llama") else qwen_cache_root))
    tok = load_tokenizer(short, None)
    for messages in CONVERSATIONS:
        for extra in ({}, {"tools": TOOLS}, {"enable_thinking": False}):
            kwargs = dict(tokenize=False, add_generation_prompt=True, date_string="26 Jul 2024", **extra)
            assert tok.apply_chat_template(messages, **kwargs) == tok.apply_chat_template(
                messages, chat_template=chat_template(template), **kwargs
            )


def test_text_prompts_start_with_bos_where_the_tokenizer_has_one(llama_tokenizer, qwen3_tokenizer):
    from types import SimpleNamespace

    from frontend.engine_client import EngineClient
    from protocol.sampling import SamplingParams

    def prepare(tokenizer, vocab_size: int) -> list[int]:  # the engine client's prompt path, without an engine
        client = SimpleNamespace(
            tokenizer=tokenizer, model_config=SimpleNamespace(vocab_size=vocab_size), max_model_len=64
        )
        return EngineClient.prepare(client, "Hello world", SamplingParams(max_tokens=4))[1]

    llama_ids, qwen_ids = prepare(llama_tokenizer, 128256), prepare(qwen3_tokenizer, 151936)
    assert (llama_ids, qwen_ids) == ([128000, 9906, 1917], [9707, 1879])


def test_chat_template_kwargs_reach_the_template(qwen3_tokenizer):
    from frontend.chat_prompt import ChatMessage, chat_prompt

    messages = [ChatMessage(role="user", content="Hi!")]
    thinking = chat_prompt(messages, qwen3_tokenizer)
    plain = chat_prompt(messages, qwen3_tokenizer, template_kwargs={"enable_thinking": False})
    assert (
        plain[: len(thinking)] == thinking
        and qwen3_tokenizer.decode(plain[len(thinking) :]) == "<think>\n\n</think>\n\n"
    )
