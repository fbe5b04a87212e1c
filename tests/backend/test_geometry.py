"""The backend-free geometry both clipping engines use (keras_noisecurve.backend.common.geometry),
against values derived by hand and a brute-force count of the windows."""

import itertools

import numpy as np
import pytest

from keras_noisecurve.backend.common.geometry import explicit_padding, live_taps, parse_einsum


def test_parse_einsum_expands_the_ellipsis_with_fresh_letters():
    assert parse_einsum("ab,bc->ac", 2) == ("ab", "bc", "ac")
    assert parse_einsum(" ab , bc -> ac ", 2) == ("ab", "bc", "ac")
    inp, ker, out = parse_einsum("a...b,bc->a...c", 4)  # two elided axes
    assert (len(inp), ker, len(out)) == (4, "bc", 4)
    filler = inp[1:3]
    assert inp == f"a{filler}b" and out == f"a{filler}c" and not set(filler) & set("abc")
    assert parse_einsum("a...b,bc->a...c", 2) == ("ab", "bc", "ac")  # nothing elided


def test_parse_einsum_refuses_a_rank_too_small():
    with pytest.raises(ValueError, match="cannot expand"):
        parse_einsum("abc...d,de->abc...e", 3)


@pytest.mark.parametrize(
    "size, out, kernel, stride, dilation, padding, expected",
    [
        (5, 3, 3, 1, 1, "valid", (0, 0)),   # 3 windows of 3 fill 5 exactly
        (5, 5, 3, 1, 1, "same", (1, 1)),    # total 2, split 1 / 1
        (6, 3, 3, 2, 1, "same", (0, 1)),    # TensorFlow's "same": total 1, the extra zero after
        (5, 3, 3, 2, 1, "same", (1, 1)),
        (1, 1, 5, 1, 1, "same", (2, 2)),    # a 5-tap kernel on a 1-entry axis
        (5, 5, 3, 1, 2, "causal", (4, 0)),   # (k − 1)·d = 4 zeros before, none after
        (7, 2, 3, 3, 1, "valid", (0, -1)),  # strided: windows 0-2 and 3-5; entry 6 is read by none
    ],
)
def test_explicit_padding_by_hand(size, out, kernel, stride, dilation, padding, expected):
    assert explicit_padding(size, out, kernel, stride, dilation, padding) == expected


def test_explicit_padding_unknown_padding_is_none():
    assert explicit_padding(5, 5, 3, 1, 1, "reflect") is None


@pytest.mark.parametrize("size, kernel, stride, dilation", list(itertools.product((1, 4, 7), (1, 3, 5), (1, 2), (1, 2))))
@pytest.mark.parametrize("padding", ["valid", "same"])
def test_padding_and_live_taps_agree_with_a_brute_force_count(size, kernel, stride, dilation, padding):
    span = (kernel - 1) * dilation + 1
    out = -(-size // stride) if padding == "same" else (size - span) // stride + 1  # Keras's output size
    if out < 1:
        return
    before, after = explicit_padding(size, out, kernel, stride, dilation, padding)
    assert before + size + after == (out - 1) * stride + span
    padded = np.concatenate([np.zeros(before), np.arange(1, size + 1), np.zeros(max(after, 0))])
    reads = {j for o in range(out) for j in range(kernel) if padded[o * stride + j * dilation] != 0}
    assert live_taps(size, out, kernel, stride, dilation, before) == sorted(reads)
