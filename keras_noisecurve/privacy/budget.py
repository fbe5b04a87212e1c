"""``PrivacyBudget``: a Keras callback that logs ε spent and stops before overspending.

Steps are counted by ``model.optimizer.iterations`` (saved with the optimizer, so
the count survives checkpoint/resume). After k optimizer steps an example has
participated at most ⌈k/b⌉ times (cyclic Poisson) or ⌈k/steps_per_epoch⌉ times
(fixed epochs); the ε spent is that of the dominating event with that many
participations (``keras_noisecurve.privacy.accounting``), cached per participation
count. The reported ε is at the accounting δ; the run's total δ adds the sampler's
overflow term (``keras_noisecurve.privacy.overflow_delta``).
"""

from __future__ import annotations

from typing import Optional

import keras

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.privacy import accounting


class PrivacyBudget(keras.callbacks.Callback):
    """Log ``logs["epsilon"]`` and stop training before the plan or ε budget runs out.

    Args:
      noise_multiplier: σ of the optimizer (noise std / clip norm).
      delta: accounting δ in (0, 1).
      num_examples, batch_size, steps, bands, sampling, epochs: the run plan, as for
        :func:`keras_noisecurve.compute_epsilon`; ``steps`` = T is the number of
        optimizer steps the plan (and C) covers.
      target_epsilon: optional ε budget (> 0). Training stops after the last step
        whose ε is ≤ target_epsilon.
      accountant: ``"pld"`` (default; seconds per new participation count) or ``"rdp"``
        (fast, looser). With ``log_every_step`` and b = 1 prefer ``"rdp"``.
      log_every_step: also put ε into the logs of every batch.
      verbose: 0 silent, 1 prints why training stopped.

    Behaviour: after each batch, with k = ``optimizer.iterations`` and s the model's
    ``steps_per_execution``, sets ``model.stop_training = True`` if the next s steps
    would pass T or a step whose ε exceeds ``target_epsilon``. ``on_train_begin``
    raises ``RuntimeError`` if not even one more step is allowed (Keras runs at least
    one batch after ``on_train_begin``, so stopping there would overspend).
    ``logs["epsilon"]`` is set at every epoch end (History records it).
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        delta: float,
        num_examples: int,
        batch_size: int,
        steps: int,
        bands: int = 1,
        sampling: str = "cyclic_poisson",
        epochs: Optional[int] = None,
        target_epsilon: Optional[float] = None,
        accountant: str = "pld",
        log_every_step: bool = False,
        verbose: int = 1,
    ):
        super().__init__()
        self.noise_multiplier = check_float("noise_multiplier", noise_multiplier, positive=True)
        self.delta = check_float("delta", delta, open_unit=True)
        self.setup = accounting.accounting_setup(
            num_examples=num_examples, batch_size=batch_size, steps=steps, bands=bands,
            sampling=sampling, epochs=epochs,
        )
        self.target_epsilon = None if target_epsilon is None else check_float(
            "target_epsilon", target_epsilon, positive=True
        )
        self.accountant = check_choice("accountant", accountant, accounting.ACCOUNTANTS)
        self.log_every_step = bool(log_every_step)
        self.verbose = check_int("verbose", verbose, minimum=0)
        self._eps_cache: dict[int, float] = {}
        self._allowed_steps: Optional[int] = None
        self.stop_reason: Optional[str] = None
        self.stopped_at_step: Optional[int] = None

    # ------------------------------------------------------------- accounting
    def _participations(self, steps_done: int) -> int:
        return self.setup.participations(steps_done) if steps_done > 0 else 0

    def _epsilon_of_participations(self, k: int) -> float:
        if k not in self._eps_cache:
            self._eps_cache[k] = accounting.epsilon_for_setup(
                self.setup, noise_multiplier=self.noise_multiplier, delta=self.delta,
                accountant=self.accountant, participations=k,
            )
        return self._eps_cache[k]

    def epsilon_at(self, steps_done: int) -> float:
        """ε spent after ``steps_done`` optimizer steps (0 → 0.0)."""
        steps_done = check_int("steps_done", steps_done, minimum=0)
        return self._epsilon_of_participations(self._participations(steps_done))

    def allowed_steps(self) -> int:
        """Largest step count within both the plan T and ``target_epsilon``."""
        if self._allowed_steps is None:
            total = self.setup.participations()
            k_max = total
            if self.target_epsilon is not None and self._epsilon_of_participations(total) > self.target_epsilon:
                k_max = self._max_participations(total)
            stride = self.setup.bands if self.setup.sampling == "cyclic_poisson" else self.setup.steps_per_epoch
            # k participations cover the steps s with ceil(s / stride) <= k, i.e. s <= k * stride.
            self._allowed_steps = min(self.setup.steps, k_max * stride)
        return self._allowed_steps

    def _max_participations(self, total: int) -> int:
        """Largest k ≤ total with ε(k) ≤ target (ε non-decreasing in k; ε(total) > target).

        Bisection with the fast coarse accountant, then a walk with the reporting
        accountant until ε(k) ≤ target < ε(k + 1) holds exactly for it.
        """
        target = self.target_epsilon

        def coarse(k):
            return accounting.coarse_epsilon_for_setup(
                self.setup, noise_multiplier=self.noise_multiplier, delta=self.delta,
                accountant=self.accountant, participations=k,
            )

        lo, hi = 0, total  # coarse ε(lo) ≤ target < coarse ε(hi)
        if coarse(hi) <= target:
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if coarse(mid) <= target:
                lo = mid
            else:
                hi = mid
        k = lo
        while k > 0 and self._epsilon_of_participations(k) > target:
            k -= 1
        while k < total and self._epsilon_of_participations(k + 1) <= target:
            k += 1
        return k

    # --------------------------------------------------------------- keras
    def _steps_done(self) -> int:
        return int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))

    def _chunk(self) -> int:
        return max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def _why(self, done: int) -> str:
        allowed = self.allowed_steps()
        if allowed >= self.setup.steps:
            return f"the step plan of T = {self.setup.steps} steps is complete (epsilon = {self.epsilon_at(done):.4g})"
        nxt = min(allowed + 1, self.setup.steps)
        return (
            f"the next step would exceed target_epsilon = {self.target_epsilon:g}: epsilon after {allowed} steps "
            f"= {self.epsilon_at(allowed):.4g}, after {nxt} steps = {self.epsilon_at(nxt):.4g}"
        )

    def on_train_begin(self, logs=None):
        done = self._steps_done()
        if done + self._chunk() > self.allowed_steps():
            raise RuntimeError(
                f"PrivacyBudget: no further step is allowed after {done} optimizer steps: {self._why(done)}."
            )

    def on_train_batch_end(self, batch, logs=None):
        done = self._steps_done()
        if self.log_every_step and logs is not None:
            logs["epsilon"] = self.epsilon_at(done)
        if done + self._chunk() > self.allowed_steps() and not self.model.stop_training:
            self.model.stop_training = True
            self.stopped_at_step = done
            self.stop_reason = self._why(done)
            if self.verbose:
                print(f"\nPrivacyBudget: stopping after {done} steps: {self.stop_reason}.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self.epsilon_at(self._steps_done())

    # -------------------------------------------------------------- config
    def get_config(self) -> dict:
        s = self.setup
        return {
            "noise_multiplier": self.noise_multiplier,
            "delta": self.delta,
            "num_examples": s.num_examples,
            "batch_size": s.batch_size,
            "steps": s.steps,
            "bands": s.bands,
            "sampling": s.sampling,
            "epochs": s.epochs,
            "target_epsilon": self.target_epsilon,
            "accountant": self.accountant,
            "log_every_step": self.log_every_step,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict) -> "PrivacyBudget":
        return cls(**config)
