"""Scheduler policy, driven by a fake worker that keeps the row mirror over a KV cache of token ids.

The fake worker's next token depends on every token it reads back from its cache, so a wrong block
table, a bad prefix-cache hit or a block overwritten while shared changes the output; outputs are
compared with a plain loop over the same function.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.config import EngineConfig, ModelConfig
from protocol.messages import AddRequest, Error, RowSampling, StepPlan, StepResult, TokenBatch, i32
from scheduler.scheduler import Scheduler

VOCAB = 97
GARBAGE = VOCAB + 1000  # what the fake samples mid-prompt; the scheduler must never emit it
CLIENT = b"client-a"


def next_token(context: np.ndarray) -> int:
    weights = np.arange(len(context), dtype=np.int64) % 89 + 1
    return int((context.astype(np.int64) * weights).sum() * 7 + len(context)) % VOCAB


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(np.array(tokens)))
    return tokens[len(prompt) :]


def make_config(**kw) -> EngineConfig:
    mc = ModelConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        eos_token_ids=kw.pop("eos_token_ids", []),
    )
    kw = {"block_size": 8, "max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, **kw}
    return EngineConfig(model="fake", model_config=mc, **kw)


@dataclass
class Mirror:
    tokens: list[int]
    num_row_tokens: int
    computed: int
    table: list[int]
    sampling: RowSampling


class FakeWorker:
    """What a worker rank does with a plan, on a KV cache that stores token ids, with protocol checks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.cache = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.rows: dict[int, Mirror] = {}
        self.step = 0
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        assert plan.step == self.step + 1, "plans must arrive in step order"
        self.step = plan.step
        self.plans.append(plan)
        for nr in plan.new_rows:  # replaces a finished or preempted row's old mirror
            self.rows[nr.row] = Mirror(
                nr.token_ids.tolist(), len(nr.token_ids), nr.num_computed, nr.block_table.tolist(), nr.sampling
            )
        for row, ids in plan.block_appends:  # ids: an array in process, raw int32 bytes over the wire
            self.rows[row].table.extend(np.frombuffer(ids, "<i4") if isinstance(ids, bytes) else ids)
        decoding = [self.rows[r].computed >= self.rows[r].num_row_tokens for r in plan.rows.tolist()]
        assert decoding == sorted(decoding, reverse=True), "decode rows must come first"
        self.dying = set(plan.free_rows.tolist())  # freed rows read nothing any more
        work = list(zip(plan.rows.tolist(), plan.num_tokens.tolist()))
        # Like each layer of the model: every token's KV is stored before any attention reads the cache.
        for row, n in work:
            self._store(row, n)
        out = [self._sample(row) for row, _ in work]
        for r in plan.free_rows.tolist():
            assert r not in plan.rows.tolist(), f"row {r} scheduled and freed in one plan"
            assert r not in {nr.row for nr in plan.new_rows}, f"row {r} reused and freed in one plan"
            del self.rows[r]
        return StepResult(plan.step, i32(out))

    def _store(self, row: int, n: int) -> None:
        m = self.rows[row]
        assert n >= 1 and m.computed + n <= len(m.tokens), "a step may only feed tokens the mirror knows"
        assert len(m.table) * self.bs >= m.computed + n, "block table too short for the step"
        for pos in range(m.computed, m.computed + n):
            self._write(row, pos, m.tokens[pos])
        m.computed += n

    def _sample(self, row: int) -> int:
        m = self.rows[row]
        if m.computed < len(m.tokens):
            return GARBAGE
        slots = [m.table[p // self.bs] * self.bs + p % self.bs for p in range(m.computed)]
        context = self.cache[slots]
        assert (context >= 0).all(), "read a KV slot nobody wrote"
        m.tokens.append(next_token(context))
        return m.tokens[-1]

    def _write(self, row: int, pos: int, token: int) -> None:
        """Store a token's KV; it must not change a slot that another live row has counted as its own."""
        block, offset = self.rows[row].table[pos // self.bs], pos % self.bs
        for other_row, o in self.rows.items():
            if other_row in (row, *self.dying) or block not in o.table:
                continue
            their_pos = o.table.index(block) * self.bs + offset
            if their_pos < o.computed and o.tokens[their_pos] != token:
                raise AssertionError(f"row {row} overwrites block {block}, which row {other_row} reads")
        self.cache[block * self.bs + offset] = token


@dataclass
class Out:
    tokens: list
    finish: str | None = None
    error: str | None = None
    logprobs: list | None = None


class Harness:
    def __init__(self, num_blocks: int = 64, **config) -> None:
        self.config = make_config(**config)
        self.sched = Scheduler(self.config, num_blocks)
        self.worker = FakeWorker(num_blocks, self.config.block_size)
        self.outs: dict[str, Out] = {}
        self.batches: list[tuple[bytes, TokenBatch]] = []
        self._ids = itertools.count()

    def add(
        self, prompt, client: bytes = CLIENT, request_id: str | None = None, params: dict | None = None, **kw
    ) -> str:
        rid = request_id or f"req-{next(self._ids)}"
        self.outs.setdefault(rid, Out([]))
        self.collect(self.sched.add_request(AddRequest(rid, i32(prompt), {**(params or {}), **kw}), client))
        return rid

    def collect(self, batches) -> None:
        for client, batch in batches:
            self.batches.append((client, batch))
            if isinstance(batch, Error):
                continue
            for i, rid in enumerate(batch.request_ids):
                out = self.outs[rid]
                if batch.token_ids[i] >= 0:
                    out.tokens.append(int(batch.token_ids[i]))
                    if batch.logprobs is not None and batch.logprobs[i] is not None:
                        out.logprobs = (out.logprobs or []) + [batch.logprobs[i]]
                out.finish = batch.finished.get(rid, out.finish)
                out.error = batch.errors.get(rid, out.error)

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        assert plan is not None, "work left but nothing scheduled"
        self.collect(self.sched.on_result(self.worker.execute(plan)))
        return plan

    def run(self, max_steps: int = 5000) -> dict[str, Out]:
        for _ in range(max_steps):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.has_work(), "did not finish"
        self.assert_all_free()
        return self.outs

    def assert_all_free(self) -> None:
        stats = self.sched.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
        assert stats["num_running"] == stats["num_waiting"] == 0, stats


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 60) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]


# ---- batching, chunking, preemption, prefix cache --------------------------------------------------


def test_batched_outputs_equal_the_sequential_reference():
    h = Harness()
    cases = [(p, 3 + i) for i, p in enumerate(prompts(8))]
    rids = [h.add(p, max_tokens=n) for p, n in cases]
    outs = h.run()
    for rid, (p, n) in zip(rids, cases):
        assert outs[rid].tokens == reference(p, n) and outs[rid].finish == "length"


def test_chunked_prefill_splits_prompts_within_the_token_budget():
    h = Harness(max_num_batched_tokens=8)
    rid = h.add(list(range(20)), max_tokens=3)
    chunks = [h.step().num_tokens.tolist() for _ in range(3)]
    assert chunks == [[8], [8], [4]]
    cases = [(p, 5) for p in prompts(6, seed=1, lo=10, hi=40)]
    rids = [h.add(p, max_tokens=n) for p, n in cases]
    outs = h.run()
    assert all(sum(plan.num_tokens.tolist()) <= 8 for plan in h.worker.plans)
    assert outs[rid].tokens == reference(list(range(20)), 3)
    for r, (p, n) in zip(rids, cases):
        assert outs[r].tokens == reference(p, n)


def test_decode_rows_come_first_then_prompt_chunks_fill_the_budget():
    h = Harness(max_num_batched_tokens=10)
    h.add([1, 2, 3], max_tokens=5)
    h.step()
    h.add(list(range(30)), max_tokens=2)
    plan = h.step()
    assert plan.num_tokens.tolist() == [1, 9]
    h.run()


def test_decode_rows_are_planned_longest_context_first():
    h = Harness(max_num_batched_tokens=64)
    lens = [5, 40, 12, 27]
    rows = {}
    for n in lens:
        h.add(list(range(n)), max_tokens=20)
        rows[h.step().rows[-1]] = n  # each prompt prefilled in its own step, so the rows' arrival order is lens'
    plan = h.step()
    assert plan.num_tokens.tolist() == [1, 1, 1, 1]
    assert [rows[r] for r in plan.rows.tolist()] == sorted(lens, reverse=True)
    outs = h.run()
    assert all(len(o.tokens) == 20 for o in outs.values())


def test_preempted_request_resumes_with_same_tokens():
    h = Harness(num_blocks=12, block_size=8)  # 96 slots for four requests of up to 60 tokens
    cases = [(p, 40) for p in prompts(4, seed=2, lo=10, hi=20)]
    rids = [h.add(p, max_tokens=n) for p, n in cases]
    outs = h.run()
    assert h.sched.stats()["num_preemptions"] > 0
    for rid, (p, n) in zip(rids, cases):
        assert outs[rid].tokens == reference(p, n) and outs[rid].finish == "length"
    resumed = [nr for plan in h.worker.plans for nr in plan.new_rows if len(nr.token_ids) > nr.num_prompt_tokens]
    assert resumed, "a preempted request comes back with its generated tokens"
    prompt_lens = {len(p) for p, _ in cases}
    assert all(nr.num_prompt_tokens in prompt_lens for nr in resumed)


def test_preemption_takes_the_newest_request():
    h = Harness(num_blocks=6, block_size=8, max_num_batched_tokens=64)
    old = h.add(list(range(16)), max_tokens=24)
    new = h.add(list(range(20, 36)), max_tokens=24)
    preempted_rows = set()
    while h.sched.stats()["num_preemptions"] == 0:
        h.step()
    preempted_rows = {nr.row for nr in h.worker.plans[0].new_rows if nr.token_ids[0] == 20}
    assert preempted_rows and set(h.worker.plans[-1].free_rows.tolist()) == preempted_rows
    assert h.sched.waiting[0].request_id == new
    outs = h.run()
    assert outs[old].tokens == reference(list(range(16)), 24)
    assert outs[new].tokens == reference(list(range(20, 36)), 24)


def test_prefix_cache_reuse_is_counted_and_gives_the_same_tokens():
    h = Harness()
    shared = prompts(1, seed=3, lo=40, hi=40)[0]
    first = h.add(shared + [1, 2], max_tokens=4)
    h.run()
    assert h.sched.stats()["num_cached_tokens"] == 0
    second = h.add(shared + [5], max_tokens=4)
    third = h.add(shared + [1, 2], max_tokens=6)  # hits the first request's 5 full blocks
    outs = h.run()
    assert h.sched.stats()["num_cached_tokens"] == 5 * 8 + 5 * 8
    assert outs[first].tokens == reference(shared + [1, 2], 4)
    assert outs[second].tokens == reference(shared + [5], 4)
    assert outs[third].tokens == reference(shared + [1, 2], 6)


def test_generated_tokens_fill_blocks_that_later_requests_share():
    h = Harness()
    prompt = list(range(10))
    first = h.add(prompt, max_tokens=20)
    h.run()
    follow = prompt + h.outs[first].tokens[:14] + [3]  # 25 tokens: 3 full blocks, 2 of them generated
    rid = h.add(follow, max_tokens=2)
    h.run()
    assert h.sched.stats()["num_cached_tokens"] == 24
    assert h.outs[rid].tokens == reference(follow, 2)


def test_requests_admitted_in_one_step_share_the_blocks_that_step_fills():
    h = Harness()
    prompt = list(range(40))
    rids = [h.add(prompt + [i], max_tokens=8) for i in range(4)]
    plan = h.step()
    assert [nr.num_computed for nr in plan.new_rows] == [0, 40, 40, 40]
    assert plan.num_tokens.tolist() == [41, 1, 1, 1]
    assert h.sched.stats()["num_cached_tokens"] == 3 * 40
    outs = h.run()
    assert all(outs[r].tokens == reference(prompt + [i], 8) for i, r in enumerate(rids))


def test_rows_stay_below_max_num_seqs_and_are_freed_in_the_next_plan():
    h = Harness(max_num_seqs=2)
    for p in prompts(5, seed=4, lo=2, hi=10):
        h.add(p, max_tokens=3)
    while h.sched.has_work():
        plan = h.step()
        assert len(h.worker.rows) <= 2 and set(plan.rows.tolist()) <= {0, 1}
    h.assert_all_free()


# ---- stops and lengths -----------------------------------------------------------------------------


def _first_new(prompt: list[int], n: int, at: int) -> tuple[int, int]:
    """(i, token): the first i >= `at` whose token the reference has not generated before i."""
    ref = reference(prompt, n)
    i = next(i for i in range(at, n) if ref[i] not in ref[:i])
    return i, ref[i]


PROMPT = [5, 17, 33, 2, 8]


def test_eos_stops_the_request_and_is_its_last_token():
    i, eos = _first_new(PROMPT, 20, 3)
    h = Harness(eos_token_ids=[eos])
    rid = h.add(PROMPT, max_tokens=20)
    outs = h.run()
    assert outs[rid].tokens == reference(PROMPT, i + 1) and outs[rid].finish == "stop"


def test_ignore_eos_runs_to_max_tokens():
    _, eos = _first_new(PROMPT, 20, 3)
    h = Harness(eos_token_ids=[eos])
    rid = h.add(PROMPT, max_tokens=20, ignore_eos=True)
    outs = h.run()
    assert outs[rid].tokens == reference(PROMPT, 20) and outs[rid].finish == "length"


def test_stop_token_ids_stop_but_not_before_min_tokens():
    ref = reference(PROMPT, 30)
    i, stop = _first_new(PROMPT, 30, 1)
    h = Harness()
    early = h.add(PROMPT, max_tokens=30, stop_token_ids=[stop])
    late = h.add(PROMPT, max_tokens=30, stop_token_ids=[stop], min_tokens=i + 4)
    outs = h.run()
    assert outs[early].tokens == ref[: i + 1] and outs[early].finish == "stop"
    later = [j for j, t in enumerate(ref) if t == stop and j >= i + 3]
    expected = ref[: later[0] + 1] if later else ref
    assert outs[late].tokens == expected
    assert outs[late].finish == ("stop" if later else "length")


def test_max_model_len_bounds_generation_when_max_tokens_is_none():
    h = Harness(max_model_len=32)
    rid = h.add(list(range(20)), max_tokens=None)
    outs = h.run()
    assert len(outs[rid].tokens) == 12 and outs[rid].finish == "length"


def test_prompt_plus_max_tokens_over_max_model_len_is_rejected():
    h = Harness(max_model_len=32)
    rid = h.add(list(range(20)), max_tokens=13)
    assert h.outs[rid].finish == "error" and "max_model_len=32" in h.outs[rid].error
    ok = h.add(list(range(20)), max_tokens=12)
    assert h.run()[ok].finish == "length"


# ---- abort, errors, params -------------------------------------------------------------------------


def test_abort_frees_a_running_and_a_waiting_request():
    h = Harness(max_num_seqs=1)
    running = h.add(list(range(30)), max_tokens=50)
    waiting = h.add(list(range(5)), max_tokens=5)
    for _ in range(3):
        h.step()
    h.collect(h.sched.abort([running, waiting, "no-such-id"], CLIENT))
    for rid in (running, waiting):
        assert h.outs[rid].finish == "abort"
    batch = h.batches[-1][1]
    assert batch.token_ids.tolist() == [-1, -1]
    h.assert_all_free()
    assert not h.sched.has_work()


def test_abort_only_touches_the_clients_own_request():
    h = Harness()
    mine = h.add([1, 2, 3], client=b"a", request_id="same", max_tokens=4)
    assert h.sched.abort(["same"], b"b") == []
    outs = h.run()
    assert outs[mine].finish == "length"


def test_result_for_an_aborted_row_is_dropped():
    h = Harness()
    rid = h.add([1, 2, 3], max_tokens=10)
    plan = h.sched.schedule()
    h.sched.abort([rid], CLIENT)
    assert h.sched.on_result(h.worker.execute(plan)) == []
    plan = h.sched.schedule()
    assert plan is None
    h.assert_all_free()


@pytest.mark.parametrize(
    "prompt,params,needle",
    [
        ([1, 2], {"temperature": -1.0}, "temperature"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"bogus": 1}, "bogus"),
        ([1, 2], {"stop": 5}, ""),
        ([1, 2], {1: 2}, ""),
        ([1, 2], {"stop_token_ids": [float("inf")]}, ""),
        ([], {}, "non-empty"),
        ([1, VOCAB], {}, f"token id {VOCAB}"),
        ([-3, 1], {}, "token id -3"),
        (list(range(60)) * 4, {"max_tokens": 1}, "KV cache"),
    ],
)
def test_bad_requests_come_back_as_error_batches(prompt, params, needle):
    h = Harness(num_blocks=16)
    rid = h.add(prompt, params=params)
    client, batch = h.batches[-1]
    assert client == CLIENT and batch.request_ids == [rid] and batch.token_ids.tolist() == [-1]
    assert batch.finished == {rid: "error"} and needle in batch.errors[rid]
    assert not h.sched.has_work()
    good = h.add([1, 2], max_tokens=2)
    assert h.run()[good].finish == "length"


