"""How tools/compare_llamacpp.py scores our greedy tokens against llama-completion's printed text."""
from __future__ import annotations

from tools.compare_llamacpp import text_agreement

EOS = 0
PIECES = {EOS: "<|endoftext|>", 1: "def", 2: " f", 3: "():", 4: "\n", 5: "    pass", 6: " g"}


def decode(ids) -> str:
    return "".join(PIECES[i] for i in ids)


def score(ours: list[int], theirs: str, tokens: int = 32) -> int:
    return text_agreement([ours], [theirs], decode, tokens, {EOS})["first_divergence"][0]


def test_identical_text_agrees_to_the_end_and_a_different_token_is_found():
    assert score([1, 2, 3, 4, 5], "def f():\n    pass\n") == 5
    assert score([1, 6, 3], "def f():\n") == 1


def test_an_end_of_text_both_reached_is_agreement():
    """llama-completion prints ``[end of text]`` where it stops: stopping there too agrees."""
    r = text_agreement([[1, 2, 3, EOS]], ["def f(): [end of text]\n\n"], decode, 32, {EOS})
    assert r["first_divergence"] == [4] and r["first32_identical"] == 1.0


def test_an_end_of_text_only_we_reached_is_a_divergence_at_it():
    assert score([1, 2, 3, EOS], "def f():\n    pass") == 3
    assert score([1, 2, EOS], "def f(): [end of text]") == 2  # llama.cpp wrote "():" first


def test_only_the_first_tokens_count():
    assert score([1, 2, 3, 4, 5], "def f():\n    return", tokens=3) == 3
