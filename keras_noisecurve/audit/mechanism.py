"""Mechanism checks on the user's own model and run: does the implementation do what the
accountant assumes? (TensorFlow and JAX)

A canary audit (:mod:`keras_noisecurve.audit.whitebox`) bounds ε from below on the
audit's own small model; it cannot see a bug in a layer that model does not have. These
checks are exact (or tests with a fixed false-alarm rate) and run on the user's model,
data, run and optimizer:

- **clipping** (:mod:`~keras_noisecurve.audit.mechanism_clipping`): the clipped sum and
  per-example norms of ``make_private(model)``'s engine, layer by layer, against an
  independent per-example gradient loop (``GradientTape`` on TensorFlow, ``jax.grad`` on
  JAX); no example contributes more than ζ;
- **sampling** (:mod:`~keras_noisecurve.audit.participation`): the participations the
  run's data pipeline produces over the whole plan against the accountant's assumption;
- **noise** (:mod:`~keras_noisecurve.audit.mechanism_noise`): the optimizer's noise on
  zero clipped sums has scale ζσ and, whitened by the claimed C, is white.

``noisecurve audit --model FILE.keras --data FILE.npz`` runs them (docs/audit.md).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from keras_noisecurve._validation import check_float, check_int

__all__ = ["CHECKS", "MechanismReport", "check_mechanism", "check_sampling"]

#: the checks, in the order they run
CHECKS = ("clipping", "sampling", "noise")


@dataclasses.dataclass(frozen=True)
class MechanismReport:
    """The outcome of :func:`check_mechanism`.

    Attributes:
      passed: every check that ran passed.
      checks: ``{name: result}`` (a ``ClippingCheck``, ``ParticipationCheck`` or ``NoiseCheck``).
      seconds: ``{name: wall seconds}``.
    """

    passed: bool
    checks: dict
    seconds: dict

    def lines(self) -> list:
        """One line per check: ``name: PASS|FAIL - the number``."""
        return [check.line for check in self.checks.values()]

    def to_dict(self) -> dict:
        """JSON-able form."""
        return {"passed": self.passed, "seconds": dict(self.seconds),
                "checks": {name: dataclasses.asdict(check) for name, check in self.checks.items()}}


def _run_ids(run):
    """For each step of the plan, the ids of the real examples the run's pipeline yields
    (``run.dataset(arange(n)).batches()``: the sampler, the gather and the mask of training)."""
    import keras

    ids = np.arange(run.num_examples, dtype=np.int64)
    out = []
    for element in run.dataset(ids).batches():
        xb, mask = (keras.ops.convert_to_numpy(t) for t in (element[0], element[2]))
        out.append(np.asarray(xb)[np.asarray(mask) > 0])
    return out


def check_sampling(*, run):
    """The sampling check of ``run`` (a ``PrivateRun``): iterate its pipeline over the whole
    plan and compare every example's participations with the accountant's assumption
    (:func:`keras_noisecurve.audit.participation.check_participations`; for cyclic Poisson
    with the sampler's partitions)."""
    from keras_noisecurve.audit.participation import check_participations

    partitions = run.sampler().partitions if run.spec.sampling == "cyclic_poisson" else None
    return check_participations(batches=_run_ids(run), spec=run.spec, partitions=partitions)


def _resolve(model, run, loss, l2_norm_clip, optimizer):
    """(private model, run, loss, ζ, optimizer) from the arguments and the model's compile state."""
    import keras

    import keras_noisecurve as knc

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model (or the PrivateModel of make_private), got "
                        f"{type(model).__name__}.")
    private = model if isinstance(model, knc.PrivateModel) else knc.make_private(model)
    compiled = getattr(model, "optimizer", None)
    if optimizer is None and isinstance(compiled, knc.NoiseCurveOptimizer):
        optimizer = compiled
    if optimizer is not None and not isinstance(optimizer, knc.NoiseCurveOptimizer):
        raise TypeError(f"optimizer must be a keras_noisecurve.NoiseCurveOptimizer, got {type(optimizer).__name__}.")
    if run is None and optimizer is not None:
        run = optimizer.run
    if run is not None and not isinstance(run, knc.PrivateRun):
        raise TypeError(f"run must be a keras_noisecurve.PrivateRun, got {type(run).__name__}.")
    if loss is None:
        loss = getattr(model, "loss", None)
    if loss is None:
        raise ValueError("loss is needed for the clipping check: pass loss= (e.g. a keras.losses.Loss) or a model "
                         "compiled with one.")
    if l2_norm_clip is None and optimizer is not None:  # an adaptive clip: its current ζ_t
        adaptive = optimizer.adaptive_clip is not None and not optimizer.built
        clip = optimizer.adaptive_clip.initial if adaptive else optimizer.current_clip()
        l2_norm_clip = float(np.asarray(keras.ops.convert_to_numpy(clip)))
    if l2_norm_clip is None:
        raise ValueError("l2_norm_clip (zeta) is needed: pass l2_norm_clip= or a model compiled with a "
                         "NoiseCurveOptimizer.")
    return private, run, loss, check_float("l2_norm_clip", l2_norm_clip, positive=True), optimizer


