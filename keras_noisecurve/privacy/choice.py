"""Choosing the mechanism for the run's budget: ``PrivateRun(mixing="auto")``.

Every mechanism of a run (DP-SGD, C = I; a b-banded C; a BLT or BISR C under fixed epochs)
is calibrated to the same target (ε, δ) by the run's accountant, amplification by sampling
included: with cyclic Poisson sampling a b-banded C samples each of b partitions with
probability q = B·b/n, ⌈T/b⌉ times, so σ(b) grows with b. What the model sees is the
noise of its updates, the rows of ``A_rule C⁻¹`` scaled by ζ·σ(b)/B (``A_rule`` maps the
noise of the steps to the change of the weights under the run's update rule: momentum,
learning-rate schedule). So the expected squared error of the run, summed over its T
steps, is

    E(C) = σ(C)² · Tr(W X⁻¹),      X = CᵀC,  W = A_ruleᵀ A_rule,

in units of (ζη/B)² per coordinate. DP-SGD's is σ(1)²·Tr(W). :func:`choose_mixing`
evaluates E for every candidate and returns the smallest, as a :class:`MixingChoice` that
also holds the whole comparison. Its ``relative_error`` E(C)/E(I) is the predicted noise
*variance* relative to DP-SGD, and ``1 − √relative_error`` the predicted lowering of the
noise's standard deviation: the number the summary turns into words.

Candidates (cyclic Poisson):

1. **screen**: for b on a grid from 1 to the most bands the sampling allows
   (b < n/B; at most T, ``max_bands``), the banded Toeplitz C of DP-BandMF for plain SGD
   (O(T log T) to solve; its truncated last columns normalised to norm 1), scored under
   the run's own workload, at σ(b);
2. **solve**: the screened b's within 25 % of the best screen, best first, solved exactly
   for the run's workload by the banded solver (``solve_mixing_matrix(strategy="banded",
   update_rule=...)``) while their summed cost T·b² (×13 under momentum or a schedule)
   stays within ``EXACT_SOLVE_BUDGET``: every competitive b at the demo's size (T = 140),
   none or few at T = 10⁴, where the screen stands (plain SGD's exact C is within 1 % of
   its screen there; under momentum 0.9 within 3 % at T = 10⁴, but up to 18 % at T = 140,
   where every competitive b is solved exactly).

Under fixed epochs (no amplification, σ set by the run's sensitivity): DP-SGD, banded C of
b ≤ the epoch length, and, for plain SGD, BLT (d buffers, optimised for the run's
participations) and BISR.

The choice is the smallest candidate (fewest bands, so the fewest noise buffers the
optimizer keeps) whose E is within ``tolerance`` of the best and not above DP-SGD's: a
gain under ``tolerance`` is not worth b − 1 buffers per variable, and DP-SGD is always a
candidate, so the choice is never predicted worse than DP-SGD. Deterministic: no
wall-clock enters the choice.

With a Hessian spectrum (``objective=`` a curvature objective, ``spectrum=``,
``learning_rate=``), E is the objective's Tr(W X⁻¹) (paper eq. 1, the predicted increase
of the final loss) and the curvature-solved banded C are candidates under the same σ(b),
beside the DP-BandMF ones: the prediction of a quadratic model, which on the repository's
models has not come true (docs/results.md).

numpy/scipy + ``dp_accounting``: nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Optional

import numpy as np

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.mixing.workloads import CURVATURE_OBJECTIVES
from keras_noisecurve.privacy.calibration import noise_multiplier_for
from keras_noisecurve.privacy.events import ACCOUNTANTS
from keras_noisecurve.privacy.spec import RunSpec

__all__ = ["EXACT_SOLVE_BUDGET", "TOLERANCE", "Candidate", "MixingChoice", "choose_mixing", "expectation",
           "predicted_gain"]

#: The objective of the running sums of the noise under the update rule (DP-BandMF's):
#: what the candidates are scored by unless a curvature objective is given.
RUNNING_SUMS = "bandmf"

#: A candidate with fewer bands is chosen when its predicted error is within this factor
#: (relative) of the best one's.
TOLERANCE = 0.01

#: The summed cost T·b² of the exact banded solves (×``_RULE_SOLVE_COST`` under momentum or a
#: schedule): the whole grid at the demo's size (T = 140, b ≤ 13), b ≤ 17 at T = 10⁴ (about
#: 10 s on one core; plain SGD's exact C is within 1 % of its screen there).
EXACT_SOLVE_BUDGET = 3e6
#: Only screens within this factor of the best screen are solved exactly.
_SCREEN_MARGIN = 0.25
#: How much slower the banded solver is for a momentum or schedule workload (measured ×13 at
#: T = 10⁴, b = 10).
_RULE_SOLVE_COST = 13

#: The grid of sizes screened: every size to 8, then about ×1.5 apart, and the largest (near
#: its best b the error is flat: within 1 % from b = 28 to 55 at T = 10⁴).
_DENSE_UP_TO = 8
_GRID_RATIO = 1.5
#: σ per accounting event (its sampling, q, participations, sensitivity) and target
#: (ε, δ, accountant): calibration is deterministic, and a process that chooses twice (the
#: demo, a sweep) calibrates each event once.
_SIGMAS: dict = {}
_SIGMA_CACHE_SIZE = 4096

#: BLT buffers tried under fixed epochs.
_BLT_BUFFERS = (1, 2, 3, 4, 6, 8)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One mechanism of the comparison.

    Attributes:
      label: how it is printed (``"DP-SGD"``, ``"banded b=7"``, ``"blt d=4"``, ...).
      kind: the strategy kind of its C (``"banded"`` for DP-SGD's C = I too).
      size: b (bands of C), d (BLT buffers) or p (bands of C⁻¹, BISR); 1 for DP-SGD.
      buffers: the noise vectors the optimizer keeps per variable (b − 1, d, p).
      objective: the objective its C was solved for (``"bandmf"``, or a curvature objective).
      solved: ``"exact"`` (solved for the scored workload), ``"screen"`` (the plain-SGD Toeplitz
        C, columns normalised, scored under the run's workload) or ``"closed form"``.
      noise_multiplier: σ of the run with this C at the target (ε, δ).
      error: Tr(W X⁻¹) of its C (per unit σ²).
      relative_error: σ²·error relative to DP-SGD's (the predicted noise variance ratio).
      seconds: time to solve and score it (calibration included).
    """

    label: str
    kind: str
    size: int
    buffers: int
    objective: str
    solved: str
    noise_multiplier: float
    error: float
    relative_error: float
    seconds: float

    @property
    def noise_reduction(self) -> float:
        """1 − √relative_error: how much lower the noise's standard deviation is than DP-SGD's."""
        return 1.0 - math.sqrt(self.relative_error)


