"""lever_actors.client: status-file validation and the async client, in-process."""
from __future__ import annotations

import json
import os

import pytest
import trio
import trio.testing

from fake_backend import FakeBackend, expected_tokens, params, running_daemon, trio_autojump
from lever_actors.client import (BadStatusFile, ConnectionLost, DaemonNotRunning, RemoteError,
                                 check_status, default_socket_path, open_client, read_status)
from test_daemon import dead_pid

GOOD = {"pid": os.getpid(), "socket": "/x/lever.sock", "protocol": [1, 0], "version": "0.1.0",
        "started_at": "2026-01-01T00:00:00+00:00"}


def write(tmp_path, content) -> os.PathLike:
    path = tmp_path / "lever.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_daemon_errors_live_in_errors_and_the_client_re_exports_them():
    import lever_actors.client as client
    from lever_actors import errors

    for name in ("DaemonNotRunning", "ConnectionLost", "DaemonAlreadyRunning", "BadStatusFile",
                 "RemoteError"):
        assert getattr(client, name) is getattr(errors, name)
        assert issubclass(getattr(errors, name), errors.LeverError)
    assert issubclass(errors.ConnectionLost, errors.DaemonNotRunning)
    error = RemoteError.from_wire({"code": "busy", "message": "later", "retryable": True})
    assert (error.code, error.message, error.retryable, str(error)) == ("busy", "later", True,
                                                                        "[busy] later")
    assert RemoteError.from_wire("junk").code == "internal"


def test_a_valid_status_file_of_a_live_daemon_is_accepted(tmp_path):
    assert check_status(write(tmp_path, GOOD)) == GOOD


