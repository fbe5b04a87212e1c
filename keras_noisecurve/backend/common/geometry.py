"""The backend-free geometry of a layer's call, shared by both clipping engines: the axes of an
``EinsumDense`` equation and the windows of a convolution along one spatial axis. Plain Python
on static sizes (no framework, no arrays)."""

from __future__ import annotations

import string

__all__ = ["explicit_padding", "live_taps", "parse_einsum"]


def parse_einsum(equation: str, input_rank: int):
    """``(input, kernel, output)`` letter strings of an ``EinsumDense`` equation, ``...`` replaced
    by fresh letters for the ``input_rank − len(spec)`` elided axes of an input of rank
    ``input_rank``.

    Raises:
      ValueError: the ``...`` cannot be expanded for that rank.
    """
    lhs, out = equation.replace(" ", "").split("->")
    inp, ker = lhs.split(",")
    if "..." in inp:
        fresh = [ch for ch in string.ascii_letters if ch not in equation]
        n = input_rank - len(inp.replace("...", ""))
        if n < 0 or n > len(fresh):
            raise ValueError(f"cannot expand '...' of {equation!r} for input rank {input_rank}")
        filler = "".join(fresh[:n])
        inp, out = inp.replace("...", filler), out.replace("...", filler)
    return inp, ker, out


def explicit_padding(size: int, out: int, kernel: int, stride: int, dilation: int, padding: str):
    """``(before, after)`` zeros of one spatial axis so that the padded input spans exactly the
    ``out`` windows: ``before + size + after = (out − 1)·stride + (kernel − 1)·dilation + 1``
    (``after`` may be negative: trailing entries no window reads). ``before``: 0 for ``"valid"``,
    ``⌊total/2⌋`` of the TensorFlow/Keras ``"same"`` total, ``(kernel − 1)·dilation`` for
    ``"causal"``; ``None`` for any other padding."""
    needed = (out - 1) * stride + (kernel - 1) * dilation + 1
    if padding == "valid":
        before = 0
    elif padding == "same":
        before = max(needed - size, 0) // 2
    elif padding == "causal":
        before = (kernel - 1) * dilation
    else:
        return None
    return before, needed - size - before


def live_taps(size: int, out: int, kernel: int, stride: int, dilation: int, before: int) -> list:
    """The taps j of one spatial axis that read some input entry (not padding): tap j of output
    position o reads padded index ``o·stride + j·dilation``, input index that minus ``before``."""
    return [j for j in range(kernel) if any(0 <= o * stride + j * dilation - before < size for o in range(out))]
