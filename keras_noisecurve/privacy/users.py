"""User-level privacy on the data side: the users of a run and the rows of a step's users.

A user-level run (``PrivateRun(privacy_unit="user", num_users=n, examples_per_user=k)``)
samples USERS: its :class:`~keras_noisecurve.privacy.sampler.BatchSampler` draws user indices
0 … n − 1 exactly as an example-level run draws example indices, and the accounting is the
example-level one with n users and B users per step. :class:`UserTable` (numpy only) holds
which examples belong to which user (``run.dataset(x, y, users=ids)``) and expands a step's
users into the rows of its batch, user-major:

- slot j (the j-th user of the sampler's batch, its padding slots included) occupies rows
  ``[j·k, (j+1)·k)``;
- a user with m ≤ k examples contributes all m, in its example order; the k − m rows left
  are padding (the user's first example under mask 0);
- a user with m > k examples contributes k of them, a uniformly random k-subset (without
  replacement, in example order) drawn from ``(key, step, user)`` alone: the Philox-4×32-10
  block (:func:`keras_noisecurve.backend.common.philox.philox_block`) of the counter
  ``(draw, user)`` under a key derived from the run's secret sampling key and the step, so a
  replay, another process and a resumed run draw the same rows;
- the mask of a real row i of user u is ``w_i · slot mask / m_u`` (w_i its sample weight, or
  1; m_u = min(m, k), the rows the user contributes): the unit's weighted gradient is the MEAN
  of its examples' gradients, bounded by one clip ζ as one example's would be.

Imports no framework.
"""

from __future__ import annotations

import hashlib
import numbers

import numpy as np

from keras_noisecurve._validation import check_choice, check_int
from keras_noisecurve.backend.common.philox import philox_block

__all__ = ["PRIVACY_UNITS", "UserTable", "check_unit"]

#: the privacy units of a run: one example, or one user (all of the user's examples)
PRIVACY_UNITS = ("example", "user")

#: the numpy stream tag of the row draws (the sampler's are 0, the permutation, and 1, the steps)
_ROWS = 2


def check_unit(privacy_unit, *, num_examples, num_users, examples_per_user):
    """``(unit, n, k)``: the validated privacy unit, the number of units n (examples, or users)
    and k (``examples_per_user``; 1 for example-level), or ``ValueError`` saying what was
    received and what is allowed."""
    unit = check_choice("privacy_unit", privacy_unit, PRIVACY_UNITS)
    if unit == "example":
        if num_users is not None or examples_per_user is not None:
            raise ValueError(
                "num_users= and examples_per_user= are for privacy_unit='user' (the privacy unit is a user); "
                f"this run's unit is the example: got num_users={num_users!r}, examples_per_user="
                f"{examples_per_user!r}. Give num_examples alone, or privacy_unit='user' with num_users and "
                "examples_per_user.")
        if num_examples is None:
            raise ValueError("give num_examples (n, the number of private examples), or privacy_unit='user' with "
                             "num_users (the number of users) and examples_per_user.")
        return unit, num_examples, 1
    if num_examples is not None or num_users is None:
        raise ValueError(
            "privacy_unit='user' counts users: give num_users (n, the number of users) instead of num_examples; "
            f"got num_examples={num_examples!r}, num_users={num_users!r}.")
    if examples_per_user is None:
        raise ValueError("privacy_unit='user' needs examples_per_user=k >= 1: the most examples of one user a step "
                         "uses (a user with more contributes k of them, chosen at random each step).")
    return unit, num_users, check_int("examples_per_user", examples_per_user, minimum=1)


def _ids(users) -> np.ndarray:
    """``users`` as a 1-D numpy array of ints or strings, or ``ValueError``."""
    try:
        ids = np.asarray(users)
        if ids.dtype == object and ids.ndim == 1:  # e.g. a pandas column of Python strings or ints
            values = ids.tolist()
            if all(isinstance(u, str) for u in values):
                ids = np.asarray(values, dtype=str)
            elif all(isinstance(u, numbers.Integral) and not isinstance(u, bool) for u in values):
                ids = np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError):
        ids = None
    if ids is not None and ids.ndim == 1 and ids.size == 0:
        raise ValueError("users= is empty: give one user id per example.")
    if ids is None or ids.ndim != 1 or ids.dtype.kind not in "iuUS":
        got = "an object that is not an array" if ids is None else f"shape {ids.shape} and dtype {ids.dtype}"
        raise ValueError(f"users= must be a 1-D array of user ids, ints or strings, one per example; got {got}.")
    return ids