@pytest.mark.parametrize("content, message", [
    ("{", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ({k: v for k, v in GOOD.items() if k != "pid"}, "no pid field"),
    ({**GOOD, "pid": "123"}, "pid is not a int"),
    ({**GOOD, "pid": True}, "pid is not a int"),
    ({**GOOD, "pid": 0}, "pid 0 is not positive"),
    ({**GOOD, "socket": 5}, "socket is not a str"),
    ({k: v for k, v in GOOD.items() if k != "started_at"}, "no started_at field"),
    ({**GOOD, "protocol": [1]}, "protocol is not [major, minor]"),
    ({**GOOD, "protocol": "1.0"}, "protocol is not a list"),
])
def test_each_bad_status_file_field_has_its_own_message(tmp_path, content, message):
    path = write(tmp_path, content)
    with pytest.raises(BadStatusFile) as info:
        read_status(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_missing_status_file_means_not_running(tmp_path):
    with pytest.raises(DaemonNotRunning, match="no daemon status file"):
        check_status(tmp_path / "lever.json")


def test_dead_pid_in_status_file_means_the_daemon_has_died(tmp_path):
    pid = dead_pid()
    with pytest.raises(DaemonNotRunning, match=f"daemon has died \\(pid {pid}\\)"):
        check_status(write(tmp_path, {**GOOD, "pid": pid}))


def test_default_socket_falls_back_to_a_per_user_temp_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    assert default_socket_path() == tmp_path / f"lever-actors-{os.getuid()}" / "lever.sock"


@trio_autojump
async def test_connecting_where_no_daemon_runs_explains_why(tmp_path):
    with pytest.raises(DaemonNotRunning, match="no daemon is running at .*no daemon status file"):
        async with open_client(tmp_path / "d.sock"):
            pass  # pragma: no cover
    write(tmp_path, {**GOOD, "pid": dead_pid()}).rename(tmp_path / "d.json")
    with pytest.raises(DaemonNotRunning, match="daemon has died"):
        async with open_client(tmp_path / "d.sock"):
            pass  # pragma: no cover
    (tmp_path / "d.json").write_text(json.dumps(GOOD))  # alive pid, but no socket
    with pytest.raises(DaemonNotRunning, match=f"daemon pid {os.getpid()} .* is alive but"):
        async with open_client(tmp_path / "d.sock"):
            pass  # pragma: no cover


@trio_autojump
async def test_client_methods_and_streaming_callback(tmp_path):
    async with running_daemon(tmp_path / "d.sock"), open_client(tmp_path / "d.sock") as client:
        hello = await client.hello()
        assert hello["protocol"] == [1, 0]
        assert (await client.models())["modes"] == ["resident-ar", "flash-ar", "flash-chain"]
        assert (await client.health())["status"] == "ok"
        chunks = []
        result = await client.generate("two words", max_tokens=9, seed=3,
                                       on_token=lambda text, ids: chunks.append((text, ids)))
        ids, text, _ = expected_tokens(params("two words", max_tokens=9, seed=3))
        assert (result.token_ids, result.text, result.finish_reason) == (ids, text, "length")
        assert "".join(c[0] for c in chunks) == text and [t for c in chunks for t in c[1]] == ids
        stats = await client.stats(result.request_id)
        assert stats["request"]["state"] == "done"
        assert (await client.stats())["daemon"]["requests"]["completed"] == 1


@trio_autojump
async def test_async_on_token_and_async_iteration(tmp_path):
    async with running_daemon(tmp_path / "d.sock"), open_client(tmp_path / "d.sock") as client:
        seen = []

        async def on_token(text, ids):
            await trio.sleep(0.1)  # a slow consumer only slows its own stream
            seen.append(text)

        result = await client.generate("slow reader", max_tokens=12, on_token=on_token)
        assert "".join(seen) == result.text
        async with client.stream(messages=[{"role": "user", "content": "hi"}], max_tokens=5) as s:
            texts = [chunk.text async for chunk in s]
        assert "".join(texts) == s.result.text and s.result.finish_reason == "length"


@trio_autojump
async def test_leaving_a_stream_early_cancels_it_on_the_daemon(tmp_path):
    async with running_daemon(tmp_path / "d.sock") as daemon, \
            open_client(tmp_path / "d.sock") as client:
        async with client.stream("endless", max_tokens=4000) as s:
            async for _ in s:
                break
        await trio.testing.wait_all_tasks_blocked()  # the cancel reached the daemon and took effect
        assert daemon.stats()["requests"]["cancelled"] == 1
        assert daemon.backend.pool_stats()["buffers_free"] == 4
        result = await client.generate("after", max_tokens=3)  # the connection is still fine
        assert result.finish_reason == "length"


@trio_autojump
async def test_a_stream_nobody_reads_does_not_hold_up_the_clients_other_calls(tmp_path):
    """One task reads every reply of a connection: a stream left unread past any buffer size
    must not make it wait, or every later call on the client waits for ever."""
    async with running_daemon(tmp_path / "d.sock"), open_client(tmp_path / "d.sock") as client:
        s = await client.start_stream("unread", max_tokens=1000)
        await trio.sleep(60)  # the whole answer has arrived, unread
        with trio.fail_after(5):
            assert (await client.generate("after", max_tokens=3)).finish_reason == "length"
            await client.stats()
        chunks = [chunk async for chunk in s]
        assert s.result.finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 1000


@trio_autojump
async def test_explicit_cancel_returns_the_partial_result(tmp_path):
    async with running_daemon(tmp_path / "d.sock"), open_client(tmp_path / "d.sock") as client:
        s = await client.start_stream("endless", max_tokens=4000)
        first = await s.__anext__()
        reply = await client.cancel(s.request_id)
        assert reply["cancelled"] is True
        rest = [chunk async for chunk in s]
        assert s.result.finish_reason == "cancelled"
        assert s.result.text == first.text + "".join(c.text for c in rest)


@trio_autojump
async def test_error_responses_raise_remote_error_with_code_and_retryable(tmp_path):
    async with running_daemon(tmp_path / "d.sock", queue_depth=0), \
            open_client(tmp_path / "d.sock") as client:
        with pytest.raises(RemoteError) as info:
            await client.generate("x", max_tokens=0)
        assert (info.value.code, info.value.retryable) == ("invalid_params", False)
        assert "max_tokens" in info.value.message
        with pytest.raises(RemoteError) as info:
            await client.call("nope")
        assert info.value.code == "method_not_found"

        async def long_one():
            await client.generate("long", max_tokens=50)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_one)
            await trio.sleep(0.05)
            with pytest.raises(RemoteError) as info:  # queue_depth 0: nothing may wait
                await client.generate("second", max_tokens=5)
            assert info.value.code == "busy" and info.value.retryable is True


@trio_autojump
async def test_one_client_serves_several_tasks_at_once(tmp_path):
    async with running_daemon(tmp_path / "d.sock"), open_client(tmp_path / "d.sock") as client:
        results = {}

        async def one(i):
            results[i] = await client.generate(f"task {i}", max_tokens=6)

        async with trio.open_nursery() as nursery:
            for i in range(5):
                nursery.start_soon(one, i)
            nursery.start_soon(client.health)
        for i, result in results.items():
            assert result.token_ids == expected_tokens(params(f"task {i}", max_tokens=6))[0]


@trio_autojump
async def test_shutdown_while_waiting_raises_cancelled_then_connection_lost(tmp_path):
    async with trio.open_nursery() as nursery:
        from lever_actors.daemon import ServeConfig, serve
        daemon = await nursery.start(serve, ServeConfig(socket=tmp_path / "d.sock"), FakeBackend())
        async with open_client(tmp_path / "d.sock") as client:
            async with client.stream("long", max_tokens=1000) as s:
                await s.__anext__()
                daemon.shutdown()
                with pytest.raises(RemoteError) as info:
                    async for _ in s:
                        pass
                assert info.value.code == "cancelled" and info.value.retryable
            with pytest.raises(ConnectionLost):
                await client.health()
