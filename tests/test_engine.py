"""The whole engine in real processes: frontend, scheduler and worker, against Hugging Face's greedy output."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from frontend import LLM, AsyncLLM, SamplingParams
from frontend.engine_client import EngineDeadError
from protocol.config import ContextTooLong, InvalidParam

MAX_NEW = 12
PROMPT_LENS = [1, 3, 16, 17, 40, 77, 128, 200]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(ckpt, prompts: list[list[int]], max_new: int, **load) -> list[list[int]]:
    """HF's greedy tokens; load: more from_pretrained keywords (attn_implementation)."""
    model = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32, **load).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=0,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return _prompts(512)


@pytest.fixture(scope="module")
def hf_tokens(tiny_ckpt, prompts) -> list[list[int]]:
    return _hf_greedy(tiny_ckpt, prompts, MAX_NEW)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats


def test_greedy_batch_equals_hf_token_for_token(tiny_ckpt, prompts, hf_tokens):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        assert _generate(llm, prompts) == hf_tokens
        _assert_all_blocks_free(llm)


def test_chunked_prefill_gives_the_same_tokens(tiny_ckpt, prompts, hf_tokens):
    with LLM(str(tiny_ckpt), device="cpu", max_num_batched_tokens=16) as llm:
        assert _generate(llm, prompts) == hf_tokens
        _assert_all_blocks_free(llm)


def test_preempted_requests_resume_with_the_same_tokens(tiny_ckpt, prompts, hf_tokens):
    # 28 blocks of 8 hold the longest request (211 cached tokens = 27 blocks), but the first six admitted
    # (22 blocks of prompt) need 30 by their last step.
    with LLM(str(tiny_ckpt), device="cpu", num_kv_blocks=28, block_size=8) as llm:
        assert _generate(llm, prompts) == hf_tokens
        assert llm.stats()["num_preemptions"] > 0
        _assert_all_blocks_free(llm)


def test_shared_prefixes_are_served_from_the_prefix_cache(tiny_ckpt):
    g = torch.Generator().manual_seed(2)
    prefix = torch.randint(3, 512, (64,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 512, (n,), generator=g).tolist() for n in (1, 5, 16, 33)]
    expected = _hf_greedy(tiny_ckpt, prompts, MAX_NEW)
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        assert _generate(llm, prompts[:1]) == expected[:1]
        assert _generate(llm, prompts[1:]) == expected[1:]
        assert llm.stats()["num_cached_tokens"] >= 3 * 64
        _assert_all_blocks_free(llm)


def test_generate_takes_more_prompts_than_the_engine_queue_holds(tiny_ckpt, prompts, hf_tokens):
    with LLM(str(tiny_ckpt), device="cpu", max_num_seqs=2, max_waiting_requests=3) as llm:
        # 8 prompts, one of them sampled 2 ways: all sent at once, 5 would be refused as "engine overloaded"
        params = [GREEDY] * 7 + [SamplingParams(temperature=0.0, n=2, max_tokens=MAX_NEW, ignore_eos=True)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == hf_tokens
        assert outputs[-1].outputs[1].token_ids == hf_tokens[-1]
        _assert_all_blocks_free(llm)


def test_logit_bias_forces_or_bans_a_token_for_its_request_only(tiny_ckpt, prompts, hf_tokens):
    first = hf_tokens[0][0]
    forced = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={5: 100.0})
    banned = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logit_bias={first: -100.0})
    with LLM(str(tiny_ckpt), device="cpu", max_num_seqs=2) as llm:
        outs = llm.generate(prompts[:3], [forced, banned, GREEDY], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs[:2]] == [[5] * 4, outs[1].outputs[0].token_ids]
        assert outs[1].outputs[0].token_ids[0] != first and outs[2].outputs[0].token_ids == hf_tokens[2]
        # rows are reused with max_num_seqs=2: a request after a biased one must not inherit its bias
        assert _generate(llm, prompts[:2]) == hf_tokens[:2]
        with pytest.raises(ValueError, match="logit_bias.*outside the vocabulary"):
            llm.generate(prompts[:1], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
        _assert_all_blocks_free(llm)


def test_min_tokens_bans_stop_ids_like_hugging_face_min_new_tokens(tiny_ckpt, prompts, hf_tokens):
    i = next(i for i, out in enumerate(hf_tokens) if out[1] not in out[:1])
    stop = hf_tokens[i][1]  # greedy would emit it second: min_tokens=4 must steer around it
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompts[i]])
    expected = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=MAX_NEW,
        min_new_tokens=4,
        eos_token_id=stop,
        pad_token_id=0,
    )[0, ids.shape[1] :].tolist()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, min_tokens=4, stop_token_ids=[stop])
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        got = llm.generate([prompts[i]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == expected and stop not in got[:4]
        _assert_all_blocks_free(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny_ckpt, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=MAX_NEW, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True)
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        alone = llm.generate([prompts[4]], [params], use_tqdm=False)[0].outputs[0].token_ids
        batch = llm.generate(prompts[:6], [other] * 4 + [params, other], use_tqdm=False)
        assert batch[4].outputs[0].token_ids == alone
        unseeded = llm.generate([prompts[4]] * 2, [other] * 2, use_tqdm=False)
        assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_samples_and_stop_strings_in_text(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu") as llm:
        full = llm.generate(
            "Hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False
        )[0].outputs[0]
        stop = full.text[3:6]
        cut = llm.generate(
            "Hello world", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]), use_tqdm=False
        )[0].outputs[0]
        assert cut.text == full.text[: full.text.index(stop)] and cut.finish_reason == "stop"
        many = llm.generate(
            "Hello", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False
        )[0]
        assert [o.index for o in many.outputs] == [0, 1, 2]
        assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in many.outputs)
        _assert_all_blocks_free(llm)


