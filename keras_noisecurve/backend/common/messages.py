"""Messages every backend prints the same way (no framework import)."""

from __future__ import annotations

__all__ = ["dropped_examples", "past_plan", "plan_spent"]


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


def plan_spent(steps: int) -> str:
    """The error of a noise draw past the last of the mixing matrix's ``steps`` planned steps."""
    return (
        f"the mixing matrix plans {steps} steps and they have all been used: the privacy plan is spent. "
        "Refusing to train past step T (the noise would not be covered by the privacy accounting); solve a "
        "mixing matrix with more steps."
    )


def past_plan(step, steps=None) -> str:
    """The refusal of a train step at optimizer step ``step``, past the plan of ``steps`` steps
    (``None``: not known where the refusal is made)."""
    of = "" if steps is None else f" of {steps} steps"
    return (
        f"the optimizer's step {step} is past the mixing matrix's plan{of} (the privacy plan is spent): refusing "
        "to train past step T, whose noise the privacy accounting does not cover; solve a mixing matrix with "
        "more steps"
    )
