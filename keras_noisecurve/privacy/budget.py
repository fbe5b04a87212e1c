"""``PrivacyBudget``: a Keras callback that logs ε spent and stops before overspending.

Steps are counted by ``model.optimizer.iterations`` (saved with the optimizer, so
the count survives checkpoint/resume). After k optimizer steps an example has
participated at most ⌈k/b⌉ times (cyclic Poisson) or ⌈k/steps_per_epoch⌉ times
(fixed epochs); the ε spent is that of the dominating event with that many
participations, read from the run's ε table (``run.ledger``; each participation count
computed once, cheaply). ``on_train_begin`` builds the
ledger's shared state and ε at the last allowed step, so no batch or epoch end pays for
a PLD computation. The reported ε is at the accounting δ; the run's total δ adds the
sampler's overflow term (``keras_noisecurve.privacy.overflow_delta``).
"""

from __future__ import annotations

from typing import Optional

import keras

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.privacy.run import PrivateRun


class PrivacyBudget(keras.callbacks.Callback):
    """Log ``logs["epsilon"]`` and stop training before the plan or ε budget runs out.

    Args (keyword-only):
      run: ``None`` (default): the run of the model's optimizer
        (``NoiseCurveOptimizer(run=run)``), taken when training starts; its ε table is
        shared, not rebuilt. A run given here must be the optimizer's plan (``ValueError``
        at ``on_train_begin`` otherwise, before the first step: the ε of another run is not
        the ε spent). For an optimizer without a run (the low-level path), describe the
        run as a ``PrivateRun`` (σ given): its C, σ and B must be the optimizer's.
      target_epsilon: optional ε budget (> 0). Training stops after the last step
        whose ε is ≤ target_epsilon.
      log_every_step: also put ε into the logs of every batch.
      verbose: 0 silent, 1 prints why training stopped.

    Behaviour: after each batch, with k = ``optimizer.iterations`` and s the model's
    ``steps_per_execution``, sets ``model.stop_training = True`` if the next s steps
    would pass T or a step whose ε exceeds ``target_epsilon``. ``on_train_begin``
    raises ``RuntimeError`` if not even one more step is allowed (Keras runs at least
    one batch after ``on_train_begin``, so stopping there would overspend).
    ``logs["epsilon"]`` is set at every epoch end (History records it).

    Cost: the ledger's shared state and ε at the last allowed step are computed in
    ``on_train_begin`` (with PLD, about the time of one from-scratch ε); every other ε is
    a few milliseconds, computed at most once per participation count (docs/privacy.md §6).
    """

    def __init__(self, *, run: Optional[PrivateRun] = None, target_epsilon: Optional[float] = None,
                 log_every_step: bool = False, verbose: int = 1):
        super().__init__()
        if run is not None and not isinstance(run, PrivateRun):
            raise TypeError(f"run must be a keras_noisecurve.PrivateRun or None, got {type(run).__name__}.")
        self.run = run
        self.target_epsilon = None if target_epsilon is None else check_float(
            "target_epsilon", target_epsilon, positive=True
        )
        self.log_every_step = bool(log_every_step)
        self.verbose = check_int("verbose", verbose, minimum=0)
        self._allowed_steps: Optional[int] = None
        self._host_count: Optional[int] = None
        self.stop_reason: Optional[str] = None
        self.stopped_at_step: Optional[int] = None

    # ------------------------------------------------------------- the run
    @property
    def ledger(self):
        """The run's ε table (``run.ledger``)."""
        return self._the_run().ledger

    @property
    def spec(self):
        """The run's :class:`~keras_noisecurve.privacy.spec.RunSpec`."""
        return self._the_run().spec

    def _the_run(self) -> PrivateRun:
        if self.run is None:
            raise RuntimeError("PrivacyBudget(run=None) takes its run from the model's optimizer, when training "
                               "starts; give run=... to ask for epsilon before that.")
        return self.run

    def _take_run(self) -> None:
        """The run whose ε this callback reports is the optimizer's: taken from it when none
        was given; a given run must have the optimizer's plan (``ValueError`` otherwise, before
        the first step). An optimizer without a run (the low-level path) must have the given
        run's C, σ and B."""
        optimizer = getattr(self.model, "optimizer", None)
        own = getattr(optimizer, "run", None)
        if self.run is None:
            if own is None:
                raise ValueError(
                    "PrivacyBudget has no run: the model's optimizer was not made from a PrivateRun. Pass "
                    "run=keras_noisecurve.PrivateRun(...) describing how it is trained, or make the optimizer "
                    "with NoiseCurveOptimizer(run=run, ...).")
            self.run = own
            return
        if own is not None:
            if not self.run.same_plan(own):
                raise ValueError(
                    f"PrivacyBudget was given another run ({self.run!r}) than the one the model's optimizer "
                    f"trains ({own!r}): it would report that run's epsilon, not the one spent. Leave run out "
                    "(PrivacyBudget takes the optimizer's) or pass the optimizer's run.")
            return
        if optimizer is None:
            return
        if not hasattr(optimizer, "noise_multiplier"):
            raise ValueError(
                f"the model's optimizer ({type(optimizer).__name__}) adds no noise: there is no epsilon to report. "
                "Train with keras_noisecurve.make_private(model) and a NoiseCurveOptimizer.")
        mine = (self.run.mixing.digest(), float(self.run.noise_multiplier), int(self.run.batch_size),
                self.run.adaptive_clip)
        theirs = (optimizer.mixing.digest(), float(optimizer.noise_multiplier), int(optimizer.expected_batch_size),
                  getattr(optimizer, "adaptive_clip", None))
        if mine != theirs:
            raise ValueError(
                f"PrivacyBudget's run ({self.run!r}) does not describe the model's optimizer: its mixing matrix, "
                f"noise_multiplier={optimizer.noise_multiplier}, expected_batch_size="
                f"{optimizer.expected_batch_size} or adaptive clip ({getattr(optimizer, 'adaptive_clip', None)!r}: "
                "its count queries are part of epsilon) differ, so the epsilon reported would not be the one spent.")

    # ------------------------------------------------------------- accounting
    def epsilon_at(self, steps_done: int) -> float:
        """ε spent after ``steps_done`` ∈ [0, T] optimizer steps (0 → 0.0), from the ledger."""
        return self.ledger.epsilon(check_int("steps_done", steps_done, minimum=0, maximum=self.spec.steps))

    def allowed_steps(self) -> int:
        """Largest step count within both the plan T and ``target_epsilon``."""
        if self._allowed_steps is None:
            total = self.ledger.num_participations
            k_max = total
            if self.target_epsilon is not None and self.ledger.epsilon_of_participations(total) > self.target_epsilon:
                k_max = self._max_participations(total)
            # k participations cover the steps s with ceil(s / separation) <= k, i.e. s <= k * separation.
            self._allowed_steps = min(self.spec.steps, k_max * self.spec.separation)
        return self._allowed_steps

    def _max_participations(self, total: int) -> int:
        """k with ε(k) ≤ target < ε(k + 1), by bisection on the ledger (ε(0) = 0 ≤ target < ε(total)).

        About log2(total) ledger queries of a few milliseconds each.
        """
        lo, hi = 0, total  # invariant: ε(lo) ≤ target < ε(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.ledger.epsilon_of_participations(mid) <= self.target_epsilon:
                lo = mid
            else:
                hi = mid
        return lo

    # --------------------------------------------------------------- keras
    def _steps_done(self) -> int:
        if self._host_count is not None:  # JAX: the variables are synchronised once per epoch
            return self._host_count
        return self._read_iterations()

    def _read_iterations(self) -> int:
        # through .numpy(): converting a keras.Variable with numpy warns (DeprecationWarning,
        # its __array__ takes no copy argument)
        iterations = self.model.optimizer.iterations
        value = getattr(iterations, "value", iterations)
        return int(value.numpy()) if hasattr(value, "numpy") else int(value)

    def _counts_on_host(self) -> bool:
        """Whether steps are counted here rather than read from ``optimizer.iterations``
        after each batch: a private model on JAX, whose trainer copies the variables back
        only at the end of an epoch (one optimizer step per batch there)."""
        return bool(getattr(self.model, "_dp_counts_steps_on_host", False))

    def _chunk(self) -> int:
        return max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def _why(self, done: int) -> str:
        allowed = self.allowed_steps()
        if done > self.spec.steps:
            return f"{done} steps already exceed the step plan of T = {self.spec.steps} steps"
        if allowed >= self.spec.steps:
            return f"the step plan of T = {self.spec.steps} steps is complete (epsilon = {self.epsilon_at(done):.4g})"
        nxt = min(allowed + 1, self.spec.steps)
        return (
            f"the next step would exceed target_epsilon = {self.target_epsilon:g}: epsilon after {allowed} steps "
            f"= {self.epsilon_at(allowed):.4g}, after {nxt} steps = {self.epsilon_at(nxt):.4g}"
        )

    def on_train_begin(self, logs=None):
        self._take_run()
        self._host_count = None
        done = self._steps_done()
        if self._counts_on_host():
            self._host_count = done
        allowed = self.allowed_steps()
        if done + self._chunk() > allowed:
            raise RuntimeError(
                f"PrivacyBudget: no further step is allowed after {done} optimizer steps: {self._why(done)}."
            )
        # Up front, before the first step: the ledger's shared state (with PLD: the mechanism's
        # privacy loss distribution) and ε after the last allowed step, which the last epoch end
        # reports. Every later query is a few milliseconds.
        self.ledger.epsilon(allowed)

    def on_train_batch_end(self, batch, logs=None):
        if self._host_count is not None:
            self._host_count += 1
        done = self._steps_done()
        if self.log_every_step and logs is not None:
            logs["epsilon"] = self.epsilon_at(done)
        if done + self._chunk() > self.allowed_steps() and not self.model.stop_training:
            self.model.stop_training = True
            self.stopped_at_step = done
            self.stop_reason = self._why(done)
            if self.verbose and _is_chief(self.model):
                print(f"\nPrivacyBudget: stopping after {done} steps: {self.stop_reason}.")

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self.epsilon_at(self._steps_done())

    # -------------------------------------------------------------- config
    def get_config(self) -> dict:
        """The constructor's arguments, the run as ``run.get_config()`` (its public plan)."""
        return {
            "run": None if self.run is None else self.run.get_config(),
            "target_epsilon": self.target_epsilon,
            "log_every_step": self.log_every_step,
            "verbose": self.verbose,
        }

    @classmethod
    def from_config(cls, config: dict) -> "PrivacyBudget":
        config = dict(config)
        if isinstance(config.get("run"), dict):
            config["run"] = PrivateRun.from_config(config["run"])
        return cls(**config)


def _is_chief(model) -> bool:
    """Whether this process prints: the chief of a multi-worker strategy (worker 0),
    always in a single process."""
    strategy = getattr(model, "distribute_strategy", None)
    return bool(getattr(getattr(strategy, "extended", None), "should_checkpoint", True))
