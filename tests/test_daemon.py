"""The daemon in-process: real Unix sockets in tmp_path, FakeBackend, MockClock."""
from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys

import msgpack
import pytest
import trio
import trio.testing

from fake_backend import (FakeBackend, RawConnection, expected_tokens, params, running_daemon,
                          trio_autojump)
from lever_actors.backend import GenerateOutcome
from lever_actors.client import DaemonAlreadyRunning, read_status
from lever_actors.daemon import ServeConfig, serve
from lever_actors.errors import ConfigError
from lever_actors.memory import peak_rss
from protocols.rpc import ErrorCode


def check_stream(notes: list, response: list, msgid: int) -> dict:
    """The token notifications of request ``msgid`` add up to its result, in order."""
    assert response[0] == 1 and response[1] == msgid and response[2] is None, response
    result = response[3]
    tokens = [n for n in notes if n[:2] == [2, "token"]]
    assert all(n[2][0] == msgid for n in tokens)
    assert "".join(n[2][1] for n in tokens) == result["text"]
    assert [t for n in tokens for t in n[2][2]] == result["token_ids"]
    assert all(n[2][1] or n[2][2] for n in tokens)  # no empty chunks
    return result

async def refused_then_closed(conn, code: str) -> list:
    """The daemon answers ``conn`` with error ``code`` and hangs up; returns the error reply."""
    reply = await conn.receive()
    assert reply[2]["code"] == code
    assert await conn.receive() is None
    return reply


async def assert_serving(path) -> None:
    """A new connection to ``path`` is answered: the daemon outlived whatever came before."""
    conn = await RawConnection.open(path)
    _, reply = await conn.request(1, "health")
    assert reply[3]["status"] == "ok"



@trio_autojump
async def test_streamed_chunks_add_up_to_the_final_result(tmp_path):
    async with running_daemon(tmp_path / "d.sock") as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        notes, response = await conn.request(7, "generate", {"prompt": "def add(a, b):", "max_tokens": 40})
        result = check_stream(notes, response, 7)
        ids, text, reason = expected_tokens(params("def add(a, b):", max_tokens=40))
        assert (result["token_ids"], result["text"], result["finish_reason"]) == (ids, text, reason)
        assert len(notes) > 10  # streamed in many chunks, not one
        assert result["request_id"] == 7 and result["prompt_tokens"] == 4
        assert result["stats"]["n_tokens"] == 40 and result["stats"]["passes"] == len(notes)
        assert set(result["timings"]) == {"queue_s", "first_token_s", "generate_s", "total_s"}
        assert daemon.backend.pool_stats()["buffers_free"] == 4


@trio_autojump
async def test_the_daemons_own_peak_is_in_its_answers_and_left_out_where_proc_does_not_say(tmp_path, monkeypatch):
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        _, response = await conn.request(1, "generate", {"prompt": "def add(a, b):", "max_tokens": 3})
        peak = response[3]["stats"]["peak_rss_bytes"]
        _, stats = await conn.request(2, "stats")
        # the daemon is this process (VmHWM readings a moment apart may differ by some pages: the kernel
        # folds each thread's RSS count in lazily)
        slack = 2**20
        assert 0 < peak <= stats[3]["daemon"]["peak_rss_bytes"] + slack <= peak_rss() + 2 * slack

        def no_proc(pid="self"):
            raise FileNotFoundError(f"/proc/{pid}/status")

        monkeypatch.setattr("lever_actors.memory.peak_rss", no_proc)
        _, response = await conn.request(3, "generate", {"prompt": "def add(a, b):", "max_tokens": 3})
        assert "peak_rss_bytes" not in response[3]["stats"] and response[3]["stats"]["n_tokens"] == 3
        _, stats = await conn.request(4, "stats")
        assert stats[3]["daemon"]["peak_rss_bytes"] is None