def check_mechanism(
    *,
    model,
    x,
    y,
    run=None,
    loss=None,
    l2_norm_clip: Optional[float] = None,
    optimizer=None,
    sample_weight=None,
    batches: int = 2,
    batch_size: int = 16,
    tolerance: float = 1e-3,
    noise_steps: int = 32,
    probes: Optional[int] = None,
    checks=CHECKS,
    seed: int = 0,
    verbose: bool = False,
) -> MechanismReport:
    """Run the mechanism checks on a model, its data, its run and its optimizer.

    Args:
      model: the user's Keras model, or its ``PrivateModel`` (``make_private(model)``);
        when compiled with a ``NoiseCurveOptimizer`` (e.g. loaded from a ``.keras`` file)
        the optimizer, its run, ζ and the loss come from it.
      x, y: the user's examples (numpy arrays, or dicts/tuples of them; the clipping
        check takes ``batches`` random batches of ``batch_size`` of them).
      run: the ``PrivateRun`` (default: the optimizer's); needed by the sampling check.
      loss: the training loss (default: the model's compiled loss).
      l2_norm_clip: ζ (default: the optimizer's).
      optimizer: the ``NoiseCurveOptimizer`` (default: the model's); needed by the noise check.
      sample_weight: (n,) weights w_i of the examples (default 1).
      batches, batch_size: the clipping check's batches (≥ 1 each).
      tolerance: relative tolerance of the clipping check, in (0, 1).
      noise_steps: T', steps of the noise check (≥ 2); probes: its N (default max(2000, 40·T')).
      checks: which of ``CHECKS`` to run; a check whose input is missing (no run, no
        optimizer) is refused with a message rather than skipped.
      seed: chooses the clipping check's examples.
      verbose: print each check's line as it finishes.

    Returns:
      a :class:`MechanismReport`; ``report.passed`` is False when any check failed.
    """
    import time

    import keras

    from keras_noisecurve._losses import per_example_loss_fn
    from keras_noisecurve.audit import mechanism_clipping, mechanism_noise
    from keras_noisecurve.backend import batch_probe

    checks = tuple(checks)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown or not checks:
        raise ValueError(f"checks must be a non-empty subset of {CHECKS}, got {list(checks)}.")
    batches = check_int("batches", batches, minimum=1)
    batch_size = check_int("batch_size", batch_size, minimum=1)
    tolerance = check_float("tolerance", tolerance, open_unit=True)
    noise_steps = check_int("noise_steps", noise_steps, minimum=2)
    if probes is not None:
        probes = check_int("probes", probes, minimum=noise_steps + 1)
    seed = check_int("seed", seed, minimum=0)
    private, run, loss, clip, optimizer = _resolve(model, run, loss, l2_norm_clip, optimizer)
    if "sampling" in checks and run is None:
        raise ValueError("the sampling check needs the run: pass run= (a PrivateRun) or a model compiled with "
                         "NoiseCurveOptimizer(run=...), or leave 'sampling' out of checks.")
    if "noise" in checks and optimizer is None:
        raise ValueError("the noise check needs the optimizer: pass optimizer= (a NoiseCurveOptimizer) or a model "
                         "compiled with one, or leave 'noise' out of checks.")
    n = int(np.asarray(keras.tree.flatten(x)[0]).shape[0])
    lengths = {int(np.asarray(a).shape[0]) for a in keras.tree.flatten((x, y))}
    if len(lengths) != 1:
        raise ValueError(f"x and y must hold the same number of examples, got leading sizes {sorted(lengths)}.")
    weights = None if sample_weight is None else np.asarray(sample_weight, np.float32).reshape(-1)
    if weights is not None and weights.shape[0] != n:
        raise ValueError(f"sample_weight must have {n} entries (one per example), got {weights.shape[0]}.")

    results, seconds = {}, {}

    def done(name, result, start):
        results[name], seconds[name] = result, time.perf_counter() - start
        if verbose:
            print(result.line, flush=True)

    if "clipping" in checks:
        start = time.perf_counter()
        if not private.built:
            private(keras.tree.map_structure(lambda a: np.asarray(a)[:1], x), training=False)
        loss_fn = per_example_loss_fn(loss)
        rng = np.random.default_rng(seed)
        order = rng.permutation(n)
        parts = []
        for k in range(batches):
            index = order[(k * batch_size) % n:][:batch_size]
            if index.size == 0:
                break
            parts.append(mechanism_clipping.check_clipping(
                private=private, loss_fn=loss_fn, l2_norm_clip=clip,
                x=keras.tree.map_structure(lambda a: np.asarray(a)[index], x),
                y=keras.tree.map_structure(lambda a: np.asarray(a)[index], y),
                sample_weight=None if weights is None else weights[index], tolerance=tolerance))
        merged = mechanism_clipping.merge(parts, tolerance=tolerance)
        first = order[:batch_size]  # in training mode: MixUp, batch statistics, state written from the data
        probe = batch_probe.probe_examples(private.inner, keras.tree.map_structure(lambda a: np.asarray(a)[first], x),
                                           keras.tree.map_structure(lambda a: np.asarray(a)[first], y),
                                           loss_fn=loss_fn)
        done("clipping", mechanism_clipping.with_probe(merged, probe), start)
    if "sampling" in checks:
        start = time.perf_counter()
        done("sampling", check_sampling(run=run), start)
    if "noise" in checks:
        start = time.perf_counter()
        done("noise", mechanism_noise.check_noise(optimizer=optimizer, steps=noise_steps, probes=probes), start)
    return MechanismReport(passed=all(r.passed for r in results.values()), checks=results, seconds=seconds)
