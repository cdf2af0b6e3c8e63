"""ModelRunner driven with hand-built StepPlans: Hugging Face's greedy tokens, rows that do not disturb
each other, rows reused after a free, seeds that ignore the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from frontend.model_resolution import resolve_config
from protocol.config import EngineConfig
from protocol.messages import NewRow, StepPlan, i32
from protocol.sampling import SamplingParams
from worker.model_runner import ModelRunner
from worker.startup import build_runner

BLOCK = 8


class MiniScheduler:
    """Just enough scheduler: bump-allocated blocks, prompts in chunks of `chunk`, decode rows first."""

    def __init__(self, runner: ModelRunner, chunk: int = 1000) -> None:
        self.runner, self.chunk = runner, chunk
        self.block = runner.config.block_size
        self.step, self.next_block = 0, 0
        self.rows: dict[int, dict] = {}
        self.pending_new: list[NewRow] = []
        self.pending_free: list[int] = []

    def add(self, row: int, prompt: list[int], params: SamplingParams | None = None, generated: list[int] = ()) -> None:
        tokens = list(prompt) + list(generated)
        blocks = self._blocks(len(tokens))
        self.rows[row] = {"sent": len(tokens), "known": len(tokens), "computed": 0, "blocks": blocks, "out": []}
        self.pending_new.append(
            NewRow(
                row,
                i32(tokens),
                len(prompt),
                0,
                i32(blocks),
                (params or SamplingParams(temperature=0.0)).row_sampling(),
            )
        )

    def free(self, row: int) -> list[int]:
        self.pending_free.append(row)
        return self.rows.pop(row)["out"]

    def _blocks(self, n_tokens: int) -> list[int]:
        n = max(0, -(-n_tokens // self.block))
        self.next_block += n
        return list(range(self.next_block - n, self.next_block))

    def plan(self) -> tuple[StepPlan, list[bool]]:
        """The next step, counted as done; which of its rows sample (their tokens come with the result)."""
        decode = [r for r, s in self.rows.items() if s["computed"] >= s["sent"]]
        prefill = [r for r, s in self.rows.items() if s["computed"] < s["sent"]]
        rows, counts, appends, samples = [], [], [], []
        for r in decode + prefill:
            s = self.rows[r]
            n = 1 if r in decode else min(self.chunk, s["sent"] - s["computed"])
            extra = self._blocks(s["computed"] + n - len(s["blocks"]) * self.block)
            if extra:
                s["blocks"] += extra
                appends.append((r, i32(extra)))
            s["computed"] += n
            samples.append(s["computed"] == s["known"])
            s["known"] += samples[-1]
            rows.append(r)
            counts.append(n)
        self.step += 1
        plan = StepPlan(self.step, i32(rows), i32(counts), self.pending_new, appends, i32(self.pending_free))
        self.pending_new, self.pending_free = [], []
        return plan, samples

    def take(self, plan: StepPlan, samples: list[bool], result) -> None:
        for r, sampled, tok in zip(plan.rows.tolist(), samples, result.token_ids.tolist()):
            if sampled:
                self.rows[r]["out"].append(tok)
            else:
                assert tok == -1

    def run_step(self):
        plan, samples = self.plan()
        result = self.runner.execute(plan)
        self.take(plan, samples, result)
        return result

    def generate(self, num_tokens: int, overlap: bool = False) -> dict[int, list[int]]:
        """With overlap, step N+1 is launched before step N is collected, as a pipelining worker does."""
        pending = None
        while any(s["known"] - s["sent"] < num_tokens for s in self.rows.values()):
            if not overlap:
                self.run_step()
                continue
            plan, samples = self.plan()
            launched = self.runner.launch(plan)
            if pending is not None:
                self.take(pending[0], pending[1], self.runner.collect(pending[2]))
            pending = (plan, samples, launched)
        if pending is not None:
            self.take(pending[0], pending[1], self.runner.collect(pending[2]))
        return {r: s["out"][:num_tokens] for r, s in self.rows.items()}


def _runner(ckpt, **kw) -> ModelRunner:
    config = EngineConfig(
        model=str(ckpt),
        device="cpu",
        block_size=BLOCK,
        num_kv_blocks=kw.pop("num_kv_blocks", 128),
        max_num_seqs=kw.pop("max_num_seqs", 4),
        max_num_batched_tokens=64,
        **kw,
    )
    return build_runner(resolve_config(config), rank=0, tp_size=1)


@pytest.fixture(scope="module")
def runner(tiny_ckpt) -> ModelRunner:
    return _runner(tiny_ckpt)


@pytest.fixture(scope="module")
def hf_greedy(tiny_ckpt):
    model = AutoModelForCausalLM.from_pretrained(tiny_ckpt, torch_dtype=torch.float32).eval()

    def generate(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, len(prompt) :].tolist()

    return generate


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def _fresh(runner: ModelRunner, chunk: int = 1000) -> MiniScheduler:
    """A new driver for a shared runner: the runner's step count carries on."""
    sched = MiniScheduler(runner, chunk)
    sched.step = runner.step
    for row in np.flatnonzero(runner.mirror.active).tolist():
        sched.pending_free.append(row)
    return sched