@trio_autojump
async def test_chat_messages_seed_and_stop_strings_reach_the_backend(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        plain = params(None, messages=messages, max_tokens=12, seed=5)
        _, full_text, _ = expected_tokens(plain)
        stop = full_text.split(" ")[4] + " "  # a word that occurs in the output
        notes, response = await conn.request(1, "generate", {
            "messages": messages, "max_tokens": 12, "seed": 5, "stop": [stop]})
        result = check_stream(notes, response, 1)
        ids, text, reason = expected_tokens(params(None, messages=messages, max_tokens=12, seed=5,
                                                   stop=(stop,)))
        assert reason == "stop" and result["finish_reason"] == "stop"
        assert result["text"] == text and stop not in text and len(ids) < 12


@trio_autojump
async def test_cancel_stops_the_running_request_and_frees_its_buffers(tmp_path):
    async with running_daemon(tmp_path / "d.sock") as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send([0, 3, "generate", [{"prompt": "long one", "max_tokens": 2000}]])
        first = await conn.receive()
        assert first[:2] == [2, "token"]
        notes, cancel_reply = await conn.request(4, "cancel", {"request_id": 3})
        assert cancel_reply[3] == {"request_id": 3, "cancelled": True, "state": "running"}
        while True:
            msg = await conn.receive()
            if msg[0] == 1:
                break
            notes.append(msg)
        result = check_stream([first, *notes], msg, 3)
        assert result["finish_reason"] == "cancelled"
        assert 0 < len(result["token_ids"]) < 2000
        assert trio.current_time() < 1.0  # prompt: 2000 tokens would take 10 s of fake time
        assert daemon.backend.pool_stats() == {"buffers_total": 4, "buffers_free": 4}
        _, stats = await conn.request(5, "stats", {"request_id": 3})
        assert stats[3]["request"]["state"] == "cancelled"
        assert stats[3]["daemon"]["requests"]["cancelled"] == 1
        notes, response = await conn.request(6, "generate", {"prompt": "next", "max_tokens": 5})
        assert check_stream(notes, response, 6)["finish_reason"] == "length"


@trio_autojump
async def test_cancel_of_a_queued_request_answers_it_at_once(tmp_path):
    async with running_daemon(tmp_path / "d.sock") as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send([0, 1, "generate", [{"prompt": "first", "max_tokens": 30}]])
        await conn.send([0, 2, "generate", [{"prompt": "second", "max_tokens": 30}]])
        await conn.send([0, 3, "cancel", [{"request_id": 2}]])
        replies, notes = {}, []
        while len(replies) < 3:
            msg = await conn.receive()
            if msg[0] == 1:
                replies[msg[1]] = msg
            else:
                notes.append(msg)
        assert replies[3][3] == {"request_id": 2, "cancelled": True, "state": "queued"}
        assert replies[2][3]["finish_reason"] == "cancelled" and replies[2][3]["text"] == ""
        assert check_stream(notes, replies[1], 1)["finish_reason"] == "length"
        assert daemon.backend.generations == 1


@trio_autojump
async def test_cancel_of_finished_or_unknown_request_is_not_an_error(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.request(1, "generate", {"prompt": "x", "max_tokens": 2})
        _, done = await conn.request(2, "cancel", {"request_id": 1})
        _, unknown = await conn.request(3, "cancel", {"request_id": 99})
        assert done[3] == {"request_id": 1, "cancelled": False, "state": "done"}
        assert unknown[3] == {"request_id": 99, "cancelled": False, "state": "unknown"}


@trio_autojump
async def test_disconnect_cancels_only_that_clients_work(tmp_path):
    async with running_daemon(tmp_path / "d.sock") as daemon:
        a = await RawConnection.open(tmp_path / "d.sock")
        b = await RawConnection.open(tmp_path / "d.sock")
        await a.send([0, 1, "generate", [{"prompt": "a", "max_tokens": 2000}]])
        assert (await a.receive())[:2] == [2, "token"]
        t_b = trio.current_time()
        await b.send([0, 1, "generate", [{"prompt": "b", "max_tokens": 20}]])
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.health()["queue_length"] == 1
        await a.aclose()
        notes = []
        while (msg := await b.receive())[0] != 1:
            notes.append(msg)
        result = check_stream(notes, msg, 1)
        assert result["token_ids"] == expected_tokens(params("b", max_tokens=20))[0]
        assert trio.current_time() - t_b < 1.0  # not behind a's 10 s of work
        stats = daemon.stats()
        assert stats["requests"]["cancelled"] == 1 and stats["requests"]["completed"] == 1
        assert stats["pool"]["buffers_free"] == 4


@trio_autojump
async def test_disconnect_during_a_long_prefill_frees_the_engine_at_once(tmp_path):
    backend = FakeBackend(prefill_s=100.0)
    async with running_daemon(tmp_path / "d.sock", backend) as daemon:
        a = await RawConnection.open(tmp_path / "d.sock")
        await a.send([0, 1, "generate", [{"prompt": "a", "max_tokens": 5}]])
        await trio.sleep(1.0)  # a is in its prefill, nothing emitted yet
        await a.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert daemon.health()["running"] is False and daemon.stats()["requests"]["cancelled"] == 1
        assert trio.current_time() < 2.0 and backend.pool_stats()["buffers_free"] == 4


@trio_autojump
async def test_concurrent_clients_are_served_in_arrival_order(tmp_path):
    async with running_daemon(tmp_path / "d.sock") as daemon:
        conns = [await RawConnection.open(tmp_path / "d.sock") for _ in range(6)]
        for i, conn in enumerate(conns):
            await conn.send([0, 100 + i, "generate", [{"prompt": f"client {i}", "max_tokens": 8}]])
            await trio.testing.wait_all_tasks_blocked()
        finished = []

        async def drain(i: int, conn: RawConnection) -> None:
            notes = []
            while (msg := await conn.receive())[0] != 1:
                notes.append(msg)
            result = check_stream(notes, msg, 100 + i)
            assert result["token_ids"] == expected_tokens(params(f"client {i}", max_tokens=8))[0]
            finished.append(i)

        async with trio.open_nursery() as nursery:
            for i, conn in enumerate(conns):
                nursery.start_soon(drain, i, conn)
        assert finished == list(range(6))
        assert daemon.stats()["requests"]["completed"] == 6


@trio_autojump
async def test_full_queue_answers_busy_and_the_rest_complete(tmp_path):
    async with running_daemon(tmp_path / "d.sock", queue_depth=2) as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send([0, 1, "generate", [{"prompt": "p1", "max_tokens": 10}]])
        assert (await conn.receive())[:2] == [2, "token"]  # 1 runs; 2 and 3 wait; 4 and 5 do not fit
        await conn.send_bytes(b"".join(msgpack.packb([0, i, "generate", [{"prompt": f"p{i}", "max_tokens": 10}]])
                                       for i in range(2, 6)))
        replies = {}
        while len(replies) < 5:
            msg = await conn.receive()
            if msg[0] == 1:
                replies[msg[1]] = msg
        busy = [m for m in replies.values() if m[2] is not None]
        assert sorted(m[1] for m in busy) == [4, 5]
        assert all(m[2]["code"] == "busy" and m[2]["retryable"] is True for m in busy)
        assert all(replies[i][3]["finish_reason"] == "length" for i in (1, 2, 3))
        assert daemon.stats()["requests"]["rejected_busy"] == 2


BAD_REQUESTS = [
    # (message, code, msgid in reply, words the error message must contain)
    ("just a string", "invalid_request", None, "array"),
    ([0, 1, "hello"], "invalid_request", None, "4 elements"),
    ([3, 1, "hello", []], "invalid_request", None, "type"),
    ([0, -1, "hello", []], "invalid_request", None, "msgid"),
    ([0, 2**32, "hello", []], "invalid_request", None, "msgid"),
    ([0, 1, 7, []], "invalid_request", 1, "method"),
    ([0, 1, "hello", {"a": 1}], "invalid_request", 1, "params"),
    ([0, 1, "nope", []], "method_not_found", 1, "nope"),
    ([0, 1, "generate", [1, 2]], "invalid_params", 1, "one map"),
    ([0, 1, "generate", [{}]], "invalid_params", 1, "prompt"),
    ([0, 1, "generate", [{"prompt": "a", "messages": []}]], "invalid_params", 1, "exactly one"),
    ([0, 1, "generate", [{"prompt": ""}]], "invalid_params", 1, "prompt"),
    ([0, 1, "generate", [{"prompt": 5}]], "invalid_params", 1, "prompt"),
    ([0, 1, "generate", [{"prompt": "a", "max_tokens": "5"}]], "invalid_params", 1, "max_tokens"),
    ([0, 1, "generate", [{"prompt": "a", "max_tokens": 0}]], "invalid_params", 1, "max_tokens"),
    ([0, 1, "generate", [{"prompt": "a", "cache_prompt": 1}]], "invalid_params", 1, "cache_prompt"),
    ([0, 1, "generate", [{"prompt": "a", "max_tokens": True}]], "invalid_params", 1, "max_tokens"),
    ([0, 1, "generate", [{"prompt": "a", "max_tokens": 10**6}]], "invalid_params", 1, "max_tokens"),
    ([0, 1, "generate", [{"prompt": "a", "temperature": float("nan")}]], "invalid_params", 1, "temperature"),
    ([0, 1, "generate", [{"prompt": "a", "temperature": -1}]], "invalid_params", 1, "temperature"),
    ([0, 1, "generate", [{"prompt": "a", "top_p": 0}]], "invalid_params", 1, "top_p"),
    ([0, 1, "generate", [{"prompt": "a", "seed": -1}]], "invalid_params", 1, "seed"),
    ([0, 1, "generate", [{"prompt": "a", "seed": 1.5}]], "invalid_params", 1, "seed"),
    ([0, 1, "generate", [{"prompt": "a", "stop": "x"}]], "invalid_params", 1, "stop"),
    ([0, 1, "generate", [{"prompt": "a", "stop": ["x"] * 17}]], "invalid_params", 1, "stop"),
    ([0, 1, "generate", [{"prompt": "a", "stop": [""]}]], "invalid_params", 1, "stop[0]"),
    ([0, 1, "generate", [{"prompt": "a", "mode": "warp"}]], "invalid_params", 1, "mode"),
    ([0, 1, "generate", [{"prompt": "a", "mode": "flash-chain:x"}]], "invalid_params", 1, "integer draft"),
    ([0, 1, "generate", [{"prompt": "a", "max_token": 5}]], "invalid_params", 1, "max_token"),
    ([0, 1, "generate", [{"messages": [{"role": "user"}]}]], "invalid_params", 1, "messages[0]"),
    ([0, 1, "generate", [{"messages": [{"role": "", "content": "x"}]}]], "invalid_params", 1, "role"),
    ([0, 1, "generate", [{"messages": [{"role": "tool", "content": "x"}]}]], "invalid_params", 1, "'tool'"),
    ([0, 1, "cancel", [{}]], "invalid_params", 1, "request_id"),
    ([0, 1, "cancel", [{"request_id": "3"}]], "invalid_params", 1, "request_id"),
    ([0, 1, "stats", [{"request_id": 12345}]], "invalid_params", 1, "12345"),
    ([0, 1, "health", [{"verbose": True}]], "invalid_params", 1, "verbose"),
    ([0, 1, "hello", [{"protocol": [2, 0]}]], "invalid_params", 1, "protocol major 2"),
]


@pytest.mark.parametrize("message, code, msgid, words", BAD_REQUESTS)
@trio_autojump
async def test_bad_request_gets_a_stable_error_and_the_connection_stays_open(
        tmp_path, message, code, msgid, words):
    async with running_daemon(tmp_path / "d.sock") as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send(message)
        reply = await conn.receive()
        assert reply[0] == 1 and reply[1] == msgid and reply[3] is None
        assert reply[2]["code"] == code and reply[2]["retryable"] is False
        assert words in reply[2]["message"]
        _, health = await conn.request(9, "health")
        assert health[3]["status"] == "ok"
        assert daemon.stats()["internal_errors"] == 0


@trio_autojump
async def test_duplicate_in_flight_msgid_is_refused(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send([0, 1, "generate", [{"prompt": "a", "max_tokens": 50}]])
        await conn.send([0, 1, "generate", [{"prompt": "b", "max_tokens": 50}]])
        msg = await conn.receive()
        while msg[0] != 1:
            msg = await conn.receive()
        assert msg[2]["code"] == "invalid_request" and "already in flight" in msg[2]["message"]


class TemplateRefusingBackend(FakeBackend):
    def count_prompt_tokens(self, params):
        raise ValueError("messages[0]: the template refuses this")


@trio_autojump
async def test_messages_the_chat_template_refuses_are_the_callers_error_not_internal(tmp_path):
    async with running_daemon(tmp_path / "d.sock", TemplateRefusingBackend()) as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        _, reply = await conn.request(1, "generate", {"messages": [{"role": "user", "content": "x"}]})
        assert reply[2]["code"] == "invalid_params" and "template refuses" in reply[2]["message"]
        assert daemon.stats()["internal_errors"] == 0


@trio_autojump
async def test_prompt_longer_than_the_context_gets_context_overflow(tmp_path):
    async with running_daemon(tmp_path / "d.sock", FakeBackend(context_length=32)) as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        _, reply = await conn.request(1, "generate", {"prompt": "w " * 40, "max_tokens": 1})
        assert reply[2]["code"] == "context_overflow" and "context_length 32" in reply[2]["message"]
        _, reply = await conn.request(2, "generate", {"prompt": "w " * 20, "max_tokens": 20})
        assert reply[2]["code"] == "context_overflow"
        _, reply = await conn.request(3, "generate", {"prompt": "w " * 20, "max_tokens": 11})
        assert reply[2] is None
        assert daemon.backend.generations == 1


@trio_autojump
async def test_backend_failure_is_an_internal_error_and_the_daemon_keeps_serving(
        tmp_path, caplog):
    async with running_daemon(tmp_path / "d.sock") as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        notes, reply = await conn.request(1, "generate", {"prompt": "FAIL please", "max_tokens": 30})
        assert reply[2]["code"] == "internal" and "injected backend failure" in reply[2]["message"]
        assert "injected backend failure" in caplog.text  # the traceback is logged
        assert daemon.backend.pool_stats()["buffers_free"] == 4
        notes, reply = await conn.request(2, "generate", {"prompt": "fine", "max_tokens": 3})
        assert check_stream(notes, reply, 2)["finish_reason"] == "length"
        assert daemon.stats()["requests"]["failed"] == 1


@trio_autojump
async def test_malformed_msgpack_gets_parse_error_then_the_connection_closes(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send_bytes(b"\x93\x00\x01\xc1")  # 0xc1 is never valid msgpack
        reply = await refused_then_closed(conn, "parse_error")
        assert reply[0] == 1 and reply[1] is None
        await assert_serving(tmp_path / "d.sock")


@trio_autojump
async def test_message_over_the_size_limit_is_refused_and_one_at_the_limit_is_not(
        tmp_path):
    limit = 4096
    async with running_daemon(tmp_path / "d.sock", max_message_bytes=limit):
        def request_of_size(size: int) -> bytes:
            base = len(msgpack.packb([0, 1, "generate", [{"prompt": "", "max_tokens": 1}]]))
            data = msgpack.packb([0, 1, "generate", [{"prompt": "p" * (size - base - 2), "max_tokens": 1}]])
            assert len(data) == size
            return data

        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send_bytes(request_of_size(limit))
        reply = await conn.receive()
        while reply[0] != 1:
            reply = await conn.receive()
        assert reply[2] is None or reply[2]["code"] == "context_overflow"
        # Feed a too-long message in pieces: refused once the limit is passed,
        # although the message is far from complete.
        await conn.send_bytes(request_of_size(limit + 1)[: limit + 1])
        reply = await conn.receive()
        assert reply[:2] == [1, None] and reply[2]["code"] == "frame_too_large"
        assert await conn.receive() is None
        # Many small parts, trickled: msgpack's own buffer stays small as it parses
        # them, so only the daemon's count of the message's bytes catches this.
        trickle = await RawConnection.open(tmp_path / "d.sock")
        data = msgpack.packb([0, 2, "generate", [{"messages": [{"role": "u", "content": "x" * 50}] * 200}]])
        assert len(data) > 3 * limit
        for i in range(0, len(data), 100):
            try:
                await trickle.send_bytes(data[i:i + 100])
            except trio.BrokenResourceError:
                break
            await trio.sleep(0.01)
        reply = await trickle.receive()
        assert reply[:2] == [1, None] and reply[2]["code"] == "frame_too_large"
        huge = await RawConnection.open(tmp_path / "d.sock")
        await huge.send_bytes(b"\xdb\xff\xff\xff\xff" + b"x" * (limit * 2))  # str claiming 4 GiB
        assert (await huge.receive())[2]["code"] in ("frame_too_large", "parse_error")


@trio_autojump
async def test_half_sent_message_is_closed_after_the_stall_timeout(tmp_path):
    async with running_daemon(tmp_path / "d.sock", stall_timeout_s=5.0):
        stalled = await RawConnection.open(tmp_path / "d.sock")
        await stalled.send_bytes(msgpack.packb([0, 1, "health", [{}]])[:3])
        t0 = trio.current_time()
        other = await RawConnection.open(tmp_path / "d.sock")
        _, reply = await other.request(1, "health")  # served meanwhile
        assert reply[3]["status"] == "ok" and trio.current_time() - t0 < 5.0
        reply = await stalled.receive()
        assert reply[:2] == [1, None] and reply[2]["code"] == "invalid_request"
        assert "incomplete message: 3 bytes" in reply[2]["message"]
        assert trio.current_time() - t0 == pytest.approx(5.0)
        assert await stalled.receive() is None
        _, reply = await other.request(2, "health")  # idle, nothing half-sent: never timed out
        assert reply[3]["status"] == "ok"


class StepCounter(trio.abc.Instrument):
    """Counts task steps: a task that spins instead of blocking shows up as thousands."""

    def __init__(self) -> None:
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


@trio_autojump(watchdog_s=20)
async def test_eof_in_the_middle_of_a_message_ends_the_connection_at_once(tmp_path):
    """Regression: a reader that does not stop at end-of-file re-reads b"" forever.

    Each empty read is a checkpoint, so the loop stays runnable, the autojump
    clock never advances, and no virtual timeout can end it: the test hangs
    at 100% CPU. Here the reader must end at EOF, at once, in a few steps.
    """
    async with running_daemon(tmp_path / "d.sock", stall_timeout_s=5.0) as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send_bytes(msgpack.packb([0, 1, "health", [{}]])[:3])
        await trio.testing.wait_all_tasks_blocked()
        counter = StepCounter()
        trio.lowlevel.add_instrument(counter)
        t0 = trio.current_time()
        await conn.stream.send_eof()
        assert await conn.receive() is None  # closed; the fragment gets no reply
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.remove_instrument(counter)
        assert trio.current_time() == t0  # at EOF, not at the stall deadline
        assert daemon.stats()["connections_open"] == 0 and daemon.stats()["internal_errors"] == 0
        assert counter.steps < 50


@trio_autojump
async def test_client_closing_with_replies_unread_is_a_disconnect_not_a_crash(tmp_path, caplog):
    """Closing a Unix socket with unread data makes the peer's next read fail with
    ECONNRESET (trio: BrokenResourceError) instead of returning b"": still a disconnect."""
    async with running_daemon(tmp_path / "d.sock") as daemon:
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send([0, 1, "generate", [{"prompt": "a", "max_tokens": 2000}]])
        assert (await conn.receive())[:2] == [2, "token"]
        await trio.sleep(0.1)  # more chunks arrive and stay unread
        await conn.aclose()
        await trio.testing.wait_all_tasks_blocked()
        stats = daemon.stats()
        assert stats["connections_open"] == 0 and stats["internal_errors"] == 0
        assert stats["requests"]["cancelled"] == 1 and stats["pool"]["buffers_free"] == 4
    assert "crashed" not in caplog.text


@trio_autojump
async def test_a_trickled_message_is_refused_at_its_stall_deadline(tmp_path):
    """The stall deadline is fixed when a message begins; more bytes do not re-arm it."""
    async with running_daemon(tmp_path / "d.sock", stall_timeout_s=5.0):
        conn = await RawConnection.open(tmp_path / "d.sock")
        data = msgpack.packb([0, 1, "health", [{}]])
        t0 = trio.current_time()

        async def trickle() -> None:
            for i in range(len(data) - 1):  # a byte every 0.7 s (not at 5.0), never the last
                try:
                    await conn.send_bytes(data[i:i + 1])
                except trio.BrokenResourceError:
                    return
                await trio.sleep(0.7)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            reply = await conn.receive()
            nursery.cancel_scope.cancel()
        assert reply[:2] == [1, None] and reply[2]["code"] == "invalid_request"
        assert "not complete 5.0 s after it began" in reply[2]["message"]
        assert trio.current_time() - t0 == pytest.approx(5.0)
        assert await conn.receive() is None


@trio_autojump
async def test_client_that_stops_reading_is_closed_and_does_not_wedge_others(
        tmp_path):
    backend = FakeBackend(description_padding=4 << 20)
    async with running_daemon(tmp_path / "d.sock", backend, stall_timeout_s=10.0,
                              max_message_bytes=1 << 20) as daemon:
        lazy = await RawConnection.open(tmp_path / "d.sock")
        for msgid in range(3):  # 12 MiB of replies that are never read
            await lazy.send([0, msgid, "models", []])
        t0 = trio.current_time()
        busy = await RawConnection.open(tmp_path / "d.sock")
        notes, reply = await busy.request(1, "generate", {"prompt": "go on", "max_tokens": 20})
        check_stream(notes, reply, 1)
        assert trio.current_time() - t0 < 10.0
        await trio.sleep_until(t0 + 9.9)
        assert daemon.stats()["connections_open"] == 2
        await trio.sleep_until(t0 + 10.1)
        assert daemon.stats()["connections_open"] == 1  # the lazy one was closed at 10 s


@trio_autojump
async def test_notifications_and_responses_from_a_client_are_ignored(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send([2, "nvim_set_client_info", ["x", {}, "remote", {}, {}]])
        await conn.send([2, b"binary-name", []])
        await conn.send([1, 0, "some error", None])
        _, reply = await conn.request(5, "health")  # the first reply is health's
        assert reply[3]["status"] == "ok"


@trio_autojump
async def test_many_pipelined_requests_in_one_write_are_all_answered(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send_bytes(b"".join(msgpack.packb([0, i, "stats", []]) for i in range(500)))
        seen = [(await conn.receive())[1] for _ in range(500)]
        assert seen == list(range(500))


@trio_autojump
async def test_binary_method_name_is_accepted(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        conn = await RawConnection.open(tmp_path / "d.sock")
        await conn.send([0, 1, b"health", []])
        assert (await conn.receive())[3]["status"] == "ok"


@trio_autojump
async def test_hello_models_health_and_stats_describe_the_daemon(tmp_path):
    async with running_daemon(tmp_path / "d.sock", queue_depth=3, max_tokens=64):
        conn = await RawConnection.open(tmp_path / "d.sock")
        _, hello = await conn.request(1, "hello", {"client_name": "t", "protocol": [1, 7]})
        hello = hello[3]
        assert hello["protocol"] == [1, 0] and hello["pid"] == os.getpid()
        assert hello["limits"] == {"max_message_bytes": 1 << 20, "queue_depth": 3, "max_tokens": 64,
                                   "context_length": 8192, "max_connections": 64,
                                   "stall_timeout_s": 30.0}
        assert set(hello["methods"]) == {"hello", "generate", "cancel", "stats", "health", "models"}
        assert hello["models"]["target"]["name"] == "fake-target"
        _, models = await conn.request(2, "models")
        assert models[3]["context_length"] == 8192 and models[3]["modes"] == ["resident-ar", "flash-ar", "flash-chain"]
        _, reply = await conn.request(3, "generate", {"prompt": "a", "max_tokens": 65})
        assert "between 1 and 64" in reply[2]["message"]
        await conn.request(4, "generate", {"prompt": "a b", "max_tokens": 6, "mode": "flash-chain:4"})
        _, stats = await conn.request(5, "stats", {"request_id": 4})
        request = stats[3]["request"]
        assert request["state"] == "done" and request["n_tokens"] == 6 and request["prompt_tokens"] == 3
        assert request["stats"]["n_tokens"] == 6
        daemon_stats = stats[3]["daemon"]
        assert daemon_stats["tokens_generated"] == 6 and daemon_stats["backend"]["n_tokens"] == 6
        assert daemon_stats["requests"]["rejected_invalid"] == 1
        _, health = await conn.request(6, "health", {})
        assert health[3]["connections_open"] == 1 and health[3]["running"] is False


@trio_autojump
async def test_a_request_naming_the_running_mode_without_its_parameter_runs_it(tmp_path):
    """A daemon started with ``--mode lever`` offers ``lever:32``: a request for ``lever`` (what
    ``generate --socket auto --mode lever`` sends) runs in it; other modes are still refused."""
    ran = []

    class Recording(FakeBackend):
        async def generate(self, params, emit):
            ran.append(params.mode)
            return await super().generate(params, emit)

    backend = Recording(modes=("lever:32+no-prune", "flash-ar"))
    async with running_daemon(tmp_path / "d.sock", backend):
        conn = await RawConnection.open(tmp_path / "d.sock")
        for i, mode in enumerate(["lever", "lever:32+no-prune", "flash-ar"]):
            _, reply = await conn.request(i, "generate", {"prompt": "a b", "max_tokens": 2, "mode": mode})
            assert reply[2] is None, reply
        for i, mode in enumerate(["lever:16", "lever:32", "lever+no-prune", "flash-chain", "flash", "warp"], 10):
            _, reply = await conn.request(i, "generate", {"prompt": "a b", "max_tokens": 2, "mode": mode})
            assert reply[2]["code"] == "invalid_params" and "mode must be one of" in reply[2]["message"], mode
    assert ran == ["lever:32+no-prune", "lever:32+no-prune", "flash-ar"]


@trio_autojump
async def test_too_many_connections_get_busy_and_are_closed(tmp_path):
    async with running_daemon(tmp_path / "d.sock", max_connections=2):
        kept = [await RawConnection.open(tmp_path / "d.sock") for _ in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        extra = await RawConnection.open(tmp_path / "d.sock")
        reply = await refused_then_closed(extra, "busy")
        assert reply[2]["retryable"] is True
        await kept[0].aclose()
        await trio.testing.wait_all_tasks_blocked()
        await assert_serving(tmp_path / "d.sock")


@trio_autojump
async def test_shutdown_cancels_in_flight_work_and_removes_socket_and_status(
        tmp_path):
    backend = FakeBackend()
    sock = tmp_path / "d.sock"
    async with trio.open_nursery() as nursery:
        daemon = await nursery.start(serve, ServeConfig(socket=sock), backend)
        assert sock.exists() and (tmp_path / "d.json").exists()
        conn = await RawConnection.open(sock)
        await conn.send([0, 1, "generate", [{"prompt": "a", "max_tokens": 2000}]])
        await conn.send([0, 2, "generate", [{"prompt": "b", "max_tokens": 2000}]])
        assert (await conn.receive())[:2] == [2, "token"]
        daemon.shutdown()
        errors = {}
        while (msg := await conn.receive()) is not None:
            if msg[0] == 1:
                errors[msg[1]] = msg[2]
        assert set(errors) == {1, 2}
        assert all(e["code"] == "cancelled" and e["retryable"] for e in errors.values())
    assert not sock.exists() and not (tmp_path / "d.json").exists()
    assert backend.pool_stats()["buffers_free"] == 4


@trio_autojump
async def test_second_daemon_on_the_same_socket_is_refused_naming_the_pid(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        with pytest.raises(DaemonAlreadyRunning, match=f"pid {os.getpid()}"):
            async with running_daemon(tmp_path / "d.sock"):
                pass  # pragma: no cover
        conn = await RawConnection.open(tmp_path / "d.sock")  # the first still serves
        _, reply = await conn.request(1, "health")
        assert reply[3]["status"] == "ok"
    assert not (tmp_path / "d.sock").exists()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@trio_autojump
async def test_stale_socket_from_a_dead_daemon_is_removed_and_logged(tmp_path, caplog):
    sock = tmp_path / "d.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock))  # closing leaves the file behind, as a killed daemon does
    pid = dead_pid()
    (tmp_path / "d.json").write_text(json.dumps({"pid": pid, "socket": str(sock), "protocol": [1, 0],
                                                 "version": "0", "started_at": "then"}))
    with caplog.at_level(logging.WARNING, logger="lever_actors.daemon_files"):
        async with running_daemon(sock):
            conn = await RawConnection.open(sock)
            _, reply = await conn.request(1, "health")
            assert reply[3]["status"] == "ok"
    assert f"removing stale socket {sock}" in caplog.text and f"pid {pid}" in caplog.text


@trio_autojump
async def test_a_file_that_is_not_a_socket_is_never_replaced(tmp_path):
    (tmp_path / "d.sock").write_text("precious")
    with pytest.raises(ConfigError, match="not a socket"):
        async with running_daemon(tmp_path / "d.sock"):
            pass  # pragma: no cover
    assert (tmp_path / "d.sock").read_text() == "precious"


@trio_autojump
async def test_status_file_and_socket_are_private_and_complete(tmp_path):
    async with running_daemon(tmp_path / "d.sock"):
        status_path = tmp_path / "d.json"
        status = read_status(status_path)
        assert status["pid"] == os.getpid() and status["socket"] == str(tmp_path / "d.sock")
        assert status["protocol"] == [1, 0] and status["started_at"].endswith("+00:00")
        assert status_path.read_text().endswith("}\n")
        assert stat.S_IMODE(os.stat(tmp_path / "d.sock").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(status_path).st_mode) == 0o600
        assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


@trio_autojump
async def test_default_socket_lives_in_a_private_runtime_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    from lever_actors.client import default_socket_path
    sock = default_socket_path()
    assert sock == tmp_path / "lever-actors" / "lever.sock"
    async with running_daemon(sock):
        assert stat.S_IMODE(os.stat(tmp_path / "lever-actors").st_mode) == 0o700
        assert (tmp_path / "lever-actors" / "lever.json").exists()


@trio_autojump
async def test_socket_path_too_long_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="too long"):
        async with running_daemon(tmp_path / ("x" * 120 + ".sock")):
            pass  # pragma: no cover


def test_error_codes_are_the_documented_set():
    assert {c.value for c in ErrorCode} == {
        "parse_error", "invalid_request", "method_not_found", "invalid_params", "frame_too_large",
        "busy", "cancelled", "context_overflow", "internal", "io_error", "model_damaged"}
    import protocols.rpc as rpc
    for code in ErrorCode:
        assert code.value in rpc.__doc__
    for method in rpc.METHODS:
        assert f"``{method}``" in rpc.__doc__


class BackendWithTasks(FakeBackend):
    """A backend with a ``run`` task that must be up before the daemon listens."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "new"

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        self.state = "running"
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self.state = "stopped"

    def describe(self) -> dict:
        return {**super().describe(), "plan": self.state}


@trio_autojump
async def test_backend_run_task_starts_before_listening_and_stops_at_shutdown(tmp_path):
    backend = BackendWithTasks()
    async with running_daemon(tmp_path / "d.sock", backend):
        conn = await RawConnection.open(tmp_path / "d.sock")
        _, models = await conn.request(1, "models")
        assert models[3]["plan"] == "running"  # describe() ran after run() started
    assert backend.state == "stopped"


class SplitCharacterBackend(FakeBackend):
    """Emits an ids-only chunk (a character split across tokens), an empty one, a text-only flush."""

    async def generate(self, params, emit):
        for text, ids in (("", [1]), ("é→", [2, 3]), ("", []), ("!", [])):
            await trio.sleep(0.01)
            await emit(text, ids)
        return GenerateOutcome(text="é→!", token_ids=[1, 2, 3], finish_reason="stop", stats={})


@trio_autojump
async def test_chunks_without_text_or_without_ids_are_streamed_and_empty_ones_skipped(tmp_path):
    async with running_daemon(tmp_path / "d.sock", SplitCharacterBackend()):
        conn = await RawConnection.open(tmp_path / "d.sock")
        notes, reply = await conn.request(1, "generate", {"prompt": "x"})
        assert [n[2][1:] for n in notes] == [["", [1]], ["é→", [2, 3]], ["!", []]]
        assert check_stream(notes, reply, 1)["text"] == "é→!"