@dataclasses.dataclass(frozen=True)
class MixingChoice:
    """The mechanism :func:`choose_mixing` chose, and the comparison it chose from.

    Give it to ``PrivateRun(mixing=choice, ...)`` with the same plan and (ε, δ), or let
    ``PrivateRun(mixing="auto")`` make it (``run.mixing_choice``).

    Attributes:
      mixing: the chosen C (``MixingMatrix.identity(T)`` for DP-SGD).
      chosen: its :class:`Candidate`.
      candidates: every candidate, DP-SGD first, in the order evaluated.
      plan: the run the choice is for: ``num_examples``, ``batch_size``, ``steps``,
        ``sampling``, ``epsilon``, ``delta``, ``accountant``.
      update_rule: the rule's metadata (``UpdateRule.to_metadata()``).
      objective: the objective the candidates were scored under.
      seconds: the whole choice's time.
    """

    mixing: object
    chosen: Candidate
    candidates: tuple
    plan: dict
    update_rule: dict
    objective: str
    seconds: float

    @property
    def noise_multiplier(self) -> float:
        """σ of the chosen mechanism at the target (ε, δ)."""
        return self.chosen.noise_multiplier

    @property
    def relative_error(self) -> float:
        """The chosen mechanism's predicted noise variance relative to DP-SGD's (≤ 1)."""
        return self.chosen.relative_error

    @property
    def noise_reduction(self) -> float:
        """1 − √relative_error (≥ 0): the predicted lowering of the noise's std."""
        return self.chosen.noise_reduction

    @property
    def dpsgd(self) -> Candidate:
        """DP-SGD's candidate (the reference of every ``relative_error``)."""
        return self.candidates[0]

    def expectation(self) -> str:
        """The predicted gain over DP-SGD, in words."""
        return expectation(self.chosen, epsilon=self.plan["epsilon"], curvature=self.objective in CURVATURE_OBJECTIVES)

    def table(self, *, every: bool = False) -> str:
        """The comparison as text, the chosen candidate marked ``->``: one row per mechanism
        (its exact solve where there is one, else its screen); ``every=True``: every candidate."""
        rows = [f"   {'candidate':<32}{'sigma':>8}{'error/DP-SGD':>14}{'noise std':>11}{'solved':>13}{'s':>7}"]
        shown = self.candidates
        if not every:
            exact = {(c.kind, c.size, c.objective) for c in self.candidates if c.solved != "screen"}
            shown = [c for c in self.candidates if c.solved != "screen" or (c.kind, c.size, c.objective) not in exact]
            shown = sorted(shown, key=lambda c: (c.buffers > 0, c.kind, c.size, c.objective))
        for c in shown:
            mark = "->" if c is self.chosen else ""
            rows.append(f"{mark:>2} {c.label:<32}{c.noise_multiplier:>8.4g}{c.relative_error:>14.3f}"
                        f"{-100 * c.noise_reduction:>+10.1f}%{c.solved:>13}{c.seconds:>7.2f}")
        return "\n".join(rows)

    def summary(self) -> str:
        """A header line (the plan, the number of candidates, the time, the choice), the table
        and :meth:`expectation`."""
        plan = self.plan
        scored = f", scored by {self.objective}" if self.objective in CURVATURE_OBJECTIVES else ""
        head = (f"mixing='auto' for n={plan['num_examples']}, B={plan['batch_size']}, T={plan['steps']}, "
                f"{plan['sampling']}, eps={plan['epsilon']:g}, delta={plan['delta']:g} ({plan['accountant']}), "
                f"update rule {rule_text(self.update_rule)}{scored}: {len(self.candidates)} candidates in "
                f"{self.seconds:.1f} s; chosen: {self.chosen.label} (sigma {self.noise_multiplier:.4g}).")
        return "\n".join([head, self.table(), self.expectation()])

    def to_metadata(self) -> dict:
        """A JSON-able record of the choice (kept in the chosen C's metadata under ``"choice"``)."""
        return {"plan": dict(self.plan), "update_rule": self.update_rule, "objective": self.objective,
                "chosen": self.chosen.label, "seconds": self.seconds,
                "candidates": [dataclasses.asdict(c) for c in self.candidates]}

    def check_plan(self, plan: dict) -> None:
        """``ValueError`` unless ``plan`` (the same keys as :attr:`plan`) is the plan chosen for."""
        differ = {k: (self.plan[k], plan.get(k)) for k in self.plan if plan.get(k) != self.plan[k]}
        if differ:
            raise ValueError(
                "this MixingChoice was made for another run: " + ", ".join(
                    f"{k}={a!r} there, {b!r} here" for k, (a, b) in sorted(differ.items()))
                + ". A mechanism chosen for one budget is calibrated for it: choose again for this run "
                "(mixing='auto').")