class UserTable:
    """Which examples belong to which user, and the rows of a step's users.

    Args:
      users: a 1-D array-like of user ids (ints or strings), one per example. The users are
        numbered 0 … n − 1 in ``np.unique`` order of their ids.
      examples_per_user: k ≥ 1, the rows of one user's slot.

    Attributes: ``num_users`` (n), ``num_examples`` (the ids given), ``examples_per_user`` (k),
    ``counts`` (int64 (n,), each user's examples).
    """

    def __init__(self, users, *, examples_per_user: int):
        ids = _ids(users)
        self.examples_per_user = check_int("examples_per_user", examples_per_user, minimum=1)
        _, inverse = np.unique(ids, return_inverse=True)
        inverse = inverse.reshape(-1).astype(np.int64)
        self.counts = np.bincount(inverse).astype(np.int64)
        self.num_users = int(self.counts.size)
        self.num_examples = int(ids.size)
        self._order = np.argsort(inverse, kind="stable").astype(np.int64)  # by user, example order within
        self._starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        digest = hashlib.blake2b(digest_size=16)
        digest.update(repr(("users", self.examples_per_user, self.num_users, self.num_examples)).encode())
        digest.update(np.ascontiguousarray(inverse).tobytes())
        self._digest = digest.digest()

    def digest(self) -> bytes:
        """16 bytes naming k and the users of every example in order (what the data fingerprint adds)."""
        return self._digest

    def examples(self, user: int) -> np.ndarray:
        """The examples of user ``user`` (int64, in example order)."""
        start = self._starts[user]
        return self._order[start:start + self.counts[user]]

    def rows(self, user_indices, user_mask, step, key, *, sample_weight=None):
        """The rows of a step's users: ``(row_indices int64 (U·k,), row_mask float32 (U·k,))``.

        Args:
          user_indices: int (U,), the sampler's batch of user indices (padding slots included).
          user_mask: (U,), the sampler's slot mask (1 a user, 0 a padding slot).
          step, key: the step and the run's secret sampling key (int64 (2,)), which seed the
            choice of k examples of a user with more than k.
          sample_weight: ``None`` or float (num_examples,), multiplied into each example's row.

        Slot j is rows ``[j·k, (j+1)·k)``; see the module docstring for the masks.
        """
        users = np.asarray(user_indices, np.int64).reshape(-1)
        slot = np.asarray(user_mask, np.float64).reshape(-1)
        k = self.examples_per_user
        counts = self.counts[users]
        local = np.broadcast_to(np.arange(k, dtype=np.int64), (users.size, k)).copy()
        large = (counts > k) & (slot != 0)
        if large.any():
            local[large] = self._draw(users[large], counts[large], step, key)
        taken = np.minimum(counts, k)
        real = np.arange(k)[None, :] < taken[:, None]
        local = np.where(real, local, 0)  # padding rows: the user's first example, under mask 0
        rows = self._order[self._starts[users][:, None] + local]
        mask = real * (slot / taken)[:, None]
        if sample_weight is not None:
            mask = mask * np.asarray(sample_weight, np.float64)[rows]
        return rows.reshape(-1), mask.reshape(-1).astype(np.float32)

    def _draw(self, users, counts, step, key) -> np.ndarray:
        """int64 (len(users), k): for each user u of m_u > k examples a uniformly random k-subset
        of [0, m_u), sorted; Floyd's algorithm on Philox words of the counter (draw, u)."""
        k = self.examples_per_user
        words = [int(w) for w in np.asarray(key, np.int64).view(np.uint64)]
        seed = np.random.SeedSequence(words + [_ROWS, int(step)]).generate_state(3, np.uint32)
        pairs = np.arange(-(-k // 2), dtype=np.uint32)
        lo = (users & 0xFFFFFFFF).astype(np.uint32)[:, None]
        hi = (users >> 32).astype(np.uint32)[:, None]
        block = philox_block(np, (pairs[None, :], lo, hi, seed[2]), (seed[0], seed[1]))
        # two 53-bit uniforms per block (numpy's own double from two words): draw i is pair i // 2
        a = np.stack([block[0], block[2]], axis=-1).reshape(users.size, -1)[:, :k] >> np.uint32(5)
        b = np.stack([block[1], block[3]], axis=-1).reshape(users.size, -1)[:, :k] >> np.uint32(6)
        uniform = (a.astype(np.float64) * 67108864.0 + b) / 9007199254740992.0
        chosen = np.empty((users.size, k), np.int64)
        for i in range(k):  # Floyd: for j = m−k … m−1, t uniform in [0, j]; take t unless taken, else j
            j = counts - k + i
            t = np.minimum((uniform[:, i] * (j + 1)).astype(np.int64), j)
            seen = (chosen[:, :i] == t[:, None]).any(axis=1)
            chosen[:, i] = np.where(seen, j, t)
        return np.sort(chosen, axis=1)

    def __repr__(self) -> str:
        return (f"UserTable(num_users={self.num_users}, num_examples={self.num_examples}, "
                f"examples_per_user={self.examples_per_user})")
