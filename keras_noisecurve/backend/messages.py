"""Messages every backend prints the same way (no framework import)."""

from __future__ import annotations

__all__ = ["dropped_examples"]


def dropped_examples(count: int, steps: int, first: int, last: int) -> str:
    """The warning after a ``fit`` that dropped ``count`` non-finite examples in ``steps`` steps
    (the first at step ``first``, the last at step ``last``)."""
    where = f"step {first}" if steps == 1 else f"{steps} steps (the first at step {first}, the last at step {last})"
    return (
        f"private training dropped {count} example(s) whose loss or gradient was not finite, in {where}: "
        "they contributed 0 to the clipped sum (within the clip bound, so the privacy guarantee holds) and the "
        "run went on without them. The count per epoch is the 'nonfinite_examples' log of fit. Check the "
        "inputs and labels for inf/nan (numpy.isfinite), or a layer that overflows."
    )
