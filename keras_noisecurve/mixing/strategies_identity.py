"""C = I: independent noise, i.e. DP-SGD, as a strategy (kind ``"dpsgd"``).

numpy only. ``IdentityMixing()`` has no step limit (what ``mixing="dpsgd"`` means);
``IdentityMixing(steps=T)`` plans T steps (the optimizer then refuses step T, like any
other strategy). Its recurrence has no state (z̃_t = z_t), every column of C is a unit
vector, so k participations have sensitivity √k at any separation, and both samplings
are allowed (C is 1-banded). ``MixingMatrix.identity(T)`` is the same noise stored as a
banded C with b = 1.

File: the ``keras-noisecurve/mixing-strategy`` ``.npz`` with kind ``"dpsgd"``, no
parameters, and ``steps`` 0 for "no limit".
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Optional

import numpy as np

from keras_noisecurve._validation import check_int
from keras_noisecurve.mixing.stream import IdentityStream
from keras_noisecurve.mixing.strategies_base import Strategy
from keras_noisecurve.mixing.strategies_toeplitz import save_strategy_file, strategy_digest

__all__ = ["IdentityMixing"]


class IdentityMixing(Strategy):
    """C = I (DP-SGD).

    Args:
      steps: T ≥ 1, the planned steps, or ``None`` (default): no step limit.
      metadata: JSON-serialisable dict.
    """

    kind = "dpsgd"
    banded = True
    is_identity = True

    def __init__(self, *, steps: Optional[int] = None, metadata: Mapping[str, Any] | None = None):
        self._steps = None if steps is None else check_int("steps", steps, minimum=1)
        self._metadata = dict(metadata or {})
        json.dumps(self._metadata)

    @property
    def steps(self) -> Optional[int]:
        """T, or ``None`` without a step limit."""
        return self._steps

    @property
    def bands(self) -> int:
        """1: C is diagonal."""
        return 1

    def stream(self) -> IdentityStream:
        return IdentityStream(self._steps)

    def leading_column_norm(self, steps) -> float:
        """1: every column of C = I is a unit vector."""
        return 1.0

    def inverse_apply(self, z) -> np.ndarray:
        """z̃ = z (a float64 copy)."""
        return np.array(z, dtype=np.float64, copy=True)

    def _needs_plan(self, what: str) -> int:
        if self._steps is None:
            raise ValueError(f"{what} needs a step plan; IdentityMixing() has none. Use IdentityMixing(steps=T).")
        return self._steps

    def first_column(self) -> np.ndarray:
        """e_0, shape (T,) (needs ``steps``)."""
        col = np.zeros(self._needs_plan("first_column"))
        col[0] = 1.0
        return col

    def to_dense(self) -> np.ndarray:
        """I, shape (T, T) (needs ``steps``)."""
        return np.eye(self._needs_plan("to_dense"))

    def column_norms(self) -> np.ndarray:
        """Ones, shape (T,) (needs ``steps``)."""
        return np.ones(self._needs_plan("column_norms"))

    def with_metadata(self, **updates) -> "IdentityMixing":
        """A new strategy with the same plan and ``metadata`` updated by ``updates``."""
        meta = dict(self._metadata)
        meta.update(updates)
        return IdentityMixing(steps=self._steps, metadata=meta)

    # -------------------------------------------------------------------- I/O
    def _file_steps(self) -> int:
        return 0 if self._steps is None else self._steps

    def digest(self) -> str:
        """SHA-256 of the kind and the plan (0: no limit)."""
        return strategy_digest(self.kind, self._file_steps(), {})

    def to_config(self) -> dict:
        """``{"kind": "dpsgd", "steps": T or None, "metadata": …}`` (``load_mixing`` reads it)."""
        return {"kind": self.kind, "steps": self._steps, "metadata": self.metadata}

    def save(self, path: str | os.PathLike) -> None:
        """Write the strategy ``.npz`` (no pickle): kind, steps (0: no limit), metadata, digest."""
        save_strategy_file(path, kind=self.kind, steps=self._file_steps(), parameters={},
                           metadata=self._metadata, digest=self.digest())

    @classmethod
    def from_fields(cls, *, steps, params, metadata=None) -> "IdentityMixing":
        """Build from a file's or config's fields (``steps`` 0 or ``None``: no limit; no parameters)."""
        if params:
            raise ValueError(f"a dpsgd strategy has no parameters; got {sorted(params)}.")
        return cls(steps=None if steps is None or int(steps) == 0 else int(steps), metadata=metadata)

    def _identity_key(self):
        return (self._steps,)

    def __repr__(self) -> str:
        return f"IdentityMixing(steps={self._steps})"