def expectation(candidate: Candidate, *, epsilon: float, curvature: bool = False) -> str:
    """One sentence: the predicted lowering of the noise std against DP-SGD, and what to expect."""
    what = "the predicted loss increase" if curvature else "the noise of the updates"
    reduction = candidate.noise_reduction
    if candidate.buffers == 0 and candidate.solved == "given":
        return "This C = I is DP-SGD itself: no correlation, no gain or loss against DP-SGD."
    if candidate.buffers == 0:
        return (f"At eps = {epsilon:g} amplification by sampling outweighs correlation: DP-SGD has the least "
                "noise of the candidates; correlated noise is predicted to gain nothing here.")
    if reduction < 0:
        return (f"At eps = {epsilon:g} {candidate.label} is predicted to have {100 * -reduction:.0f} % more "
                f"noise (std) than DP-SGD in {what}: expect it to do worse.")
    words = ("expect no visible gain" if reduction < 0.10 else
             "expect a small gain, visible over several seeds" if reduction < 0.25 else "expect a clear gain")
    return (f"At eps = {epsilon:g} {candidate.label} lowers {what} by {100 * reduction:.0f} % (std; variance "
            f"x{candidate.relative_error:.2f}) against DP-SGD at the same (eps, delta): {words}.")


def rule_text(rule: dict) -> str:
    """``plain SGD`` or ``momentum 0.9, cosine``: an update rule's metadata in words."""
    momentum = float(rule.get("momentum", 0.0))
    schedule = rule.get("schedule", "constant")
    if not momentum and schedule == "constant":
        return "plain SGD"
    return ", ".join(([f"momentum {momentum:g}"] if momentum else []) + [f"{schedule} learning rate"])


