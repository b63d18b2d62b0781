"""The wire codec: every record round-trips; every malformed message is a ProtocolError."""

from __future__ import annotations

import ast
import pathlib

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollmesh.wire import protocol
from rollmesh.wire.protocol import RECORDS, WIRE_DTYPES, ProtocolError, decode, encode, to_torch
from rollmesh.wire.messages import Group, Metrics, Ok, Trajectory
from tests.helpers.wire_strategies import any_record, assert_same, record_strategy


def trajectory(n: int, sample_id: str = "s-000001") -> Trajectory:
    rng = np.random.default_rng(n)
    return Trajectory(
        sample_id=sample_id, group_id="g-000001",
        token_ids=rng.integers(0, 150_000, n, dtype=np.int32),
        logprobs=-rng.random(n, dtype=np.float32),
        versions=np.where(np.arange(n) < n // 4, -1, 3).astype(np.int32),
        loss_mask=(np.arange(n) >= n // 4).astype(np.uint8),
        prompt_len=n // 4, label="72", loop_state={"turn": 1, "messages": [{"role": "user"}]},
    )


def roundtrip(rec):
    # bytes() copies as a socket would; decode must not depend on the encoder's memory
    return decode([bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f
                   for f in encode(rec)])


@pytest.mark.parametrize("name", sorted(RECORDS))
@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_record_round_trips(name, data):
    rec = data.draw(record_strategy(RECORDS[name]))
    assert_same(rec, roundtrip(rec))


def test_empty_arrays_round_trip():
    rec = trajectory(0)
    out = roundtrip(rec)
    assert out.token_ids.shape == (0,) and out.token_ids.dtype == np.int32
    assert_same(rec, out)


def test_large_array_round_trips_without_copy():
    n = 5 * 1024 * 1024  # 5M int32 + 5M float32 + ... > 16 MiB per array pair, 45 MiB total
    rec = trajectory(n)
    assert rec.token_ids.nbytes + rec.logprobs.nbytes >= 16 << 20
    frames = encode(rec)
    # encode references the caller's arrays: no copy on the way out
    assert np.shares_memory(frames[2], rec.token_ids)
    out = decode(frames)
    assert np.shares_memory(out.token_ids, rec.token_ids)  # and none on the way in
    assert_same(rec, out)


def test_bf16_and_float8_round_trip_from_torch():
    t = torch.randn(4, 3).to(torch.bfloat16)
    rec = Metrics(role="trainer", host="h", values={})
    rec2 = Group(group_id="g", trajectories=[])
    # arrays of any wire dtype ride in Trajectory's array fields
    for tensor in (t, torch.randn(5).to(torch.float8_e4m3fn), torch.randn(2, 2).to(torch.float8_e5m2)):
        traj = trajectory(4)
        traj.logprobs = tensor
        out = roundtrip(traj)
        assert out.logprobs.dtype.name == str(tensor.dtype).removeprefix("torch.")
        back = to_torch(out.logprobs)
        assert back.dtype == tensor.dtype
        assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))
    assert_same(rec, roundtrip(rec))
    assert_same(rec2, roundtrip(rec2))


def test_every_wire_dtype_round_trips():
    for name, dtype in WIRE_DTYPES.items():
        arr = np.frombuffer(np.arange(48, dtype=np.uint8).tobytes(), dtype=dtype).reshape(2, -1)
        traj = trajectory(2)
        traj.token_ids = arr
        assert_same(traj, roundtrip(traj))


def test_big_endian_and_non_contiguous_arrays_are_normalised():
    traj = trajectory(8)
    traj.token_ids = np.arange(16, dtype=">i4")[::2]
    out = roundtrip(traj)
    assert out.token_ids.dtype == np.dtype("<i4")
    np.testing.assert_array_equal(out.token_ids, np.arange(16)[::2])


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(any_record)
def test_random_valid_records_round_trip(rec):
    assert_same(rec, roundtrip(rec))


# ---- malformed messages --------------------------------------------------------------------


