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


@pytest.mark.parametrize("mode", ["flash-chain:2", "flash-chain:6", "lever:8"])
def test_a_stop_string_ends_the_ids_where_it_ends_the_text_whatever_a_pass_commits(tiny_bundles, mode):
    """A pass commits several tokens at once, as many as its tree allowed; the answer to a request
    with a stop string must not depend on that: its ids end with the token that completes the stop
    (a soak of the real pair once saw the same request answer with different ids)."""
    from lever_actors.backend import GenerateParams
    from lever_actors.service import EngineBackend

    target, draft = tiny_bundles
    tok = TextTokenizer.from_file(target / "tokenizer.json")
    ref = resident_tokens(target, 24)
    cut = next(i for i in range(6, 20) if tok.decode(ref[i - 2:i + 1]).strip())
    stop = tok.decode(ref[cut - 2:cut + 1])  # completed by token `cut`, mid-way through some pass

    def answer(cfg):
        backend = EngineBackend(cfg)
        chunks = []

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(backend.run)
                out = await backend.generate(GenerateParams(PROMPT, None, 24, 0.0, 1.0, None, (stop,), None),
                                             lambda text, ids: _append(chunks, text, ids))
                nursery.cancel_scope.cancel()
            return out

        return trio.run(main), chunks

    base = EngineConfig(target=str(target), draft=str(draft), context=256, dram_budget=12 * 2**20)
    want, _ = answer(EngineConfig(target=str(target), context=256))
    got, chunks = answer(base.with_mode(mode))
    assert want.finish_reason == got.finish_reason == "stop" and stop not in want.text
    first = tok.decode(ref).find(stop)
    assert want.text == got.text == tok.decode(ref)[:first]
    assert want.token_ids == got.token_ids and got.token_ids[-1] == ref[len(got.token_ids) - 1]
    assert [t for _, ids in chunks for t in ids] == got.token_ids and "".join(t for t, _ in chunks) == got.text


async def _append(chunks, text, ids):
    chunks.append((text, list(ids)))


def test_a_seed_names_one_text_in_every_mode_and_no_seed_draws_a_fresh_one(tiny_bundles, monkeypatch):
    """Coupled sampling through the backend: a seeded sampled request answers with the tokens the
    target alone draws with that seed, whichever mode the daemon runs; an unseeded one gets a fresh
    random seed (OpenAI's semantics), not a fixed default, and its stats say which."""
    import secrets

    from lever_actors.backend import GenerateParams
    from lever_actors.service import EngineBackend

    target, draft = tiny_bundles
    tok = TextTokenizer.from_file(target / "tokenizer.json")

    def answer(cfg, seed):
        backend = EngineBackend(cfg)

        async def main():
            async with trio.open_nursery() as nursery:
                await nursery.start(backend.run)
                out = await backend.generate(GenerateParams(PROMPT, None, 20, 0.9, 0.95, seed, (), None),
                                             lambda text, ids: _append([], text, ids))
                nursery.cancel_scope.cancel()
            assert out.stats["seed"] == 77  # the seed given, or the one drawn: the text can be asked for again
            return out.token_ids

        return trio.run(main)

    async def alone(seed):
        async with open_pipeline(EngineConfig(mode="resident-ar", context=256), target, None, set(tok.eos_ids)) as p:
            async def emit(_):
                return False
            return (await p.generate(tok.encode(PROMPT), 20, SamplingParams(0.9, 0.95, seed), emit))[0]

    want = trio.run(alone, 77)
    assert want != trio.run(alone, 78)
    base = EngineConfig(target=str(target), draft=str(draft), context=256, dram_budget=12 * 2**20)
    for mode in ("flash-chain:3", "lever:8"):
        assert answer(base.with_mode(mode), 77) == want, mode
    drawn = []
    monkeypatch.setattr(secrets, "randbits", lambda k: drawn.append(k) or 77)
    assert answer(base.with_mode("lever:8"), None) == want and drawn == [53]


def test_the_daemon_admits_exactly_the_room_its_pipeline_runs(engine_daemon, tiny_bundles):
    """``limits.context_length`` is what a request may use: the context less a pass's tree. A request
    in the gap between the two was admitted, then failed in the pipeline, and its Abort then named
    the next request's session, which waited for ever."""
    from lever_actors.errors import LeverError

    _, sock = engine_daemon
    n_prompt = len(TextTokenizer.from_file(tiny_bundles[0] / "tokenizer.json").encode(PROMPT))

    async def main():
        with trio.fail_after(120):
            async with open_client(sock) as c:
                room = (await c.hello())["limits"]["context_length"]
                with pytest.raises(LeverError, match="context_length"):
                    await c.generate(PROMPT, max_tokens=room - n_prompt + 1, temperature=0.0)
                full = await c.generate(PROMPT, max_tokens=room - n_prompt, temperature=0.0)
                after = await c.generate(PROMPT, max_tokens=30, temperature=0.0)
                return room, full, after

    room, full, after = trio.run(main)
    assert room == 256 - 4  # flash-chain:3: a pass verifies the root and three drafted tokens
    assert full.token_ids == resident_tokens(tiny_bundles[0], len(full.token_ids))
    assert after.token_ids == resident_tokens(tiny_bundles[0], 30)
