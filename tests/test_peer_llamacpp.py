"""tools/peer_llamacpp.py: what it reads from each engine's output and how it pools runs (no building, no runs)."""
from __future__ import annotations

import argparse
import json

import pytest

from tools.peer_llamacpp import (Job, Measured, build_report, make_record, parse_completion, parse_draft_max,
                                 parse_lever, parse_proc_io, parse_psi_total, parse_speculative, retry_reason,
                                 speculative_cmd, summarize, table)

SPECULATIVE_TAIL = """\
0.06.731.494 I encoded  118 tokens in    1.482 seconds, speed:   79.613 t/s
0.06.731.509 I decoded   21 tokens in    2.422 seconds, speed:    8.672 t/s
0.06.731.514 I
0.06.731.520 I n_draft   = 8
0.06.731.525 I n_predict = 21
0.06.731.530 I n_drafted = 32
0.06.731.535 I n_accept  = 16
0.06.731.540 I accept    = 50.000%
"""

COMPLETION_TAIL = (
    "0.02.345.286 I common_perf_print: prompt eval time =     821.19 ms /   127 tokens "
    "(    6.47 ms per token,   154.65 tokens per second)\n"
    "0.02.345.301 I common_perf_print:        eval time =    1153.17 ms /    15 runs   "
    "(   76.88 ms per token,    13.01 tokens per second)\n")


def lever_stdout(n_tokens: int = 16, passes: int = 4, decode_s: float = 5.0) -> str:
    obj = {"token_ids": list(range(n_tokens)), "prompt_token_ids": [1, 2, 3], "text": "x", "finish_reason": "length",
           "mode": "lever:32", "timings": {"load_s": 0.9, "prefill_s": 3.4, "decode_s": decode_s, "total_s": 9.0,
                                          "tokens_per_s": n_tokens / decode_s},
           "stats": {"passes": passes, "flash_bytes_read": 4 << 30, "draft_n": 100, "draft_n_accepted": 22}}
    return json.dumps(obj) + "\n"


def measured(exit_code=0, stdout="", stderr="", read_bytes=1 << 30, peak=700 << 20, oom=0) -> Measured:
    return Measured(exit_code, False, peak, oom, read_bytes, 10.0, 0.05, stdout, stderr)


def test_speculative_passes_are_iterations_minus_one():
    got = parse_speculative(SPECULATIVE_TAIL, max_tokens=64)
    # 21 tokens, 16 of them accepted drafts: 5 loop iterations, the first sampled from the prefill
    assert got["passes"] == 4 and got["tokens"] == 21 and got["decode_s"] == pytest.approx(2.422)
    assert got["prompt_tokens"] == 118 and got["detail"]["n_drafted"] == 32


def test_speculative_counts_no_tokens_past_max_tokens():
    assert parse_speculative(SPECULATIVE_TAIL, max_tokens=16)["tokens"] == 16


def test_speculative_without_report_is_an_error():
    with pytest.raises(ValueError, match="decoded"):
        parse_speculative("llama_model_load: error loading model\n", 64)


def test_completion_counts_runs_plus_the_prefill_token():
    got = parse_completion(COMPLETION_TAIL, max_tokens=16)
    assert got["tokens"] == 16 and got["passes"] == 15 and got["decode_s"] == pytest.approx(1.15317)
    assert got["prompt_tokens"] == 127


def test_lever_json():
    got = parse_lever("fetch target: ok\n" + lever_stdout(), max_tokens=16)
    assert got["tokens"] == 16 and got["passes"] == 4 and got["decode_s"] == 5.0 and got["prompt_tokens"] == 3
    assert got["detail"]["flash_bytes_read"] == 4 << 30


def test_proc_io():
    assert parse_proc_io("rchar: 10\nread_bytes: 4096\nwrite_bytes: 0\n")["read_bytes"] == 4096


