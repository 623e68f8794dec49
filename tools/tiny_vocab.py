"""A tiny Qwen-shaped byte-level BPE vocabulary for test models written as GGUF.

`build_tiny_vocab()` returns a spec dict in the shape of
`lever_actors.tokenizer.tokenizer_spec_from_gguf`: the 256 byte tokens (GPT-2 alphabet,
in Qwen's id order), BPE merges trained by `tokenizers` with the same pre-tokenizer, and
`<|endoftext|>`, `<|im_start|>`, `<|im_end|>` as control tokens at the end.

The training corpus is synthetic Python source generated from `seed` with
`random.Random`, not stdlib files: stdlib source changes between Python versions, and
the vocabulary (hence any golden transcript decoded with it) must not.
"""
from __future__ import annotations

import json
import random
from typing import Any

from gguf import GGUFWriter, TokenType
from tokenizers import Tokenizer, models, normalizers, trainers
from tokenizers.pre_tokenizers import ByteLevel

from lever_actors.tokenizer import DEFAULT_SYSTEM_PROMPT, byte_level_alphabet, make_pre_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# A compact ChatML template that renders what TextTokenizer.apply_chat_template does.
TINY_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    f"{{{{- '<|im_start|>system\\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\\n' }}}}"
    "{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_NAMES = ["value", "items", "result", "count", "index", "data", "self", "key", "name", "path",
          "line", "text", "total", "node", "left", "right", "buffer", "token", "size", "offset"]
_VERBS = ["get", "set", "read", "write", "parse", "build", "find", "count", "merge", "split"]
# Made-up identifiers from syllables give the trainer enough distinct words for ~4k merges.
_SYLLABLES = ["ka", "lo", "mi", "ner", "tor", "qua", "zi", "pe", "run", "sta", "vek", "dal", "bo", "xu"]
# Non-ASCII words so that some merges join bytes of multibyte characters.
_WORDS = ["return", "the", "list", "of", "values", "naïve", "café", "größe", "日本語", "数据",
          "résumé", "🐍", "über", "λ", "→", "≤", "ok"]
_EXPRS = ["{a} + {b}", "{a} * {n}", "len({a})", "{a}[{n}]", "{a}.{v}_{b}()", "{a} if {b} else None",
          "[{a} for {a} in {b}]", "{{'{a}': {b}}}", "'{w}'", "{n} - {a}", "not {a}", "{a} <= {n}.{n}"]


def _synthetic_python(rng: random.Random, n_functions: int = 1500) -> list[str]:
    """Deterministic Python-looking functions (one string each) drawn from small word lists."""
    def name() -> str:
        if rng.random() < 0.6:
            return rng.choice(_NAMES)
        return "_".join("".join(rng.choices(_SYLLABLES, k=rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3)))

    def expr() -> str:
        return rng.choice(_EXPRS).format(a=name(), b=name(), v=rng.choice(_VERBS), w=rng.choice(_WORDS),
                                         n=rng.randrange(1000))

    out = []
    for _ in range(n_functions):
        args = ", ".join(name() for _ in range(rng.randrange(1, 4)))
        doc = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 8)))
        body = [f"    {name()} = {expr()}" for _ in range(rng.randrange(1, 4))]
        if rng.random() < 0.5:
            body.append(f"    for {name()} in range({rng.randrange(1, 1000)}):")
            body.append(f"        # {' '.join(rng.choice(_WORDS) for _ in range(4))}")
            body.append(f"        {name()} += {expr()}")
        out.append(f'def {rng.choice(_VERBS)}_{name()}({args}):\n    """{doc.capitalize()}."""\n'
                   + "\n".join(body) + f"\n    return {expr()}\n\n")
    return out


def _train_merges(corpus: list[str], n_merges: int) -> list[str]:
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = make_pre_tokenizer("qwen2")
    trainer = trainers.BpeTrainer(vocab_size=256 + n_merges, initial_alphabet=ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tk.train_from_iterator(corpus, trainer)
    merges = json.loads(tk.to_str())["model"]["merges"]
    # Serialized as [left, right] pairs by recent `tokenizers`, as "left right" by older ones.
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def build_tiny_vocab(vocab_size: int = 384, seed: int = 0) -> dict[str, Any]:
    """A deterministic spec dict with `vocab_size` tokens (256 bytes + merges + 3 specials).

    bos = pad = `<|endoftext|>`, eos = `<|im_end|>`, no BOS added, like Qwen2.5.

    Raises:
        ValueError: vocab_size leaves no room for the bytes and specials, or needs more
            merges than the synthetic corpus supports.
    """
    n_merges = vocab_size - 256 - len(SPECIAL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} < {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
    merges = _train_merges(_synthetic_python(random.Random(seed)), n_merges) if n_merges else []
    if len(merges) != n_merges:
        raise ValueError(f"corpus yields only {len(merges)} merges; vocab_size {vocab_size} needs {n_merges}")
    # Code-point order puts the printable bytes first, the shifted ones last: Qwen's ids 0-255.
    tokens = sorted(byte_level_alphabet(), key=ord)
    tokens += ["".join(m.split(" ")) for m in merges]
    tokens += SPECIAL_TOKENS
    types = [int(TokenType.NORMAL)] * (len(tokens) - len(SPECIAL_TOKENS))
    types += [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    endoftext = tokens.index("<|endoftext|>")
    return {
        "tokens": tokens, "token_types": types, "merges": merges,
        "bos_id": endoftext, "eos_id": tokens.index("<|im_end|>"), "pad_id": endoftext,
        "add_bos": False, "chat_template": TINY_CHAT_TEMPLATE, "pre": "qwen2",
    }


def write_tokenizer_fields(gguf_writer: GGUFWriter, spec: dict[str, Any]) -> None:
    """Add the `tokenizer.ggml.*` and chat template fields for `spec` to a GGUFWriter.

    `tokenizer_spec_from_gguf` reads the written file back to an equal spec.
    """
    gguf_writer.add_tokenizer_model("gpt2")
    gguf_writer.add_tokenizer_pre(spec["pre"])
    gguf_writer.add_token_list(spec["tokens"])
    gguf_writer.add_token_types(spec["token_types"])
    gguf_writer.add_token_merges(spec["merges"])
    for key, add in (("bos_id", gguf_writer.add_bos_token_id), ("eos_id", gguf_writer.add_eos_token_id),
                     ("pad_id", gguf_writer.add_pad_token_id)):
        if spec[key] is not None:
            add(spec[key])
    gguf_writer.add_add_bos_token(spec["add_bos"])
    if spec["chat_template"] is not None:
        gguf_writer.add_chat_template(spec["chat_template"])