def test_chunked_prefill_then_decode_equals_hf_greedy(runner, hf_greedy):
    prompt = _prompt(37, seed=1)
    sched = _fresh(runner, chunk=16)
    sched.add(0, prompt)
    assert sched.generate(12)[0] == hf_greedy(prompt, 12)


def test_two_rows_at_once_equal_each_alone(runner, hf_greedy):
    prompts = {1: _prompt(5, seed=2), 3: _prompt(21, seed=3)}
    sched = _fresh(runner, chunk=8)
    for row, prompt in prompts.items():
        sched.add(row, prompt)
    out = sched.generate(10)
    for row, prompt in prompts.items():
        assert out[row] == hf_greedy(prompt, 10)


def test_freed_row_serves_a_new_request(runner, hf_greedy):
    sched = _fresh(runner)
    first, second = _prompt(9, seed=4), _prompt(13, seed=5)
    sched.add(2, first)
    sched.generate(3)
    assert sched.free(2) == hf_greedy(first, 3)
    sched.add(2, second)
    assert sched.generate(6)[2] == hf_greedy(second, 6)


def test_row_resumed_after_preemption_continues_the_same_tokens(runner, hf_greedy):
    prompt = _prompt(11, seed=6)
    want = hf_greedy(prompt, 8)
    sched = _fresh(runner)
    sched.add(0, prompt, generated=want[:3])
    assert sched.generate(5)[0] == want[3:]


def test_launching_the_next_step_before_collecting_gives_the_same_tokens(tiny_ckpt):
    prompts = {0: _prompt(12, seed=12), 1: _prompt(20, seed=13)}
    outs = []
    for overlap in (False, True):
        sched = MiniScheduler(_runner(tiny_ckpt), chunk=8)
        for row, prompt in prompts.items():
            sched.add(row, prompt, SamplingParams(temperature=0.9, seed=row, presence_penalty=0.5))
        outs.append(sched.generate(6, overlap=overlap))
    assert outs[0] == outs[1]


def test_seeded_row_samples_the_same_alone_or_beside_others(tiny_ckpt):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, repetition_penalty=1.2)
    alone = MiniScheduler(_runner(tiny_ckpt))
    alone.add(0, _prompt(10, seed=7), params)
    busy = MiniScheduler(_runner(tiny_ckpt), chunk=4)
    busy.add(2, _prompt(30, seed=8), SamplingParams(temperature=0.7, seed=9))
    busy.add(1, _prompt(10, seed=7), params)
    assert alone.generate(8)[0] == busy.generate(8)[1]


def test_logprobs_come_back_for_each_sampled_row(runner):
    sched = _fresh(runner)
    sched.add(0, _prompt(6, seed=9), SamplingParams(temperature=0.0, logprobs=3))
    result = sched.run_step()
    lp = result.logprobs
    assert lp["k"] == 3 and lp["top_ids"].tolist()[0] == result.token_ids[0]
    assert lp["sampled"][0] == pytest.approx(lp["top_logprobs"][0]) and lp["sampled"][0] < 0


