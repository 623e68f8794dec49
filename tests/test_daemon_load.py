"""Bounded load: many clients pipelining many requests through a small queue."""
from __future__ import annotations

import trio
import trio.testing

from fake_backend import (FakeBackend, RawConnection, expected_tokens, params, running_daemon,
                          trio_autojump)

N_CLIENTS, N_REQUESTS, IN_FLIGHT = 8, 25, 3


@trio_autojump
async def test_every_request_is_answered_or_refused_busy_with_no_lost_tokens(tmp_path):
    backend = FakeBackend(delay_s=0.002)
    async with running_daemon(tmp_path / "d.sock", backend, queue_depth=6) as daemon:
        outcomes: dict[tuple[int, int], tuple] = {}

        async def client(c: int) -> None:
            conn = await RawConnection.open(tmp_path / "d.sock")
            slots = trio.Semaphore(IN_FLIGHT)
            chunks: dict[int, list] = {}
            sent = {}

            async def reader() -> None:
                while len(outcomes_of(c)) < N_REQUESTS:
                    msg = await conn.receive()
                    assert msg is not None
                    if msg[0] == 2:
                        request_id, text, ids = msg[2]
                        assert request_id in sent and (c, request_id) not in outcomes
                        chunks.setdefault(request_id, []).append((text, ids))
                    else:
                        assert (c, msg[1]) not in outcomes, "answered twice"
                        outcomes[(c, msg[1])] = (sent[msg[1]], chunks.pop(msg[1], []), msg)
                        if msg[2] is not None:
                            await trio.sleep(0.2)  # back off after busy, as a client should
                        slots.release()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(reader)
                for i in range(N_REQUESTS):
                    await slots.acquire()
                    request = {"prompt": f"client {c} request {i}", "max_tokens": 1 + (i * 7 + c) % 12}
                    sent[i] = request
                    await conn.send([0, i, "generate", [request]])
                    await trio.sleep(0.001 * (c % 3))
            await conn.aclose()

        def outcomes_of(c: int) -> list:
            return [k for k in outcomes if k[0] == c]

        with trio.fail_after(600):
            async with trio.open_nursery() as nursery:
                for c in range(N_CLIENTS):
                    nursery.start_soon(client, c)

        assert len(outcomes) == N_CLIENTS * N_REQUESTS
        n_busy = n_done = n_tokens = 0
        for request, got, reply in outcomes.values():
            if reply[2] is not None:
                assert reply[2]["code"] == "busy" and reply[2]["retryable"] and got == []
                n_busy += 1
                continue
            ids, text, reason = expected_tokens(params(request["prompt"], max_tokens=request["max_tokens"]))
            result = reply[3]
            assert (result["token_ids"], result["text"], result["finish_reason"]) == (ids, text, reason)
            assert [t for _, chunk in got for t in chunk] == ids  # nothing lost, repeated or reordered
            assert "".join(t for t, _ in got) == text
            n_done += 1
            n_tokens += len(ids)
        assert n_busy > 0 and n_done > N_CLIENTS * N_REQUESTS // 4
        stats = daemon.stats()
        assert stats["requests"]["accepted"] == n_done and stats["requests"]["completed"] == n_done
        assert stats["requests"]["rejected_busy"] == n_busy
        assert stats["tokens_generated"] == n_tokens == stats["backend"]["n_tokens"]
        assert stats["pool"] == {"buffers_total": 4, "buffers_free": 4}
        assert stats["internal_errors"] == 0 and stats["queue_length"] == 0
