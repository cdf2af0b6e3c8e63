"""The model's HF tokenizer and chat template; with no files, the real BPE of a short name (Qwen2.5, Qwen3,
Llama 3) is rebuilt offline from the ranks dashscope and llama-models ship."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from frontend.model_resolution import short_model
from protocol.config import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Qwen2's pre-tokenizer: like GPT-4's but digits split one per token.
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
NUM_BPE_TOKENS = 151643
# (token, special) in id order from 151643; the tool-call and FIM tokens are added but not "special" in Qwen2.5.
QWEN25_ADDED_TOKENS = [
    (t, True)
    for t in (
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
    )
] + [
    (t, False)
    for t in (
        "<tool_call>",
        "</tool_call>",
        "<|fim_prefix|>",
        "<|fim_middle|>",
        "<|fim_suffix|>",
        "<|fim_pad|>",
        "<|repo_name|>",
        "<|file_sep|>",
    )
]
QWEN3_ADDED_TOKENS = QWEN25_ADDED_TOKENS + [
    (t, False) for t in ("<tool_response>", "</tool_response>", "<think>", "</think>")
]
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
NUM_LLAMA3_BPE_TOKENS = 128000
# Llama 3's 256 special tokens from id 128000, as its Hugging Face repos name them.
LLAMA3_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|reserved_special_token_2|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)]


def qwen25_chat_template(instruct: bool = True) -> str:
    """The chat template a Qwen2.5 repo ships (Instruct and base differ in its default system prompt, '@SYSTEM@')."""
    system = "You are a helpful assistant."
    if instruct:
        system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    return chat_template("qwen25").replace("@SYSTEM@", system)


def chat_template(name: str) -> str:
    """One of the templates stored beside this file: 'qwen25' (with '@SYSTEM@'), 'qwen3', 'llama31' or 'llama32'."""
    return Path(__file__).with_name(f"{name}_chat_template.jinja").read_text()


def load_tokenizer(model: str, model_dir: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer (with chat template) of `model`, read from model_dir; short names work offline."""
    path = tokenizer_dir(model, model_dir)
    if path is None:
        where = f"in {model_dir!r}" if model_dir is not None else "(no model directory)"
        raise ValueError(
            f"no tokenizer for model {model!r}: found no tokenizer.json, vocab.json + merges.txt or "
            f"tokenizer.model {where}, and there is no offline fallback for it; use a model directory "
            f"with tokenizer files or a short name such as qwen2.5-1.5b, qwen3-1.7b or llama-3.2-1b"
        )
    if path == model_dir:
        return _from_pretrained(model_dir)
    repo = short_model(model)[0]
    if repo.startswith("meta-llama/"):
        return load_llama3_tokenizer(Path(path), repo.endswith("-Instruct"), "3.1" if "Llama-3.1" in repo else "3.2")
    if repo.startswith("Qwen/Qwen3-"):
        return load_qwen_tokenizer(Path(path), not repo.endswith("-Base"), qwen3=True)
    return load_qwen_tokenizer(Path(path), repo.endswith("-Instruct"), qwen3=False)


def tokenizer_dir(model: str, model_dir: str | None) -> str | None:
    """The directory load_tokenizer reads: the model's own, else a short name's offline cache (which load_tokenizer
    builds there); None when there is neither."""
    if model_dir is not None and has_tokenizer_files(model_dir):
        return model_dir
    if (short := short_model(model)) is None:
        return None
    repo = short[0]
    family = "llama3" if repo.startswith("meta-llama/") else "qwen3" if repo.startswith("Qwen/Qwen3-") else "qwen2.5"
    return str(cache_root() / f"{family}-tokenizer-v1")  # bump the suffix when what we write changes


def _from_pretrained(path, **kwargs) -> PreTrainedTokenizerBase:
    """AutoTokenizer's pick, Qwen2's class imported directly: AutoTokenizer imports torch, which delays launches."""
    try:
        config = json.loads((Path(path) / "tokenizer_config.json").read_text())
        declared = config.get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # no or odd config: AutoTokenizer decides, as it would anyway
        declared = None
    if declared in ("Qwen2Tokenizer", "Qwen2TokenizerFast"):  # tokenizers-backed itself
        from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer as tokenizer_class
    elif declared == "PreTrainedTokenizerFast":  # Llama 3's
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:  # imported here: seconds to import, and the engine starts first
        from transformers import AutoTokenizer as tokenizer_class
    return tokenizer_class.from_pretrained(path, **kwargs)


def has_tokenizer_files(model_dir: str | os.PathLike) -> bool:
    d = Path(model_dir)
    return (
        (d / "tokenizer.json").is_file()
        or (d / "tokenizer.model").is_file()
        or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file())
    )


def load_qwen_tokenizer(path: Path, instruct: bool, qwen3: bool) -> PreTrainedTokenizerBase:
    """Qwen2.5's tokenizer rebuilt from Qwen's BPE ranks (built once into `path`, then read from there); Qwen3's adds
    QWEN3_ADDED_TOKENS and has one chat template (enable_thinking) for base and post-trained."""
    added = QWEN3_ADDED_TOKENS if qwen3 else QWEN25_ADDED_TOKENS
    config = lambda: _tokenizer_config(added, chat_template("qwen3") if qwen3 else None)  # noqa: E731
    _build_once(path, lambda: build_qwen25_tokenizer(read_qwen_ranks(), added), config)
    if instruct:
        return _from_pretrained(path)
    # The base repos end documents with <|endoftext|>, not the chat turn's <|im_end|>; Qwen2.5's have their own
    # default system prompt.
    template = {} if qwen3 else {"chat_template": qwen25_chat_template(False)}
    return _from_pretrained(path, eos_token="<|endoftext|>", **template)