def sigma_for(spec: RunSpec, *, epsilon: float, delta: float, accountant: str) -> float:
    """The calibrated σ of ``spec`` at (ε, δ) (``noise_multiplier_for``), once per accounting
    event and target in a process: ``PrivateRun(mixing="auto")`` calibrates its own C through
    here, so it reuses the choice's calibration and never takes a σ it was handed."""
    k = spec.participations()
    key = (spec.sampling, spec.sampling_probability, k, spec.sensitivity,
           spec.fixed_epoch_sensitivity(k) if spec.steps_per_epoch else None, spec.count_noise_multiplier,
           epsilon, delta, accountant)
    if key not in _SIGMAS:
        if len(_SIGMAS) >= _SIGMA_CACHE_SIZE:
            _SIGMAS.clear()
        _SIGMAS[key] = noise_multiplier_for(spec, epsilon, delta, accountant)
    return _SIGMAS[key]


def _grid(largest: int) -> list:
    """1, 2, …, 8, then about ×1.5 apart, and ``largest``."""
    sizes, b = [], 1
    while b < largest:
        sizes.append(b)
        b = b + 1 if b < _DENSE_UP_TO else max(b + 1, int(math.ceil(b * _GRID_RATIO)))
    return sizes + [largest]


def _normalised(band_values: np.ndarray, metadata: dict):
    """A banded ``MixingMatrix`` from band values whose columns have norms ≤ 1 (a truncated
    Toeplitz C's last columns): each column scaled to norm 1, so its sensitivity is 1."""
    from keras_noisecurve.mixing.banded import ab_to_band_values, band_values_to_ab
    from keras_noisecurve.mixing.matrix import MixingMatrix
    from keras_noisecurve.mixing.optimize import normalise_columns

    return MixingMatrix(ab_to_band_values(normalise_columns(band_values_to_ab(band_values))[0]), metadata=metadata)


