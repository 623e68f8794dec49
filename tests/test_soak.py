"""Soak: the real engine (tiny pair) behind the daemon, several clients for a bounded time."""
from __future__ import annotations

from test_service import engine_daemon  # noqa: F401  (the fixture: `lever-actors serve` on the tiny pair)
from tools.soak import soak

RSS_GROWTH_TOLERANCE = 24 << 20  # after warm-up; malloc keeps some arenas, a leak grows without bound


def test_clients_for_half_a_minute_lose_nothing_and_leak_nothing(engine_daemon):  # noqa: F811
    proc, sock = engine_daemon
    out = soak(sock, proc.pid, seconds=30, clients=3)
    print("soak:", {k: out[k] for k in ("answered", "busy", "tokens", "distinct_requests", "rss_after_warmup_bytes", "rss_end_bytes", "prompt_cache_end_bytes")})
    assert out["answered"] > 20 and not out["errors"], out
    assert out["mismatch"] == 0 and out["stream_mismatch"] == 0
    assert out["daemon_requests"]["completed"] == out["answered"]
    # the prompt cache grows by design (within its line of the budget): the leak check leaves it out
    assert out["rss_growth_net_bytes"] < RSS_GROWTH_TOLERANCE, out
    assert out["pool"]["buffers_lent"] == 0
