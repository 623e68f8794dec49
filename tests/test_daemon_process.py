"""The daemon as a process: ``python -m lever_actors.daemon --backend fake``.

Real time here, so every wait has a generous bound (READY_S, EXIT_S).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest

from fake_backend import expected_tokens, params, raw_blocking_request
from lever_actors.client import SyncClient, check_status, generate_via_socket
from lever_actors.memory import peak_rss

TESTS = Path(__file__).parent
PYTHONPATH = os.pathsep.join(filter(None, [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH")]))
READY_S = 20.0
EXIT_S = 15.0


def start_daemon(sock: Path, log: Path, *extra: str, delay: str = "0.002") -> subprocess.Popen:
    env = {**os.environ, "LEVER_FAKE_DELAY_S": delay,
           "PYTHONPATH": PYTHONPATH}
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "lever_actors.daemon", "--socket", str(sock),
                                 "--backend", "fake", *extra],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env)


def wait_ready(proc: subprocess.Popen, sock: Path, log: Path) -> dict:
    deadline = time.monotonic() + READY_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"daemon exited with {proc.returncode}:\n{log.read_text()}")
        try:
            status = check_status(sock.with_suffix(".json"))
            if status["pid"] == proc.pid:
                return status
        except Exception:
            pass
        time.sleep(0.02)
    pytest.fail(f"daemon not ready after {READY_S} s:\n{log.read_text()}")


@pytest.fixture
def daemons():
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(EXIT_S)


def spawn(daemons: list, tmp_path: Path, name: str = "d", *extra: str, **kw) -> tuple:
    sock, log = tmp_path / f"{name}.sock", tmp_path / f"{name}.log"
    proc = start_daemon(sock, log, *extra, **kw)
    daemons.append(proc)
    return proc, sock, log


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One daemon process for the interop tests, which leave it as they found it."""
    tmp = tmp_path_factory.mktemp("shared")
    sock, log = tmp / "d.sock", tmp / "d.log"
    proc = start_daemon(sock, log)
    try:
        wait_ready(proc, sock, log)
        yield sock
    finally:
        proc.terminate()
        proc.wait(EXIT_S)


def generate_args(sock: Path, prompt: str, **kw) -> argparse.Namespace:
    base = dict(socket=sock, prompt=prompt, max_tokens=8, temperature=None, top_p=None, seed=None,
                stop=None, mode=None, json=False)
    base.update(kw)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_generation_cancels_it_and_removes_socket_and_status(tmp_path, daemons, signum):
    proc, sock, log = spawn(daemons, tmp_path, delay="0.01")
    wait_ready(proc, sock, log)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(EXIT_S)
        s.connect(str(sock))
        s.sendall(msgpack.packb([0, 1, "generate", [{"prompt": "long", "max_tokens": 4000}]]))
        unpacker = msgpack.Unpacker(raw=False)
        messages = []
        while not messages:
            unpacker.feed(s.recv(65536))
            messages.extend(unpacker)
        assert messages[0][:2] == [2, "token"]
        proc.send_signal(signum)
        while data := s.recv(65536):
            unpacker.feed(data)
            messages.extend(unpacker)
    final = messages[-1]
    assert final[:2] == [1, 1] and final[2]["code"] == "cancelled" and final[2]["retryable"]
    assert proc.wait(EXIT_S) == 0
    assert not sock.exists() and not sock.with_suffix(".json").exists()
    assert f"received {signal.Signals(signum).name}" in log.read_text()


def test_second_daemon_process_is_refused_naming_the_first_pid(tmp_path, daemons):
    first, sock, log = spawn(daemons, tmp_path)
    wait_ready(first, sock, log)
    second, _, log2 = spawn(daemons, tmp_path, "d", )
    assert second.wait(READY_S) == 1
    assert f"already serving {sock} (pid {first.pid}" in log2.read_text()
    assert check_status(sock.with_suffix(".json"))["pid"] == first.pid  # untouched
    assert raw_blocking_request(sock, [[0, 1, "health", []]])[0][3]["status"] == "ok"


def test_killed_daemon_is_reported_dead_and_its_socket_replaced(tmp_path, daemons, capsys):
    first, sock, log = spawn(daemons, tmp_path)
    wait_ready(first, sock, log)
    first.kill()
    first.wait(EXIT_S)
    assert sock.exists() and sock.with_suffix(".json").exists()  # what a crash leaves
    assert generate_via_socket(generate_args(sock, "hi")) == 1
    err = capsys.readouterr().err
    assert f"no daemon is running at {sock}" in err and f"daemon has died (pid {first.pid})" in err
    second, _, log2 = spawn(daemons, tmp_path, "d")
    wait_ready(second, sock, log2)
    assert f"removing stale socket {sock}" in log2.read_text()
    assert generate_via_socket(generate_args(sock, "hi", max_tokens=4)) == 0


def test_cli_generate_without_any_daemon_says_so(tmp_path, capsys):
    assert generate_via_socket(generate_args(tmp_path / "none.sock", "hi")) == 1
    assert "no daemon is running" in capsys.readouterr().err


