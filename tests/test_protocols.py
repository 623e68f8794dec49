"""Wire protocol tests: round trips, golden bytes, versioning, arrays and hostile input.

The golden files are written only by ``tools/regen_golden.py`` from ``golden_samples.SAMPLES``;
these tests read them and never rewrite them.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import msgpack
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import protocols
from golden_samples import SAMPLES
from protocols import (
    NDARRAY_EXT,
    REGISTRY,
    WIRE_DTYPES,
    BadFrame,
    Commit,
    DraftExpansion,
    DraftRequest,
    DraftSteer,
    LaneGrant,
    ExitHidden,
    FrameTooLarge,
    LayerReady,
    LayerReleased,
    Abort,
    Message,
    PassSchedule,
    PassStats,
    PipelineMessage,
    ProtocolError,
    PruneMask,
    UnknownMessage,
    VerifyDone,
    VerifyPlan,
    VersionMismatch,
    decode,
    encode,
    pack_ndarray,
    register,
    unpack_ndarray,
)

GOLDEN_DIR = Path(__file__).parent / "golden" / "wire"


def assert_identical(a: object, b: object) -> None:
    """Deep equality that does not trust Message.__eq__: types, dtypes and shapes must match."""
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, Message):
        for field in dataclasses.fields(a):
            assert_identical(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(a, b)
    elif isinstance(a, tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_identical(x, y)
    else:
        assert a == b


def pack_envelope(kind: object, version: object, body: object) -> bytes:
    return msgpack.packb([kind, version, body], use_bin_type=True, default=pack_ndarray)


def body_of(msg: Message) -> dict:
    """The body map of an encoded message, with arrays still as ExtType."""
    _, _, body = msgpack.unpackb(encode(msg), raw=False)
    return body


# ---------------------------------------------------------------- strategies, one per class

U31 = st.integers(0, 2**31 - 1)
TOKENS = st.integers(0, 151_935)
SECONDS = st.floats(0, 1e6, allow_nan=False)
HEADERS = st.fixed_dictionaries(
    {"session_id": st.integers(0, 2**63 - 1), "step": st.integers(0, 2**63 - 1), "epoch": U31})


def i32(values) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def node_ids() -> st.SearchStrategy[np.ndarray]:
    return st.sets(U31, max_size=12).map(lambda ids: i32(sorted(ids)))


@st.composite
def draft_expansions(draw) -> DraftExpansion:
    n = draw(st.integers(0, 12))
    return DraftExpansion(
        **draw(HEADERS), root_token=draw(TOKENS), position=draw(U31),
        parents=i32([draw(st.integers(-1, i - 1)) for i in range(n)]),
        tokens=i32(draw(st.lists(TOKENS, min_size=n, max_size=n))),
        draft_probs=np.array(draw(st.lists(st.floats(0, 1, width=32), min_size=n, max_size=n)),
                             dtype=np.float32),
        draft_s=draw(SECONDS), assumed=tuple(draw(st.lists(TOKENS, max_size=4))), hypothesis=draw(st.integers(0, 2)),
        of=3, growing=draw(st.booleans()), fault=draw(st.text(max_size=20)), fault_retryable=draw(st.booleans()))


@st.composite
def verify_plans(draw) -> VerifyPlan:
    n = draw(st.integers(1, 12))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    depths = [0]
    for parent in parents[1:]:
        depths.append(depths[parent] + 1)
    return VerifyPlan(
        **draw(HEADERS), position=draw(U31),
        tokens=i32(draw(st.lists(TOKENS, min_size=n, max_size=n))),
        parents=i32(parents), depths=i32(depths), bucket=draw(st.integers(n, 128)),
        exit_layers=tuple(sorted(draw(st.sets(st.integers(0, 63), max_size=3)))))


@st.composite
def commits(draw) -> Commit:
    tokens = tuple(draw(st.lists(TOKENS, min_size=1, max_size=8)))
    path = sorted(draw(st.sets(st.integers(1, 1_000), min_size=len(tokens) - 1,
                               max_size=len(tokens) - 1)))
    finished = draw(st.booleans())
    return Commit(**draw(HEADERS), tokens=tokens,
                  accepted_nodes=draw(st.sampled_from([(), (0, *path)])), finished=finished,
                  finish_reason=draw(st.text(min_size=1, max_size=8)) if finished else None)


@st.composite
def pass_stats(draw) -> PassStats:
    n_nodes = draw(st.integers(0, 4096))
    return PassStats(**draw(HEADERS), n_nodes=n_nodes, n_accepted=draw(st.integers(0, n_nodes)),
                     n_pruned=draw(st.integers(0, n_nodes)), io_s=draw(SECONDS),
                     compute_s=draw(SECONDS), draft_s=draw(SECONDS), pass_s=draw(SECONDS),
                     bytes_read=draw(st.integers(0, 2**63 - 1)))


def _with_header(cls, **fields):
    return st.builds(lambda header, **kw: cls(**header, **kw), HEADERS, **fields)


STRATEGIES: dict[type, st.SearchStrategy] = {
    PassSchedule: _with_header(
        PassSchedule, layers=st.lists(st.integers(0, 127), unique=True, max_size=40).map(tuple)),
    LayerReady: _with_header(LayerReady, layer=U31, slot=U31, nbytes=st.integers(0, 2**40),
                             io_s=SECONDS, direct_io=st.booleans()),
    LayerReleased: _with_header(LayerReleased, layer=U31, slot=U31),
    Abort: _with_header(Abort, reason=st.text(max_size=40)),
    DraftRequest: _with_header(DraftRequest, root_token=TOKENS, position=U31, max_nodes=U31,
                               max_depth=U31, top_k=st.integers(1, 64), min_path_p=st.floats(0, 1),
                               threads=st.integers(0, 64), confirmed_hypothesis=st.integers(-1, 8), levels=st.integers(0, 64),
                               deadline_s=st.floats(0, 1e9),
                               hypotheses=st.lists(st.tuples(st.lists(TOKENS, max_size=4).map(tuple),
                                                             st.lists(TOKENS, max_size=3).map(tuple), U31, U31,
                                                             st.integers(0, 8)),
                                                   max_size=3).map(tuple)),
    DraftExpansion: draft_expansions(),
    DraftSteer: st.one_of(
        _with_header(DraftSteer, path=st.lists(TOKENS, max_size=8).map(tuple), next_token=st.integers(-1, 151_935)),
        _with_header(DraftSteer, path=st.lists(TOKENS, max_size=8).map(tuple), next_token=TOKENS, final=st.just(True),
                     max_depth=st.integers(0, 64), min_path_p=st.floats(0, 1))),
    LaneGrant: _with_header(LaneGrant, threads=st.integers(0, 16)),
    VerifyPlan: verify_plans(),
    ExitHidden: _with_header(ExitHidden, layer=U31, node_ids=node_ids(), handle=U31),
    PruneMask: _with_header(PruneMask, layer=U31,
                            keep=hnp.arrays(np.bool_, st.integers(0, 16))),
    VerifyDone: _with_header(VerifyDone, node_ids=node_ids(), handle=U31, compute_s=SECONDS,
                             io_wait_s=SECONDS),
    Commit: commits(),
    PassStats: pass_stats(),
}


def test_strategy_table_covers_registry():
    assert set(STRATEGIES) == set(REGISTRY.values())


def test_samples_cover_registry():
    assert set(SAMPLES) == set(REGISTRY)
    assert all(type(SAMPLES[kind]) is cls for kind, cls in REGISTRY.items())


@pytest.mark.parametrize("cls", sorted(STRATEGIES, key=lambda c: c.KIND), ids=lambda c: c.KIND)
@given(data=st.data())
def test_every_message_round_trips(cls, data):
    msg = data.draw(STRATEGIES[cls])
    wire = encode(msg)
    back = decode(wire)
    assert_identical(back, msg)
    assert back == msg
    assert encode(back) == wire  # encoding is deterministic


# ---------------------------------------------------------------- golden bytes

@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_golden_bytes_match_sample(kind):
    path = GOLDEN_DIR / f"{kind}.v{REGISTRY[kind].VERSION}.msgpack"
    assert path.exists(), f"missing {path.name}: run tools/regen_golden.py"
    golden = path.read_bytes()
    assert encode(SAMPLES[kind]) == golden
    assert_identical(decode(golden), SAMPLES[kind])


def test_every_golden_file_still_decodes():
    files = sorted(GOLDEN_DIR.glob("*.msgpack"))
    assert files
    for path in files:
        match = re.fullmatch(r"(.+)\.v(\d+)\.msgpack", path.name)
        assert match and match[1] in REGISTRY, path.name
        assert int(match[2]) <= REGISTRY[match[1]].VERSION
        assert type(decode(path.read_bytes())) is REGISTRY[match[1]]


def test_messages_from_before_coupled_sampling_still_sample_by_rejection():
    """Coupled sampling is a default only for messages that know it: an older sampled request
    keeps the rejection sampling its sender meant."""
    for kind, version in (("draft.request", 9), ("plan.verify", 5), ("verify.done", 5)):
        old = decode((GOLDEN_DIR / f"{kind}.v{version}.msgpack").read_bytes())
        assert old.coupled is False and old.temperature > 0, kind
        assert REGISTRY[kind].VERSION > version
    assert DraftRequest(session_id=1, step=0, epoch=0, root_token=1, position=0, max_nodes=1, max_depth=1,
                        top_k=1).coupled is True


# ---------------------------------------------------------------- class shape

@pytest.mark.parametrize("kind", sorted(REGISTRY))
def test_message_class_is_slotted_frozen_keyword_only(kind):
    cls, sample = REGISTRY[kind], SAMPLES[kind]
    assert issubclass(cls, PipelineMessage)
    assert all("__slots__" in vars(c) for c in cls.__mro__[:-1])
    assert not hasattr(sample, "__dict__")
    assert cls.__dataclass_params__.frozen
    fields = dataclasses.fields(cls)
    assert all(f.kw_only for f in fields)
    assert [f.name for f in fields[:3]] == ["session_id", "step", "epoch"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        sample.step = 1
    with pytest.raises((AttributeError, TypeError)):
        sample.not_a_field = 1
    assert re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", kind)


def test_message_base_declares_empty_slots():
    assert Message.__slots__ == ()


def test_package_exports_every_message_class():
    assert all(hasattr(protocols, name) for name in protocols.__all__)
    exported = [getattr(protocols, name) for name in protocols.__all__]
    assert all(cls.__name__ in protocols.__all__ for cls in REGISTRY.values())
    assert set(REGISTRY.values()) <= {obj for obj in exported if isinstance(obj, type)}
    assert protocols.PROTOCOL_VERSION == (1, 0)


# ---------------------------------------------------------------- constructor validation

INVALID = [
    ("flash.schedule", {"layers": (1, 1)}),
    ("flash.schedule", {"layers": (-1,)}),
    ("flash.schedule", {"step": -1}),
    ("flash.ready", {"io_s": -0.5}),
    ("flash.ready", {"nbytes": -1}),
    ("flash.released", {"slot": -1}),
    ("draft.request", {"top_k": 0}),
    ("draft.request", {"epoch": -1}),
    ("draft.request", {"min_path_p": 1.5}),
    ("draft.request", {"deadline_s": -1.0}),
    ("draft.request", {"deadline_s": float("nan")}),
    ("draft.request", {"deadline_s": float("inf")}),
    ("draft.request", {"threads": -1}),
    ("draft.expansion", {"parents": i32([-1, -1, 0, 4, 2])}),
    ("draft.expansion", {"parents": i32([-2, -1, 0, 0, 2])}),
    ("draft.expansion", {"tokens": i32([1, 2, 3])}),
    ("draft.expansion", {"tokens": i32([1, 2, -3, 4, 5])}),
    ("draft.expansion", {"tokens": np.array([1, 2, 3, 4, 5], dtype=np.int64)}),
    ("draft.expansion", {"draft_probs": np.array([0.5, 1.5, 0, 0, 0], dtype=np.float32)}),
    ("draft.expansion", {"draft_probs": np.array([0.5, np.nan, 0, 0, 0], dtype=np.float32)}),
    ("plan.verify", {"parents": i32([0, 0, 0, 1])}),
    ("plan.verify", {"parents": i32([-1, 0, 3, 1])}),
    ("plan.verify", {"depths": i32([0, 1, 1, 1])}),
    ("plan.verify", {"bucket": 3}),
    ("plan.verify", {"tokens": i32([1, -2, 3, 4])}),
    ("plan.verify", {"exit_layers": (16, 8)}),
    ("plan.verify", {"threads": -1}),
    ("plan.verify", {"tokens": i32([[1, 2, 3, 4]])}),
    ("plan.verify", {"tokens": i32([]), "parents": i32([]), "depths": i32([])}),
    ("verify.exit_hidden", {"node_ids": i32([0, 3, 3])}),
    ("verify.exit_hidden", {"node_ids": i32([-1, 3])}),
    ("prune.mask", {"keep": i32([1, 0, 1, 1])}),
    ("verify.done", {"node_ids": i32([3, 1])}),
    ("verify.done", {"compute_s": float("nan")}),
    ("verify.done", {"io_wait_s": float("inf")}),
    ("accept.commit", {"tokens": (), "accepted_nodes": ()}),
    ("accept.commit", {"tokens": (-1, 2, 3)}),
    ("accept.commit", {"accepted_nodes": (1, 2, 3)}),
    ("accept.commit", {"accepted_nodes": (0, 1)}),
    ("accept.commit", {"finished": False}),
    ("accept.commit", {"finish_reason": None}),
    ("accept.stats", {"n_accepted": 5}),
    ("accept.stats", {"n_pruned": 5}),
    ("accept.stats", {"pass_s": -1.0}),
]


@pytest.mark.parametrize(("kind", "changes"), INVALID)
def test_constructor_rejects_broken_invariants(kind, changes):
    with pytest.raises(ValueError):
        dataclasses.replace(SAMPLES[kind], **changes)


def test_commit_with_empty_tokens_is_rejected():
    with pytest.raises(ValueError, match="at least one token"):
        Commit(session_id=0, step=0, epoch=0, tokens=())
    body = body_of(SAMPLES["accept.commit"]) | {"tokens": [], "accepted_nodes": []}
    with pytest.raises(BadFrame):
        decode(pack_envelope("accept.commit", 1, body))


@pytest.mark.parametrize("changes", [
    {"layers": [1, 2]},               # list in a tuple field
    {"step": np.int64(3)},            # numpy scalar in an int field
    {"step": True},                   # bool in an int field
    {"layers": (1, 2**70)},           # does not fit msgpack
])
def test_encode_rejects_values_that_do_not_fit_their_annotation(changes):
    with pytest.raises(TypeError):
        encode(dataclasses.replace(SAMPLES["flash.schedule"], **changes))


def test_encode_rejects_unregistered_classes():
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Unregistered(Message):
        KIND: ClassVar[str] = "test.unregistered"
        VERSION: ClassVar[int] = 1

    with pytest.raises(TypeError):
        encode(Unregistered())


# ---------------------------------------------------------------- envelope and versioning

def test_unknown_keys_are_ignored():
    sample = SAMPLES["plan.verify"]
    body = body_of(sample) | {"future_field": [1, 2, {"x": None}], b"raw_key": 3,
                              "future_ext": msgpack.ExtType(99, b"\x01")}
    assert_identical(decode(pack_envelope("plan.verify", 1, body)), sample)


def test_missing_optional_keys_take_their_defaults():
    body = body_of(SAMPLES["accept.commit"])
    for key in ("accepted_nodes", "finished", "finish_reason"):
        del body[key]
    msg = decode(pack_envelope("accept.commit", 1, body))
    assert (msg.accepted_nodes, msg.finished, msg.finish_reason) == ((), False, None)
    assert msg.tokens == SAMPLES["accept.commit"].tokens
    body = body_of(SAMPLES["plan.verify"])
    del body["exit_layers"]
    assert decode(pack_envelope("plan.verify", 1, body)).exit_layers == ()


def test_missing_required_key_is_a_bad_frame():
    body = body_of(SAMPLES["flash.ready"])
    del body["nbytes"]
    with pytest.raises(BadFrame, match="nbytes"):
        decode(pack_envelope("flash.ready", 1, body))


def test_newer_version_is_rejected():
    kind = "verify.done"
    data = pack_envelope(kind, REGISTRY[kind].VERSION + 1, body_of(SAMPLES[kind]))
    with pytest.raises(VersionMismatch) as info:
        decode(data)
    assert info.value.code == "version_mismatch"


def test_version_zero_is_a_bad_frame():
    with pytest.raises(BadFrame):
        decode(pack_envelope("verify.done", 0, body_of(SAMPLES["verify.done"])))


def test_unknown_kind_is_rejected():
    with pytest.raises(UnknownMessage) as info:
        decode(pack_envelope("verify.nonexistent", 1, {}))
    assert info.value.code == "unknown_message"


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x93", msgpack.packb([1, 2]), msgpack.packb(["accept.commit", 1, []]),
    msgpack.packb(["accept.commit", "1", {}]), msgpack.packb({"kind": "accept.commit"}),
    msgpack.packb(["accept.commit", 1, {1: 2}], strict_types=False),
])
def test_malformed_envelopes_are_bad_frames(data):
    with pytest.raises(BadFrame) as info:
        decode(data)
    assert info.value.code == "bad_frame"


def test_trailing_bytes_are_a_bad_frame():
    with pytest.raises(BadFrame):
        decode(encode(SAMPLES["flash.released"]) + b"\x00")


def test_oversize_input_is_refused_before_parsing():
    data = encode(SAMPLES["flash.released"])
    with pytest.raises(FrameTooLarge) as info:
        decode(data, max_bytes=len(data) - 1)
    assert info.value.code == "frame_too_large"
    assert decode(bytearray(data), max_bytes=len(data)) == SAMPLES["flash.released"]


def test_decode_refuses_non_bytes():
    with pytest.raises(TypeError):
        decode("not bytes")


def test_error_codes_are_stable():
    errors = (BadFrame, FrameTooLarge, UnknownMessage, VersionMismatch)
    assert [cls.code for cls in errors] == [
        "bad_frame", "frame_too_large", "unknown_message", "version_mismatch"]
    assert all(issubclass(cls, ProtocolError) for cls in errors)


# ---------------------------------------------------------------- hostile input

def assert_decodes_or_protocol_error(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError as exc:
        assert exc.code in {"bad_frame", "frame_too_large", "unknown_message", "version_mismatch"}
    else:
        assert type(msg) in REGISTRY.values()


@given(st.binary(max_size=512))
def test_garbage_bytes_raise_only_protocol_errors(data):
    assert_decodes_or_protocol_error(data)


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=6) | st.binary(max_size=16)
    | st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=16))
    | st.builds(msgpack.Timestamp, st.integers(0, 2**34), st.integers(0, 999_999_999)),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    | st.builds(lambda v: msgpack.ExtType(NDARRAY_EXT, msgpack.packb(v, use_bin_type=True)),
                st.lists(inner, min_size=3, max_size=3)),
    max_leaves=10)


@given(kind=st.sampled_from(sorted(REGISTRY)), data=st.data())
def test_hostile_bodies_raise_only_protocol_errors(kind, data):
    body = body_of(SAMPLES[kind])
    for key in data.draw(st.lists(st.sampled_from(sorted(body)), max_size=3)):
        if data.draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = data.draw(MSGPACK_VALUES)
    version = data.draw(st.integers(-2, 3) | st.just(REGISTRY[kind].VERSION))
    assert_decodes_or_protocol_error(pack_envelope(kind, version, body))


@given(kind=st.sampled_from(sorted(REGISTRY)), data=st.data())
def test_corrupted_golden_bytes_raise_only_protocol_errors(kind, data):
    wire = bytearray(encode(SAMPLES[kind]))
    for _ in range(data.draw(st.integers(1, 4))):
        wire[data.draw(st.integers(0, len(wire) - 1))] = data.draw(st.integers(0, 255))
    assert_decodes_or_protocol_error(bytes(wire[:data.draw(st.integers(0, len(wire)))]))


# ---------------------------------------------------------------- ndarray codec

DTYPES = sorted(WIRE_DTYPES) + ["=i4", ">i4", ">f8", ">u2", ">c8", "?", "=f2"]


@st.composite
def any_arrays(draw) -> np.ndarray:
    arr = draw(hnp.arrays(st.sampled_from(DTYPES).map(np.dtype),
                          hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
    layout = draw(st.sampled_from(["c", "transposed", "strided"]))
    if layout == "transposed":
        return arr.T
    if layout == "strided" and arr.ndim:
        return arr[..., ::2]
    return arr


@given(any_arrays())
def test_ndarray_round_trip_over_dtypes_and_shapes(arr):
    ext = pack_ndarray(arr)
    assert ext.code == NDARRAY_EXT
    back = unpack_ndarray(ext.data)
    expected = arr.astype(arr.dtype.newbyteorder("<"))
    assert back.dtype == expected.dtype and back.dtype.str in WIRE_DTYPES
    assert back.shape == arr.shape
    assert back.tobytes() == expected.tobytes()  # bitwise, so NaN payloads count too
    assert not back.flags.writeable


def test_ndarray_payload_is_dtype_shape_raw():
    arr = np.arange(6, dtype=">f4").reshape(2, 3)[:, ::2]
    dtype, shape, raw = msgpack.unpackb(pack_ndarray(arr).data, raw=False)
    assert (dtype, shape) == ("<f4", [2, 2])
    assert raw == np.array([[0, 2], [3, 5]], dtype="<f4").tobytes()


@pytest.mark.parametrize("arr", [
    np.array(3.5, dtype=np.float32), np.array(True), np.zeros((0,), np.int32),
    np.zeros((3, 0, 2), np.float64), np.asfortranarray(np.arange(12).reshape(3, 4)),
])
def test_ndarray_edge_shapes_round_trip(arr):
    back = unpack_ndarray(pack_ndarray(arr).data)
    assert back.shape == arr.shape and back.dtype == arr.dtype
    assert np.array_equal(back, arr)


@pytest.mark.parametrize("arr", [
    np.array([1, "a"], dtype=object), np.array(["ab"]), np.array([b"ab"]),
    np.array(["2024-01-01"], dtype="datetime64[D]"), np.zeros(2, dtype=np.longdouble),
    np.zeros(2, dtype=[("a", "<i4")]), [1, 2, 3],
])
def test_ndarray_rejects_untransportable_inputs(arr):
    with pytest.raises(TypeError):
        pack_ndarray(arr)


def test_ndarray_rejects_payloads_that_are_not_msgpack():
    with pytest.raises(ValueError):
        unpack_ndarray(b"\xc1")


@pytest.mark.parametrize("payload", [
    ["<f4", [2], b"\x00" * 4], ["|O", [1], b"\x00" * 8], [">f4", [1], b"\x00" * 4],
    ["<f4", [-1], b""], ["<f4", [True], b"\x00" * 4], ["<f4", [0] * 40, b""],
    ["<f4", [0, 2**62, 2**62], b""], ["<f4", 1, b"\x00" * 4], ["<f4", [1], "text"], [1, 2],
])
def test_ndarray_rejects_malformed_payloads(payload):
    data = msgpack.packb(payload, use_bin_type=True)
    with pytest.raises(ValueError):
        unpack_ndarray(data)
    body = body_of(SAMPLES["prune.mask"]) | {"keep": msgpack.ExtType(NDARRAY_EXT, data)}
    with pytest.raises(BadFrame):
        decode(pack_envelope("prune.mask", 1, body))


def test_decoded_message_arrays_are_read_only():
    back = decode(encode(SAMPLES["plan.verify"]))
    assert not back.tokens.flags.writeable


# ---------------------------------------------------------------- generic field kinds
# Pipeline messages use only ints, floats, tuples and arrays; these test-only classes live in
# a private registry so they never leak into REGISTRY.

LOCAL: dict[str, type[Message]] = {}


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Mode(enum.StrEnum):
    GREEDY = "greedy"
    SAMPLE = "sample"


@register(registry=LOCAL)
@dataclass(frozen=True, slots=True, kw_only=True)
class Inner(Message):
    KIND: ClassVar[str] = "test.inner"
    VERSION: ClassVar[int] = 1
    level: Level
    values: np.ndarray


@register(registry=LOCAL)
@dataclass(frozen=True, slots=True, kw_only=True)
class Everything(Message):
    KIND: ClassVar[str] = "test.everything"
    VERSION: ClassVar[int] = 1
    mode: Mode
    name: str
    blob: bytes
    ratio: float
    flag: bool
    pair: tuple[int, str]
    inner: Inner
    inners: tuple[Inner, ...]
    maybe_inner: Inner | None = None
    maybe: int | None = None
    levels: tuple[Level, ...] = ()


def nan_free_arrays(dtype: str) -> st.SearchStrategy[np.ndarray]:
    # NaN != NaN, so a message holding one never equals itself; bitwise NaN handling is
    # covered by the ndarray round trip above.
    kw = {"allow_nan": False} if np.dtype(dtype).kind in "fc" else {}
    return hnp.arrays(dtype, st.integers(0, 4), elements=hnp.from_dtype(np.dtype(dtype), **kw))


INNERS = st.builds(Inner, level=st.sampled_from(Level),
                   values=st.sampled_from(sorted(WIRE_DTYPES)).flatmap(nan_free_arrays))
EVERYTHING = st.builds(
    Everything, mode=st.sampled_from(Mode), name=st.text(max_size=8), blob=st.binary(max_size=8),
    ratio=st.floats(allow_nan=False), flag=st.booleans(),
    pair=st.tuples(st.integers(-(2**63), 2**64 - 1), st.text(max_size=4)), inner=INNERS,
    inners=st.lists(INNERS, max_size=3).map(tuple), maybe_inner=st.none() | INNERS,
    maybe=st.none() | st.integers(-(2**63), 2**64 - 1),
    levels=st.lists(st.sampled_from(Level), max_size=3).map(tuple))


@given(EVERYTHING)
def test_enums_nested_messages_and_optionals_round_trip(msg):
    back = decode(encode(msg), registry=LOCAL)
    assert_identical(back, msg)
    assert isinstance(back.inner.level, Level) and isinstance(back.mode, Mode)
    assert back == msg


SIMPLE = Everything(mode=Mode.GREEDY, name="", blob=b"", ratio=0.0, flag=False, pair=(1, "a"),
                    inner=Inner(level=Level.LOW, values=i32([1])), inners=())


def test_nested_message_of_unknown_kind_is_a_protocol_error():
    body = msgpack.unpackb(encode(SIMPLE), raw=False)[2] | {"inner": ["test.nope", 1, {}]}
    with pytest.raises(UnknownMessage):
        decode(pack_envelope("test.everything", 1, body), registry=LOCAL)


@pytest.mark.parametrize("changes", [
    {"mode": "beam"},                          # not an enum value
    {"maybe": "seven"},                        # matches no member of int | None
    {"pair": [1]},                             # fixed-length tuple of the wrong length
    {"pair": ["1", "a"]},                      # wrong item type
    {"inner": ["test.renamed", 3, {"count": 1, "unit": "x"}]},  # nested message of another kind
    {"inners": [["test.inner", 1, {"level": 1}]]},              # nested message missing a field
    {"ratio": True}, {"flag": 1}, {"blob": "text"}, {"name": b"bytes"},
])
def test_fields_that_do_not_fit_their_annotation_are_bad_frames(changes):
    body = msgpack.unpackb(encode(SIMPLE), raw=False)[2] | changes
    with pytest.raises(BadFrame):
        decode(pack_envelope("test.everything", 1, body), registry=LOCAL)


def test_int_values_are_accepted_in_float_fields():
    body = msgpack.unpackb(encode(SIMPLE), raw=False)[2] | {"ratio": 2}
    back = decode(pack_envelope("test.everything", 1, body), registry=LOCAL)
    assert back.ratio == 2.0 and type(back.ratio) is float


def test_messages_of_different_classes_are_never_equal():
    assert SAMPLES["flash.released"] != SAMPLES["flash.schedule"]
    assert SAMPLES["flash.released"] != "flash.released"


def test_array_fields_compare_by_dtype_and_value():
    sample = SAMPLES["prune.mask"]
    assert sample == dataclasses.replace(sample, keep=sample.keep.copy())
    assert sample != dataclasses.replace(sample, keep=~sample.keep)
    assert Inner(level=Level.LOW, values=i32([1, 2])) != Inner(
        level=Level.LOW, values=np.array([1, 2], dtype=np.int64))
    assert Inner(level=Level.LOW, values=i32([1, 2])) != Inner(
        level=Level.LOW, values=i32([[1, 2]]))


@register(registry=LOCAL)
@dataclass(frozen=True, slots=True, kw_only=True)
class Renamed(Message):
    KIND: ClassVar[str] = "test.renamed"
    VERSION: ClassVar[int] = 3
    count: int
    unit: str

    @staticmethod
    def upgrade_from_1(body: dict) -> dict:
        body["count"] = body.pop("n")
        return body

    @staticmethod
    def upgrade_from_2(body: dict) -> dict:
        return body | {"unit": "tokens"}


@register(registry=LOCAL)
@dataclass(frozen=True, slots=True, kw_only=True)
class NoUpgrade(Message):
    KIND: ClassVar[str] = "test.no_upgrade"
    VERSION: ClassVar[int] = 2


def test_older_versions_are_upgraded_through_hooks():
    assert decode(pack_envelope("test.renamed", 1, {"n": 5}), registry=LOCAL) == Renamed(
        count=5, unit="tokens")
    assert decode(pack_envelope("test.renamed", 2, {"count": 6}), registry=LOCAL) == Renamed(
        count=6, unit="tokens")
    with pytest.raises(BadFrame):  # a v1 body the hook cannot read
        decode(pack_envelope("test.renamed", 1, {"count": 5}), registry=LOCAL)
    with pytest.raises(VersionMismatch):
        decode(pack_envelope("test.no_upgrade", 1, {}), registry=LOCAL)
    assert decode(pack_envelope("test.no_upgrade", 2, {}), registry=LOCAL) == NoUpgrade()


# ---------------------------------------------------------------- registration rules

def test_duplicate_kind_is_an_import_time_error():
    with pytest.raises(ValueError, match="duplicate KIND"):
        @register
        @dataclass(frozen=True, slots=True, kw_only=True)
        class Impostor(Message):
            KIND: ClassVar[str] = "accept.commit"
            VERSION: ClassVar[int] = 1
    assert REGISTRY["accept.commit"] is Commit


def _declare(kind="test.ok", version=1, frozen=True, slots=True, kw_only=True, annotation=int):
    cls = type("Declared", (Message,), {
        "__annotations__": {"KIND": ClassVar[str], "VERSION": ClassVar[int], "x": annotation},
        "KIND": kind, "VERSION": version, "__module__": __name__})
    return dataclass(frozen=frozen, slots=slots, kw_only=kw_only)(cls)


@pytest.mark.parametrize(("changes", "error"), [
    ({"frozen": False}, TypeError), ({"slots": False}, TypeError), ({"kw_only": False}, TypeError),
    ({"annotation": dict[str, int]}, TypeError), ({"annotation": list[int]}, TypeError),
    ({"kind": "NoDots"}, ValueError), ({"kind": "Accept.Commit"}, ValueError),
    ({"version": 0}, ValueError), ({"version": True}, ValueError),
])
def test_register_refuses_malformed_classes(changes, error):
    with pytest.raises(error):
        register(_declare(**changes), registry={})
    register(_declare(), registry={})  # the unchanged declaration is fine


class NotADataclass(Message):
    KIND = "test.not_a_dataclass"
    VERSION = 1


@pytest.mark.parametrize("cls", [int, NotADataclass])
def test_register_refuses_non_messages(cls):
    with pytest.raises(TypeError):
        register(cls, registry={})


def test_a_v6_draft_request_becomes_one_hypothesis():
    """v6 assumed one outcome (a path, then the draft's top choice) and confirmed it with a flag."""
    old = decode((GOLDEN_DIR / "draft.request.v6.msgpack").read_bytes())
    assert old.hypotheses == (((198, 220), (), old.max_nodes, old.max_depth, 0),)
    assert old.confirmed_hypothesis == 0
    plain = decode(pack_envelope("draft.request", 6, {"session_id": 1, "step": 2, "epoch": 0, "root_token": 5,
                                                      "position": 9, "max_nodes": 4, "max_depth": 4, "top_k": 1}))
    assert plain.hypotheses == () and plain.confirmed_hypothesis == -1


def test_a_v7_draft_request_assumes_the_drafts_best_token_for_every_hypothesis():
    """v7's hypotheses had no rank: each assumed the draft's best token after its path (rank 0)."""
    old = decode((GOLDEN_DIR / "draft.request.v7.msgpack").read_bytes())
    assert old.hypotheses == (((198, 220), (), 16, 8, 0), ((198,), (220, 262), 6, 6, 0))
    with pytest.raises(ValueError, match="ranks"):
        DraftRequest(session_id=1, step=2, epoch=0, root_token=5, position=9, max_nodes=4, max_depth=4, top_k=1,
                     hypotheses=(((), (), 1, 1, -1),))


def test_an_extend_request_carries_no_commit():
    base = dict(session_id=1, step=2, epoch=0, root_token=5, position=9, max_nodes=4, max_depth=4, top_k=1)
    assert DraftRequest(**base, extend=True, levels=1).extend
    for bad in ({"committed": (3,)}, {"reset": True}, {"hypotheses": (((), (), 1, 1, 0),)}):
        with pytest.raises(ValueError, match="extend"):
            DraftRequest(**base, extend=True, **bad)
