"""``PrivateRun``: a private training run described once.

A run is: n examples, expected batch size B, T steps (or epochs), the sampling
(cyclic Poisson with b partitions, or fixed epochs), the mixing matrix C (its b and
its sensitivity), the noise multiplier σ — given, or calibrated here from a target
(ε, δ) — and a secret sampling key. Everything else takes the run:

- ``NoiseCurveOptimizer(run=run, ...)``: the optimizer with C, σ and B of the run; it
  keeps the sampling key and its step counter as optimizer variables, so every
  checkpoint holds the run's position and key;
- ``run.dataset(x, y)``: the examples (a ``RunData``); a private model's ``fit`` takes
  its batches ``(x, y, mask, step)`` for the model's optimizer, starting at the
  optimizer's step (so a resumed run continues the exact batch sequence) and carrying
  each batch's step index, which the private model checks;
- ``run.epsilon(step)``: ε after any step of the plan (the run's ledger, which the
  ``PrivacyBudget(run=run)`` callback shares).

The run flows one way: the optimizer holds the run, the run holds no optimizer.
- ``run.fingerprint()``: a hash of the public plan, compared across workers.

``privacy_unit="user"`` makes the unit a user (``num_users``, ``examples_per_user``): the plan
and ε are those of ``num_examples=num_users``, the sampler draws users and
``run.dataset(x, y, users=ids)`` expands them into rows (``keras_noisecurve.privacy.users``).

This module imports TensorFlow only inside the methods that build TensorFlow objects.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional

import numpy as np

from keras_noisecurve._validation import check_choice, check_float, check_int, check_memory
from keras_noisecurve.privacy.calibration import noise_multiplier_for
from keras_noisecurve.privacy.events import ACCOUNTANTS, PLD_VALUE_DISCRETIZATION, RDP_ORDERS, event_of
from keras_noisecurve.privacy.spec import RunSpec
from keras_noisecurve.privacy.overflow import checked_padding, overflow_delta
from keras_noisecurve.privacy.sampler import BatchSampler, check_key, key_from_seed
from keras_noisecurve.privacy.secrets import fixed_seed_warning
from keras_noisecurve.privacy.users import check_unit

__all__ = ["PrivateRun"]


def _resolve_mixing(mixing):
    """The mixing strategy, or None for C = I without a step plan (built once T is known)."""
    from keras_noisecurve.mixing.strategies import load_mixing

    mixing = load_mixing("dpsgd" if mixing is None else mixing)
    return mixing if mixing.has_plan else None


def _is_auto(mixing) -> bool:
    return isinstance(mixing, str) and mixing == "auto"


def _choose(mixing, *, plan, update_rule):
    """``(C, its MixingChoice)`` for ``mixing="auto"`` or a ``MixingChoice``; ``(mixing, None)``
    otherwise (``update_rule`` only applies to a choice)."""
    from keras_noisecurve.privacy.choice import MixingChoice, choose_mixing

    if _is_auto(mixing):
        if plan["epsilon"] is None:
            raise ValueError(
                "mixing='auto' chooses the mechanism with the least noise at a target epsilon: give epsilon= "
                "(sigma is then calibrated for each candidate), not noise_multiplier=.")
        choice = choose_mixing(update_rule=update_rule, **plan)
    elif isinstance(mixing, MixingChoice):
        if update_rule is not None:
            raise ValueError("update_rule= is the choice's own (choose_mixing(update_rule=...)); leave it unset "
                             "when mixing is a MixingChoice.")
        if plan["epsilon"] is None:
            raise ValueError("a MixingChoice is calibrated for a target epsilon: give the run the same epsilon= "
                             f"({mixing.plan['epsilon']:g}), not noise_multiplier=.")
        choice = mixing
        steps = RunSpec(num_examples=plan["num_examples"], batch_size=plan["batch_size"], steps=plan["steps"],
                        epochs=plan["epochs"], sampling=plan["sampling"]).steps
        choice.check_plan({**{k: v for k, v in plan.items() if k in choice.plan}, "steps": steps})
    else:
        if update_rule is not None:
            raise ValueError(
                "update_rule= is for mixing='auto' (the rule the chosen C is solved for); a given C carries the "
                "rule it was solved for in its metadata (solve_mixing_matrix(update_rule=...)).")
        return mixing, None
    return choice.mixing, choice


def _check_adaptive_clip(value):
    """``adaptive_clip=``: ``None``, an ``AdaptiveClip`` or its ``to_config()`` dict."""
    from keras_noisecurve.privacy.adaptive_clip import AdaptiveClip

    if value is None:
        return None
    clip = AdaptiveClip.coerce(value)
    if clip is None:
        raise TypeError(f"adaptive_clip must be a keras_noisecurve.AdaptiveClip or None, got {value!r} "
                        f"({type(value).__name__}); a fixed clip norm is the optimizer's l2_norm_clip.")
    return clip


class PrivateRun:
    """One private training run: plan, noise, accounting and secret sampling key.

    Args (keyword-only):
      num_examples: n, the size of the private training set.
      batch_size: B, the expected (cyclic Poisson) or fixed batch size; the optimizer
        divides the noisy sum by B.
      privacy_unit: ``"example"`` (default) or ``"user"``: the privacy unit is a user, all
        of its examples (user-level DP). Then give ``num_users`` (n, the number of users)
        instead of ``num_examples`` and ``examples_per_user`` (k ≥ 1, the most examples of
        one user a step uses); ``batch_size`` B and the epochs count users, and ε is the
        example-level accountant's with n users and B users per step.
        ``run.dataset(x, y, users=ids)`` then takes the user of every example
        (:class:`~keras_noisecurve.privacy.users.UserTable`: each step's batch holds k rows
        per sampled user, whose masks average the user's examples).
      steps: T, the number of optimizer steps. Give ``steps`` or ``epochs``:
        ``epochs`` = k sets T = k·⌈n/B⌉ (one pass is ⌈n/B⌉ steps).
      mixing: the mixing matrix C (a ``MixingMatrix`` or another strategy of
        ``keras_noisecurve.mixing.strategies``, the path of a ``.npz`` file, its config
        dict) with at least T steps; ``None`` (or ``"dpsgd"``): C = I for T steps, i.e.
        DP-SGD. b is C's number of bands. BLT and BISR (not banded) need
        ``sampling="fixed_epochs"``: their sensitivity over all epochs is computed from C.
        ``"auto"``: the mechanism with the least expected noise in the model's updates at
        the target ``epsilon``, each candidate at the σ this run's accountant calibrates for
        it (:func:`keras_noisecurve.choose_mixing`; DP-SGD is a candidate, so the choice is
        never predicted worse); ``run.mixing_choice`` holds the comparison and
        :meth:`summary` prints it. A :class:`~keras_noisecurve.MixingChoice` made for this
        plan and (ε, δ) is taken as it is.
      update_rule: ``mixing="auto"`` only: the ``UpdateRule`` training runs (momentum,
        learning-rate schedule), which the chosen C is solved for; default plain SGD.
      noise_multiplier: σ > 0. Give ``noise_multiplier`` or ``epsilon``.
      epsilon: a target ε > 0: σ is calibrated (the smallest σ whose run is
        (ε, δ)-DP, :func:`keras_noisecurve.calibrate_noise_multiplier`).
      delta: the accounting δ in (0, 1).
      sampling: ``"cyclic_poisson"`` (default; amplified by sampling) or
        ``"fixed_epochs"`` (one shuffled order repeated, no amplification).
      accountant: ``"pld"`` (default) or ``"rdp"``, for calibration and the ledger.
      max_batch_size / overflow_probability: the padded batch size P of cyclic
        Poisson sampling (at most one; default: overflow probability 1e-12, smaller where
        the overflow rule needs it). The overflow rule: the δ a step's truncation adds,
        ``(1 + e^ε)·p`` with p the overflow probability of P
        (:func:`~keras_noisecurve.privacy.overflow.overflow_delta`), must be at most δ/10,
        so the total δ (:meth:`total_delta`) is at most 1.1·δ; a P that breaks it is
        refused (``ValueError`` giving p, δ and the smallest ``max_batch_size`` that passes).
      seed: ``None`` (default): a secret sampling key from OS entropy. An int gives a
        reproducible key, for tests only: it makes the batches predictable.
      adaptive_clip: a :class:`~keras_noisecurve.AdaptiveClip`: the run's optimizer clips at
        a private estimate of a quantile of the per-example norms, ζ_t, and σ and ε
        include its count queries (one beside every participation, noise multiplier
        ``adaptive_clip.count_noise_multiplier(B)``). ``None`` (default): the optimizer's
        fixed ``l2_norm_clip``.

    Raises ``ValueError`` naming the argument for any inconsistent plan (b > T, q ≥ 1,
    a C shorter than T, both or neither of ``steps``/``epochs`` or
    ``noise_multiplier``/``epsilon``, …); all validation happens here, once: the run's
    description becomes ``run.spec`` (a :class:`~keras_noisecurve.privacy.spec.RunSpec`),
    which every part of the run (calibration, ε, padding, the sampler, the budget) takes.
    """

    def __init__(
        self,
        *,
        num_examples: Optional[int] = None,
        batch_size: int,
        steps: Optional[int] = None,
        epochs: Optional[int] = None,
        mixing=None,
        noise_multiplier: Optional[float] = None,
        epsilon: Optional[float] = None,
        delta: float,
        sampling: str = "cyclic_poisson",
        accountant: str = "pld",
        max_batch_size: Optional[int] = None,
        overflow_probability: Optional[float] = None,
        seed=None,
        update_rule=None,
        adaptive_clip=None,
        privacy_unit: str = "example",
        num_users: Optional[int] = None,
        examples_per_user: Optional[int] = None,
    ):
        self._unit, num_examples, self._per_user = check_unit(
            privacy_unit, num_examples=num_examples, num_users=num_users, examples_per_user=examples_per_user)
        if (steps is None) == (epochs is None):
            raise ValueError(
                f"give exactly one of steps (the number of optimizer steps T) and epochs (passes over the "
                f"data, T = epochs * ceil(n/B)); got steps={steps!r}, epochs={epochs!r}."
            )
        if (noise_multiplier is None) == (epsilon is None):
            raise ValueError(
                "give exactly one of noise_multiplier (sigma) and epsilon (a target, sigma is then "
                f"calibrated); got noise_multiplier={noise_multiplier!r}, epsilon={epsilon!r}."
            )
        self._adaptive_clip = _check_adaptive_clip(adaptive_clip)
        counts = None if self._adaptive_clip is None else self._adaptive_clip.count_noise_multiplier(batch_size)
        mixing, self._choice = _choose(mixing, update_rule=update_rule, plan={
            "num_examples": num_examples, "batch_size": batch_size, "steps": steps, "epochs": epochs,
            "sampling": sampling, "epsilon": epsilon, "delta": delta, "accountant": accountant,
            **({} if counts is None else {"count_noise_multiplier": counts})})
        loaded = _resolve_mixing(mixing)
        self._spec = RunSpec(num_examples=num_examples, batch_size=batch_size, steps=steps, epochs=epochs,
                             sampling=sampling, mixing=loaded, count_noise_multiplier=counts)
        if loaded is None:  # C = I: DP-SGD, same facts as no mixing (b = 1, s = 1)
            from keras_noisecurve.mixing.matrix import MixingMatrix

            check_memory(f"C = I for steps={self._spec.steps}", 8 * self._spec.steps, hint="Use fewer steps.")
            loaded = MixingMatrix.identity(self._spec.steps)
        self._mixing = loaded
        self._delta = check_float("delta", delta, open_unit=True)
        if self._delta >= 1.0 / self._spec.num_examples:
            import warnings

            unit = "example" if self._unit == "example" else "user's data"
            warnings.warn(
                f"delta={self._delta:g} is not below 1/n = {1.0 / self._spec.num_examples:g}"
                f"{'' if self._unit == 'example' else ' (n = ' + str(self._spec.num_examples) + ' users)'}: an "
                f"(epsilon, delta) guarantee with delta >= 1/n allows releasing one {unit} in the clear. Use delta "
                "much smaller than 1/n (e.g. 1e-5 for n up to 10^4, or 1/n^1.1).", UserWarning, stacklevel=2)
        self._accountant = check_choice("accountant", accountant, ACCOUNTANTS)
        if (noise_multiplier is None) == (epsilon is None):
            raise ValueError(
                "give exactly one of noise_multiplier (sigma) and epsilon (a target, sigma is then "
                f"calibrated); got noise_multiplier={noise_multiplier!r}, epsilon={epsilon!r}."
            )
        self._target_epsilon = None
        if epsilon is not None:
            self._target_epsilon = check_float("epsilon", epsilon, positive=True)
            if self._choice is not None:  # this C's own calibration (the choice's, kept in-process)
                from keras_noisecurve.privacy.choice import sigma_for

                noise_multiplier = sigma_for(self._spec, epsilon=self._target_epsilon, delta=self._delta,
                                             accountant=self._accountant)
            else:
                noise_multiplier = noise_multiplier_for(self._spec, self._target_epsilon, self._delta,
                                                        self._accountant)
        # sigma = 0 is no privacy: refused (as by compute_epsilon and calibration)
        self._sigma = check_float("noise_multiplier", noise_multiplier, positive=True)
        self._ledger = None
        self._padded, self._overflow = checked_padding(
            spec=self._spec, delta=self._delta, epsilon=self.epsilon, epsilon_bound=self._epsilon_bound(),
            max_batch_size=max_batch_size, overflow_probability=overflow_probability)
        self._max_batch_size = None if max_batch_size is None else self._padded
        self._overflow_target = None if overflow_probability is None else float(overflow_probability)
        if seed is not None:
            fixed_seed_warning("PrivateRun", "batches")
        self._key = key_from_seed(seed)

    def _epsilon_bound(self) -> Optional[float]:
        """A cheap upper bound on :meth:`epsilon` for the overflow rule, or ``None`` (then the
        rule asks for ε itself, only if the overflow probability is not 0).

        Calibrated: the target (calibration keeps ε ≤ target; 1e-6 relative covers the
        ledger's round-off). Given σ and the PLD accountant: the RDP ε on the integer orders
        (milliseconds, no warning at small σ; an upper bound on the exact ε, as calibration
        uses it) plus a margin for the PLD's pessimistic discretisation, at most one grid step
        per composition, and one more nat. With RDP, ε itself is as cheap."""
        if self._spec.sampling != "cyclic_poisson":
            return None  # fixed epochs never overflow: no ε needed
        if self._target_epsilon is not None:
            return self._target_epsilon * (1.0 + 1e-6)
        if self._accountant != "pld":
            return None
        from dp_accounting import rdp

        orders = [order for order in RDP_ORDERS if float(order).is_integer()]
        try:
            bound = rdp.RdpAccountant(orders).compose(event_of(self._spec, self._sigma)).get_epsilon(self._delta)
        except (ArithmeticError, ValueError):  # an extreme run: ask for ε itself
            return None
        return float(bound) + 1.0 + self._spec.compositions * PLD_VALUE_DISCRETIZATION

    # ------------------------------------------------------------------ plan
    @property
    def num_examples(self) -> int:
        """n, the number of privacy units: examples, or users when ``privacy_unit='user'``."""
        return self._spec.num_examples

    @property
    def privacy_unit(self) -> str:
        """``"example"`` or ``"user"`` (user-level DP: a unit is all of one user's examples)."""
        return self._unit

    @property
    def num_users(self) -> Optional[int]:
        """n, the number of users of a user-level run; ``None`` for an example-level one."""
        return None if self._unit == "example" else self._spec.num_examples

    @property
    def examples_per_user(self) -> int:
        """k, the rows of one user's slot in a batch (the most examples of a user a step uses);
        1 for an example-level run."""
        return self._per_user

    @property
    def batch_size(self) -> int:
        """B, the expected batch size (the optimizer's divisor)."""
        return self._spec.batch_size

    @property
    def steps(self) -> int:
        """T, the number of optimizer steps of the plan."""
        return self._spec.steps

    @property
    def bands(self) -> int:
        """b, the number of bands of C (= the number of cyclic Poisson partitions)."""
        return self._spec.bands

    @property
    def sampling(self) -> str:
        return self._spec.sampling

    @property
    def mixing(self):
        """The mixing matrix C (a ``MixingMatrix``; ``MixingMatrix.identity(T)`` for DP-SGD)."""
        return self._mixing

    @property
    def mixing_choice(self):
        """The :class:`~keras_noisecurve.MixingChoice` of ``mixing="auto"`` (every candidate's
        σ, predicted error relative to DP-SGD and solve time), or ``None``."""
        return self._choice

    @property
    def adaptive_clip(self):
        """The run's :class:`~keras_noisecurve.AdaptiveClip`, or ``None`` (a fixed clip)."""
        return self._adaptive_clip

    @property
    def noise_multiplier(self) -> float:
        """σ: the noise standard deviation divided by the clip norm."""
        return self._sigma

    @property
    def delta(self) -> float:
        return self._delta

    @property
    def target_epsilon(self) -> Optional[float]:
        """The ε σ was calibrated for, or ``None`` when σ was given."""
        return self._target_epsilon

    @property
    def accountant(self) -> str:
        return self._accountant

    @property
    def spec(self) -> RunSpec:
        """The validated :class:`~keras_noisecurve.privacy.spec.RunSpec` (n, B, T, b,
        sampling, q, compositions, the sensitivity s of C)."""
        return self._spec

    @property
    def padded_batch_size(self) -> int:
        """P, the fixed number of units (examples, or users) of every batch, real + masked padding."""
        return self._padded

    @property
    def padded_rows(self) -> int:
        """P·k, the rows of one step's batch: k rows per user slot (P for an example-level run)."""
        return self._padded * self._per_user

    @property
    def overflow_probability(self) -> float:
        """Probability that some step draws more than P examples (0 for fixed epochs)."""
        return self._overflow

    @property
    def steps_per_epoch(self) -> int:
        """Steps per pass over the data, ⌈n/B⌉ (at most T): what ``fit`` calls an epoch."""
        return min(self.steps, -(-self.num_examples // self.batch_size))

    @property
    def epochs(self) -> int:
        """⌈T / steps_per_epoch⌉: the epochs ``fit`` runs for the whole plan."""
        return -(-self.steps // self.steps_per_epoch)

    # ------------------------------------------------------------- accounting
    @property
    def ledger(self):
        """The run's ε table (ε after every step, each participation count computed once),
        built on first use; :meth:`epsilon` reads it and ``PrivacyBudget(run=run)`` shares it."""
        if self._ledger is None:
            from keras_noisecurve.privacy.ledger import EpsilonLedger

            self._ledger = EpsilonLedger(
                spec=self._spec, noise_multiplier=self._sigma, delta=self._delta, accountant=self._accountant
            )
        return self._ledger

    def epsilon(self, step: Optional[int] = None) -> float:
        """ε spent after ``step`` ∈ [0, T] optimizer steps (default: the whole plan, T), at δ.

        The one way to ask for ε of a run (``compute_epsilon`` plans without one). With
        ``"pld"`` it equals dp_accounting's PLD accountant on the same event to ``PLD_RTOL``
        (``keras_noisecurve.privacy.ledger``)."""
        step = self.steps if step is None else check_int("step", step, minimum=0, maximum=self.steps)
        return float(self.ledger.epsilon(step))

    def total_delta(self) -> float:
        """δ of the whole run: the accounting δ plus the sampler's overflow term
        ``(1 + e^ε)·p`` at ε = :meth:`epsilon` (at most 1.1·δ: the overflow rule, see
        ``max_batch_size``; δ itself for fixed epochs)."""
        return self._delta + overflow_delta(epsilon=self.epsilon(), overflow_probability=self._overflow)

    # --------------------------------------------------------- config / hash
    def get_config(self) -> dict:
        """The public plan as JSON-able data (never the secret key); a user-level run's holds
        ``privacy_unit``, ``num_users`` and ``examples_per_user`` instead of ``num_examples``."""
        units = ({"num_examples": self.num_examples} if self._unit == "example" else
                 {"privacy_unit": self._unit, "num_users": self.num_examples, "examples_per_user": self._per_user})
        return units | {
            "batch_size": self.batch_size,
            "steps": self.steps,
            "mixing": self._mixing.to_config(),
            "noise_multiplier": self._sigma,
            "delta": self._delta,
            "sampling": self._spec.sampling,
            "accountant": self._accountant,
            "max_batch_size": self._max_batch_size,
            "overflow_probability": self._overflow_target,
        } | ({} if self._adaptive_clip is None else {"adaptive_clip": self._adaptive_clip.to_config()})

    @classmethod
    def from_config(cls, config: dict) -> "PrivateRun":
        """The run of ``get_config()``, with a NEW secret key: a restored optimizer's
        variables supply the saved one. Takes exactly the keys ``get_config`` writes
        (``ValueError`` otherwise: a ``seed`` in a config would make the batches predictable)."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be the dict of PrivateRun.get_config(), got {type(config).__name__}.")
        keys = {"num_examples", "batch_size", "steps", "mixing", "noise_multiplier", "delta", "sampling",
                "accountant", "max_batch_size", "overflow_probability"}
        optional = {"adaptive_clip", "privacy_unit"}
        if config.get("privacy_unit") == "user":
            keys = keys - {"num_examples"} | {"privacy_unit", "num_users", "examples_per_user"}
        unknown, missing = sorted(set(config) - keys - optional), sorted(keys - set(config))
        if unknown or missing:
            raise ValueError(
                f"a PrivateRun config holds exactly the keys get_config() writes ({sorted(keys)}); got "
                f"{'unknown ' + str(unknown) if unknown else ''}{' and ' if unknown and missing else ''}"
                f"{'missing ' + str(missing) if missing else ''}. A seed is never part of a config: give "
                "PrivateRun(seed=...) directly, for tests only.")
        return cls(**config)  # adaptive_clip: its config dict, read by _check_adaptive_clip

    def fingerprint(self) -> int:
        """A 63-bit hash of the public plan (n, B, T, C, σ, δ, sampling, P): equal on every
        worker of one run, different for any other plan."""
        public = self.get_config()
        public["mixing"] = self._mixing.digest()
        public["padded_batch_size"] = self._padded
        digest = hashlib.sha256(json.dumps(public, sort_keys=True).encode()).digest()
        return int.from_bytes(digest[:8], "little") & (2**63 - 1)

    def same_plan(self, other: "PrivateRun") -> bool:
        """Whether ``other`` is a ``PrivateRun`` of the same public plan (equal fingerprints)."""
        return isinstance(other, PrivateRun) and other.fingerprint() == self.fingerprint()

    def __repr__(self) -> str:
        """The plan; a calibrated run shows its target ε, and beside it the total δ at that ε
        (the accounting δ plus the overflow term, :meth:`total_delta`'s bound) where the
        overflow term shows in its digits."""
        eps = f", epsilon={self._target_epsilon:g}" if self._target_epsilon is not None else ""
        total = ""
        if self._target_epsilon is not None and self._overflow > 0:
            value = self._delta + overflow_delta(epsilon=self._target_epsilon, overflow_probability=self._overflow)
            total = f", total_delta={value:g}" if f"{value:g}" != f"{self._delta:g}" else ""
        units = (f"num_examples={self.num_examples}" if self._unit == "example" else
                 f"privacy_unit='user', num_users={self.num_examples}, examples_per_user={self._per_user}")
        return (
            f"PrivateRun({units}, batch_size={self.batch_size}, steps={self.steps}, "
            f"bands={self.bands}, sampling={self._spec.sampling!r}, noise_multiplier={self._sigma:.6g}{eps}, "
            f"delta={self._delta:g}{total}"
            f"{'' if self._adaptive_clip is None else ', adaptive_clip=' + repr(self._adaptive_clip)})"
        )

    def summary(self) -> str:
        """The plan, ε and δ in a few lines, and with ``mixing="auto"`` the comparison the
        mechanism was chosen from and the gain predicted over DP-SGD."""
        lines = [repr(self), f"epsilon after the {self.steps} steps: {self.epsilon():.4g} at delta={self._delta:g}"]
        if self._unit == "user":
            lines.append(f"privacy unit: the user (n = {self.num_examples} users, B = {self.batch_size} users per "
                         f"step, at most {self._per_user} examples of a user per step; {self.padded_rows} rows per "
                         "batch); epsilon is the example-level accountant's with n and B in users")
        if self._choice is not None:
            lines.append(self._choice.summary())
        return "\n".join(lines)

    # ------------------------------------------------------------ the key
    def __getstate__(self):
        """Pickling (joblib, multiprocessing, experiment trackers) leaves the secret key out:
        an unpickled run plans, accounts and checks plans, and refuses what needs the key."""
        state = dict(self.__dict__)
        state["_key"] = None
        state["_ledger"] = None
        return state

    def _own_key(self) -> np.ndarray:
        if self._key is None:
            raise ValueError(
                "this PrivateRun was unpickled: pickling leaves its secret sampling key out. Sample with the "
                "original run, or with a restored optimizer's key (run.sampler(optimizer.sampling_key)).")
        return self._key

    def initial_key(self) -> np.ndarray:
        """The key a new optimizer's ``sampling_key`` variable starts from (secret)."""
        return self._own_key().copy()

    def sampler(self, key=None) -> BatchSampler:
        """The random-access :class:`BatchSampler` of the plan for ``key`` (default: this
        run's key, :meth:`initial_key`; a restored run's is ``optimizer.sampling_key``)."""
        key = self._own_key() if key is None else check_key(key)
        return BatchSampler(spec=self._spec, padded_size=self._padded, key=key)

    # ------------------------------------------------------------ the batches
    def dataset(self, x, y=None, *, users=None, sample_weight=None, example_fn=None):
        """The private examples of the run, a :class:`~keras_noisecurve.privacy.run_data.RunData`:
        ``fit(run.dataset(x, y))`` trains on the plan's batches from the optimizer's step
        on; a custom loop iterates ``run.dataset(x, y).batches(optimizer)``.

        Args:
          x, y, sample_weight, example_fn: the private examples, anything
            :func:`keras_noisecurve.privacy.sources.as_source` accepts: numpy arrays
            (or dicts/tuples of them), a ``tf.data.Dataset`` of examples, a
            memory-mapped array, a random-access sequence (``__len__``/``__getitem__``,
            e.g. ``tfds.data_source(...)``) or a ``keras.utils.PyDataset``; only the
            examples of each batch are read. Must hold exactly ``num_examples`` examples
            (user-level: any number, with ``users``).
          users: a user-level run only (and required there): a 1-D array of user ids (ints
            or strings), one per example, with exactly ``num_users`` distinct ids; users are
            numbered in ``np.unique`` order of their ids
            (:class:`~keras_noisecurve.privacy.users.UserTable`).

        :meth:`RunData.batches` describes the batches ``(x, y, mask, step)``.
        """
        from keras_noisecurve.privacy.run_data import RunData

        return RunData(self, x, y, users=users, sample_weight=sample_weight, example_fn=example_fn)