def test_a_duplicate_id_is_refused_by_an_error_that_leaves_the_live_request_alone_and_overload_is_an_error():
    h = Harness(max_waiting_requests=2)
    h.add([1], request_id="x", max_tokens=2)
    h.add([1], request_id="x", max_tokens=5)
    refusal = h.batches[-1][1]
    assert isinstance(refusal, Error) and refusal.request_id == "x" and "already in use" in refusal.reason
    h.add([1], max_tokens=2)
    over = h.add([1], max_tokens=2)
    assert h.outs[over].finish == "error" and "engine overloaded" in h.outs[over].error
    h.run()
    assert h.outs["x"] == Out(reference([1], 2), "length")  # the original's tokens, and no "error" for it
    assert sum("x" in b.finished for _, b in h.batches if isinstance(b, TokenBatch)) == 1


def test_n_above_one_is_refused_on_the_wire():
    h = Harness()
    rid = h.add([1, 2], n=2, max_tokens=2)
    assert h.outs[rid].finish == "error" and "n=2" in h.outs[rid].error
    assert not h.sched.has_work()


def test_a_requests_first_token_carries_its_queue_time_and_cached_tokens():
    h = Harness(block_size=8)
    first = h.add(list(range(1, 20)), max_tokens=3)
    h.run()
    again = h.add(list(range(1, 20)), max_tokens=3)  # two full blocks of its prompt are cached now
    h.run()
    stats = [(rid, s) for _, b in h.batches if isinstance(b, TokenBatch) for rid, s in b.request_stats.items()]
    assert [rid for rid, _ in stats] == [first, again]  # once each, with the first token
    assert [s["num_cached_tokens"] for _, s in stats] == [0, 16]
    assert all(0 <= s["queue_time"] < 5 for _, s in stats)


