"""The tokenizer loader: a checkpoint's own files, and Qwen2.5's real tokenizer rebuilt offline from its BPE ranks."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from frontend.tokenizer import QWEN2_PATTERN, load_tokenizer, read_qwen_ranks

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def qwen_cache_root(tmp_path_factory):
    """A fresh cache root per test session: the offline build itself is tested, once, and then shared."""
    if importlib.util.find_spec("dashscope") is None:
        pytest.skip("Qwen's BPE ranks come from `pip install --no-deps dashscope`")
    return tmp_path_factory.getbasetemp() / "pico-vllm-cache"


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_cache_root):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICO_VLLM_CACHE", str(qwen_cache_root))
        return load_tokenizer("qwen2.5-1.5b", None)


def test_a_qwen2_tokenizer_is_autotokenizers_own_class_without_importing_torch(qwen_tokenizer, qwen_cache_root):
    from frontend.tokenizer import default_cache_dir

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICO_VLLM_CACHE", str(qwen_cache_root))
        auto = AutoTokenizer.from_pretrained(default_cache_dir())
    assert type(qwen_tokenizer) is type(auto)
    texts = ["Hello world", "<|im_start|>user\nhi<|im_end|>\n", "12345 + 678"]
    assert [qwen_tokenizer.encode(t) for t in texts] == [auto.encode(t) for t in texts]
    messages = [{"role": "user", "content": "hi"}]
    assert (qwen_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    code = ("import sys; from frontend.tokenizer import load_tokenizer; load_tokenizer('qwen2.5-1.5b', None); "
            "print('torch' in sys.modules)")
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
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n":
        [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198],
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
    names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
             "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
             "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
             "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
    assert qwen_tokenizer.convert_tokens_to_ids(names) == list(range(151643, 151665))
    assert len(qwen_tokenizer) == 151665
    assert (qwen_tokenizer.eos_token_id, qwen_tokenizer.pad_token_id) == (151645, 151643)
    # Chat markers are special (skipped when decoding), tool-call markers are text the caller parses.
    assert qwen_tokenizer.decode([151644, 872, 151645, 151657], skip_special_tokens=True) == "user<tool_call>"


def test_offline_qwen_matches_tiktoken_on_mixed_text(qwen_tokenizer):
    """Merges recovered from the ranks give exactly tiktoken's BPE (which is how Qwen defines its tokenizer)."""
    tiktoken = pytest.importorskip("tiktoken")
    enc = tiktoken.Encoding("qwen", pat_str=QWEN2_PATTERN, mergeable_ranks=read_qwen_ranks(), special_tokens={})
    text = ("import numpy as np\n\n\nclass Foo:\n\tdef __init__(self):  # 初始化\n        self.x = 3.14159\r\n"
            "Straße naïve façade — «quotes» 'll 's 've ПРИВЕТ мир 日本語のテキスト 한국어 😀👍🏽🦀 \u00a0 end  \n\n")
    assert qwen_tokenizer.encode(text) == enc.encode_ordinary(text)


CONVERSATION = [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Arr, hello."}]


def test_chat_template_renders_system_user_assistant_as_qwen25(qwen_tokenizer):
    text = qwen_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\nArr, hello.<|im_end|>\n")


def test_chat_template_adds_default_system_prompt_and_generation_prompt(qwen_tokenizer):
    text = qwen_tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_renders_tools_tool_calls_and_tool_results(qwen_tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "22C"}]
    text = qwen_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\nYou are provided with function "
        "signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": "
        "{\"name\": \"get_weather\", \"description\": \"Weather in a city\", \"parameters\": {\"type\": "
        "\"object\", \"properties\": {}}}}\n</tools>\n\nFor each function call, return a json object with "
        "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\nParis?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", "
        "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n22C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


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
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == \
        "<|im_start|>user\nhi<|im_end|>\n"


@pytest.mark.parametrize("model_dir", [None, "empty"])
def test_unknown_model_without_tokenizer_files_is_a_clear_error(tmp_path, model_dir):
    with pytest.raises(ValueError, match="no tokenizer for model 'my-model'.*qwen2.5-1.5b"):
        load_tokenizer("my-model", None if model_dir is None else str(tmp_path))


def test_missing_bpe_ranks_package_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps dashscope"):
        read_qwen_ranks()