def good_frames():
    return [bytes(memoryview(f).cast("B")) for f in encode(Group(group_id="g", trajectories=[trajectory(6)]))]


def body_with(frames, **changes):
    body = msgpack.unpackb(frames[1], raw=False, ext_hook=msgpack.ExtType)
    body.update(changes)
    return [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]


def array_ext(index, dtype, shape):
    return msgpack.ExtType(1, msgpack.packb([index, dtype, shape]))


def traj_body(**changes):
    base = {"sample_id": "s", "group_id": "g", "token_ids": array_ext(0, "int32", [2]),
            "logprobs": array_ext(1, "float32", [2]), "versions": array_ext(2, "int32", [2]),
            "loss_mask": array_ext(3, "uint8", [2]), "prompt_len": 1}
    base.update(changes)
    return msgpack.packb({k: v for k, v in base.items() if v is not None}, use_bin_type=True)


BUFS = [bytes(8), bytes(8), bytes(8), bytes(2)]

MALFORMED = [
    ([], "expected at least 2 frames (type, body), got 0"),
    ([b"Trajectory"], "expected at least 2 frames (type, body), got 1"),
    ([b"NoSuchRecord", b"\x80"], "unknown message type 'NoSuchRecord'"),
    ([b"\xff\xfe", b"\x80"], "message type is not ascii"),
    ([b"Ok", b"\x81\xa3msg\xa1x"], "Ok: unknown field(s) ['msg'] for Ok"),
    ([b"ErrorReply", b"\x81\xa4code\xa1x"], "ErrorReply: missing field(s) ['message'] for ErrorReply"),
    ([b"Ok", b"\x93\x01\x02\x03"], "Ok: expected a map for Ok, got list"),
    ([b"Trajectory", traj_body(prompt_len="1"), *BUFS], "Trajectory.prompt_len: expected int, got str"),
    ([b"Trajectory", traj_body(prompt_len=True), *BUFS], "Trajectory.prompt_len: expected int, got bool"),
    ([b"Trajectory", traj_body(token_ids=[1, 2], logprobs=array_ext(0, "float32", [2]),
                               versions=array_ext(1, "int32", [2]), loss_mask=array_ext(2, "uint8", [2])),
      *BUFS[1:]], "Trajectory.token_ids: expected array, got list"),
    ([b"Trajectory", traj_body(), *BUFS[:3]], "array refers to frame 3, message has 3"),
    ([b"Trajectory", traj_body(), *BUFS, b"extra"], "1 array frame(s) not referenced by the body"),
    ([b"Trajectory", traj_body(), bytes(7), *BUFS[1:]],
     "array frame 0 has 7 bytes, header says [2] int32 = 8"),
    ([b"Trajectory", traj_body(token_ids=array_ext(0, "int32", [2**40, 2**40])), *BUFS],
     "array frame 0 has 8 bytes, header says [1099511627776, 1099511627776] int32 = "
     "4835703278458516698824704"),
    ([b"Trajectory", traj_body(token_ids=array_ext(0, "object", [2])), *BUFS],
     "array dtype 'object' is not allowed on the wire"),
    ([b"Trajectory", traj_body(token_ids=array_ext(0, "int32", [-1])), *BUFS], "bad array shape [-1]"),
    ([b"Trajectory", traj_body(logprobs=array_ext(0, "float32", [2])), *BUFS],
     "array frame 0 referenced twice"),
    ([b"Trajectory", traj_body(token_ids=msgpack.ExtType(7, b"")), *BUFS], "unknown msgpack extension 7"),
    ([b"Trajectory", traj_body(label={1: 2}), *BUFS], "malformed message"),
    ([b"Metrics", msgpack.packb({"role": "r", "host": "h", "values": {"a": msgpack.ExtType(1, msgpack.packb([0, "int8", [1]]))}}), b"\x01"],
     "Metrics.values.a: expected plain data, got array of int8"),
    ([b"Group", b"\xdd\xff\xff\xff\xff"], "malformed message: ValueError"),
    ([b"Group", b"\xc1"], "malformed message"),
    ([b"Heartbeat", msgpack.packb({"sender": "a", "seq": 1, "time": "now"})],
     "Heartbeat.time: expected float, got str"),
]


