"""The command line: clear errors for bad input, conversion refusals, help that teaches."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter

from lever_actors.cli import main
from lever_actors.convert import convert
from lever_actors.engine import parse_mode, parse_size
from lever_actors.errors import ConfigError, ModelError, UnsupportedModel


def run(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    cap = capsys.readouterr()
    return code, cap.out + cap.err


@pytest.mark.parametrize("text,want", [("1GiB", 2**30), ("800MB", 800 * 10**6), ("512m", 512 * 2**20),
                                       ("unlimited", None), ("4096", 4096)])
def test_sizes(text, want):
    assert parse_size(text) == want


@pytest.mark.parametrize("bad", ["lots", "-1GiB", "0", "1XB", ""])
def test_bad_sizes_are_refused_with_examples(bad):
    with pytest.raises(ConfigError, match="1GiB"):
        parse_size(bad)


def test_modes():
    assert parse_mode("flash-chain:4") == ("flash-chain", 4)
    assert parse_mode("flash-ar")[0] == "flash-ar"
    for bad in ("warp", "flash-ar:3", "flash-chain:x", "flash-chain:0"):
        with pytest.raises(ConfigError):
            parse_mode(bad)


def test_generate_without_a_prompt_says_how(capsys, tiny_bundles):
    code, out = run(capsys, "generate", "--target", str(tiny_bundles[0]))
    assert code == 1 and "no prompt" in out and "--prompt-file" in out


def test_generate_with_a_bad_budget_or_mode(capsys, tiny_bundles):
    code, out = run(capsys, "generate", "hi", "--target", str(tiny_bundles[0]), "--mode", "flash-ar",
                    "--dram-budget", "lots")
    assert code == 1 and "cannot read size" in out
    code, out = run(capsys, "generate", "hi", "--target", str(tiny_bundles[0]), "--mode", "warp")
    assert code == 1 and "unknown mode" in out


@pytest.mark.parametrize("args,says", [(("--draft-threads", "0"), "--draft-threads must be >= 1"),
                                       (("--buckets", "4,2"), "--buckets: token buckets must be increasing"),
                                       (("--buckets", "1,2,x"), "--buckets: token buckets are comma-separated"),
                                       (("--mode", "lever:8+no-prune", "--prune-threshold", "1", "--json"), None),
                                       (("--mode", "lever:8", "--prune-layer", "9", "--prune-threshold", "0"),
                                        "prune exit layer 9 must lie in 0..1")])
def test_lane_and_prune_options_are_checked(capsys, tiny_bundles, args, says):
    code, out = run(capsys, "generate", "def f(", "--target", str(tiny_bundles[0]), "--draft", str(tiny_bundles[1]),
                    "--max-tokens", "3", "--context", "64", *args)
    if says is None:  # +no-prune wins over a threshold
        import json

        assert code == 0 and json.loads(out.strip().splitlines()[-1])["stats"]["prune"] == "off"
    else:
        assert code == 1 and says in out


def test_generate_json_on_the_tiny_model(capsys, tiny_bundles):
    import json

    code, out = run(capsys, "generate", "def f(", "--target", str(tiny_bundles[0]), "--max-tokens", "5", "--json",
                    "--context", "64")
    assert code == 0
    obj = json.loads(out.strip().splitlines()[-1])
    assert len(obj["token_ids"]) == 5 and obj["prompt_token_ids"] and "tokens_per_s" in obj["timings"]


def test_too_long_prompt_is_a_context_error(capsys, tiny_bundles):
    code, out = run(capsys, "generate", "x = 1\n" * 200, "--target", str(tiny_bundles[0]), "--context", "64")
    assert code == 1 and "exceeds the context" in out


def test_missing_bundle_is_explained(capsys, tmp_path):
    code, out = run(capsys, "generate", "hi", "--target", str(tmp_path / "nope"))
    assert code == 1 and "not a lever-actors bundle" in out


def test_convert_refuses_existing_output_and_non_gguf(tmp_path, tiny_gguf):
    (tmp_path / "out").mkdir()
    with pytest.raises(ModelError, match="already exists"):
        convert(tiny_gguf[0], tmp_path / "out")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelError, match="not a readable GGUF"):
        convert(junk, tmp_path / "b")
    assert not list(tmp_path.glob("b*"))  # nothing half-written left behind


def _write(path, arch="qwen2", qtype=QT.Q8_0):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    if qtype == QT.Q8_0:
        from gguf.quants import quantize

        data = quantize(np.zeros((32, 32), np.float32), QT.Q8_0)
        w.add_tensor("blk.0.attn_q.weight", data, raw_shape=data.shape, raw_dtype=QT.Q8_0)
    else:
        data = np.zeros((32, 32 // 256 * 84 + 84), np.uint8)  # any bytes: the type is refused first
        w.add_tensor("blk.0.attn_q.weight", data[:, :84], raw_shape=(32, 84), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_named(tmp_path):
    with pytest.raises(UnsupportedModel, match="'gpt2'"):
        convert(_write(tmp_path / "a.gguf", arch="gpt2"), tmp_path / "a")


def test_unsupported_tensor_type_is_named(tmp_path):
    with pytest.raises(UnsupportedModel, match="Q2_K"):
        convert(_write(tmp_path / "b.gguf", qtype=QT.Q2_K), tmp_path / "b")


def test_help_teaches_with_examples(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "models fetch" in out and "--dram-budget" in out


def test_bench_prompt_sources_refuse_bad_input(tmp_path):
    from lever_actors.bench import file_prompts, humaneval_prompts

    for bad in ("5:2", "0:999", "x"):
        with pytest.raises(ConfigError, match="humaneval"):
            humaneval_prompts(bad)
    assert [i for i, _ in humaneval_prompts("3:5")] == [3, 4]
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "def f():"}\n{"text": "no prompt key"}\n')
    with pytest.raises(ConfigError, match=r"p.jsonl:2"):
        file_prompts(str(f))
    f.write_text("\n")
    with pytest.raises(ConfigError, match="no prompts"):
        file_prompts(str(f))


def test_bench_ratios_use_the_best_chain_at_the_runs_own_budget():
    from lever_actors.bench import add_ratios

    modes = {m: {"tokens_per_s": v} for m, v in {"resident-ar": 10.0, "flash-ar": 8.0, "flash-chain:4": 12.0,
                                                   "flash-chain:8+no-overlap": 16.0, "flash-chain:8@unlimited": 20.0,
                                                   "lever:16": 24.0}.items()}
    add_ratios(modes)
    lever = modes["lever:16"]
    assert lever["best_chain"] == "flash-chain:8+no-overlap"  # not the chain with its own (unlimited) budget
    assert (lever["speedup_vs_flash_ar"], lever["speedup_vs_best_chain"], lever["vs_resident_ar"]) == (3.0, 1.5, 2.4)
    bare = {"lever:16": {"tokens_per_s": 5.0}}
    add_ratios(bare)
    assert bare["lever:16"]["speedup_vs_flash_ar"] is None and bare["lever:16"]["best_chain"] is None


def test_bench_runs_modes_side_by_side_and_writes_the_documented_json(tiny_bundles, tmp_path, capsys):
    """`lever-actors bench` end to end on the tiny pair: table, losslessness check, JSON shape."""
    import json

    from lever_actors.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def add(a, b):"}\n{"prompt": "for i in range(10):"}\n')
    out = tmp_path / "bench.json"
    modes = "resident-ar,flash-ar@3MiB,flash-chain:3+no-overlap,lever:6"
    rc = main(["bench", "--target", str(tiny_bundles[0]), "--draft", str(tiny_bundles[1]), "--modes", modes,
               "--prompts", str(prompts), "--max-tokens", "12", "--dram-budget", "24MiB", "--context", "128",
               "--warmup", "0", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "flash read bandwidth" in text and text.count("identical") == 3
    data = json.loads(out.read_text())
    assert list(data["modes"]) == modes.split(",")
    ref = data["modes"]["resident-ar"]["prompts"]
    for m, r in data["modes"].items():
        for key in ("tokens_per_s", "ms_per_token", "mean_accepted", "flash_bytes_per_token", "floor_ms_per_token"):
            assert isinstance(r[key], float), (m, key)
        assert [p["index"] for p in r["prompts"]] == [0, 1]
        assert [p["token_ids"] for p in r["prompts"]] == [p["token_ids"] for p in ref]  # greedy: lossless
        assert all(isinstance(p["tokens_per_s"], float) for p in r["prompts"])
        # the floor: flash bytes at the measured bandwidth, or compute, whichever is larger
        floor_bw = data["flash_read"]["run_bytes_per_s"] or data["flash_read"]["bytes_per_s"]
        io_ms = 1000 * r["flash_bytes_per_token"] / floor_bw
        compute_ms = 1000 * r["compute_s_per_pass"] / r["mean_accepted"]
        assert r["floor_ms_per_token"] == pytest.approx(max(io_ms, compute_ms))
    assert data["modes"]["flash-chain:3+no-overlap"]["spec_hits"] == 0
    # ratios against the run's own best chain (a mode with its own '@SIZE' budget is not a candidate)
    assert {r["best_chain"] for r in data["modes"].values()} == {"flash-chain:3+no-overlap"}
    chain_tps = data["modes"]["flash-chain:3+no-overlap"]["tokens_per_s"]
    for r in data["modes"].values():
        assert r["speedup_vs_best_chain"] == pytest.approx(r["tokens_per_s"] / chain_tps)
        assert r["vs_resident_ar"] == pytest.approx(r["tokens_per_s"] / data["modes"]["resident-ar"]["tokens_per_s"])
    assert data["modes"]["flash-ar@3MiB"]["flash_bytes_per_token"] > 0 == data["modes"]["resident-ar"]["flash_bytes_per_token"]
    # the integrity checks of the streamed bytes are timed: some time where layers stream, none where nothing does
    assert data["modes"]["flash-ar@3MiB"]["integrity_s_per_pass"] > 0 == data["modes"]["resident-ar"]["integrity_s_per_pass"]
    assert "integrity checks of the streamed bytes" in text


def test_floor_is_the_larger_of_flash_time_and_compute():
    from lever_actors.bench import floor_ms_per_token

    streamed = {"flash_bytes_per_token": 758e6, "compute_s_per_pass": 0.116, "mean_accepted": 1.0}
    drafted = {"flash_bytes_per_token": 134e6, "compute_s_per_pass": 0.6, "mean_accepted": 6.0}
    assert floor_ms_per_token(streamed, 2e9) == pytest.approx(379.0)  # I/O-bound: bytes / bandwidth
    assert floor_ms_per_token(drafted, 2e9) == pytest.approx(100.0)  # compute-bound: 0.6 s per 6 tokens


def test_mode_text_carries_flags_and_a_budget_or_fails_clearly():
    from lever_actors.cli import build_parser
    from lever_actors.engine import EngineConfig

    def cfg(*argv):
        return EngineConfig.from_args(build_parser().parse_args(["generate", "x", *argv]))

    c = cfg("--mode", "lever:12+no-overlap+fixed-tree@300MiB")
    assert (c.mode, c.gamma, c.overlap, c.fixed_tree, c.dram_budget) == ("lever", 12, False, True, 300 * 2**20)
    assert c.mode_string() == "lever:12+no-overlap+fixed-tree"
    assert cfg("--mode", "flash-chain", "--gamma", "5", "--no-overlap").mode_string() == "flash-chain:5+no-overlap"
    assert cfg("--mode", "flash-ar").dram_budget == 2**30  # flash modes default to 1 GiB
    assert cfg("--mode", "flash-ar", "--dram-budget", "unlimited").dram_budget is None
    base = EngineConfig(mode="resident-ar", dram_budget=None)
    assert base.with_mode("flash-ar").dram_budget is None  # 'unlimited' stays unlimited in bench
    for bad, why in (("lever:12+bogus", "unknown mode flag 'bogus'"), ("flash-ar@lots", "cannot read size"),
                     ("warp:3", "unknown mode 'warp'")):
        with pytest.raises(ConfigError, match=why):
            cfg("--mode", bad)


def test_fetch_reconverts_an_ort_layout_bundle_to_native(tiny_gguf, tmp_path, monkeypatch):
    """A draft converted before the kernels took 32-block rows is rebuilt, with a message."""
    from lever_actors import models
    from lever_actors.bundle import load_bundle
    from lever_actors.convert import convert

    monkeypatch.setenv("LEVER_HOME", str(tmp_path))
    src = models.ModelSource("draft", "tiny-draft", "none-", "0", 1, 0, "0" * 64)
    monkeypatch.setitem(models.DEFAULT_PAIR, "draft", src)
    monkeypatch.setattr(models, "assemble_gguf", lambda s, say: tiny_gguf[1])
    dst = models.bundle_path(src)
    dst.parent.mkdir(parents=True)
    convert(tiny_gguf[1], dst, progress=lambda m: None, layout="ort")
    said: list[str] = []
    out = models.fetch(roles=("draft",), say=said.append)
    assert out["draft"] == dst and load_bundle(dst).layout == "native"
    assert any("ORT layout" in m and "converting again" in m for m in said)
    said.clear()
    models.fetch(roles=("draft",), say=said.append)  # native now: kept as it is
    assert not any("converting again" in m for m in said)


def test_a_budget_sweep_runs_each_flash_mode_at_each_budget_and_compares_within_a_budget():
    from lever_actors.bench import add_ratios, sweep_modes

    assert sweep_modes(["resident-ar", "flash-ar", "lever+no-ngram", "flash-chain:8@1GiB"], "600MiB,unlimited") == [
        "resident-ar", "flash-ar@600MiB", "flash-ar@unlimited", "lever+no-ngram@600MiB", "lever+no-ngram@unlimited",
        "flash-chain:8@1GiB"]
    modes = {m: {"tokens_per_s": v} for m, v in {"flash-ar@600MiB": 5.0, "flash-chain:8@600MiB": 10.0,
                                                   "lever@600MiB": 15.0, "flash-ar@1GiB": 9.0,
                                                   "flash-chain:8@1GiB": 12.0, "lever@1GiB": 18.0}.items()}
    add_ratios(modes)
    assert modes["lever@600MiB"]["speedup_vs_flash_ar"] == 3.0 and modes["lever@600MiB"]["speedup_vs_best_chain"] == 1.5
    assert modes["lever@1GiB"]["speedup_vs_flash_ar"] == 2.0 and modes["lever@1GiB"]["best_chain"] == "flash-chain:8@1GiB"
    assert modes["lever@1GiB"]["budget"] == "1GiB"
    with pytest.raises(ConfigError, match="--budgets is empty"):
        sweep_modes(["flash-ar"], " , ")


def test_every_ablation_is_both_a_flag_and_a_mode_suffix():
    from lever_actors.cli import ABLATIONS
    from lever_actors.engine import MODE_FLAGS, EngineConfig

    assert tuple(f for f, _ in ABLATIONS) == MODE_FLAGS
    for flag in MODE_FLAGS:  # a suffix switches its technique off and shows in the mode's name
        cfg = EngineConfig().with_mode(f"lever:8+{flag}")
        assert f"+{flag}" in cfg.mode_string()


def test_a_suffix_with_nothing_left_to_switch_off_is_left_out_of_the_name():
    """Without the Q4 draft there are no tiles to switch off, so the name keeps only what differs
    and names the same run whichever way it was asked for."""
    from lever_actors.engine import EngineConfig

    both = EngineConfig().with_mode("lever:8+no-draft-q4+no-draft-tiles")
    assert both.mode_string() == "lever:8+no-draft-q4"
    again = EngineConfig().with_mode(both.mode_string())
    assert not again.draft_q4 and again.mode_string() == both.mode_string()
    assert EngineConfig().with_mode("lever:8+no-draft-tiles").mode_string() == "lever:8+no-draft-tiles"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_ablation_flag_takes_effect_like_its_mode_suffix(command):
    """``--FLAG`` on the command line configures what ``+FLAG`` on the mode does (a flag the
    configuration forgot to read would be accepted and silently ignored)."""
    from lever_actors.cli import build_parser
    from lever_actors.engine import MODE_FLAGS, EngineConfig

    positional = ["a prompt"] if command == "generate" else []
    for flag in MODE_FLAGS:
        args = build_parser().parse_args([command, *positional, "--mode", "lever:8", f"--{flag}"])
        assert f"+{flag}" in EngineConfig.from_args(args).mode_string(), flag


def test_bench_budget_sweep_runs_what_fits_and_names_what_was_refused(tiny_bundles, tmp_path, capsys):
    from lever_actors.cli import main

    out = tmp_path / "sweep.json"
    rc = main(["bench", "--target", str(tiny_bundles[0]), "--draft", str(tiny_bundles[1]), "--modes", "flash-ar,lever:6",
               "--budgets", "2MiB,24MiB", "--humaneval", "0:1", "--max-tokens", "6", "--context", "400",
               "--warmup", "0", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["modes"]) == {"flash-ar@24MiB", "lever:6@24MiB"}
    assert set(data["refused"]) == {"flash-ar@2MiB", "lever:6@2MiB"}
    assert all("cannot run this model pair" in why for why in data["refused"].values())
    assert data["modes"]["lever:6@24MiB"]["speedup_vs_flash_ar"] == pytest.approx(
        data["modes"]["lever:6@24MiB"]["tokens_per_s"] / data["modes"]["flash-ar@24MiB"]["tokens_per_s"])
