"""KV cache sizing: blocks from the card's memory after the peak step, or from the workload on the CPU."""

from __future__ import annotations

import pytest
import torch

from frontend.model_resolution import config_from_dir
from protocol.config import EngineConfig
from worker import kv_cache

GIB = 1 << 30


def fake_card(monkeypatch, free_gib: float, transient_gib: float, total_gib: float = 100) -> None:
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 4 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 4 * GIB + int(transient_gib * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free_gib * GIB), int(total_gib * GIB)))


def test_the_card_gives_the_cache_its_share_less_what_is_used_and_the_peak_steps_transient(monkeypatch):
    fake_card(monkeypatch, free_gib=50, transient_gib=2)
    steps = []
    # 0.9 x 100 GiB, less 50 in use, less the step's 2 GiB transient: 38 blocks of 1 GiB.
    assert kv_cache.profile_num_kv_blocks(0.9, GIB, lambda: steps.append("peak")) == 38
    assert steps == ["peak"]


def test_a_kept_peak_is_read_instead_of_running_the_step_and_its_key_follows_config_and_gpu(monkeypatch, tmp_path):
    monkeypatch.setenv("PICO_VLLM_CACHE", str(tmp_path))
    fake_card(monkeypatch, free_gib=50, transient_gib=2)
    steps, config = [], EngineConfig("qwen2.5-1.5b")
    key = kv_cache.peak_key(config, "NVIDIA H200", 0)
    assert kv_cache.profile_num_kv_blocks(0.9, GIB, lambda: steps.append("peak"), key) == 38
    fake_card(monkeypatch, free_gib=50, transient_gib=7)  # what running the step again would measure
    assert kv_cache.profile_num_kv_blocks(0.9, GIB, lambda: steps.append("peak"), key) == 38
    assert steps == ["peak"]
    assert kv_cache.profile_num_kv_blocks(0.9, GIB, lambda: steps.append("peak")) == 33  # nothing kept: measured
    assert key == kv_cache.peak_key(EngineConfig("qwen2.5-1.5b"), "NVIDIA H200", 0)
    others = {
        kv_cache.peak_key(EngineConfig("qwen2.5-1.5b", max_num_batched_tokens=4096), "NVIDIA H200", 0),
        kv_cache.peak_key(config, "NVIDIA H100 80GB HBM3", 0),
        kv_cache.peak_key(config, "NVIDIA H200", 1),
        key,
    }
    assert len(others) == 4


def test_a_card_too_full_for_two_blocks_is_a_value_error_naming_the_setting(monkeypatch):
    fake_card(monkeypatch, free_gib=10, transient_gib=1)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 leaves -1.00 GiB .* raise it"):
        kv_cache.profile_num_kv_blocks(0.9, GIB, lambda: None)


def test_a_cpu_cache_fits_the_workload_up_to_its_cap_and_holds_two_blocks_at_least():
    assert kv_cache.cpu_num_kv_blocks(100, 1 << 20) == 100
    assert kv_cache.cpu_num_kv_blocks(10**6, 1 << 20) == kv_cache._CPU_KV_CACHE_CAP // (1 << 20)
    assert kv_cache.cpu_num_kv_blocks(1, 1 << 20) == 2


def test_the_cache_holds_k_and_v_of_every_layer_zeroed(tiny_ckpt):
    mc = config_from_dir(tiny_ckpt)
    caches = kv_cache.allocate_kv_cache(mc, 5, 2, 8, torch.float16, torch.device("cpu"))
    assert len(caches) == mc.num_hidden_layers
    k, v = caches[-1]
    assert k.shape == v.shape == (5, 2, 8, mc.head_dim) and not k.any() and not v.any()
    block = sum(t[0].numel() * t[0].element_size() for pair in caches for t in pair)
    assert kv_cache.kv_block_bytes(mc, 2, 8, torch.float16) == block