def test_a_vanished_clients_requests_are_ended_and_their_blocks_freed():
    h = Harness()
    for _ in range(3):
        h.add([1, 2, 3], client=b"gone", max_tokens=50)
    kept = h.add([1, 2, 3], max_tokens=4)
    h.step()
    assert h.sched.abort_client(b"gone") == 3
    assert h.run()[kept].finish == "length"


def test_unseeded_requests_get_a_63_bit_seed_and_seeded_keep_theirs():
    h = Harness()
    h.add([1, 2], max_tokens=2)
    h.add([1, 2], max_tokens=2, seed=1234)
    plan = h.step()
    seeds = [nr.sampling.seed for nr in plan.new_rows]
    assert 0 <= seeds[0] < 2**63 and seeds[1] == 1234
    h.run()


def test_logprobs_are_cut_to_each_requests_k():
    h = Harness()
    a = h.add([1, 2, 3], max_tokens=2, logprobs=1)
    b = h.add([4, 5], max_tokens=2, logprobs=3)
    c = h.add([6], max_tokens=2)
    while h.sched.has_work():
        plan = h.sched.schedule()
        result = h.worker.execute(plan)
        n, k = len(plan.rows), 3
        result.logprobs = {
            "sampled": np.full(n, -0.5, np.float32).tobytes(),
            "k": k,
            "top_ids": i32(np.arange(n * k)).tobytes(),
            "top_logprobs": np.linspace(-1, -2, n * k, dtype=np.float32).tobytes(),
        }
        h.collect(h.sched.on_result(result))
    assert [len(lp[1]) for lp in h.outs[a].logprobs] == [1, 1]
    assert [len(lp[2]) for lp in h.outs[b].logprobs] == [3, 3]
    assert h.outs[c].logprobs is None
    assert h.outs[a].logprobs[0][0] == -0.5


