"""Fuzz: arbitrary bytes and malformed messages never crash or wedge the daemon.

Each example runs a fresh in-process daemon under MockClock (virtual time, so
stall timeouts cost nothing) and ends by checking that a normal generate still
succeeds and every buffer is back in the pool. ``run_autojump``'s real-time
watchdog fails an example that keeps the loop busy instead of letting it hang.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import msgpack
import trio
from hypothesis import HealthCheck, event, example, given, note, settings
from hypothesis import strategies as st

from fake_backend import (FakeBackend, RawConnection, expected_tokens, params, run_autojump,
                          running_daemon)
from protocols.rpc import METHODS, ErrorCode

CODES = {c.value for c in ErrorCode} - {"internal"}
SENTINEL = 4_000_000_000
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # examples: the profile
EXAMPLE_WATCHDOG_S = 10.0  # real seconds; an example takes milliseconds unless something spins


def with_daemon(body, **config) -> None:
    async def main() -> None:
        with tempfile.TemporaryDirectory(prefix="lever-fuzz-") as d:
            sock = Path(d) / "d.sock"
            async with running_daemon(sock, FakeBackend(), stall_timeout_s=5.0, max_tokens=8,
                                      max_message_bytes=4096, **config) as daemon:
                await body(daemon, sock)
                await check_still_serving(daemon, sock)

    run_autojump(main, watchdog_s=EXAMPLE_WATCHDOG_S)


async def check_still_serving(daemon, sock: Path) -> None:
    conn = await RawConnection.open(sock)
    with trio.fail_after(3600):
        notes, reply = await conn.request(1, "generate", {"prompt": "after the fuzz", "max_tokens": 5})
    assert reply[2] is None, reply
    assert reply[3]["token_ids"] == expected_tokens(params("after the fuzz", max_tokens=5))[0]
    assert "".join(n[2][1] for n in notes) == reply[3]["text"]
    assert daemon.backend.pool_stats()["buffers_free"] == daemon.backend.pool.total
    assert daemon.stats()["internal_errors"] == 0
    await conn.aclose()


def check_reply(msg) -> None:
    assert isinstance(msg, list) and msg[0] in (1, 2), msg
    if msg[0] == 1 and msg[2] is not None:
        assert msg[2]["code"] in CODES, msg
        assert isinstance(msg[2]["message"], str) and isinstance(msg[2]["retryable"], bool)


@FUZZ
@given(data=st.binary(max_size=6000), half_close=st.booleans())
@example(data=msgpack.packb([0, 1, "health", [{}]])[:3], half_close=True)  # EOF mid-message
@example(data=msgpack.packb([0, 1, "health", [{}]])[:3], half_close=False)  # stall deadline
@example(data=b"\xc0" * 6000, half_close=True)  # 6000 messages in one read, then EOF
def test_arbitrary_bytes_never_crash_or_wedge_the_daemon(data, half_close):
    async def body(daemon, sock):
        conn = await RawConnection.open(sock)
        await conn.send_bytes(data)
        if half_close:
            await conn.stream.send_eof()
        replies = []
        with trio.move_on_after(60):  # virtual seconds: past the 5 s stall timeout
            while (msg := await conn.receive()) is not None:
                replies.append(msg)
        note(f"replies: {replies!r:.500}")
        event(f"closed by the daemon: {bool(replies) and replies[-1][1] is None}")
        for msg in replies:
            check_reply(msg)
        await conn.aclose()

    with_daemon(body)


@FUZZ
@given(data=st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=8),
       request=st.sampled_from([b"", msgpack.packb([0, 9, "health", []])]))
def test_valid_prefix_then_garbage_in_random_pieces(data, request):
    async def body(daemon, sock):
        conn = await RawConnection.open(sock)
        await conn.send_bytes(request)
        for piece in data:
            try:
                await conn.send_bytes(piece)
            except trio.BrokenResourceError:
                break  # the daemon already closed it (parse error): fine
            await trio.sleep(0.5)
        with trio.move_on_after(60):
            while (msg := await conn.receive()) is not None:
                check_reply(msg)
        await conn.aclose()

    with_daemon(body)


values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4),
    max_leaves=10)
param_names = st.sampled_from(["prompt", "messages", "max_tokens", "temperature", "top_p", "seed",
                               "stop", "mode", "request_id", "client_name", "protocol"])
plausible = st.one_of(values, st.integers(0, 10), st.text(min_size=1, max_size=10),
                      st.lists(st.text(max_size=3), max_size=3), st.just([1, 0]),
                      st.sampled_from(["flash-ar", "flash-chain:x", "flash-chain:2"]))
param_maps = st.dictionaries(param_names | st.text(max_size=6), plausible, max_size=5)
rpc_shaped = st.tuples(
    st.sampled_from([0, 0, 0, 1, 2, 3, -1]),
    st.integers(-1, 2**33).filter(lambda i: i != SENTINEL) | values,
    st.sampled_from([*METHODS, "nope", b"health"]) | values,
    st.lists(param_maps, max_size=2) | values,
).map(list)
near_valid = st.builds(  # a valid request with up to two parameters changed or added
    lambda msgid, method, extra: [0, msgid, method, [{**BASE_PARAMS[method], **extra}]],
    st.integers(0, 100), st.sampled_from(METHODS), st.dictionaries(param_names, plausible, max_size=2))
BASE_PARAMS = {"generate": {"prompt": "fuzz", "max_tokens": 3}, "cancel": {"request_id": 0},
               "stats": {}, "hello": {}, "health": {}, "models": {}}
near_valid_generate = st.builds(
    lambda msgid, extra: [0, msgid, "generate", [{**BASE_PARAMS["generate"], **extra}]],
    st.integers(0, 100),
    st.dictionaries(st.sampled_from(["prompt", "max_tokens", "seed", "stop", "mode", "temperature"]),
                    plausible, max_size=1))
messages = st.one_of(values, rpc_shaped, rpc_shaped.map(lambda m: m[:3]), st.lists(values, max_size=5),
                     near_valid, near_valid_generate)


@FUZZ
@given(message=messages)
def test_malformed_messages_get_stable_errors_and_the_connection_stays_open(message):
    async def body(daemon, sock):
        conn = await RawConnection.open(sock)
        await conn.send(message)
        await conn.send([0, SENTINEL, "health", []])
        fuzz_id = message[1] if isinstance(message, list) and len(message) > 1 else None
        answered = 0
        with trio.fail_after(3600):
            while True:
                msg = await conn.receive()
                assert msg is not None, "the daemon closed the connection"
                check_reply(msg)
                if msg[0] == 1 and msg[1] == SENTINEL:
                    assert msg[3]["status"] == "ok"
                    break
                if msg[0] == 1:
                    assert msg[1] in (fuzz_id, None)
                    answered += 1
        assert answered <= 1
        event(f"generate accepted: {daemon.stats()['requests']['accepted'] > 0}")
        await conn.aclose()  # a generate it started is cancelled by the disconnect

    with_daemon(body)