def test_pynvim_msgpack_rpc_client_drives_hello_and_generate(shared):
    """Interop: pynvim's msgpack_rpc layer, a client this project did not write."""
    msgpack_rpc = pytest.importorskip("pynvim.msgpack_rpc")
    session = msgpack_rpc.socket_session(str(shared))  # also sends it a notification
    session.error_wrapper = lambda error: RuntimeError(error)
    try:
        hello = session.request("hello", {"client_name": "pynvim"})
        assert hello["protocol"] == [1, 0] and hello["server"] == "lever-actors"
        result = session.request("generate", {"prompt": "from pynvim", "max_tokens": 12})
        notes = []
        while session._pending_messages:  # notifications queued while it waited
            notes.append(session.next_message())
        assert [n.name for n in notes] == ["token"] * len(notes)
        assert "".join(n.args[1] for n in notes) == result["text"]
        assert result["token_ids"] == expected_tokens(params("from pynvim", max_tokens=12))[0]
        with pytest.raises(RuntimeError, match="method_not_found"):
            session.request("no_such_method", {})
    finally:
        session.close()


def test_plain_blocking_socket_speaks_the_protocol(shared):
    """Interop with nothing but the msgpack package and a stdlib socket."""
    messages = raw_blocking_request(shared, [[0, 1, "hello", [{}]],
                                             [0, 2, "generate", [{"prompt": "plain", "max_tokens": 6}]]])
    replies = {m[1]: m for m in messages if m[0] == 1}
    tokens = [m for m in messages if m[0] == 2]
    assert replies[1][3]["protocol"] == [1, 0]
    assert "".join(t[2][1] for t in tokens) == replies[2][3]["text"]


def test_sync_client_generates_streams_and_cancels(shared):
    with SyncClient(shared) as client:
        assert client.hello()["protocol"] == [1, 0]
        chunks = []
        result = client.generate("sync", max_tokens=10, on_token=lambda t, ids: chunks.append(t))
        assert "".join(chunks) == result.text and len(result.token_ids) == 10
        stream = client.stream("sync stream", max_tokens=4000)
        for i, _ in enumerate(stream):
            if i == 0:
                stream.cancel()
        assert stream.result.finish_reason == "cancelled"
        assert client.stats(stream.request_id)["request"]["state"] == "cancelled"
        assert client.health()["status"] == "ok"


def test_cli_generate_streams_text_or_prints_one_json_object(shared, capsys):
    assert generate_via_socket(generate_args(shared, "cli", max_tokens=7)) == 0
    text = capsys.readouterr().out
    expected_ids, expected_text, _ = expected_tokens(params("cli", max_tokens=7))
    assert text == expected_text + "\n"
    assert generate_via_socket(generate_args(shared, "cli", max_tokens=7, json=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == expected_text and out["token_ids"] == expected_ids
    assert out["finish_reason"] == "length" and out["stats"]["n_tokens"] == 7
    assert {"queue_s", "total_s", "client_total_s"} <= set(out["timings"])
    assert generate_via_socket(generate_args(shared, "cli", max_tokens=0)) == 1
    assert "[invalid_params] max_tokens" in capsys.readouterr().err


def test_lever_actors_serve_and_generate_commands_work_together(tmp_path):
    """The installed CLI's wiring: `serve --backend fake`, `generate --socket`, SIGTERM."""
    sock, log = tmp_path / "cli.sock", tmp_path / "cli.log"
    env = {**os.environ, "LEVER_FAKE_DELAY_S": "0.001",
           "PYTHONPATH": PYTHONPATH}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lever_actors", "serve", "--socket", str(sock),
                                 "--backend", "fake"], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=out, env=env)
    try:
        wait_ready(proc, sock, log)
        ready_peak = peak_rss(proc.pid)
        run = subprocess.run([sys.executable, "-m", "lever_actors", "generate", "--socket", str(sock),
                              "--json", "--max-tokens", "6", "def add(a, b):"],
                             capture_output=True, text=True, env=env, timeout=READY_S)
        assert run.returncode == 0, run.stderr
        out = json.loads(run.stdout)
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 6
        # the peak is the daemon's own (what --dram-budget bounds), not the client's; the kernel syncs
        # each thread's RSS count into VmHWM lazily, so readings a moment apart may differ by some pages
        slack = 2**20
        assert out["peak_rss_bytes"] == out["stats"]["peak_rss_bytes"]
        assert ready_peak - slack <= out["peak_rss_bytes"] <= peak_rss(proc.pid) + slack
        run = subprocess.run([sys.executable, "-m", "lever_actors", "generate", "--socket", str(sock),
                              "--max-tokens", "3", "def add(a, b):"], capture_output=True, text=True, env=env,
                             timeout=READY_S)
        assert run.returncode == 0 and "[3 tokens, finish: length, the daemon's peak RSS " in run.stderr, run.stderr
        with SyncClient(sock) as client:
            assert client.stats()["daemon"]["peak_rss_bytes"] >= out["peak_rss_bytes"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(EXIT_S) == 0
        assert not sock.exists() and not sock.with_suffix(".json").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(EXIT_S)