def test_mismatched_result_is_rejected_without_side_effects():
    h = Harness()
    h.add([1, 2, 3], max_tokens=2)
    plan = h.sched.schedule()
    with pytest.raises(ValueError, match="matches no plan"):
        h.sched.on_result(StepResult(plan.step + 5, i32([1])))
    with pytest.raises(ValueError, match="token ids"):
        h.sched.on_result(StepResult(plan.step, i32([1, 2])))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        h.sched.on_result(StepResult(plan.step, i32([VOCAB])))
    h.collect(h.sched.on_result(h.worker.execute(plan)))
    h.run()


def test_stats_report_the_contract_keys():
    h = Harness(num_blocks=20)
    assert h.sched.stats() == {
        "num_free_blocks": 20,
        "num_total_blocks": 20,
        "num_running": 0,
        "num_waiting": 0,
        "num_preemptions": 0,
        "num_cached_tokens": 0,
    }
    h.add([1, 2, 3], max_tokens=2)
    assert h.batches == [] and h.sched.stats()["num_waiting"] == 1
    h.run()
    assert h.batches[-1][1].stats["num_free_blocks"] == 20


# ---- robustness: whatever a decoded AddRequest holds, add() answers ---------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.binary(max_size=5),
)
_values = st.one_of(
    _scalars,
    st.lists(st.one_of(st.integers(-5, 200), _scalars), max_size=3),
    st.dictionaries(st.text(max_size=3), _scalars, max_size=2),
)
_param_names = st.sampled_from(
    [
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "max_tokens",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "logprobs",
        "junk",
    ]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    params=st.dictionaries(st.one_of(_param_names, st.integers()), _values, max_size=4),
    prompt=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=8),
)
def test_any_add_request_is_admitted_or_answered_with_an_error(params, prompt):
    h = Harness(num_blocks=8, max_model_len=64)
    replies = h.sched.add_request(AddRequest("r", i32(prompt), params), CLIENT)
    if replies:
        assert replies[0][1].finished == {"r": "error"}
    else:
        h.sched.abort(["r"], CLIENT)
    h.assert_all_free()


