"""Flash faults become clear errors, never wrong output: injected at the FlashFile seam on the tiny
pair (EIO, short reads, zeros), damaged and truncated bundles, and the daemon serving through them."""
from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import trio

from lever_actors.bundle import load_bundle
from lever_actors.engine import EngineConfig
from lever_actors.errors import FlashFault, ModelError
from lever_actors.flashio import READ_RETRIES, FlashFile
from lever_actors.kernels import simd
from lever_actors.runtime import open_pipeline
from lever_actors.sampling import SamplingParams
from lever_actors.tokenizer import TextTokenizer

PROMPT = "def add(left, right):\n    return"
TOKENS = 16
# budgets at which the tiny target streams all three layers and its head (two stream slots, nothing
# pinned): lever's draft is Q4_0 on AVX-512 builds, smaller than as stored (the chains' draft, and
# lever's on other builds); test_the_fault_budgets_stream_every_layer keeps them there
STREAMED_CHAIN = dict(context=128, dram_budget=int(8.0 * 2**20))
STREAMED = dict(context=128, dram_budget=int((7.8 if simd() == "avx512-vnni" else 8.0) * 2**20))
STREAMED_AR = dict(context=128, dram_budget=int(2.2 * 2**20))


class Faults:
    """What the next reads of one region do: 'eio', 'short' or 'zeros', ``count`` times."""

    def __init__(self) -> None:
        self.kind, self.count, self.region, self.hits = None, 0, None, 0

    def arm(self, kind: str, count: int, region) -> None:
        self.kind, self.count, self.region = kind, count, region

    def take(self, offset: int) -> str | None:
        r = self.region
        if self.kind is None or self.count <= 0 or not r.offset <= offset < r.offset + r.nbytes:
            return None
        self.count -= 1
        self.hits += 1
        return self.kind


def faulty_flash_file(faults: Faults):
    class FaultyFlashFile(FlashFile):
        def _pread(self, view, offset):
            kind = faults.take(offset)
            if kind == "eio":
                raise OSError(errno.EIO, "Input/output error (injected)")
            if kind == "short":
                return 0
            n = super()._pread(view, offset)
            if kind == "zeros":
                view[:n] = bytes(n)
            return n
    return FaultyFlashFile


def generate_all(cfg, target, draft, faults: Faults, steps, tokens: int = TOKENS):
    """Run ``steps`` (callables arming faults, then a generation each) on one pipeline; per step:
    the tokens or the FlashFault, and whether every stream buffer came back."""
    tok = TextTokenizer.from_file(target / "tokenizer.json")

    async def main():
        out = []
        async with open_pipeline(cfg, target, draft if cfg.drafted else None, set(tok.eos_ids),
                                 flash_file=faulty_flash_file(faults)) as pipe:
            async def emit(_):
                return False
            for step in steps:
                step()
                try:
                    result = (await pipe.generate(tok.encode(PROMPT), tokens, SamplingParams(), emit))[0]
                except FlashFault as exc:
                    result = exc
                out.append((result, pipe.verifier.taken == set()))
        return out

    return trio.run(main)


@pytest.fixture(scope="module")
def reference(tiny_bundles):
    target, draft = tiny_bundles
    faults = Faults()
    return generate_all(EngineConfig(mode="lever", gamma=6, **STREAMED), target, draft, faults, [lambda: None])[0][0]


def layer(tiny_bundles, i: int):
    return load_bundle(tiny_bundles[0]).layers[i]


@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_transient_read_fault_is_retried_and_the_output_is_exact(tiny_bundles, reference, kind):
    faults = Faults()
    cfg = EngineConfig(mode="lever", gamma=6, **STREAMED)
    [(out, freed)] = generate_all(cfg, *tiny_bundles, faults, [lambda: faults.arm(kind, READ_RETRIES, layer(tiny_bundles, 1))])
    assert out == reference and freed and faults.hits == READ_RETRIES  # every injected fault was met


@pytest.mark.parametrize("mode", ["flash-ar", "lever:6"])
@pytest.mark.parametrize("kind", ["eio", "short"])
def test_a_persistent_read_fault_fails_the_request_names_the_region_and_the_next_is_exact(
        tiny_bundles, reference, kind, mode):
    faults = Faults()
    name, _, gamma = mode.partition(":")
    cfg = EngineConfig(mode=name, gamma=int(gamma or 8), **(STREAMED if name == "lever" else STREAMED_AR))
    ref = reference if name == "lever" else generate_all(cfg, *tiny_bundles, Faults(), [lambda: None])[0][0]
    steps = [lambda: faults.arm(kind, 10**6, layer(tiny_bundles, 1)), lambda: faults.arm(None, 0, None)]
    (failed, freed), (after, freed_after) = generate_all(cfg, *tiny_bundles, faults, steps)
    assert isinstance(failed, FlashFault) and failed.retryable
    assert "layer 1" in str(failed) and "flash.bin" in str(failed)
    assert freed and freed_after and after == ref