def load_llama3_tokenizer(path: Path, instruct: bool, version: str) -> PreTrainedTokenizerBase:
    """Llama 3's tokenizer rebuilt from Meta's ranks, BOS added on encode; the chat template of Llama 3.1 or 3.2."""
    _build_once(path, build_llama3_tokenizer, _llama3_tokenizer_config)
    template = chat_template("llama31" if version == "3.1" else "llama32")
    # Instruct repos end a turn with <|eot_id|>, base ones a document with <|end_of_text|>.
    return _from_pretrained(path, eos_token="<|eot_id|>" if instruct else "<|end_of_text|>", chat_template=template)


def _build_once(path: Path, build: Callable[[], Tokenizer], config: Callable[[], dict]) -> None:
    """Write the tokenizer files into a temporary sibling, then rename: readers never see half a cache."""
    if has_tokenizer_files(path):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    try:
        build().save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config(), indent=2, ensure_ascii=False))
        os.replace(tmp, path)
    except OSError:
        if not has_tokenizer_files(path):  # not merely another process winning the rename race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _package_file(package: str, relative: str, install: str) -> Path:
    """A data file of an installed package, found without importing it (its own dependencies may be absent)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"building this tokenizer offline needs BPE ranks from the PyPI package {package!r}: run "
            f"`{install}`, or pass a model directory that has tokenizer files"
        )
    return Path(list(spec.submodule_search_locations)[0]) / relative


def read_qwen_ranks() -> dict[bytes, int]:
    """Qwen's BPE ranks from dashscope's qwen.tiktoken."""
    ranks_file = _package_file("dashscope", "resources/qwen.tiktoken", "pip install dashscope")
    ranks = {
        base64.b64decode(token): int(rank)
        for token, rank in (line.split() for line in ranks_file.read_bytes().splitlines())
    }
    if len(ranks) != NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        raise ValueError(f"{ranks_file} holds {len(ranks)} ranks, not Qwen's {NUM_BPE_TOKENS}: reinstall dashscope")
    return ranks


def llama3_ranks_file() -> Path:
    """Llama 3's BPE ranks (tiktoken format), llama-models' llama3/tokenizer.model."""
    return _package_file("llama_models", "llama3/tokenizer.model", "pip install llama-models")


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the two parts BPE reaches by lower ranks (as merges.txt)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pair_ranks = [ranks.get(parts[i] + parts[i + 1], rank) for i in range(len(parts) - 1)]
            best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[best] >= rank:
                raise ValueError(f"token {token!r} (rank {rank}) cannot be built from lower ranks")
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def build_qwen25_tokenizer(ranks: dict[bytes, int], added: list[tuple[str, bool]] = QWEN25_ADDED_TOKENS) -> Tokenizer:
    """Qwen2's byte-level BPE (NFC, Qwen2 split pattern) with Qwen2.5's (or Qwen3's) added tokens at their ids."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_unicode = bytes_to_unicode()  # the printable alphabet byte-level vocabularies are written in

    def unicode(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    vocab = {unicode(token): rank for token, rank in ranks.items()}
    merges = [(unicode(a), unicode(b)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in added])
    for i, (t, _) in enumerate(added):
        if tok.token_to_id(t) != NUM_BPE_TOKENS + i:
            raise ValueError(f"added token {t!r} got id {tok.token_to_id(t)}, not {NUM_BPE_TOKENS + i}")
    return tok


def build_llama3_tokenizer() -> Tokenizer:
    """Llama 3's byte-level BPE by transformers' tiktoken converter (a whole pre-token found in the vocabulary is
    one token, tiktoken's rule); encoding with special tokens puts <|begin_of_text|> first."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(
        str(llama3_ranks_file()), LLAMA3_PATTERN, extra_special_tokens=LLAMA3_SPECIAL_TOKENS
    ).converted()
    bos = LLAMA3_SPECIAL_TOKENS[0]
    if tok.get_vocab_size() != NUM_LLAMA3_BPE_TOKENS + 256 or tok.token_to_id(bos) != NUM_LLAMA3_BPE_TOKENS:
        raise ValueError(f"{llama3_ranks_file()} is not Llama 3's tokenizer: `pip install llama-models` again")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, NUM_LLAMA3_BPE_TOKENS)]
            ),
        ]
    )
    return tok


def _added_tokens_decoder(added: list[tuple[str, bool]], first_id: int) -> dict:
    unset = dict.fromkeys(("lstrip", "normalized", "rstrip", "single_word"), False)
    return {str(first_id + i): {"content": t, **unset, "special": s} for i, (t, s) in enumerate(added)}


def _tokenizer_config(added: list[tuple[str, bool]] = QWEN25_ADDED_TOKENS, template: str | None = None) -> dict:
    """Qwen2.5-Instruct's (or Qwen3's) tokenizer_config.json (the fields that change behaviour)."""
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(added, NUM_BPE_TOKENS),
        "additional_special_tokens": [t for t, s in QWEN25_ADDED_TOKENS[1:] if s],
        "bos_token": None,
        "chat_template": template or qwen25_chat_template(True),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _llama3_tokenizer_config() -> dict:
    """Llama-3.2-Instruct's tokenizer_config.json (the fields that change behaviour)."""
    return {
        "added_tokens_decoder": _added_tokens_decoder(
            [(t, True) for t in LLAMA3_SPECIAL_TOKENS], NUM_LLAMA3_BPE_TOKENS
        ),
        "bos_token": "<|begin_of_text|>",
        "chat_template": chat_template("llama32"),
        # The repos say true; transformers 5 ignores it for BPE (it would strip spaces before punctuation).
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