# ---- the scheduler process over real sockets (the loop in a thread, the fake worker in another) -----

import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import zmq  # noqa: E402

from protocol.addresses import make_addresses, remove_ipc_dir  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.messages import EngineDead, GetStats, Ready, Shutdown, WorkerError  # noqa: E402
from scheduler.process import serve  # noqa: E402


def socket_worker(addresses, num_blocks: int, block_size: int, fail_at: int | None, log: list) -> None:
    """Rank 0: Ready, then plans in, results out; WorkerError at step `fail_at` (0: instead of Ready);
    silence after -1."""
    ctx = zmq.Context()
    plans, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    plans.connect(addresses.plans[0])
    results.connect(addresses.results)
    if fail_at == 0:
        time.sleep(0.3)  # let the client's hello arrive first
        results.send(encode(WorkerError(rank=0, reason="out of memory while loading")))
    else:
        results.send(encode(Ready(role="worker", rank=0, info={"num_kv_blocks": num_blocks})))
    fake, failed = FakeWorker(num_blocks, block_size), False
    while plans.poll(10_000):
        msg = decode(plans.recv())
        log.append(msg)
        if isinstance(msg, Shutdown):
            break
        if msg.step == fail_at:
            results.send(encode(WorkerError(rank=0, reason="CUDA error: out of luck")))
            failed = True  # plans already in flight behind the failed one are never run
        elif fail_at != -1 and not failed:
            results.send(encode(fake.execute(msg)))
    ctx.destroy(linger=1000)


