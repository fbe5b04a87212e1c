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

A user-level run (``PrivateRun(privacy_unit="user")``) is checked on its unit, the user: the
clipping check takes ``batch_size`` users per batch, their rows as the run's
:class:`~keras_noisecurve.privacy.users.UserTable` lays them out (``users=``, the user of every
example), and compares the engine, clipping with ``unit_rows = run.examples_per_user``, against
per-user sums of the reference's per-example gradients; the sampling check counts the
participations of USERS in the run's user-level pipeline; the noise check is the same (B and
the adaptive clip's count are in users).

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


def _run_ids(run, users=None):
    """``(ids, mixed)``: for each step of the plan, the ids of the privacy units the run's
    pipeline yields (``run.dataset(arange(n)).batches()``: the sampler, the gather and the mask
    of training), and the number of user slots holding rows of more than one user.

    Example-level: the real examples of each step (``mixed`` 0). User-level: the users of each
    step, one per user slot of k rows that holds a real row (its users, should its rows belong to
    several, each counted); the examples are ``users`` (one id per example, users numbered in
    ``np.unique`` order), or one example per user (``users = arange(num_users)``)."""
    import keras

    if run.privacy_unit == "example":
        data, user_of, k = run.dataset(np.arange(run.num_examples, dtype=np.int64)), None, 1
    else:
        if users is None:
            users = np.arange(run.num_users, dtype=np.int64)
        user_of = np.unique(np.asarray(users), return_inverse=True)[1].reshape(-1).astype(np.int64)
        data, k = run.dataset(np.arange(user_of.size, dtype=np.int64), users=users), run.examples_per_user
    out, mixed = [], 0
    for element in data.batches():
        xb, mask = (np.asarray(keras.ops.convert_to_numpy(t)) for t in (element[0], element[2]))
        if user_of is None:
            out.append(xb[mask > 0])
            continue
        step = []
        for slot_rows, slot_mask in zip(xb.reshape(-1, k), mask.reshape(-1, k)):
            present = np.unique(user_of[slot_rows[slot_mask > 0]])
            mixed += int(present.size > 1)
            step.extend(present.tolist())
        out.append(np.asarray(step, np.int64))
    return out, mixed


def check_sampling(*, run, users=None):
    """The sampling check of ``run`` (a ``PrivateRun``): iterate its pipeline over the whole
    plan and compare every unit's participations with the accountant's assumption
    (:func:`keras_noisecurve.audit.participation.check_participations`; for cyclic Poisson
    with the sampler's partitions).

    A user-level run's units are its users (n = ``num_users``): ``users`` the user of every
    example (the data's own table, as ``run.dataset(x, y, users=users)``; default: one example
    per user), and it fails too when a user slot of the batches holds rows of more than one user."""
    from keras_noisecurve.audit.participation import check_participations

    if users is not None and run.privacy_unit != "user":
        raise ValueError("users= is for a user-level run (PrivateRun(privacy_unit='user', ...)); this run's unit is "
                         "the example: leave users= out.")
    partitions = run.sampler().partitions if run.spec.sampling == "cyclic_poisson" else None
    ids, mixed = _run_ids(run, users)
    result = check_participations(batches=ids, spec=run.spec, partitions=partitions, unit=run.privacy_unit)
    if mixed:
        result = dataclasses.replace(
            result, passed=False, line=f"sampling: FAIL - {mixed} user slots hold rows of more than one user; "
                                       + result.line.split(" - ", 1)[1])
    return result


