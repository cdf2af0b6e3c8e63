"""Shared fixtures. Kernels run under Triton's interpreter when there is no GPU."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))
from checkpoints import make_checkpoint  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The default tiny checkpoint: tied embeddings, 4 query heads over 2 KV heads, head_dim 16."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))


def offline_cache_root(tmp_path_factory, package: str, install: str, name: str) -> Path:
    """A fresh cache root per test session: the offline build itself is tested, once, and then shared."""
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"the BPE ranks come from `{install}`")
    return tmp_path_factory.getbasetemp() / name


def offline_tokenizer(cache_root: Path, short_name: str):
    """The offline tokenizer of a short name, built under cache_root."""
    from frontend.tokenizer import load_tokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PICO_VLLM_CACHE", str(cache_root))
        return load_tokenizer(short_name, None)


@pytest.fixture(scope="session")
def qwen_cache_root(tmp_path_factory):
    return offline_cache_root(tmp_path_factory, "dashscope", "pip install dashscope", "pico-vllm-cache")


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_cache_root):
    return offline_tokenizer(qwen_cache_root, "qwen2.5-1.5b")


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen_cache_root):
    return offline_tokenizer(qwen_cache_root, "qwen3-1.7b")


@pytest.fixture
def fresh_choices(monkeypatch, tmp_path):
    """No linear pick in memory, an empty disk cache under tmp_path, nothing read from it yet, no capture."""
    from worker import linear_plan as plan

    monkeypatch.setattr(plan, "_CHOICES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("PICO_VLLM_CACHE", str(tmp_path))
    plan._kept_choices.cache_clear()
    yield tmp_path
    plan._kept_choices.cache_clear()


@pytest.fixture(scope="session")
def tool_server(tmp_path_factory):
    """The server on a tiny checkpoint with Qwen2.5's chat template (tools, tool calls and results) and an API
    key "test-key", served as "tiny": shared by the tests of the APIs that translate to chat."""
    from server_fixture import launch

    from frontend.tokenizer import qwen25_chat_template

    ckpt = make_checkpoint(tmp_path_factory.mktemp("tool-server"))
    (ckpt / "chat_template.jinja").write_text(qwen25_chat_template())
    args = ["--model", str(ckpt), "--device", "cpu", "--max-model-len", "2048", "--served-model-name", "tiny"]
    server = launch([*args, "--api-key", "test-key"], tmp_path_factory.mktemp("log") / "server.log")
    try:
        server.wait_healthy()
        yield server.url
    finally:
        server.stop()