OWNER = b"the-owning-frontend"  # the identity whose Shutdown the engine takes (the launcher's is random)


class Engine:
    """serve() and the socket worker in threads; `client()` gives a connected DEALER (`owner`: the owning one)."""

    def __init__(self, fail_at: int | None = None, num_blocks: int = 64, **config) -> None:
        self.addresses = make_addresses(1)
        self.config = make_config(**config)
        self.code: list[int] = []
        self.worker_log: list = []
        self.ctx = zmq.Context()
        self.threads = [
            threading.Thread(
                target=lambda: self.code.append(serve(self.config, self.addresses, owner=OWNER)), daemon=True
            ),
            threading.Thread(
                target=socket_worker,
                daemon=True,
                args=(self.addresses, num_blocks, self.config.block_size, fail_at, self.worker_log),
            ),
        ]
        for t in self.threads:
            t.start()

    def client(self, owner: bool = False) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if owner:
            sock.setsockopt(zmq.IDENTITY, OWNER)
        sock.connect(self.addresses.engine)
        return sock

    def close(self) -> None:
        for t in self.threads:
            t.join(10)
        self.ctx.destroy(linger=0)
        remove_ipc_dir(self.addresses)


def recv(sock: zmq.Socket, timeout_s: float = 10.0):
    assert sock.poll(timeout_s * 1000), "no reply from the engine"
    return decode(sock.recv())