def test_psi_total():
    text = ("some avg10=45.18 avg60=48.54 avg300=64.03 total=2303240696\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert parse_psi_total(text) == 2303240696


def test_record_of_a_clean_run():
    rec = make_record(100, "lever", measured(stdout=lever_stdout()), parse_lever, "stdout", 16)
    assert rec["tokens_per_s"] == pytest.approx(16 / 5.0)
    assert rec["tokens_per_pass"] == pytest.approx(15 / 4)  # the prefill's token is no pass's
    assert rec["read_bytes_per_token"] == pytest.approx((1 << 30) / 16)
    assert "error" not in rec


def test_record_of_a_killed_run_keeps_the_kernels_figures():
    rec = make_record(100, "draft-max-8", measured(exit_code=-9, stderr="Killed", oom=1), parse_speculative,
                      "stderr", 64)
    assert rec["tokens"] == 0 and rec["tokens_per_s"] is None and rec["oom_kills"] == 1 and "Killed" in rec["error"]


def test_record_of_unreadable_output():
    rec = make_record(100, "draft-max-8", measured(stderr="nothing useful"), parse_speculative, "stderr", 64)
    assert rec["tokens_per_s"] is None and "unreadable" in rec["error"]


def test_summary_pools_tokens_and_time():
    a = make_record(1, "lever", measured(stdout=lever_stdout(16, 4, 4.0)), parse_lever, "stdout", 16)
    b = make_record(2, "lever", measured(stdout=lever_stdout(16, 6, 12.0), peak=750 << 20), parse_lever, "stdout", 16)
    dead = make_record(3, "lever", measured(exit_code=-9, oom=1), parse_lever, "stdout", 16)
    s = summarize([a, b, dead])
    assert s["tokens_per_s"] == pytest.approx(32 / 16.0)  # not the mean of 4.0 and 1.33
    assert s["tokens_per_pass"] == pytest.approx(30 / 10)
    assert (s["runs"], s["failed"], s["oom_kills"], s["peak_bytes"]) == (3, 1, 1, 750 << 20)
    assert summarize([]) is None


def test_report_picks_the_fastest_setting_and_the_ratio():
    runs = [make_record(1, "lever", measured(stdout=lever_stdout(16, 4, 4.0)), parse_lever, "stdout", 16)]
    for setting, secs in (("draft-max-8", "8.0"), ("draft-max-16", "16.0")):
        tail = SPECULATIVE_TAIL.replace("2.422 seconds", f"{secs} seconds")
        runs.append(make_record(1, setting, measured(stderr=tail), parse_speculative, "stderr", 16))
    meta = {"cap": "768MiB", "cap_bytes": 768 << 20, "max_tokens": 16, "threads": 2,
            "prompts": {"source": "humaneval 1:2", "ids": [1]}}
    doc = build_report(meta, runs, ["draft-max-8", "draft-max-16"], complete=True)
    assert doc["llamacpp"]["best"]["setting"] == "draft-max-8"
    assert doc["ratio"] == pytest.approx((16 / 4.0) / (16 / 8.0))
    assert doc["llamacpp"]["target_alone"] is None and doc["ratio_vs_target_alone"] is None
    assert "draft-max-8" in table(doc)
    json.dumps(doc)


def test_speculative_asks_one_token_short(tmp_path):
    job = Job("def f():\n", tmp_path / "p.txt", 64, 2, 1024, tmp_path / "t.gguf", tmp_path / "d.gguf")
    cmd = speculative_cmd(tmp_path / "llama-speculative", job, 16)
    assert cmd[cmd.index("-n") + 1] == "63" and cmd[cmd.index("--spec-draft-n-max") + 1] == "16"
    assert cmd[cmd.index("-p") + 1] == "def f():\n" and "--no-repack" in cmd


@pytest.mark.parametrize("text", ["", "8,x", "0,8"])
def test_bad_draft_lengths(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_draft_max(text)


def test_warm_runs_are_counted_apart_and_left_out():
    cold = make_record(1, "lever", measured(stdout=lever_stdout(16, 4, 4.0)), parse_lever, "stdout", 16)
    warm = dict(make_record(2, "lever", measured(stdout=lever_stdout(16, 4, 1.0)), parse_lever, "stdout", 16),
                warm=True)
    s = summarize([cold, warm])
    assert (s["runs"], s["failed"], s["warm"]) == (2, 0, 1)
    assert s["tokens_per_s"] == pytest.approx(16 / 4.0)


def test_retry_reasons():
    good = make_record(1, "lever", measured(stdout=lever_stdout()), parse_lever, "stdout", 16)
    lost = make_record(1, "draft-max-8", measured(stderr="no report"), parse_speculative, "stderr", 16)
    killed = make_record(1, "draft-max-8", measured(exit_code=-9), parse_speculative, "stderr", 16)
    assert retry_reason(good, None) is None and retry_reason(killed, None) is None
    assert "report" in retry_reason(lost, None)
    assert retry_reason(dict(good, cpu_pressure=0.5), 0.35).startswith("CPU wait 50%")
    assert retry_reason(dict(good, cpu_pressure=0.2), 0.35) is None


def test_lever_source_names_modified_code_but_not_the_runs_own_outputs(tmp_path, monkeypatch):
    """The report is rewritten after every prompt; when it is a tracked file it is not a change
    to the code that ran (a run warns only when that changes)."""
    import subprocess
    import types

    import tools.peer_llamacpp as peer

    repo = tmp_path / "repo"
    (repo / "lever_actors").mkdir(parents=True)
    (repo / "lever_actors" / "__init__.py").write_text("")
    (repo / "out.json").write_text("{}")
    real_run = subprocess.run

    def run(cmd, *a, **k):  # the import probe answers with the scratch checkout; git runs for real
        if cmd[0] != "git":
            return types.SimpleNamespace(returncode=0, stdout=f"{repo / 'lever_actors' / '__init__.py'}\n", stderr="")
        return real_run(cmd, *a, **k)

    def git(*argv):
        real_run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *argv], check=True,
                 capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "x")
    (repo / "out.json").write_text('{"runs": 1}')
    (repo / "lever_actors" / "__init__.py").write_text("# edited\n")
    monkeypatch.setattr(peer.subprocess, "run", run)
    src = peer.lever_source({}, (repo / "out.json",))
    assert src["package"] == str(repo / "lever_actors") and src["commit"]
    assert src["modified"] == ["lever_actors/__init__.py"]
    assert sorted(peer.lever_source({})["modified"]) == ["lever_actors/__init__.py", "out.json"]