def test_bad_input_raises_value_error_naming_it(tiny_ckpt):
    with LLM(str(tiny_ckpt), device="cpu", max_model_len=256) as llm:
        with pytest.raises(ContextTooLong, match="max_model_len") as too_long:
            llm.generate([[5] * 250], SamplingParams(max_tokens=10), use_tqdm=False)
        with pytest.raises(InvalidParam, match="outside the vocabulary") as outside:
            llm.generate([[5, 99999]], use_tqdm=False)
        with pytest.raises(InvalidParam, match="empty") as empty:
            llm.generate("", use_tqdm=False)
        with pytest.raises(InvalidParam, match="temperature") as temperature:
            SamplingParams(temperature=-1)
        fields = [e.value.field for e in (too_long, outside, empty, temperature)]
        assert fields == ["max_tokens", "prompt", "prompt", "temperature"]
        assert _generate(llm, [[5, 6, 7]])[0]  # still serving
        _assert_all_blocks_free(llm)


def test_async_abort_mid_generation_frees_blocks(tiny_ckpt):
    engine = AsyncLLM(str(tiny_ckpt), device="cpu")

    async def run():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        seen = 0
        async for out in engine.generate([5, 6, 7, 8], params, "to-abort"):
            seen = len(out.outputs[0].token_ids)
            if seen >= 3:
                break  # leaving the loop aborts the request
        assert seen >= 3
        finals = [o async for o in engine.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=4), "next")]
        assert finals[-1].finished and len(finals[-1].outputs[0].token_ids) == 4
        stats = await engine.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


def test_killed_worker_fails_pending_requests_within_5_s(tiny_ckpt):
    llm = LLM(str(tiny_ckpt), device="cpu")
    procs = llm.client.procs
    pids = [p.pid for p in procs.procs.values()]
    worker = procs.procs["worker0"]
    killer = _kill_later(worker.pid, 1.0)
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker0"):
        llm.generate([[5, 6]] * 4, SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True), use_tqdm=False)
    assert time.monotonic() - start < 6.0
    killer.join()
    llm.shutdown()
    for pid in pids:
        assert not _alive(pid), f"process {pid} left behind"


def _kill_later(pid: int, delay: float):
    import threading

    t = threading.Thread(target=lambda: (time.sleep(delay), os.kill(pid, signal.SIGKILL)))
    t.start()
    return t


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


README_SNIPPET = """\
from frontend import LLM, SamplingParams

with LLM({model!r}, device="cpu", num_kv_blocks=64) as llm:
    out = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    print("OUT:" + repr(out[0].outputs[0].text))
"""


@pytest.mark.parametrize("how", ["script", "stdin", "-c"])
def test_readme_snippet_runs_without_a_main_guard(tiny_ckpt, tmp_path, how):
    """The README's LLM(...) at module level: as a script, piped to `python -`, and with `python -c`,
    run from a directory that is not the repository (the children must still find their modules)."""
    import subprocess
    import sys
    from pathlib import Path

    code = README_SNIPPET.format(model=str(tiny_ckpt))
    script = tmp_path / "use.py"
    script.write_text(code)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    argv = {"script": [str(script)], "stdin": ["-"], "-c": ["-c", code]}[how]
    with open(script) as stdin:
        done = subprocess.run(
            [sys.executable, *argv], stdin=stdin, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr[-3000:]
    with LLM(str(tiny_ckpt), device="cpu", num_kv_blocks=64) as llm:
        want = llm.generate(["Hello, my name is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert f"OUT:{want[0].outputs[0].text!r}" in done.stdout.splitlines()
