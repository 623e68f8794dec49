"""The real engine behind the real daemon: `lever-actors serve` on the tiny models, driven over its socket."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from lever_actors.client import open_client
from lever_actors.engine import EngineConfig
from lever_actors.runtime import open_pipeline
from lever_actors.sampling import SamplingParams
from lever_actors.tokenizer import TextTokenizer

PROMPT = "def add(left, right):\n    return"


@pytest.fixture
def engine_daemon(tiny_bundles, tmp_path):
    target, draft = tiny_bundles
    sock = tmp_path / "lever.sock"
    log = open(tmp_path / "daemon.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "lever_actors", "serve", "--socket", str(sock), "--target", str(target),
         "--draft", str(draft), "--mode", "flash-chain:3", "--dram-budget", "12MiB", "--context", "256"],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=dict(os.environ, PYTHONPATH=str(Path.cwd())))
    deadline = time.monotonic() + 120
    while not (sock.exists() and sock.with_suffix(".json").exists()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("daemon did not start: " + (tmp_path / "daemon.log").read_text())
        time.sleep(0.05)
    yield proc, sock
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


def resident_tokens(target: Path, n: int) -> list[int]:
    tok = TextTokenizer.from_file(target / "tokenizer.json")

    async def main():
        async with open_pipeline(EngineConfig(mode="resident-ar", context=256), target, None, set(tok.eos_ids)) as p:
            async def emit(_):
                return False
            return (await p.generate(tok.encode(PROMPT), n, SamplingParams(), emit))[0]

    return trio.run(main)


def test_daemon_streams_the_exact_greedy_output_and_cleans_up(engine_daemon, tiny_bundles):
    proc, sock = engine_daemon
    chunks = []

    async def main():
        async with open_client(sock) as c:
            hello = await c.hello()
            assert "flash-chain:3" in str(hello)
            r = await c.generate(PROMPT, max_tokens=30, temperature=0.0,
                                 on_token=lambda text, ids: chunks.append((text, ids)))
            # a second request on the same pipeline starts cleanly from a new prompt
            r2 = await c.generate(PROMPT, max_tokens=30, temperature=0.0)
            return r, r2

    r, r2 = trio.run(main)
    want = resident_tokens(tiny_bundles[0], 30)
    streamed_ids = [t for _, ids in chunks for t in ids]
    assert streamed_ids == r.token_ids == r2.token_ids
    assert r.token_ids == want[: len(r.token_ids)] and len(r.token_ids) >= 1
    assert "".join(t for t, _ in chunks) == r.text
    assert r.stats["passes"] >= 1 and r.stats["mean_accepted"] >= 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not sock.exists() and not sock.with_suffix(".json").exists()


def test_cancel_mid_generation_leaves_the_daemon_exact(engine_daemon, tiny_bundles):
    _, sock = engine_daemon

    async def main():
        async with open_client(sock) as c:
            s = await c.start_stream(PROMPT, max_tokens=60, temperature=0.0)
            async for _ in s:
                await s.cancel()
                break
            await s.aclose()
            return await c.generate(PROMPT, max_tokens=30, temperature=0.0)

    r = trio.run(main)
    assert r.token_ids == resident_tokens(tiny_bundles[0], 30)[: len(r.token_ids)]