def _user_batches(table, weights, batches, batch_size, seed):
    """``[(rows, mask)]``: ``batches`` batches of ``batch_size`` random users each (fewer when the
    users run out), their rows and masks as a user-level step lays them out
    (:meth:`~keras_noisecurve.privacy.users.UserTable.rows`; a user with more than k examples
    contributes k of them, drawn from a key made from ``seed``)."""
    rng = np.random.default_rng([seed, 1])
    order = rng.permutation(table.num_users)
    key = rng.integers(0, np.iinfo(np.int64).max, size=2, dtype=np.int64)
    out = []
    for b in range(batches):
        chosen = order[(b * batch_size) % table.num_users:][:batch_size]
        if chosen.size == 0:
            break
        out.append(table.rows(chosen, np.ones(chosen.size), b, key, sample_weight=weights))
    return out


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
    users=None,
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
      users: a user-level run's (``PrivateRun(privacy_unit="user")``): the user id (int or
        string) of every example of x, as ``run.dataset(x, y, users=users)`` takes them; needed
        by its clipping check, used by its sampling check (default there: one example per user);
        refused for an example-level run.
      batches, batch_size: the clipping check's batches (≥ 1 each); ``batch_size`` counts users
        for a user-level run (each user's k = ``examples_per_user`` rows laid out as a step's).
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
    from keras_noisecurve.backend.common import batch_probe

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
    user_level = run is not None and run.privacy_unit == "user"
    if users is not None and not user_level:
        raise ValueError("users= is for a user-level run (PrivateRun(privacy_unit='user', ...)), whose privacy unit "
                         f"is the user; {'no run was given' if run is None else 'this run is example-level'}: leave "
                         "users= out, or pass the user-level run (run=).")
    if user_level and "clipping" in checks and users is None:
        raise ValueError(
            f"the run is user-level (examples_per_user={run.examples_per_user}): its clipping check clips per user "
            "and needs users= (the user id of every example of x, as run.dataset(x, y, users=...) takes them); "
            "pass users=, or leave 'clipping' out of checks.")
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

    table = None
    if user_level and users is not None:
        from keras_noisecurve.privacy.users import UserTable

        table = UserTable(users, examples_per_user=run.examples_per_user)
        if table.num_examples != n:
            raise ValueError(f"users= must have {n} entries (one per example of x), got {table.num_examples}.")
        if "sampling" in checks and table.num_users != run.num_users:
            raise ValueError(f"users= holds {table.num_users} distinct users but the run was planned for num_users="
                             f"{run.num_users}: the sampling check iterates the run's pipeline on them; give the "
                             "users of the whole training set, or leave 'sampling' out of checks.")

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
        if table is None:  # (rows, their weights) of each batch
            order = np.random.default_rng(seed).permutation(n)
            chosen = [order[(k * batch_size) % n:][:batch_size] for k in range(batches)]
            chosen = [(index, None if weights is None else weights[index]) for index in chosen if index.size]
        else:  # batch_size users each, their k rows as a user-level step lays them out
            chosen = _user_batches(table, weights, batches, batch_size, seed)
        parts = []
        for index, mask in chosen:
            parts.append(mechanism_clipping.check_clipping(
                private=private, loss_fn=loss_fn, l2_norm_clip=clip,
                x=keras.tree.map_structure(lambda a: np.asarray(a)[index], x),
                y=keras.tree.map_structure(lambda a: np.asarray(a)[index], y),
                sample_weight=mask, tolerance=tolerance, unit_rows=1 if table is None else run.examples_per_user))
        merged = mechanism_clipping.merge(parts, tolerance=tolerance)
        # in training mode: MixUp, batch statistics, state written from the data (a user-level batch's real rows)
        first = chosen[0][0] if table is None else np.unique(chosen[0][0][chosen[0][1] > 0])
        probe = batch_probe.probe_examples(private.inner, keras.tree.map_structure(lambda a: np.asarray(a)[first], x),
                                           keras.tree.map_structure(lambda a: np.asarray(a)[first], y),
                                           loss_fn=loss_fn)
        done("clipping", mechanism_clipping.with_probe(merged, probe), start)
    if "sampling" in checks:
        start = time.perf_counter()
        done("sampling", check_sampling(run=run, users=users), start)
    if "noise" in checks:
        start = time.perf_counter()
        done("noise", mechanism_noise.check_noise(optimizer=optimizer, steps=noise_steps, probes=probes), start)
    return MechanismReport(passed=all(r.passed for r in results.values()), checks=results, seconds=seconds)
