"""User mistakes on the command line end in one clear line and a nonzero exit, never a traceback,
and before a run starts rather than after it (an output that cannot be written, a bad rate)."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from lever_actors import cli
from lever_actors.cli import build_parser, main
from lever_actors.engine import EngineConfig, parse_mode, parse_size
from lever_actors.errors import BudgetError, ConfigError


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out + cap.err


def one_line_error(code: int, out: str, *says: str) -> None:
    assert code != 0, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    for s in says:
        assert s in out, out


# --- 1: files that cannot be read ------------------------------------------------------------

@pytest.mark.parametrize("command", [("generate", "--prompt-file"), ("bench", "--prompts")])
@pytest.mark.parametrize("path,why", [("/nonexistent/p.txt", "No such file or directory"), ("/", "Is a directory")])
def test_an_unreadable_prompt_file_is_one_line_naming_it(capsys, command, path, why):
    code, out = run(capsys, command[0], command[1], path)
    one_line_error(code, out, f"{command[1]} {path}", why)


def test_any_other_os_error_is_one_line_not_a_traceback(capsys, monkeypatch):
    def convert_fails(args):
        raise PermissionError(13, "Permission denied", "/some/out")

    monkeypatch.setattr(cli, "cmd_convert", convert_fails)
    code, out = run(capsys, "convert", "a.gguf", "out")
    one_line_error(code, out, "/some/out: Permission denied")


# --- 2: outputs checked before the run --------------------------------------------------------

@pytest.mark.parametrize("argv,option", [(("generate", "x", "--trace"), "--trace"), (("bench", "--json"), "--json")])
def test_an_output_that_cannot_be_written_is_refused_before_the_run(capsys, tmp_path, argv, option):
    # no model is given or needed: the refusal comes before anything loads
    code, out = run(capsys, *argv, str(tmp_path / "missing" / "out.json"))
    one_line_error(code, out, option, "does not exist")
    code, out = run(capsys, *argv, str(tmp_path))
    one_line_error(code, out, option, "is a directory")


# --- 3, 4: sizes --------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["infMiB", "1e400", "nan", "nanGiB", "-inf", "0.5b"])
def test_sizes_that_are_no_byte_count_are_refused(bad):
    with pytest.raises(ConfigError, match="cannot read size"):
        parse_size(bad)


@pytest.mark.parametrize("argv", [("--dram-budget", "infMiB"), ("--dram-budget", "1e400"), ("--dram-budget", "nan"),
                                  ("--flash-bandwidth", "infMB")])
def test_non_finite_sizes_on_the_command_line(capsys, argv):
    code, out = run(capsys, "generate", "x", "--mode", "flash-ar", *argv)
    one_line_error(code, out, "cannot read size")


@pytest.mark.parametrize("option,value,says", [("--prompt-cache", "64", "did you mean 64MiB?"),
                                               ("--flash-bandwidth", "800", "did you mean 800MB?")])
def test_a_size_option_without_a_unit_is_refused(capsys, option, value, says):
    code, out = run(capsys, "generate", "x", option, value)
    one_line_error(code, out, f"{option} {value} has no unit", says)


def test_scripts_keep_passing_byte_counts():
    assert parse_size("4096") == 4096  # tools and tests: a bare number is bytes without an option
    cfg = EngineConfig.from_args(build_parser().parse_args(["generate", "x", "--dram-budget", str(800 * 2**20)]))
    assert cfg.dram_budget == 800 * 2**20
    assert cfg.prompt_cache is None and EngineConfig.from_args(
        build_parser().parse_args(["generate", "x", "--prompt-cache", "0"])).prompt_cache == 0


def test_a_tiny_budget_without_a_unit_is_refused_with_the_unit_it_surely_meant(capsys, tiny_bundles):
    from lever_actors.engine import unitless_size_hint

    assert unitless_size_hint("768") == "768 without a unit is 768 bytes: did you mean 768MiB?"
    assert unitless_size_hint(str(800 * 2**20)) is None and unitless_size_hint("768MiB") is None
    for argv in (("--mode", "flash-ar", "--dram-budget", "768"), ("--mode", "flash-ar@768")):
        code, out = run(capsys, "generate", "hi", "--target", str(tiny_bundles[0]), *argv)
        # the planner's refusal still names the smallest budget that runs (scripts read it)
        one_line_error(code, out, "cannot run this model pair", "at least", "did you mean 768MiB?")


# --- 5: the emulated flash rate ------------------------------------------------------------------

@pytest.mark.parametrize("rate", ["1b", "0.5MB", "999kB"])
def test_a_flash_rate_below_1_mb_per_s_is_refused(capsys, rate):
    code, out = run(capsys, "generate", "x", "--flash-bandwidth", rate)
    one_line_error(code, out, f"--flash-bandwidth {rate}", "below the 1 MB/s")


def test_a_throttled_read_ends_its_wait_once_its_reader_leaves():
    from lever_actors.flashio import throttle

    leaving = threading.Event()
    t0 = time.perf_counter()
    done = []
    worker = threading.Thread(target=lambda: done.append(throttle(10 * 10**6, t0, 10**6, leaving)))  # a 10 s read
    worker.start()
    time.sleep(0.1)
    leaving.set()
    worker.join(timeout=2)
    assert done and time.perf_counter() - t0 < 1.0
    t1 = time.perf_counter()
    throttle(100_000, t1, 10**6)  # a plain rate still throttles: 0.1 s
    assert 0.09 < time.perf_counter() - t1 < 0.5


def test_a_pipeline_closes_without_waiting_out_an_emulated_slow_read(tiny_bundles):
    """The prefetcher starts reading the first streamed layer as the pipeline opens; at an emulated
    rate where that read takes 30 s, closing must not wait for it (a thread cannot be interrupted,
    so the throttle itself must stop waiting once its reader leaves)."""
    import trio

    from lever_actors.bundle import load_bundle
    from lever_actors.runtime import open_pipeline
    from lever_actors.tokenizer import TextTokenizer

    target = tiny_bundles[0]
    layer = max(load_bundle(target).layer_bytes())
    eos = set(TextTokenizer.from_file(target / "tokenizer.json").eos_ids)
    times = {}

    async def main():
        try:  # the smallest budget: every layer streams
            async with open_pipeline(EngineConfig(mode="flash-ar", context=64, dram_budget=1), target, None, eos):
                pass
        except BudgetError as e:
            budget = e.minimum
        cfg = EngineConfig(mode="flash-ar", context=64, dram_budget=budget, flash_bandwidth=layer / 30)
        async with open_pipeline(cfg, target, None, eos) as pipe:
            await trio.sleep(0.2)  # the first read is under way
            times["reading"] = pipe.prefetcher.reading
            times["t0"] = time.perf_counter()
        times["closed"] = time.perf_counter() - times["t0"]

    trio.run(main)
    assert times["reading"] >= 1 and times["closed"] < 5.0


# --- 6: one prompt source -----------------------------------------------------------------------

@pytest.mark.parametrize("argv,named", [(("x", "--prompt-file", "f"), "PROMPT and --prompt-file"),
                                        (("x", "--humaneval", "3"), "PROMPT and --humaneval"),
                                        (("--prompt-file", "f", "--humaneval", "3"), "--prompt-file and --humaneval")])
def test_conflicting_prompt_sources_are_refused(capsys, argv, named):
    code, out = run(capsys, "generate", *argv)
    one_line_error(code, out, "give only one of PROMPT, --prompt-file, --humaneval", named)


def test_bench_takes_humaneval_or_a_prompt_file_not_both(capsys, tmp_path):
    # it used to take the file and report nothing, so a run meant for a range measured another set
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def f():"}) + "\n")
    code, out = run(capsys, "bench", "--humaneval", "100:110", "--prompts", str(path))
    one_line_error(code, out, "give --humaneval or --prompts, not both", "--humaneval 100:110", str(path))


# --- 7: --socket refuses what the daemon cannot honour ---------------------------------------

def test_socket_refuses_local_options_before_connecting(capsys, tmp_path):
    code, out = run(capsys, "generate", "--socket", str(tmp_path / "none.sock"), "def f():", "--dram-budget", "100KiB",
                    "--target", "/nonexistent", "--context", "5", "--trace", "t.json", "--no-overlap")
    one_line_error(code, out, "not applied by a daemon")
    for option in ("--dram-budget", "--target", "--context", "--trace", "--no-overlap"):
        assert option in out
    assert not (Path.cwd() / "t.json").exists()


def test_socket_passes_what_the_daemon_honours(capsys, tmp_path):
    args = build_parser().parse_args(["generate", "--socket", "auto", "x", "--mode", "lever:8", "--max-tokens", "5",
                                      "--temperature", "0.5", "--top-p", "0.9", "--seed", "3", "--chat", "--json"])
    assert cli._local_only_options(args) == []
    # with nothing listening, it gets as far as the connection
    code, out = run(capsys, "generate", "--socket", str(tmp_path / "none.sock"), "x", "--max-tokens", "5")
    assert code == 1 and "no daemon is running" in out


# --- 8: messages that name what the user gave ----------------------------------------------------

@pytest.mark.parametrize("mode,says", [("lever:abc", "mode 'lever:abc': lever:NODES needs an integer"),
                                       ("flash-tree:x", "mode 'flash-tree:x': flash-tree:NODES needs an integer"),
                                       ("flash-chain:y", "mode 'flash-chain:y': flash-chain:GAMMA needs an integer")])
def test_a_bad_mode_parameter_names_the_mode_given(mode, says):
    with pytest.raises(ConfigError, match=says):
        parse_mode(mode)


@pytest.mark.parametrize("argv,says", [(("generate", "--humaneval", "164"), "HumanEval problem must be 0-163, got 164"),
                                       (("generate", "--humaneval", "-1"), "HumanEval problem must be 0-163, got -1"),
                                       (("bench", "--humaneval", "3:3"), "--humaneval 3:3 is an empty range"),
                                       (("bench", "--humaneval", "5:2"), "--humaneval 5:2 is an empty range")])
def test_humaneval_numbers_out_of_range(capsys, argv, says):
    code, out = run(capsys, *argv)
    one_line_error(code, out, says)


# --- 9, 10, 11 ----------------------------------------------------------------------------------

def test_bench_refuses_a_negative_warmup(capsys):
    code, out = run(capsys, "bench", "--warmup", "-1")
    one_line_error(code, out, "--warmup must be >= 0, got -1")


def test_help_points_to_sections_that_exist_and_names_auto(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "see 'Measured' in the README" in top
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "\n## Measured\n" in readme
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    dram_budget_help = capsys.readouterr().out.split("\n  --dram-budget SIZE", 1)[1].split("\n  --gamma", 1)[0]
    assert "'auto'" in dram_budget_help and "cgroup" in dram_budget_help


def test_verify_writes_no_carriage_returns_when_stderr_is_not_a_terminal(capsys, tiny_bundles):
    code, out = run(capsys, "models", "verify", str(tiny_bundles[0]))
    assert code == 0 and "\r" not in out and out.strip() == f"{tiny_bundles[0]}: ok"


def test_a_sweep_budget_without_a_unit_is_named_in_its_refusal(capsys, tiny_bundles, tmp_path):
    out = tmp_path / "sweep.json"
    code = main(["bench", "--target", str(tiny_bundles[0]), "--modes", "flash-ar", "--budgets", "768,24MiB",
                 "--humaneval", "0:1", "--max-tokens", "2", "--context", "400", "--warmup", "0", "--json", str(out)])
    assert code == 0
    assert "did you mean 768MiB?" in json.loads(out.read_text())["refused"]["flash-ar@768"]


@pytest.mark.parametrize("argv,says", [(("--temperature", "3"), "--temperature must lie in 0..2, got 3"),
                                       (("--seed", "-1"), "--seed must lie in 0.."),
                                       (("--temperature", "-1"), "--temperature must lie in 0..2")])
def test_sampling_ranges_are_the_daemons(capsys, tiny_bundles, argv, says):
    """A command that runs locally must also run through --socket: the same ranges, refused before loading."""
    code, out = run(capsys, "generate", "x", "--target", str(tiny_bundles[0]), "--max-tokens", "2", *argv)
    one_line_error(code, out, says)
