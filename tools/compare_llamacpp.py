"""Greedy agreement with an independent implementation (llama.cpp through llama-cpp-python).

    python tools/compare_llamacpp.py --humaneval 0:80 --tokens 64 [--model target|draft|both]

llama-cpp-python is a tool dependency only: it is installed from PyPI into its own venv
(``--llama-venv``, default ``~/.cache/lever-actors/llama-venv``; building it compiles llama.cpp, a
few minutes; with ``LLAMA_CPP_LIB_PATH`` pointing at an existing llama.cpp build, e.g. the one
``tools/peer_llamacpp.py`` makes, install it with ``CMAKE_ARGS=-DLLAMA_BUILD=OFF``) and runs in a subprocess, fed the same prompt token ids our tokenizer produced. For
each prompt both sides decode ``--tokens`` greedy tokens from the raw prompt; we report the share of
prompts whose first 32 tokens are identical and the mean index of the first divergence (near-ties in
the logits make some divergence legitimate: int8 activations round differently from llama.cpp's q8).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

WORKER = r'''
import json, sys
from llama_cpp import Llama
job = json.load(open(sys.argv[1]))
llm = Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"], verbose=False)
out = []
for ids in job["prompts"]:
    llm.reset()
    toks = []
    for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        toks.append(int(t))
        if len(toks) >= job["tokens"] or t == llm.token_eos():
            break
    out.append(toks)
json.dump(out, open(sys.argv[2], "w"))
'''


def ensure_llama(venv_dir: Path) -> Path:
    py = venv_dir / "bin" / "python"
    ok = py.exists() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0
    if not ok:
        print(f"installing llama-cpp-python into {venv_dir} (compiles llama.cpp) ...", file=sys.stderr)
        venv.create(venv_dir, with_pip=True)
        subprocess.run([str(py), "-m", "pip", "install", "llama-cpp-python"], check=True)
    return py


def ours(bundle: Path, prompts: list[list[int]], tokens: int, threads: int, kv: str | None = None) -> list[list[int]]:
    import numpy as np

    from lever_actors.model import KVCache
    from lever_actors.bundle import load_bundle
    from lever_actors.decode import decode_resident
    from lever_actors.tokenizer import load_tokenizer
    from lever_actors.model import Transformer
    from lever_actors.ortrt import LaneConfig
    from lever_actors.sampling import SamplingParams

    b = load_bundle(bundle)
    eos = set(load_tokenizer(bundle).eos_ids)
    m = Transformer(b, 1024, LaneConfig(threads=threads))
    if kv is not None:  # the other KV row format, for a side-by-side figure
        m.kv = KVCache(m.n_layer, m.n_kv_head, 1024, m.head_dim, np.dtype(kv).type)
    out = []
    for ids in prompts:
        m.kv.truncate(0)
        out.append(decode_resident(m, ids, tokens, SamplingParams(), eos).token_ids)
    return out


def completion_texts(binary: Path, gguf: Path, prompts: list[str], tokens: int, threads: int) -> list[str]:
    """llama.cpp's greedy continuation of each prompt by its ``llama-completion`` binary (text)."""
    out = []
    for i, prompt in enumerate(prompts):
        p = subprocess.run([str(binary), "-m", str(gguf), "-p", prompt, "-n", str(tokens), "-no-cnv", "--temp", "0",
                            "-s", "0", "-t", str(threads), "-c", "1024", "--no-repack", "--no-escape", "--fit", "off",
                            "--no-display-prompt", "--simple-io"], capture_output=True, text=True, check=True,
                           stdin=subprocess.DEVNULL)
        out.append(p.stdout)
        print(f"\rllama-completion {i + 1}/{len(prompts)}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return out


def text_agreement(mine: list[list[int]], theirs: list[str], decode, tokens: int, eos=()) -> dict:
    """As :func:`agreement`, against llama.cpp's text: our token i agrees while the text of our
    first i + 1 tokens is a prefix of theirs (the binary may print a trailing newline of its own).
    Our end-of-text token agrees when llama.cpp ended there too: it prints ``[end of text]``
    where it stopped. ``theirs`` must run longer than ``tokens``, or its last tokens would look
    like a divergence (the binary does not always print its final token)."""
    firsts = []
    for ids, text in zip(mine, theirs):
        n = min(len(ids), tokens)
        first = n
        for i in range(n):
            if ids[i] in eos:
                before = decode(ids[:i])
                ended = text.startswith(before) and text[len(before):].lstrip().startswith("[end of text]")
                first = n if ended else i
                break
            if not text.startswith(decode(ids[:i + 1])):
                first = i
                break
        firsts.append(first)
    same32 = sum(1 for f, ids in zip(firsts, mine) if f >= min(32, len(ids)))
    return {"prompts": len(mine), "first32_identical": same32 / len(mine),
            "mean_first_divergence": sum(firsts) / len(mine), "first_divergence": firsts}


def agreement(a: list[list[int]], b: list[list[int]], tokens: int) -> dict:
    firsts = []
    for x, y in zip(a, b):
        n = min(len(x), len(y), tokens)
        d = next((i for i in range(n) if x[i] != y[i]), n)
        firsts.append(d)
    same32 = sum(1 for f, x, y in zip(firsts, a, b) if f >= min(32, len(x), len(y)))
    return {"prompts": len(a), "first32_identical": same32 / len(a), "mean_first_divergence": sum(firsts) / len(a),
            "first_divergence": firsts}


def main() -> None:
    from lever_actors.bench import humaneval_prompts
    from lever_actors.tokenizer import load_tokenizer
    from lever_actors.models import DEFAULT_PAIR, fetch, gguf_path, lever_home

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--humaneval", default="0:80")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", choices=("target", "draft", "both"), default="both")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-venv", type=Path, default=lever_home() / "llama-venv")
    ap.add_argument("--kv", choices=("default", "both"), default="default",
                    help="'both' also decodes with fp32 KV rows, to show what the half-size rows change")
    ap.add_argument("--llama-bin", type=Path, default=None,
                    help="a llama.cpp build's bin/ directory: compare against its llama-completion binary "
                         "(text) instead of the Python binding")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    bundles = fetch()
    tok = load_tokenizer(bundles["target"])
    texts = [p for _, p in humaneval_prompts(a.humaneval)]
    prompts = [tok.encode(p) for p in texts]
    report = {}
    if a.llama_bin is not None:
        for role in (("target", "draft") if a.model == "both" else (a.model,)):
            theirs = completion_texts(a.llama_bin / "llama-completion", gguf_path(DEFAULT_PAIR[role]), texts,
                                      a.tokens + 16, a.threads)
            for kv in ((None, "float32") if a.kv == "both" else (None,)):
                key = role if kv is None else f"{role}_kv_{kv}"
                mine = ours(bundles[role], prompts, a.tokens, a.threads, kv)
                report[key] = text_agreement(mine, theirs, tok.decode, a.tokens, set(tok.eos_ids))
                print(f"{key}: first 32 tokens identical on {100 * report[key]['first32_identical']:.0f}% of "
                      f"{len(prompts)} prompts", flush=True)
        if a.json_out:
            Path(a.json_out).write_text(json.dumps(report, indent=1))
        return
    py = ensure_llama(a.llama_venv)
    for role in (("target", "draft") if a.model == "both" else (a.model,)):
        with tempfile.TemporaryDirectory() as d:
            job, res, script = Path(d) / "job.json", Path(d) / "out.json", Path(d) / "worker.py"
            script.write_text(WORKER)
            job.write_text(json.dumps({"gguf": str(gguf_path(DEFAULT_PAIR[role])), "prompts": prompts,
                                       "tokens": a.tokens, "n_ctx": 1024, "threads": a.threads}))
            env = dict(os.environ, PYTHONPATH="")
            subprocess.run([str(py), str(script), str(job), str(res)], check=True, env=env)
            theirs = json.loads(res.read_text())
        for kv in ((None, "float32") if a.kv == "both" else (None,)):
            key = role if kv is None else f"{role}_kv_{kv}"
            report[key] = agreement(ours(bundles[role], prompts, a.tokens, a.threads, kv), theirs, a.tokens)
            print(f"{key}: first 32 tokens identical on {100 * report[key]['first32_identical']:.0f}% of "
                  f"{len(prompts)} prompts; mean first divergence at token {report[key]['mean_first_divergence']:.1f}",
                  flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
