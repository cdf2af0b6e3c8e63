"""The msgpack codec: every message survives a round trip; anything malformed is a ProtocolError."""

from __future__ import annotations

import dataclasses
import os

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec import MAX_FRAME_BYTES, ProtocolError, decode, encode
from protocol.config import InvalidParam
from protocol.messages import (
    MESSAGE_TYPES,
    Abort,
    AddRequest,
    EngineDead,
    Error,
    GetStats,
    GrammarMask,
    NewRow,
    Ready,
    Shutdown,
    StepPlan,
    StepResult,
    TokenBatch,
    WorkerError,
    i32,
)
from protocol.sampling import SamplingParams

NEW_ROW = NewRow(
    row=3,
    token_ids=i32([5, 6, 7]),
    num_prompt_tokens=2,
    num_computed=1,
    block_table=i32([9, 4]),
    sampling=SamplingParams(seed=7, min_tokens=2, stop_token_ids=[3], logit_bias={5: -1.5}).row_sampling(),
)
SAMPLES = [
    AddRequest("r-1", i32([1, 2, 2**31 - 1]), {"max_tokens": 4, "temperature": 0.5, "stop": ["\n"]}),
    Abort(["a", "b"]),
    Shutdown(),
    GetStats(),
    TokenBatch(
        step=4,
        request_ids=["a", "b"],
        token_ids=i32([11, -1]),
        finished={"b": "error"},
        errors={"b": "bad"},
        logprobs=[[-0.5, [11, 3], [-0.5, -2.0]], None],
        stats={"num_running": 1},
        request_stats={"a": {"queue_time": 0.25, "num_cached_tokens": 16}},
    ),
    TokenBatch(step=0, request_ids=[], token_ids=i32([])),
    Ready(role="engine", rank=0, info={"num_kv_blocks": 10, "eos_token_ids": [1, 2]}),
    EngineDead("worker 0 died"),
    Error("malformed frame: AddRequest.prompt_token_ids must be raw i32 bytes", "r-1"),
    Error("Shutdown refused"),
    NEW_ROW.sampling,
    NEW_ROW,
    StepPlan(
        step=2,
        rows=i32([3, 1]),
        num_tokens=i32([1, 7]),
        new_rows=[NEW_ROW],
        block_appends=[],
        free_rows=i32([0]),
        trace=True,
        masked=i32([0]),
    ),
    GrammarMask(step=2, rows=3),
    StepResult(
        step=2,
        token_ids=i32([4, -1]),
        logprobs={"sampled": np.float32([-1.5, 0]).tobytes(), "k": 0, "top_ids": b"", "top_logprobs": b""},
        timings={"start_ns": 1},
    ),
    WorkerError(rank=1, reason="CUDA error"),
]


def assert_same(a, b) -> None:
    assert type(a) is type(b)
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert y.dtype == x.dtype and np.array_equal(x, y), f.name
        elif f.name == "new_rows":
            assert len(x) == len(y) and all(assert_same(p, q) is None for p, q in zip(x, y))
        else:
            assert x == y, f.name


