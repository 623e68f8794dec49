"""The bench's pass breakdown: the pipeline bound, efficiency, the ceiling and the wait share."""
from __future__ import annotations

import pytest

from lever_actors.bench import _pipeline_summary


def _row(passes, pass_s, io_s, compute_s, wait_s, n_tokens, hits=0, misses=0):
    return {"stats": {"passes": passes, "pass_s": pass_s, "io_s": io_s, "compute_s": compute_s,
                      "draft_wait_s": wait_s, "mean_accepted": n_tokens / passes if passes else 0.0, "spec_hits": hits, "spec_misses": misses,
                      "flash_bytes_read": int(io_s * 3e9), "draft_tokens": 0, "draft_busy_s": 0.0}}


def test_the_bound_is_the_largest_part_and_the_ceiling_follows_from_it():
    rows = [_row(10, 3.0, 2.4, 1.9, 0.2, 70, hits=8, misses=2), _row(10, 3.2, 2.6, 2.1, 0.4, 60, hits=5, misses=5)]
    s = _pipeline_summary(rows, 20)
    assert s["pipeline_bound_part"] == "flash"
    assert s["pipeline_bound_s"] == pytest.approx(5.0 / 20)
    assert s["efficiency"] == pytest.approx(0.25 / (6.2 / 20))
    assert s["bound_tokens_per_s"] == pytest.approx(130 / 5.0)  # every pass at its bound: 130 tokens in 20 x 0.25 s
    assert s["draft_wait_share"] == pytest.approx(0.6 / 6.2)
    assert s["spec_hit_rate"] == pytest.approx(13 / 20)


def test_a_passs_reads_are_the_decode_passes_not_the_prefills():
    """The prefill reads every streamed layer once more: counted into a pass's reads, 64 tokens in
    11 passes made the bound 9% too long and the efficiency 9% too high."""
    from lever_actors.bench import summarize

    rows = [_row(10, 3.0, 3.0, 1.9, 0.2, 70)]
    rows[0]["stats"]["decode_io_s"] = 2.5  # the prefill's 0.5 s of reads are the request's, not a pass's
    s = _pipeline_summary(rows, 10)
    assert s["pipeline_bound_s"] == pytest.approx(0.25) and s["efficiency"] == pytest.approx(0.25 / 0.3)
    assert s["run_read_bytes_per_s"] == pytest.approx(3e9)  # bytes and seconds of the same reads
    full = dict(rows[0], n_tokens=64, decode_s=3.0, tokens_per_s=21.0, prefill_s=0.3)
    assert summarize([full])["io_s_per_pass"] == pytest.approx(0.25)


def test_a_drafter_bound_mode_is_bound_by_its_waits():
    s = _pipeline_summary([_row(4, 2.0, 0.8, 0.6, 1.1, 20)], 4)
    assert s["pipeline_bound_part"] == "draft"
    assert s["bound_tokens_per_s"] == pytest.approx(20 / 1.1)


def test_no_pass_no_bound():
    s = _pipeline_summary([_row(0, 0.0, 0.0, 0.0, 0.0, 0)], 0)
    assert s["efficiency"] is None and s["bound_tokens_per_s"] is None and s["draft_wait_share"] == 0.0


def test_the_tables_tokens_a_pass_are_the_prompts_lines_tokens_a_pass():
    """Both count what the passes committed: the returned tokens also hold the prefill's first token
    and drop what a last pass committed past max_tokens, so they are not the passes' tokens."""
    from lever_actors.bench import summarize

    rows = [{"n_tokens": 64, "decode_s": 2.0, "tokens_per_s": 32.0, "prefill_s": 0.1,
             "stats": {"passes": 13, "mean_accepted": 66 / 13, "n_tokens": 64}},  # 66 committed, 64 returned
            {"n_tokens": 64, "decode_s": 2.0, "tokens_per_s": 32.0, "prefill_s": 0.1,
             "stats": {"passes": 16, "mean_accepted": 64 / 16, "n_tokens": 64}}]
    assert summarize(rows)["mean_accepted"] == pytest.approx(130 / 29)
