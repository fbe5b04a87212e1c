"""The base class of every mixing strategy C: what a strategy owns, in one place.

numpy only. A strategy is a lower-triangular T×T mixing matrix C (or C = I with no step
limit) that owns

- its **recurrence**: ``stream()`` returns the ``keras_noisecurve.mixing.stream.NoiseStream``
  whose ``init``/``coefficients``/``next`` give z̃ = C⁻¹z online (numpy reference
  ``inverse_apply``; the optimizer runs the same code in TensorFlow);
- its **sensitivity** under each participation pattern: :meth:`Strategy.sensitivity`
  (one implementation; the accountant, the CLIs and the solvers call it);
- the **samplings** its accounting allows: :meth:`Strategy.allows_sampling`;
- its **file format** and config (``save``/``to_config``; the registry in
  ``keras_noisecurve.mixing.strategies`` reads them back); its solver is registered in
  ``keras_noisecurve.mixing.strategies_solve``.

Code outside ``keras_noisecurve/mixing/strategies*`` asks these attributes and methods
(``banded``, ``has_plan``, ``is_identity``, ``allows_sampling``, ``sensitivity``,
``stream``) and never compares a kind string or a class.
"""

from __future__ import annotations

import json

import numpy as np

from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.stream import NoiseStream, stream_apply

__all__ = ["ALL_SAMPLINGS", "Strategy"]

#: The samplings of ``keras_noisecurve.privacy`` (``SAMPLINGS`` there).
ALL_SAMPLINGS = ("cyclic_poisson", "fixed_epochs")


class Strategy:
    """A mixing strategy C (see the module docstring). Subclasses set the class
    attributes and implement :meth:`stream`, :meth:`leading_column_norm` and their files.

    Class attributes:
      kind: the registry key (``keras_noisecurve.mixing.strategies.STRATEGY_CLASSES``).
      banded: C is b-banded (participations ≥ b steps apart touch disjoint rows), so
        cyclic Poisson amplification applies with b partitions.
      is_identity: C = I.
      samplings: the samplings its accounting allows (cyclic Poisson needs ``banded``).
    """

    kind = ""
    banded = True
    is_identity = False
    samplings = ALL_SAMPLINGS

    # ------------------------------------------------------------- subclass API
    @property
    def steps(self):
        """Number of steps T (``None``: no step limit)."""
        raise NotImplementedError

    @property
    def bands(self) -> int:
        """Band width b of C (T when C is full lower-triangular)."""
        raise NotImplementedError

    def stream(self) -> NoiseStream:
        """The online recurrence (``keras_noisecurve.mixing.stream``)."""
        raise NotImplementedError

    def leading_column_norm(self, steps: int) -> float:
        """Largest column norm of the leading ``steps``×``steps`` block of C."""
        raise NotImplementedError

    def _overlapping_sensitivity(self, participations: int, separation: int, steps: int) -> float:
        """L2 sensitivity of k participations whose columns overlap (``separation`` < b)."""
        raise ValueError(
            f"participations {separation} steps apart overlap in a C with {self.bands} bands; the separation "
            f"must be at least b = {self.bands}."
        )

    def _identity_key(self):
        """What two equal strategies of the same class share (arrays compared exactly)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shared
    @property
    def has_plan(self) -> bool:
        """Whether C plans a finite number of steps (False only for C = I without a limit)."""
        return self.steps is not None

    @property
    def buffers(self) -> int:
        """Noise-state arrays the size of the model that the optimizer keeps."""
        return self.stream().buffers

    @property
    def accounting_bands(self) -> int:
        """The b of cyclic Poisson sampling: the bands of a banded C, 1 otherwise."""
        return self.bands if self.banded else 1

    @classmethod
    def allows_sampling(cls, sampling: str) -> bool:
        """Whether the accounting of this kind of C covers ``sampling`` (one of
        ``ALL_SAMPLINGS``). A class method: ``strategy_class(kind).allows_sampling(s)``
        answers before C is solved."""
        return sampling in cls.samplings

    def inverse_apply(self, z) -> np.ndarray:
        """z̃ = C⁻¹z by the online recurrence (``stream_apply``); z of shape (T', …), float64."""
        return stream_apply(self.stream(), z)

    def max_column_norm(self) -> float:
        """Largest column norm: the per-participation sensitivity factor of C."""
        return self.leading_column_norm(self.steps)

    def sensitivity(self, *, participations: int = 1, separation: int | None = None,
                    steps: int | None = None) -> float:
        """L2 sensitivity of k = ``participations`` participations ``separation`` steps apart.

        Over the leading ``steps``×``steps`` block of C (default: all of C). k = 1: the
        largest column norm. A banded C with separation ≥ b: √k × the largest column
        norm (the columns the participations touch do not overlap). Otherwise the
        strategy's overlapping-column formula (Toeplitz kinds with non-negative
        coefficients: ‖Σ_{i<k} C[:, i·s]‖, start 0 being the worst), or a refusal.
        """
        k = check_int("participations", participations, minimum=1)
        if steps is None:
            steps = self.steps
        elif self.steps is not None:
            steps = check_int("steps", steps, minimum=1, maximum=self.steps)
        if k == 1:
            return self.leading_column_norm(steps)
        s = check_int("separation", separation, minimum=1)
        if self.banded and s >= self.bands:
            return float(np.sqrt(k)) * self.leading_column_norm(steps)
        return self._overlapping_sensitivity(k, s, steps)

    @property
    def metadata(self) -> dict:
        """The strategy's metadata (a copy; edit it through ``with_metadata``)."""
        return json.loads(json.dumps(self._metadata))

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        mine, theirs = self._identity_key(), other._identity_key()
        if len(mine) != len(theirs):
            return False
        return all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(mine, theirs))

    __hash__ = None