def hello(sock: zmq.Socket) -> dict:
    sock.send(encode(GetStats()))
    ready = recv(sock)
    assert isinstance(ready, Ready) and ready.role == "engine"
    assert isinstance(recv(sock), TokenBatch)
    return ready.info


def generate(sock: zmq.Socket, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    sock.send(encode(AddRequest(rid, i32(prompt), {"max_tokens": max_tokens, "temperature": 0.0})))
    return stream(sock, rid)


def stream(sock: zmq.Socket, rid: str) -> tuple[list[int], str]:
    """Read `rid`'s tokens until it finishes: (tokens, finish reason)."""
    tokens = []
    while True:
        msg = recv(sock)
        if isinstance(msg, TokenBatch) and rid in msg.request_ids:
            tok = int(msg.token_ids[msg.request_ids.index(rid)])
            tokens += [tok] if tok >= 0 else []
            if rid in msg.finished:
                return tokens, msg.finished[rid]


def test_engine_serves_frontends_over_sockets_and_shuts_down_cleanly():
    engine = Engine()
    try:
        a, b = engine.client(owner=True), engine.client()
        info = hello(a)
        assert info["num_kv_blocks"] == 64 and info["vocab_size"] == VOCAB and info["block_size"] == 8
        hello(b)
        assert generate(a, "x", [1, 2, 3], 5) == (reference([1, 2, 3], 5), "length")
        assert generate(b, "x", [4, 5], 3) == (reference([4, 5], 3), "length")  # same id, other client
        a.send(encode(GetStats()))
        stats = recv(a).stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"] == 64
        a.send(encode(Shutdown()))
        assert isinstance(recv(b), EngineDead)
    finally:
        engine.close()
    assert engine.code == [0] and isinstance(engine.worker_log[-1], Shutdown)


def test_a_frontend_that_reads_late_still_gets_every_token_and_the_finish():
    # ZeroMQ's ROUTER silently drops what it cannot queue for a peer (1000 frames, plus the peer's own
    # 1000): a frontend busy for a few thousand steps lost tokens and finishes, and its requests hung.
    n = 2500
    engine = Engine(num_blocks=400, max_model_len=4096)
    try:
        late, watcher = engine.client(owner=True), engine.client()
        hello(late)
        hello(watcher)
        late.send(encode(AddRequest("long", i32([1, 2, 3]), {"max_tokens": n, "temperature": 0.0})))
        while True:  # `late` reads nothing until the engine is done
            watcher.send(encode(GetStats()))
            batch = recv(watcher)
            if batch.step >= n and batch.stats["num_running"] == batch.stats["num_waiting"] == 0:
                break
            time.sleep(0.05)
        assert stream(late, "long") == (reference([1, 2, 3], n), "length")
        late.send(encode(Shutdown()))
    finally:
        engine.close()
    assert engine.code == [0]


def test_malformed_frames_are_logged_dropped_and_the_engine_keeps_serving(caplog):
    engine = Engine()
    try:
        sock = engine.client(owner=True)
        hello(sock)
        junk = engine.ctx.socket(zmq.PUSH)
        junk.connect(engine.addresses.results)
        with caplog.at_level(logging.WARNING, logger="pico_vllm.scheduler"):
            for frame in (
                b"\xc1garbage",
                b"\x93\x01\x02\x03",
                encode(GetStats())[:-1],
                encode(Shutdown()).replace(b"\x01", b"\x02"),
                encode(StepResult(7, i32([1]))),
            ):
                sock.send(frame)
                junk.send(frame)
            sock.send_multipart([b"two", b"frames"])
            assert generate(sock, "after", [9, 8, 7], 4) == (reference([9, 8, 7], 4), "length")
            deadline = time.monotonic() + 10  # the results socket is read whenever no step is in flight: soon
            while sum("from a worker" in r.getMessage() for r in caplog.records) < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum("malformed frame from a frontend" in w for w in warnings) == 5  # the four, and the two-frame one
        assert sum("malformed frame from a worker" in w for w in warnings) == 4
        assert any("StepResult from a frontend" in w for w in warnings)
        assert any("2 frames" in w for w in warnings)
        sock.send(encode(Shutdown()))
    finally:
        engine.close()
    assert engine.code == [0]


def test_worker_error_fails_every_client_with_engine_dead():
    engine = Engine(fail_at=1)
    try:
        sock = engine.client()
        hello(sock)
        sock.send(encode(AddRequest("x", i32([1, 2]), {})))
        dead = recv(sock)
        assert isinstance(dead, EngineDead) and "CUDA error: out of luck" in dead.reason
    finally:
        engine.close()
    assert engine.code == [1]


def test_a_worker_failing_at_startup_fails_clients_waiting_for_ready():
    engine = Engine(fail_at=0)
    try:
        sock = engine.client()
        sock.send(encode(GetStats()))
        dead = recv(sock)
        assert isinstance(dead, EngineDead) and "failed to start: out of memory while loading" in dead.reason
    finally:
        engine.close()
    assert engine.code == [1]


def test_a_step_without_progress_marks_the_engine_dead_after_step_timeout():
    engine = Engine(fail_at=-1, step_timeout=0.5)
    try:
        sock = engine.client()
        hello(sock)
        start = time.monotonic()
        sock.send(encode(AddRequest("x", i32([1, 2]), {})))
        dead = recv(sock)
        assert isinstance(dead, EngineDead) and "step_timeout" in dead.reason
        assert time.monotonic() - start < 3
    finally:
        engine.close()
    assert engine.code == [1]


# ---- the real process entry -------------------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from frontend.launcher import start_child  # noqa: E402
from protocol.config import pack_child_args  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("ending", ["worker error", "SIGTERM"])
def test_scheduler_process_exit_code_says_how_it_ended(ending):
    addresses, log = make_addresses(1), []
    proc = start_child("scheduler", pack_child_args(make_config(), addresses.to_dict()))
    worker = threading.Thread(target=socket_worker, args=(addresses, 32, 8, 1, log), daemon=True)
    worker.start()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(addresses.engine)
        hello(sock)
        if ending == "SIGTERM":
            proc.terminate()
        else:
            sock.send(encode(AddRequest("x", i32([1]), {})))
        assert isinstance(recv(sock), EngineDead)
        assert proc.wait(10) == (0 if ending == "SIGTERM" else 1)
        worker.join(10)
        assert isinstance(log[-1], Shutdown)
    finally:
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)
        remove_ipc_dir(addresses)