class _Chooser:
    """One choice: the plan, the scored workload, σ per accounting event, the candidates."""

    def __init__(self, *, plan, spec, rule, objective, spectrum, learning_rate, verbose):
        self.plan, self.spec, self.rule = plan, spec, rule
        self.objective, self.spectrum, self.learning_rate, self.verbose = objective, spectrum, learning_rate, verbose
        self.candidates: list = []
        self.mixings: list = []
        from tqdm.auto import tqdm

        # a progress bar on stderr once the choice has taken 2 s (a long plan: T = 10⁴)
        self.progress = tqdm(desc="mixing='auto' candidates", unit="candidate", delay=2.0, leave=False,
                             disable=True if verbose else None)

    def sigma(self, mixing) -> float:
        """σ of the run with ``mixing`` at the target (ε, δ)."""
        spec = RunSpec(mixing=mixing, num_examples=self.spec.num_examples, batch_size=self.spec.batch_size,
                       steps=self.spec.steps, sampling=self.spec.sampling,
                       count_noise_multiplier=self.spec.count_noise_multiplier)
        return sigma_for(spec, epsilon=self.plan["epsilon"], delta=self.plan["delta"],
                         accountant=self.plan["accountant"])

    def score(self, mixing) -> float:
        """Tr(W X⁻¹) of ``mixing`` under the scored objective and the run's update rule."""
        from keras_noisecurve.mixing.api import objective_value

        return objective_value(mixing, objective=self.objective, spectrum=self.spectrum,
                               learning_rate=self.learning_rate, update_rule=None if self.rule.is_plain else self.rule)

    def add(self, mixing, *, label, kind, size, objective, solved, started) -> Candidate:
        sigma = self.sigma(mixing)
        error = self.score(mixing)
        base = self.candidates[0] if self.candidates else None
        relative = 1.0 if base is None else sigma ** 2 * error / (base.noise_multiplier ** 2 * base.error)
        candidate = Candidate(label=label, kind=kind, size=int(size), buffers=int(mixing.buffers),
                              objective=objective,
                              solved=solved, noise_multiplier=float(sigma), error=float(error),
                              relative_error=float(relative), seconds=time.perf_counter() - started)
        self.candidates.append(candidate)
        self.mixings.append(mixing)
        self.progress.update()
        if self.verbose:
            print(f"mixing='auto': {label:<32} sigma {sigma:.4g}, error/DP-SGD {relative:.3f} "
                  f"({solved}, {candidate.seconds:.2f} s)", file=sys.stderr, flush=True)
        return candidate

    def curvature_inputs(self) -> dict:
        """The spectrum and learning rate of a curvature objective ({} for the running sums)."""
        if self.objective in CURVATURE_OBJECTIVES:
            return {"spectrum": self.spectrum, "learning_rate": self.learning_rate}
        return {}

    # ------------------------------------------------------------ candidates
    def dpsgd(self):
        from keras_noisecurve.mixing.matrix import MixingMatrix

        started = time.perf_counter()
        self.add(MixingMatrix.identity(self.spec.steps), label="DP-SGD", kind="banded", size=1,
                 objective=RUNNING_SUMS, solved="exact", started=started)

    def banded(self, largest: int) -> None:
        """The screen over b ≤ ``largest``, then the exact solves within the budget."""
        from keras_noisecurve.mixing.api import solve_mixing_matrix

        steps, rule_record = self.spec.steps, self.rule.to_metadata()
        screened = []
        for b in _grid(largest)[1:] if largest > 1 else []:
            started = time.perf_counter()
            toeplitz = solve_mixing_matrix(steps=steps, bands=b, strategy="toeplitz")
            mixing = _normalised(toeplitz.band_values, {"objective": RUNNING_SUMS, "strategy": "banded",
                                                        "update_rule": rule_record, "from": "toeplitz"})
            screened.append(self.add(mixing, label=f"banded b={b} (screen)", kind="banded", size=b,
                                     objective=RUNNING_SUMS, solved="screen", started=started))
        objectives = [RUNNING_SUMS] + ([self.objective] if self.objective in CURVATURE_OBJECTIVES else [])
        spent = 0.0
        best = min((c.relative_error for c in screened), default=1.0)
        for candidate in sorted(screened, key=lambda c: c.relative_error):
            if candidate.relative_error > best * (1.0 + _SCREEN_MARGIN):
                break  # the exact solve lowers a screen by up to 18 % (momentum 0.9): this one cannot win
            cost = len(objectives) * steps * candidate.size ** 2 * (1 if self.rule.is_plain else _RULE_SOLVE_COST)
            if spent + cost > EXACT_SOLVE_BUDGET:
                continue
            spent += cost
            for i, objective in enumerate(objectives):
                started = time.perf_counter()
                mixing = solve_mixing_matrix(steps=steps, bands=candidate.size, objective=objective,
                                             update_rule=self.rule, **(self.curvature_inputs() if i else {}))
                suffix = f" ({objective})" if i else ""
                self.add(mixing, label=f"banded b={candidate.size}{suffix}", kind="banded", size=candidate.size,
                         objective=objective, solved="exact", started=started)

    def toeplitz_family(self, largest: int) -> None:
        """BLT (d buffers, optimised for the run's participations) and BISR, fixed epochs only."""
        from keras_noisecurve.mixing.api import solve_mixing_matrix

        steps, epochs, separation = self.spec.steps, self.spec.participations(), self.spec.steps_per_epoch
        for d in [d for d in _BLT_BUFFERS if d <= largest]:
            started = time.perf_counter()
            kwargs = {"participations": epochs, "separation": separation} if epochs > 1 else {}
            mixing = solve_mixing_matrix(steps=steps, strategy="blt", buffers=d, objective=self.objective,
                                         **self.curvature_inputs(), **kwargs)
            self.add(mixing, label=f"blt d={d}", kind="blt", size=d, objective=self.objective,
                     solved="exact", started=started)
        for p in _grid(min(steps, 32, largest + 1))[1:]:  # p - 1 buffers
            started = time.perf_counter()
            mixing = solve_mixing_matrix(steps=steps, strategy="bisr", bands=p, objective=self.objective,
                                         **self.curvature_inputs())
            self.add(mixing, label=f"bisr p={p}", kind="bisr", size=p, objective=self.objective,
                     solved="closed form", started=started)

    def chosen(self, tolerance: float) -> int:
        """The index of the candidate with the fewest buffers within ``tolerance`` of the best
        and not above DP-SGD (index 0)."""
        best = min(c.relative_error for c in self.candidates)
        eligible = [i for i, c in enumerate(self.candidates)
                    if c.relative_error <= min(1.0, best * (1.0 + tolerance))]
        return min(eligible, key=lambda i: (self.candidates[i].buffers, self.candidates[i].relative_error))