def test_samples_cover_every_message_type():
    assert {type(m).__name__ for m in SAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_a_round_trip(msg):
    assert_same(decode(encode(msg)), msg)


def test_arrays_travel_as_raw_little_endian_bytes():
    wire = msgpack.unpackb(encode(AddRequest("x", i32([1, 258]), {})), raw=False)
    assert wire == {
        "type": "AddRequest",
        "v": 1,
        "request_id": "x",
        "prompt_token_ids": b"\x01\0\0\0\x02\x01\0\0",
        "params": {},
    }


def test_block_appends_travel_as_row_and_raw_block_ids():
    plan = StepPlan(step=1, rows=i32([0]), num_tokens=i32([1]), block_appends=[(0, i32([5, 6]))])
    ((row, ids),) = decode(encode(plan)).block_appends
    assert row == 0 and np.frombuffer(ids, "<i4").tolist() == [5, 6]


def _frame(**obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


GOOD = {"type": "EngineDead", "v": 1, "reason": "x"}


@pytest.mark.parametrize(
    "frame,needle",
    [
        (b"\xc1", "not msgpack"),
        (b"", "not msgpack"),
        (encode(GetStats())[:-1], "not msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (_frame(**{**GOOD, "v": 2}), "version 2"),
        (_frame(type="EngineDead", reason="x"), "version None"),
        (_frame(**{**GOOD, "type": "Pickle"}), "unknown message type"),
        (_frame(**{**GOOD, "type": 5}), "unknown message type"),
        (_frame(type="EngineDead", v=1), "lacks field 'reason'"),
        (_frame(**{**GOOD, "reason": 5}), "EngineDead.reason"),
        (_frame(type="WorkerError", v=1, rank=True, reason="x"), "must be int, got bool"),
        (_frame(type="AddRequest", v=1, request_id="a", prompt_token_ids=b"\1\2\3", params={}), "raw i32 bytes"),
        (_frame(type="AddRequest", v=1, request_id="a", prompt_token_ids=[1, 2], params={}), "raw i32 bytes"),
        (
            _frame(
                type="StepPlan",
                v=1,
                step=1,
                rows=b"",
                num_tokens=b"",
                new_rows=[{"type": "Nope"}],
                block_appends=[],
                free_rows=b"",
                trace=False,
            ),
            "unknown message type",
        ),
    ],
)
def test_malformed_frames_raise_protocol_error(frame, needle):
    with pytest.raises(ProtocolError, match=needle):
        decode(frame)


def test_oversize_frames_are_refused_both_ways():
    with pytest.raises(ProtocolError, match="over the"):
        decode(b"\0" * (MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="over the"):
        encode(AddRequest("big", np.zeros(MAX_FRAME_BYTES // 4 + 1, np.int32), {}))


def _nested_plans(depth: int) -> bytes:
    """A StepPlan whose new_rows hold a StepPlan whose new_rows hold ... `depth` deep, built as raw bytes."""
    fields = {
        "type": "StepPlan",
        "step": 1,
        "rows": b"",
        "num_tokens": b"",
        "block_appends": [],
        "free_rows": b"",
        "trace": False,
    }
    head = bytes([0x80 + len(fields) + 1]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in fields.items())
    top = bytes([0x80 + len(fields) + 2]) + msgpack.packb("v") + msgpack.packb(1) + head[1:]
    inner = msgpack.packb({})
    for _ in range(depth):
        inner = head + msgpack.packb("new_rows") + b"\x91" + inner
    return top + msgpack.packb("new_rows") + b"\x91" + inner


def test_deeply_nested_messages_raise_protocol_error():
    with pytest.raises(ProtocolError):
        decode(_nested_plans(400))


# ---- fuzzing: whatever arrives, decode returns a message or raises ProtocolError -------------------


def _decodes_or_refuses(frame: bytes) -> None:
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert type(msg).__name__ in MESSAGE_TYPES


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_protocol_error(frame):
    _decodes_or_refuses(frame)


_mutation = st.tuples(
    st.sampled_from(["flip", "cut", "insert", "truncate"]), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)
)


def _mutate(frame: bytes, op: str, at: int, data: bytes) -> bytes:
    i = at % (len(frame) + 1)
    if op == "flip" and i < len(frame):
        return frame[:i] + bytes([frame[i] ^ data[0]]) + frame[i + 1 :]
    if op == "cut":
        return frame[:i] + frame[i + len(data) :]
    if op == "insert":
        return frame[:i] + data + frame[i:]
    return frame[:i]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SAMPLES), st.lists(_mutation, min_size=1, max_size=4))
def test_mutated_frames_never_raise_anything_but_protocol_error(msg, mutations):
    frame = encode(msg)
    for op, at, data in mutations:
        frame = _mutate(frame, op, at, data)
    _decodes_or_refuses(frame)


_ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(), st.text(max_size=6), st.binary(max_size=12))
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.text(max_size=12), _ints), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(st.text(max_size=16), _values, max_size=8),
    st.sampled_from([1, 1, 2, None]),
)
def test_maps_of_random_fields_never_raise_anything_but_protocol_error(name, fields, version):
    obj = {**fields, "type": name}
    if version is not None:
        obj["v"] = version
    # Real field names with random values, so that type checks (not only "lacks field") are exercised.
    for field_name in MESSAGE_TYPES[name].WIRE:
        obj.setdefault(field_name, fields.get(field_name[::-1]))
    _decodes_or_refuses(msgpack.packb(obj, use_bin_type=True))


@pytest.mark.parametrize(
    "obj,request_id",
    [
        ({"type": "AddRequest", "v": 1, "request_id": "a", "prompt_token_ids": [1, 2], "params": {}}, "a"),
        ({"type": "AddRequest", "v": 1, "request_id": "b", "params": {}}, "b"),
        ({"type": "AddRequest", "v": 2, "request_id": "c"}, "c"),
        ({"type": "AddRequest", "v": 1, "request_id": 7, "params": {}}, None),
        ({"type": "GetStats", "v": 3}, None),
    ],
)
def test_a_malformed_frame_names_the_request_id_it_carries(obj, request_id):
    with pytest.raises(ProtocolError) as bad:
        decode(msgpack.packb(obj, use_bin_type=True))
    assert bad.value.request_id == request_id


def test_logit_bias_takes_digit_string_keys_as_json_born_clients_send_them():
    assert SamplingParams(logit_bias={"5": 1.5, 7: -2}).logit_bias == {5: 1.5, 7: -2.0}
    for key in ("-1", "1.5", "x", "１", "9" * 12):
        with pytest.raises(InvalidParam, match="logit_bias"):
            SamplingParams(logit_bias={key: 1.0})


def test_sampling_params_errors_name_their_field_and_plans_carry_what_the_worker_samples_with():
    with pytest.raises(InvalidParam, match="top_p") as bad:
        SamplingParams.from_dict({"top_p": 0.0})
    assert bad.value.field == "top_p"
    with pytest.raises(InvalidParam) as unknown:
        SamplingParams.from_dict({"temprature": 0.5})
    assert unknown.value.field == "temprature"
    params = SamplingParams(temperature=0.5, stop="x", seed=2**64 - 1, logit_bias={3: 1.5}, stop_token_ids=[2])
    wire = decode(encode(NewRow(0, i32([1]), 1, 0, i32([0]), params.row_sampling()))).sampling
    assert wire == params.row_sampling()
    assert (wire.temperature, wire.seed, wire.logit_bias, wire.stop_token_ids, wire.logprobs) == (
        0.5,
        -1,
        {3: 1.5},
        [],
        -1,
    )


def test_a_new_row_whose_sampling_is_not_a_row_sampling_map_is_malformed():
    row = {"type": "NewRow", "v": 1, "row": 0, "token_ids": b"", "num_prompt_tokens": 0, "num_computed": 0}
    row["block_table"] = b""
    for sampling in ({"type": "Shutdown"}, {"temperature": 1.0}, [1.0]):
        with pytest.raises(ProtocolError, match="NewRow.sampling must be a RowSampling map"):
            decode(msgpack.packb({**row, "sampling": sampling}, use_bin_type=True))
    wire = msgpack.unpackb(encode(NEW_ROW.sampling), raw=False, strict_map_key=False)
    with pytest.raises(ProtocolError, match="RowSampling.temperature has type int"):
        decode(msgpack.packb({**wire, "temperature": 1}, use_bin_type=True))


def test_shared_masks_show_one_process_writes_to_another_by_step_parity_and_refuse_a_second_creator(tmp_path):
    from protocol.shared_masks import SharedMasks

    path = str(tmp_path / "masks")
    scheduler = SharedMasks(path, max_rows=3, vocab_size=70, create=True)  # 70 ids: 3 words a row
    worker = SharedMasks(path, max_rows=3, vocab_size=70)
    scheduler.slot(4, 2)[:] = [[1, 2, 3], [4, 5, 6]]
    scheduler.slot(5, 1)[:] = 7
    assert worker.slot(4, 2).tolist() == [[1, 2, 3], [4, 5, 6]] and worker.slot(5, 1).tolist() == [[7, 7, 7]]
    with pytest.raises(FileExistsError):
        SharedMasks(path, max_rows=3, vocab_size=70, create=True)


def test_the_mask_file_goes_with_the_engine_ipc_directory():
    from protocol.addresses import make_addresses, remove_ipc_dir
    from protocol.shared_masks import SharedMasks, masks_path

    addresses = make_addresses(1)
    SharedMasks(masks_path(addresses.ipc_dir), max_rows=2, vocab_size=64, create=True)
    remove_ipc_dir(addresses)
    assert not os.path.exists(masks_path(addresses.ipc_dir)) and not os.path.exists(addresses.ipc_dir)