def test_scheduler_exits_when_its_parent_dies():
    addresses = make_addresses(1)
    script = (
        "import json, sys, time\n"
        "from frontend.launcher import start_child\n"
        "from protocol.config import EngineConfig, pack_child_args\n"
        "config, addresses = json.loads(sys.argv[1])\n"
        "p = start_child('scheduler', pack_child_args(EngineConfig.from_dict(config), addresses))\n"
        "print(p.pid, flush=True); time.sleep(60)\n"
    )
    args = json.dumps([make_config().to_dict(), addresses.to_dict()])
    parent = subprocess.Popen([sys.executable, "-c", script, args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)  # at once: the child may not even have imported the scheduler
        deadline = time.monotonic() + 10
        while not _gone(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child), "the scheduler outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        remove_ipc_dir(addresses)


def test_the_protocol_md_example_client_generates_the_same_tokens():
    text = (ROOT / "protocol" / "PROTOCOL.md").read_text()
    code = text.split("```python\n")[-1].split("```")[0]
    namespace: dict = {}
    exec(compile(code, "PROTOCOL.md example", "exec"), namespace)
    engine = Engine()
    try:
        assert namespace["generate"](engine.addresses.engine, [3, 1, 4, 1, 5], max_tokens=6, timeout_s=10) == (
            reference([3, 1, 4, 1, 5], 6),
            "length",
        )
        with pytest.raises(ValueError, match="outside the vocabulary"):
            namespace["generate"](engine.addresses.engine, [VOCAB + 5], timeout_s=10)
        stop = engine.client(owner=True)
        stop.send(encode(Shutdown()))
    finally:
        engine.close()
    assert engine.code == [0]