def choose_mixing(*, num_examples: int, batch_size: int, epsilon: float, delta: float, steps: Optional[int] = None,
                  epochs: Optional[int] = None, sampling: str = "cyclic_poisson", accountant: str = "pld",
                  update_rule=None, max_bands: Optional[int] = None, objective: str = RUNNING_SUMS, spectrum=None,
                  learning_rate: Optional[float] = None, tolerance: float = TOLERANCE,
                  verbose: bool = False, count_noise_multiplier: Optional[float] = None) -> MixingChoice:
    """The mechanism (DP-SGD, banded C with b bands, or under fixed epochs BLT/BISR) whose
    run at the target (ε, δ) has the least expected noise in the model's updates.

    Args (keyword-only):
      num_examples, batch_size, steps or epochs, sampling, accountant, epsilon, delta: the
        run, as ``PrivateRun`` takes them.
      update_rule: the ``UpdateRule`` training runs (momentum, learning-rate schedule);
        ``None``: plain SGD with a constant learning rate.
      max_bands: the most bands b to consider (under fixed epochs also the most BLT buffers d
        and BISR's p − 1); default: all the sampling allows (b < n/B for cyclic Poisson, the
        epoch length for fixed epochs). The optimizer keeps b − 1 noise vectors per trainable
        variable (d for BLT): cap b where that memory matters. The sizes are a grid: every b
        to 8, then about ×1.5 apart, and the largest.
      objective: ``"bandmf"`` (default): the expected squared noise of the weights' updates,
        Tr(W X⁻¹) with W of the update rule's running sums; a curvature objective (with
        ``spectrum`` and ``learning_rate``): the predicted final-loss increase of paper
        eq. 1, and the curvature-solved C become candidates too.
      tolerance: prefer fewer bands within this relative error of the best (default 1 %).
      verbose: one line per candidate on stderr, as it is scored.
      count_noise_multiplier: an adaptive clip's count queries
        (``AdaptiveClip.count_noise_multiplier(B)``), accounted in every candidate's σ;
        ``None``: a fixed clip. ``PrivateRun(mixing="auto", adaptive_clip=...)`` passes it.

    Returns:
      A :class:`MixingChoice`: the chosen C, its σ, and every candidate's σ, error relative
      to DP-SGD and solve time (``choice.summary()`` prints them with the expected gain).

    Cost: one σ calibration per distinct accounting event (about 1 s each, more for small b on
    long plans; the grid has about 8 + 1.7·log₂(b_max/8) sizes), an O(T log T) Toeplitz solve
    and an O(T·b) score per size, and exact banded solves within ``EXACT_SOLVE_BUDGET``.
    Measured on 2 cores shared with other work (load about 3): 60 s at T = 10⁴, b_max = 234
    (17 sizes; 17 s more for a second choice of the same budget, its σ kept in-process),
    18–24 s for the demo's run (T = 70, b_max = 13).
    """
    from keras_noisecurve.mixing.rule_workloads import resolve_update_rule
    started = time.perf_counter()
    spec = RunSpec(num_examples=num_examples, batch_size=batch_size, steps=steps, epochs=epochs, sampling=sampling,
                   count_noise_multiplier=count_noise_multiplier)
    plan = {"num_examples": spec.num_examples, "batch_size": spec.batch_size, "steps": spec.steps,
            "sampling": spec.sampling, "epsilon": check_float("epsilon", epsilon, positive=True),
            "delta": check_float("delta", delta, open_unit=True),
            "accountant": check_choice("accountant", accountant, ACCOUNTANTS)}
    if spec.count_noise_multiplier is not None:  # in the plan only when there are counts (older choices compare)
        plan["count_noise_multiplier"] = spec.count_noise_multiplier
    objective = check_choice("objective", objective, (RUNNING_SUMS,) + tuple(CURVATURE_OBJECTIVES))
    rule = resolve_update_rule(update_rule, spec.steps)
    tolerance = check_float("tolerance", tolerance, nonnegative=True)
    if spec.sampling == "cyclic_poisson":
        largest = (spec.num_examples - 1) // spec.batch_size  # q = B·b/n < 1
    else:
        largest = spec.steps_per_epoch
    largest = min(largest, spec.steps)
    if max_bands is not None:
        largest = min(largest, check_int("max_bands", max_bands, minimum=1))
    chooser = _Chooser(plan=plan, spec=spec, rule=rule, objective=objective, spectrum=spectrum,
                       learning_rate=learning_rate, verbose=verbose)
    chooser.dpsgd()
    chooser.banded(largest)
    if spec.sampling == "fixed_epochs" and rule.is_plain and spec.steps >= 2:
        chooser.toeplitz_family(largest if max_bands is None else check_int("max_bands", max_bands, minimum=1))
    chooser.progress.close()
    index = chooser.chosen(tolerance)
    chosen, mixing = chooser.candidates[index], chooser.mixings[index]
    choice = MixingChoice(mixing=mixing, chosen=chosen, candidates=tuple(chooser.candidates), plan=plan,
                          update_rule=rule.to_metadata(), objective=objective,
                          seconds=time.perf_counter() - started)
    if chosen.buffers and hasattr(mixing, "with_metadata"):
        choice = dataclasses.replace(choice, mixing=mixing.with_metadata(choice=choice.to_metadata()))
    return choice