def test_plan_out_of_order_is_rejected(runner):
    with pytest.raises(ValueError, match="one by one"):
        runner.execute(StepPlan(runner.step + 2, i32([0]), i32([1])))


def test_plan_beyond_known_tokens_is_rejected(runner):
    sched = _fresh(runner)
    sched.add(3, _prompt(4, seed=10))
    plan = StepPlan(sched.step + 1, i32([3]), i32([5]), sched.pending_new, [], i32(sched.pending_free))
    with pytest.raises(ValueError, match="do not fit the mirror"):
        runner.execute(plan)


def test_block_ids_outside_the_kv_cache_are_rejected_and_the_row_keeps_its_table(runner):
    sched = _fresh(runner)
    sched.add(2, _prompt(4, seed=11))
    sched.run_step()
    for bad in (runner.num_kv_blocks, -1):
        plan = StepPlan(runner.step + 1, i32([2]), i32([1]), [], [(2, i32([bad]))], i32([]))
        with pytest.raises(
            ValueError,
            match=f"block id {bad} appended to row 2 is outside the KV cache's {runner.num_kv_blocks} blocks",
        ):
            runner.execute(plan)
    assert runner.mirror.num_blocks[2] == 1 and not runner.mirror.take_deltas()[0].size


# ---- the worker process ------------------------------------------------------------------------------


@pytest.fixture
def workers(request, tiny_ckpt):
    """A fake scheduler's sockets (results PULL, one plans PUSH per rank) and started worker processes."""
    import multiprocessing as mp

    import zmq

    from protocol.addresses import make_addresses, remove_ipc_dir
    from worker.process import run_worker

    tp = getattr(request, "param", 1)
    addresses = make_addresses(tp)
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind(addresses.results)
    results.RCVTIMEO = 60_000
    plans = [ctx.socket(zmq.PUSH) for _ in range(tp)]
    for sock, address in zip(plans, addresses.plans):
        sock.bind(address)
    config = resolve_config(
        EngineConfig(
            model=str(tiny_ckpt),
            device="cpu",
            block_size=BLOCK,
            num_kv_blocks=16,
            max_num_seqs=2,
            max_num_batched_tokens=32,
            tensor_parallel_size=tp,
        )
    )
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=run_worker, args=(config.to_dict(), addresses.to_dict(), rank)) for rank in range(tp)]
    for proc in procs:
        proc.start()
    yield plans, results, procs
    for proc in procs:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    for sock in [results, *plans]:
        sock.close(0)
    ctx.term()
    remove_ipc_dir(addresses)


@pytest.mark.parametrize("workers", [1, 2], indirect=True, ids=["tp1", "tp2"])
def test_worker_process_says_ready_answers_plans_and_exits_on_shutdown(workers, hf_greedy):
    from protocol.codec import decode, encode
    from protocol.messages import Shutdown, StepResult

    plans, results, procs = workers
    readies = sorted((decode(results.recv()) for _ in procs), key=lambda r: r.rank)
    want = [("worker", rank, 16) for rank in range(len(procs))]
    assert [(r.role, r.rank, r.info["num_kv_blocks"]) for r in readies] == want
    parts = {
        "weights_s",
        "kernels_compiled",
        "compile_s",
        "kv_cache_s",
        "graph_capture_s",
        "prefill_capture_s",
        "graph_warmup_s",
        "clock",
    }
    assert all(set(r.info["startup"]) == parts for r in readies)
    assert all(r.info["startup"]["kernels_compiled"] == 0 for r in readies)  # no graphs on the CPU: no dry run
    marks = [
        "worker_entered",
        "torch_imported",
        "device_selected",
        "runner_started",
        "weights_loaded",
        "kernels_compiled",
        "kv_profiled",
        "kv_cache_ready",
        "decode_graphs_captured",
        "prefill_graphs_captured",
        "worker_ready",
    ]
    assert all(list(r.info["startup"]["clock"]) == marks for r in readies)
    assert all(
        sorted(r.info["startup"]["clock"].values()) == list(r.info["startup"]["clock"].values()) for r in readies
    )
    prompt = _prompt(7, seed=11)
    new = NewRow(0, i32(prompt), len(prompt), 0, i32([0]), SamplingParams(temperature=0.0).row_sampling())
    for msg in (
        StepPlan(1, i32([0]), i32([7]), [new], []),
        StepPlan(2, i32([0]), i32([1]), [], [[0, i32([1]).tobytes()]]),
        Shutdown(),
    ):
        for sock in plans:
            sock.send(encode(msg))
    tokens = [decode(results.recv()) for _ in range(2)]  # rank 0 answers for all ranks
    assert all(isinstance(t, StepResult) for t in tokens)
    assert [int(t.token_ids[0]) for t in tokens] == hf_greedy(prompt, 2)
    for proc in procs:
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [0] * len(procs)