@pytest.mark.parametrize("frames,reason", MALFORMED)
def test_malformed_messages_are_protocol_errors(frames, reason):
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert reason in str(err.value)


@pytest.mark.parametrize("frames,reason", MALFORMED)
def test_a_malformed_message_is_refused_after_its_array_headers_were_seen_whole(frames, reason):
    """Array headers are parsed and checked once, then found by their bytes: a header already
    seen in a good message still gets every check against this message's frames."""
    decode([b"Trajectory", traj_body(), *BUFS])  # the usual headers, checked and remembered
    for _ in range(2):  # as it arrives the first time, then again with its headers known
        with pytest.raises(ProtocolError) as err:
            decode(frames)
        assert reason in str(err.value)


def test_expected_type_is_enforced():
    with pytest.raises(ProtocolError, match="unexpected message Ok, expected Group"):
        decode(encode(Ok()), expect=Group)


def test_nested_record_errors_name_the_path():
    frames = good_frames()
    body = msgpack.unpackb(frames[1], raw=False, ext_hook=msgpack.ExtType)
    body["trajectories"][0]["prompt_len"] = "six"
    with pytest.raises(ProtocolError, match=r"Group.trajectories\[0\].prompt_len: expected int"):
        decode([frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]])


garbage_frames = st.lists(st.binary(max_size=64), max_size=6)
typed_garbage = st.tuples(
    st.sampled_from(sorted(RECORDS)).map(str.encode),
    st.one_of(st.binary(max_size=64),
              st.recursive(st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=5) | st.binary(max_size=5),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=8).map(lambda o: msgpack.packb(o, use_bin_type=True))),
    st.lists(st.binary(max_size=32), max_size=4),
).map(lambda t: [t[0], t[1], *t[2]])


@settings(max_examples=1000, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(garbage_frames, typed_garbage))
def test_random_garbage_is_always_a_protocol_error(frames):
    try:
        rec = decode(frames)
    except ProtocolError:
        return
    # A few tiny bodies are valid by chance (e.g. {} for Ok): then they must be real records.
    assert type(rec).__name__ in RECORDS


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutilated_valid_messages_are_protocol_errors(data):
    frames = good_frames()
    how = data.draw(st.sampled_from(["drop_frame", "truncate", "extend", "add_frame"]))
    i = data.draw(st.integers(2, len(frames) - 1))
    if how == "drop_frame":
        del frames[i]
    elif how == "truncate":
        if not frames[i]:
            return
        frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i]) - 1))]
    elif how == "extend":
        frames[i] = frames[i] + data.draw(st.binary(min_size=1, max_size=8))
    else:
        frames.append(data.draw(st.binary(max_size=8)))
    with pytest.raises(ProtocolError):
        decode(frames)