def predicted_gain(mixing, *, num_examples: int, batch_size: int, epsilon: float, delta: float,
                   sampling: str = "cyclic_poisson", accountant: str = "pld", update_rule=None) -> Candidate:
    """The :class:`Candidate` of a given C for a run of ``C.steps`` steps at the target (ε, δ):
    its σ, Tr(W X⁻¹) and ``relative_error`` against DP-SGD's run at the same (ε, δ), scored as
    :func:`choose_mixing` scores (the running sums under ``update_rule``; default: the rule
    C records in its metadata, else plain SGD). ``expectation(candidate, epsilon=ε)`` says it
    in words."""
    from keras_noisecurve.mixing.rule_workloads import resolve_update_rule
    from keras_noisecurve.mixing.strategies import load_mixing
    from keras_noisecurve.mixing.update_rule import UpdateRule

    mixing = load_mixing(mixing)
    steps = mixing.steps
    if update_rule is None:
        update_rule = UpdateRule.from_metadata(getattr(mixing, "metadata", {}).get("update_rule"))
    spec = RunSpec(num_examples=num_examples, batch_size=batch_size, steps=steps, sampling=sampling, mixing=mixing)
    plan = {"num_examples": spec.num_examples, "batch_size": spec.batch_size, "steps": steps,
            "sampling": spec.sampling, "epsilon": check_float("epsilon", epsilon, positive=True),
            "delta": check_float("delta", delta, open_unit=True),
            "accountant": check_choice("accountant", accountant, ACCOUNTANTS)}
    chooser = _Chooser(plan=plan, spec=spec, rule=resolve_update_rule(update_rule, steps), objective=RUNNING_SUMS,
                       spectrum=None, learning_rate=None, verbose=False)
    chooser.dpsgd()
    started = time.perf_counter()
    size = int(mixing.bands) if mixing.banded else int(mixing.buffers)
    label = f"the given {mixing.kind} C ({mixing.buffers} noise buffers)" if mixing.buffers else "this C = I (DP-SGD)"
    chooser.add(mixing, label=label, kind=mixing.kind, size=size, objective=RUNNING_SUMS, solved="given",
                started=started)
    chooser.progress.close()
    return chooser.candidates[-1]