def test_reads_that_return_zeros_are_caught_before_and_after_verification(tiny_bundles, reference):
    faults = Faults()
    faults.arm("zeros", 1, layer(tiny_bundles, 0))  # before the pipeline reads anything: the checksum
    cfg = EngineConfig(mode="lever", gamma=6, **STREAMED)
    steps = [lambda: None,
             lambda: faults.arm(None, 0, None),
             lambda: faults.arm("zeros", 1, layer(tiny_bundles, 2)),  # verified before: the probe
             lambda: faults.arm(None, 0, None)]
    (first, f1), (clean, f2), (later, f3), (again, f4) = generate_all(cfg, *tiny_bundles, faults, steps)
    assert isinstance(first, FlashFault) and not first.retryable and "checksum" in str(first)
    assert "layer 0" in str(first)
    assert clean == reference and again == reference and all((f1, f2, f3, f4))
    assert isinstance(later, FlashFault) and "layer 2" in str(later)


def damaged_copy(bundle: Path, tmp: Path, region_index: int) -> Path:
    out = tmp / bundle.name
    shutil.copytree(bundle, out)
    r = load_bundle(out).layers[region_index]
    with open(out / r.file, "r+b") as f:
        f.seek(r.offset + r.nbytes // 2)
        b = f.read(1)
        f.seek(r.offset + r.nbytes // 2)
        f.write(bytes([b[0] ^ 0x40]))
    return out


def test_a_changed_byte_in_a_streamed_layer_is_refused_by_name(tiny_bundles, tmp_path):
    target = damaged_copy(tiny_bundles[0], tmp_path, 2)
    [(out, freed)] = generate_all(EngineConfig(mode="lever", gamma=6, **STREAMED), target, tiny_bundles[1],
                                  Faults(), [lambda: None])
    assert isinstance(out, FlashFault) and "layer 2" in str(out) and "checksum" in str(out) and freed


def test_a_changed_byte_in_a_pinned_layer_is_refused_at_load(tiny_bundles, tmp_path):
    target = damaged_copy(tiny_bundles[0], tmp_path, 0)
    with pytest.raises(ModelError, match="layer 0: checksum mismatch"):
        generate_all(EngineConfig(mode="lever", gamma=6, context=128, dram_budget=12 << 20), target,
                     tiny_bundles[1], Faults(), [lambda: None])


def test_a_truncated_flash_file_is_refused_at_load(tiny_bundles, tmp_path):
    out = tmp_path / "truncated"
    shutil.copytree(tiny_bundles[0], out)
    flash = out / load_bundle(out).layers[-1].file
    with open(flash, "r+b") as f:
        f.truncate(flash.stat().st_size - 4096)
    with pytest.raises(ModelError, match="truncated"):
        load_bundle(out)


def test_the_daemon_answers_a_fault_with_a_retryable_error_and_keeps_serving(tiny_bundles, reference, tmp_path):
    from lever_actors.client import open_client
    from lever_actors.daemon import ServeConfig, serve
    from lever_actors.errors import RemoteError
    from lever_actors.service import EngineBackend

    faults = Faults()
    cfg = EngineConfig(target=str(tiny_bundles[0]), draft=str(tiny_bundles[1]), mode="lever", gamma=6, **STREAMED)
    backend = EngineBackend(cfg, flash_file=faulty_flash_file(faults))
    tok = TextTokenizer.from_file(tiny_bundles[0] / "tokenizer.json")

    async def main():
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(serve, ServeConfig(socket=tmp_path / "d.sock"), backend)
            async with open_client(tmp_path / "d.sock") as client:
                faults.arm("eio", 10**6, layer(tiny_bundles, 1))
                with pytest.raises(RemoteError) as info:
                    await client.generate(PROMPT, max_tokens=TOKENS)
                faults.arm(None, 0, None)
                ok = await client.generate(PROMPT, max_tokens=TOKENS)
                stats = await client.stats()
            daemon.shutdown()
        return info.value, ok, stats

    error, ok, stats = trio.run(main)
    assert error.code == "io_error" and error.retryable and "layer 1" in error.message
    assert ok.token_ids == reference and tok.decode(ok.token_ids) == ok.text
    assert stats["daemon"]["requests"]["failed"] == 1 and stats["daemon"]["pool"]["buffers_lent"] <= \
        stats["daemon"]["pool"]["buffers_total"]


def test_models_verify_names_each_bad_region_and_exits_non_zero(tiny_bundles, tmp_path, capsys):
    from lever_actors.cli import main

    assert main(["models", "verify", str(tiny_bundles[0]), str(tiny_bundles[1])]) == 0
    damaged = damaged_copy(tiny_bundles[0], tmp_path, 1)
    assert main(["models", "verify", str(damaged)]) == 1
    out = capsys.readouterr().out
    assert "layer 1: checksum mismatch" in out and "1 bad region" in out


def test_read_faults_on_a_real_streamed_layer_fail_the_request_and_the_next_is_exact(real_bundles):
    """The same seam on the real pair at 768 MiB: the last layer of the 1.5B target streams from flash.
    EIO, short reads and zeros in turn, on one pipeline: each fails its request naming the layer,
    frees every buffer, and the request after it is exact."""
    target, draft = real_bundles
    cfg = EngineConfig(mode="lever", gamma=16, context=256, dram_budget=768 << 20)
    faults = Faults()
    layers = load_bundle(target).layers
    region, name = layers[-1], f"layer {len(layers) - 1}"
    steps = [lambda: None]
    for kind in ("eio", "short", "zeros"):
        steps += [lambda kind=kind: faults.arm(kind, 10**6, region), lambda: faults.arm(None, 0, None)]
    (ref, f0), *rest = generate_all(cfg, target, draft, faults, steps, tokens=8)
    assert isinstance(ref, list) and f0
    for (failed, freed), (after, freed_after) in zip(rest[::2], rest[1::2]):
        assert isinstance(failed, FlashFault) and name in str(failed), failed
        assert after == ref and freed and freed_after


def flip_embedding_row(bundle: Path, token: int) -> None:
    """Change one byte of embedding row ``token`` of ``bundle`` in place."""
    e = load_bundle(bundle).embedding
    at = e["offset"] + token * e["row_bytes"]
    with open(bundle / e["file"], "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def damaged_embedding_copy(bundle: Path, tmp: Path, token: int) -> Path:
    out = tmp / bundle.name
    shutil.copytree(bundle, out)
    flip_embedding_row(out, token)
    return out


def prompt_token(bundle: Path) -> int:
    return TextTokenizer.from_file(bundle / "tokenizer.json").encode(PROMPT)[0]


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_changed_byte_in_the_embedding_table_is_refused_at_load(tiny_bundles, tmp_path, which):
    """The rows are read on demand, never as one region: the whole table is checked when it opens."""
    i = ("target", "draft").index(which)
    bundles = list(tiny_bundles)
    bundles[i] = damaged_embedding_copy(bundles[i], tmp_path, prompt_token(bundles[i]))
    with pytest.raises(ModelError, match="embedding: checksum mismatch") as info:
        generate_all(EngineConfig(mode="lever", gamma=6, **STREAMED), *bundles, Faults(), [lambda: None])
    assert str(bundles[i]) in str(info.value)


def test_generate_on_a_damaged_embedding_table_fails_without_output(tiny_bundles, tmp_path, capsys):
    from lever_actors.cli import main

    target = damaged_embedding_copy(tiny_bundles[0], tmp_path, prompt_token(tiny_bundles[0]))
    code = main(["generate", PROMPT, "--max-tokens", "8", "--mode", "flash-ar", "--target", str(target),
                 "--context", "128", "--json"])
    out, err = capsys.readouterr()
    assert code == 1 and out == "" and "embedding: checksum mismatch" in err


def test_an_embedding_row_changed_after_it_was_read_is_refused(tiny_bundles, tmp_path):
    """A row read again must match its first read: a file changed in place under the process is a
    FlashFault that fails the request (its pass is lost, the verifier goes on), never rows computed on."""
    target = tmp_path / "target"
    shutil.copytree(tiny_bundles[0], target)
    token = TextTokenizer.from_file(target / "tokenizer.json").encode(PROMPT)[-1]  # read again: not cached
    results = generate_all(EngineConfig(mode="lever", gamma=6, **STREAMED), target, tiny_bundles[1], Faults(),
                           [lambda: None, lambda: flip_embedding_row(target, token), lambda: None])
    fault = results[1][0]
    assert isinstance(fault, FlashFault) and not fault.retryable
    assert f"embedding row {token}" in str(fault) and "changed in place" in str(fault)
    assert isinstance(results[2][0], FlashFault)  # and so does every later request: the row stays changed
    assert all(back for _, back in results)  # every stream buffer came back


def test_a_transient_bad_read_of_an_embedding_row_is_read_again(tiny_bundles, monkeypatch):
    from lever_actors import model

    table = model.EmbeddingTable(load_bundle(tiny_bundles[0]))
    first = table.lookup([5, 7])
    real, calls = model.read_raw_rows, []

    def zeros_once(*args):
        raw = real(*args)
        if not calls:
            raw[0] = 0
        calls.append(args)
        return raw

    monkeypatch.setattr(model, "read_raw_rows", zeros_once)
    try:
        again = table.lookup([5, 7])
    finally:
        table.close()
    assert np.array_equal(first, again) and len(calls) == 2  # row 5 was read once more


@pytest.mark.parametrize("mode", ["lever", "flash-chain", "flash-chain+no-overlap"])
def test_a_draft_embedding_row_changed_after_it_was_read_fails_the_request_not_the_pipeline(
        tiny_bundles, tmp_path, reference, mode):
    """The drafter answers what it owes with the fault instead of dying with it: that request fails,
    and once the row reads back as it first did, the same pipeline's next output is exact."""
    draft = tmp_path / "draft"
    shutil.copytree(tiny_bundles[1], draft)
    token = TextTokenizer.from_file(draft / "tokenizer.json").encode(PROMPT)[-1]  # fed again: not cached
    base, _, flags = mode.partition("+")
    cfg = EngineConfig(mode=base, gamma=6, overlap=flags != "no-overlap", **(STREAMED if base == "lever" else STREAMED_CHAIN))
    flip = lambda: flip_embedding_row(draft, token)  # noqa: E731 (a second flip puts the byte back)
    results = generate_all(cfg, tiny_bundles[0], draft, Faults(), [lambda: None, flip, lambda: None, flip])
    first, faulted, again, restored = (r for r, _ in results)
    assert first == reference and restored == reference
    for fault in (faulted, again):  # and every request while the row stays changed
        assert isinstance(fault, FlashFault) and not fault.retryable
        assert f"embedding row {token}" in str(fault) and str(draft) in str(fault)
    assert all(back for _, back in results)


def test_the_daemon_answers_a_changed_draft_row_with_model_damaged_and_keeps_serving(tiny_bundles, reference,
                                                                                      tmp_path):
    """Through the real socket: the request that meets the changed draft row gets `model_damaged`
    (not retryable), and once the row reads back as it first did the daemon serves exact output."""
    from lever_actors.client import open_client
    from lever_actors.daemon import ServeConfig, serve
    from lever_actors.errors import RemoteError
    from lever_actors.service import EngineBackend

    draft = tmp_path / "draft"
    shutil.copytree(tiny_bundles[1], draft)
    token = TextTokenizer.from_file(draft / "tokenizer.json").encode(PROMPT)[-1]
    cfg = EngineConfig(target=str(tiny_bundles[0]), draft=str(draft), mode="lever", gamma=6, **STREAMED)

    async def main():
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(serve, ServeConfig(socket=tmp_path / "d.sock"), EngineBackend(cfg))
            async with open_client(tmp_path / "d.sock") as client:
                first = await client.generate(PROMPT, max_tokens=TOKENS)
                flip_embedding_row(draft, token)
                with pytest.raises(RemoteError) as info:
                    await client.generate(PROMPT, max_tokens=TOKENS)
                flip_embedding_row(draft, token)  # the byte back
                after = await client.generate(PROMPT, max_tokens=TOKENS)
                stats = await client.stats()
            daemon.shutdown()
        return first, info.value, after, stats

    first, error, after, stats = trio.run(main)
    assert first.token_ids == reference and after.token_ids == reference
    assert error.code == "model_damaged" and not error.retryable and f"embedding row {token}" in error.message
    assert stats["daemon"]["requests"]["failed"] == 1


@pytest.mark.parametrize("mode", ["lever", "flash-ar"])
def test_the_fault_budgets_stream_every_layer(tiny_bundles, mode):
    """The faults above are injected into streamed reads, so at their budgets the planner must pin no
    layer of the tiny target (a plan that counts less memory pins more at the same budget)."""
    cfg = EngineConfig(mode=mode, gamma=6, **(STREAMED if mode == "lever" else STREAMED_AR))

    async def plan():
        async with open_pipeline(cfg, tiny_bundles[0], tiny_bundles[1] if mode == "lever" else None, set()) as pipe:
            return pipe.plan

    p = trio.run(plan)
    assert p.pinned == () and len(p.streamed) == 3, (p.pinned, p.streamed)