def test_protocol_uses_no_pickle():
    tree = ast.parse(pathlib.Path(protocol.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & {"pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}


def test_a_broker_forwards_received_frames_without_copying():
    """Decoded from received ZeroMQ frames and encoded again (the MessageQueue's hand-out), a
    group goes out as the very frames it came in, body included; a record made anew from it
    sends each array whole as the frame it came in; a slice or a new array is copied."""
    import dataclasses

    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://forward")
        b.connect("inproc://forward")
        group = Group(group_id="g", trajectories=[trajectory(4096), trajectory(16, "s-2")])
        a.send_multipart(encode(group), copy=False)
        received = b.recv_multipart(copy=False)
        got = decode(received)
        out = encode(got)
        assert [id(f) for f in out] == [id(f) for f in received]  # as received, whole
        assert_same(decode([bytes(memoryview(f)) for f in out]), group)
        got = dataclasses.replace(got)  # a new record: encoded again, its arrays are not
        out = encode(got)
        assert out[1] is not received[1]
        assert [id(f) for f in out[2:]] == [id(f) for f in received[2:]]
        assert_same(decode([bytes(memoryview(f)) for f in out]), group)
        # a part of an array, or an array reversed, is not the frame: copied as usual
        got.trajectories[0].token_ids = got.trajectories[0].token_ids[1:]
        got.trajectories[0].logprobs = got.trajectories[0].logprobs[::-1]
        out = encode(got)
        assert not any(f is r for f in out[2:4] for r in received)
        again = decode([bytes(memoryview(f)) for f in out])
        assert np.array_equal(again.trajectories[0].token_ids, group.trajectories[0].token_ids[1:])
        assert np.array_equal(again.trajectories[0].logprobs, group.trajectories[0].logprobs[::-1])
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


# ---- records nested as their own frames (a Group in a PutGroups or a Batch) ------------------


def nested_ext(first, count):
    return msgpack.ExtType(2, msgpack.packb([first, count]))


EMPTY_GROUP = [b"Group", msgpack.packb({"group_id": "g", "trajectories": []})]


def deep_group(levels):
    """A Group whose only trajectory is a nested Group, `levels` deep."""
    frames = EMPTY_GROUP
    for _ in range(levels):
        body = {"group_id": "g", "trajectories": [nested_ext(0, len(frames))]}
        frames = [b"Group", msgpack.packb(body), *frames]
    return frames


NESTED_MALFORMED = [
    ([b"Batch", msgpack.packb({"groups": [msgpack.ExtType(2, msgpack.packb([0]))], "version": 0})],
     "nested record header must be [first frame, frame count]"),
    ([b"Batch", msgpack.packb({"groups": [nested_ext(0, 6)], "version": 0}), *EMPTY_GROUP],
     "nested record in frames 0..5, message has 2"),
    ([b"Batch", msgpack.packb({"groups": [nested_ext(0, 2), nested_ext(0, 2)], "version": 0}),
      *EMPTY_GROUP], "frame 0 referenced twice"),
    ([b"Batch", msgpack.packb({"groups": [nested_ext(0, 2)], "version": 0}), b"Ok", b"\x80"],
     "nested record in frames 0..1: unexpected message Ok, expected Framed"),
    ([b"Assign", msgpack.packb({"trajectory": nested_ext(0, 2)}), *EMPTY_GROUP],
     "Assign.trajectory: expected a map for Trajectory, got Group"),
    ([b"Batch", msgpack.packb({"groups": [nested_ext(0, 2)], "version": 0}), *EMPTY_GROUP, b"x"],
     "1 array frame(s) not referenced by the body"),
    ([b"Batch", msgpack.packb({"groups": [nested_ext(0, 6)], "version": 0}), *deep_group(2)],
     "records nested deeper than 2"),
    ([b"Metrics", msgpack.packb({"role": "r", "host": "h", "values": {"g": nested_ext(0, 2)}}),
      *EMPTY_GROUP], "Metrics.values.g: expected plain data, got Group"),
]


@pytest.mark.parametrize("frames,reason", NESTED_MALFORMED)
def test_malformed_nested_records_are_protocol_errors(frames, reason):
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert reason in str(err.value)


def test_a_nested_group_keeps_its_frames_and_a_new_record_is_encoded_anew():
    import dataclasses

    from rollmesh.wire.protocol import frames_of
    from rollmesh.wire.messages import Batch, PutGroups

    groups = [Group(group_id=f"g{i}", trajectories=[trajectory(8, f"s{i}")]) for i in range(3)]
    frames = [bytes(memoryview(f).cast("B")) for f in encode(PutGroups(groups=groups))]
    assert frames[2::6] == [b"Group"] * 3  # each group: its type, its body, its 4 arrays
    put = decode(frames)
    assert [frames_of(g) for g in put.groups] == [frames[2 + 6 * i:8 + 6 * i] for i in range(3)]
    out = encode(Batch(groups=put.groups[::-1], version=1))
    assert out[2:] == frames[14:20] + frames[8:14] + frames[2:8]  # as received, reordered
    assert_same(decode(out).groups, groups[::-1])
    renamed = dataclasses.replace(put.groups[0], group_id="other")
    assert frames_of(renamed) is None and decode(encode(renamed)).group_id == "other"