def test_worker_process_reports_a_malformed_plan_and_exits_nonzero(workers):
    from protocol.codec import decode
    from protocol.messages import Ready, WorkerError

    plans, results, (proc,) = workers
    assert isinstance(decode(results.recv()), Ready)
    plans[0].send(b"\x93not a plan")
    error = decode(results.recv())
    assert isinstance(error, WorkerError) and error.rank == 0 and "ProtocolError" in error.reason
    proc.join(30)
    assert proc.exitcode == 1


def test_prefill_buckets_pad_at_most_one_and_a_half_times_and_end_at_the_step_budget():
    from worker.cuda_graphs import prefill_buckets

    assert prefill_buckets(8192) == prefill_buckets(2048) == [256, 512, 768, 1024, 1536, 2048]
    assert prefill_buckets(1000) == [256, 512, 768, 1000]
    assert prefill_buckets(128) == [128]


def test_steps_through_the_graph_registry_flow_equal_hf_greedy(tiny_ckpt, hf_greedy):
    # The graphs' flow without CUDA (CudaGraphs(graphs=False)): decode steps padded to batch 2 or 4, prompt
    # steps to buckets of 8 and 32 tokens, one of them mixed (a decode row beside a chunk). The staging buffers
    # start as garbage: a field left unpadded would carry it into the tokens.
    from worker.cuda_graphs import CudaGraphs

    runner = _runner(tiny_ckpt)
    graphs = CudaGraphs(runner.dummy_row, graphs=False)
    with torch.inference_mode():
        graphs.capture(
            "decode",
            {s: runner.buffers.decode_views(s) for s in (2, 4)},
            runner.decode_forward,
            runner.decode_forward,
        )
        graphs.capture(
            "prefill",
            {b: runner.buffers.prefill_views(b) for b in (8, 32)},
            runner.prefill_forward,
            runner.prefill_forward,
        )
    for host in runner.buffers._host_np:
        host[:] = np.random.default_rng(0).integers(0, 256, host.shape, dtype=np.uint8)
    runner.graphs, steps = graphs, []
    replay = graphs.replay
    graphs.replay = lambda kind, size: steps.append((kind, size)) or replay(kind, size)
    prompts = {0: _prompt(37, seed=1), 1: _prompt(5, seed=2), 2: _prompt(3, seed=3)}
    sched = MiniScheduler(runner, chunk=16)
    sched.add(0, prompts[0])
    sched.run_step()
    sched.add(1, prompts[1])
    out = sched.generate(6)
    # Row 0's first 16; its next 16 beside row 1's 5; its last 5 beside row 1's first decode token; then two rows.
    assert steps[:3] == [("prefill", 32), ("prefill", 32), ("prefill", 8)], steps
    assert set(steps[3:]) == {("decode", 2)}, steps
    sched.add(2, prompts[2])
    out.update(sched.generate(8))  # three rows decode in the size-4 graph: one padded lane
    assert ("decode", 4) in steps, steps
    for row, prompt in prompts.items():
        assert out[row] == hf_greedy(prompt, 8)
