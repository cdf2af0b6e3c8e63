"""The model's HF tokenizer and chat template; with no files, Qwen2.5's BPE is rebuilt offline from Qwen's ranks."""
from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from frontend.model_resolution import short_model
from protocol.config import cache_root

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CHAT_TEMPLATE_FILE = Path(__file__).with_name("qwen25_chat_template.jinja")  # '@SYSTEM@': the default system prompt

# Qwen2's pre-tokenizer: like GPT-4's but digits split one per token.
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
NUM_BPE_TOKENS = 151643
# (token, special) in id order from 151643; the tool-call and FIM tokens are added but not "special" in Qwen2.5.
QWEN25_ADDED_TOKENS = [(t, True) for t in (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")] + [(t, False) for t in (
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>")]


def qwen25_chat_template(instruct: bool = True) -> str:
    """The chat template a Qwen2.5 repo ships (Instruct or base: they differ in the default system prompt)."""
    system = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant." if instruct else \
        "You are a helpful assistant."
    return CHAT_TEMPLATE_FILE.read_text().replace("@SYSTEM@", system)


def load_tokenizer(model: str, model_dir: str | None) -> PreTrainedTokenizerBase:
    """The tokenizer (with chat template) of `model`, read from model_dir; Qwen2.5 short names work offline."""
    if model_dir is not None and has_tokenizer_files(model_dir):
        return _from_pretrained(model_dir)
    if short_model(model) is None:
        where = f"in {model_dir!r}" if model_dir is not None else "(no model directory)"
        raise ValueError(f"no tokenizer for model {model!r}: found no tokenizer.json, vocab.json + merges.txt or "
                         f"tokenizer.model {where}, and there is no offline fallback for it; use a model directory "
                         f"with tokenizer files or a Qwen2.5 short name such as qwen2.5-1.5b")
    path = default_cache_dir()  # Qwen2.5's tokenizer, rebuilt from Qwen's BPE ranks once
    if not has_tokenizer_files(path):  # built in a temporary sibling, then renamed: never half a cache
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
        try:
            build_qwen25_tokenizer(read_qwen_ranks()).save(str(tmp / "tokenizer.json"))
            (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2, ensure_ascii=False))
            os.replace(tmp, path)
        except OSError:
            if not has_tokenizer_files(path):  # not merely another process winning the rename race
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not model.lower().endswith("-base"):
        return _from_pretrained(path)
    # The base repos end documents with <|endoftext|>, not the chat turn's <|im_end|>.
    return _from_pretrained(path, eos_token="<|endoftext|>", chat_template=qwen25_chat_template(False))


def _from_pretrained(path, **kwargs) -> PreTrainedTokenizerBase:
    """AutoTokenizer's pick, but Qwen2's class is imported directly: AutoTokenizer's import pulls in torch, which
    the frontend never uses and which made the tokenizer, not the engine, the last thing a launch waited for."""
    try:
        declared = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # no or odd config: AutoTokenizer decides, as it would anyway
        declared = None
    if declared in ("Qwen2Tokenizer", "Qwen2TokenizerFast"):
        try:  # the tokenizers-backed class of each transformers major, as AutoTokenizer picks it
            from transformers.models.qwen2.tokenization_qwen2_fast import Qwen2TokenizerFast as Qwen2  # 4
        except ImportError:
            from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer as Qwen2  # 5
        return Qwen2.from_pretrained(path, **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **kwargs)


def has_tokenizer_files(model_dir: str | os.PathLike) -> bool:
    d = Path(model_dir)
    return ((d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file()
            or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file()))


def default_cache_dir() -> Path:
    return cache_root() / "qwen2.5-tokenizer-v1"  # bump the suffix when what we write changes


def read_qwen_ranks() -> dict[bytes, int]:
    """Qwen's BPE ranks from dashscope's qwen.tiktoken, found without importing dashscope (its deps may be absent)."""
    spec = importlib.util.find_spec("dashscope")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("building the Qwen2.5 tokenizer offline needs Qwen's BPE ranks from the PyPI package "
                         "'dashscope': run `pip install --no-deps dashscope`, or pass a model directory that has "
                         "tokenizer files")
    ranks_file = Path(list(spec.submodule_search_locations)[0]) / "resources" / "qwen.tiktoken"
    ranks = {}
    for line in ranks_file.read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != NUM_BPE_TOKENS or sorted(ranks.values()) != list(range(NUM_BPE_TOKENS)):
        raise ValueError(f"{ranks_file} holds {len(ranks)} ranks, not Qwen's {NUM_BPE_TOKENS}: reinstall dashscope")
    return ranks


def recover_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """One merge per multi-byte token, in rank order: the two parts BPE reaches by lower ranks (as merges.txt)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) == 1:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            pair_ranks = [ranks.get(parts[i] + parts[i + 1], rank) for i in range(len(parts) - 1)]
            best = min(range(len(pair_ranks)), key=pair_ranks.__getitem__)
            if pair_ranks[best] >= rank:
                raise ValueError(f"token {token!r} (rank {rank}) cannot be built from lower ranks")
            parts[best:best + 2] = [parts[best] + parts[best + 1]]
        merges.append((parts[0], parts[1]))
    return merges


def build_qwen25_tokenizer(ranks: dict[bytes, int]) -> Tokenizer:
    """Qwen2's byte-level BPE (NFC, Qwen2 split pattern) with Qwen2.5's added tokens at their real ids."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_unicode = bytes_to_unicode()  # the printable alphabet byte-level vocabularies are written in

    def unicode(b: bytes) -> str:
        return "".join(to_unicode[x] for x in b)

    vocab = {unicode(token): rank for token, rank in ranks.items()}
    merges = [(unicode(a), unicode(b)) for a, b in recover_merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in QWEN25_ADDED_TOKENS])
    for i, (t, _) in enumerate(QWEN25_ADDED_TOKENS):
        if tok.token_to_id(t) != NUM_BPE_TOKENS + i:
            raise ValueError(f"added token {t!r} got id {tok.token_to_id(t)}, not {NUM_BPE_TOKENS + i}")
    return tok


def _tokenizer_config() -> dict:
    """Qwen2.5-Instruct's tokenizer_config.json (the fields that change behaviour)."""
    added = {str(NUM_BPE_TOKENS + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": s}
             for i, (t, s) in enumerate(QWEN25_ADDED_TOKENS)}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": [t for t, s in QWEN25_ADDED_TOKENS[1:] if s],
        "bos_token": None, "chat_template": qwen25_chat_template(True), "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None}
