"""HeadScores: the head's slices merged one at a time give exactly np.argmax over the whole row."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lever_actors.head_scores import HeadScores

# few distinct values so that ties across slices are common; every float class numpy orders specially
VALUES = st.sampled_from([0.0, -0.0, 1.0, 1.5, -2.0, np.inf, -np.inf, np.nan, 3.25, 1e30])


@st.composite
def sliced_logits(draw):
    rows = draw(st.integers(0, 5))
    widths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=6))
    vocab = sum(widths)
    flat = draw(st.lists(VALUES, min_size=rows * vocab, max_size=rows * vocab))
    return np.asarray(flat, np.float32).reshape(rows, vocab), widths


@settings(max_examples=400, deadline=None)
@given(sliced_logits(), st.booleans())
def test_merged_argmax_is_numpys_argmax_of_the_whole_row(case, want_logits):
    logits, widths = case
    rows, vocab = logits.shape
    if vocab == 0:
        return
    scores = HeadScores(rows, vocab, want_logits)
    lo = 0
    for w in widths:
        scores.add(logits[:, lo:lo + w])
        lo += w
    assert np.array_equal(scores.argmax, np.argmax(logits, axis=1).astype(np.int32))
    if want_logits:
        assert np.array_equal(scores.logits, logits, equal_nan=True)
    else:
        assert scores.logits is None


def test_a_missing_or_overflowing_slice_is_an_error_not_a_wrong_token():
    scores = HeadScores(2, 10, False)
    scores.add(np.zeros((2, 6), np.float32))
    with pytest.raises(ValueError, match="covered 6 of 10"):
        scores.argmax
    with pytest.raises(ValueError, match="does not fit"):
        scores.add(np.zeros((2, 5), np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        scores.add(np.zeros((3, 4), np.float32))
