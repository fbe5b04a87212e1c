"""White-box gradient-canary audit of a real training run (TensorFlow).

The run is the library's own: ``PrivateRun`` (plan, σ calibrated for the target ε),
``make_private`` (per-example clipping, the ``"auto"`` engine) and
``NoiseCurveOptimizer`` (the online noise z̃ = C⁻¹z of the strategy), trained with
``fit(run.dataset(x, y))``. Only the data and the model are built for the audit:

- the model is linear: ``out = Dense(1, no bias)(features) + gate · Embedding(m + N, 1)(id)``;
  the embedding rows 0 … m−1 are the canaries' coordinates, rows m … m+N−1 are PROBES
  that no example touches (their trajectories are pure noise);
- ``real_examples`` ordinary regression examples use the features (gate 0);
- canary i is an example with id i, gate 1, zero features and target ``CANARY_TARGET``
  (10⁴): its squared-error gradient on its own row is 2(w_i − 10⁴) ≪ −ζ, so after
  clipping it is exactly −ζ on coordinate i and 0 elsewhere — a known vector of norm ζ;
- each canary is included with probability ½; an excluded canary keeps its slot as an
  all-zero example (gate 0, zero features and target), whose gradient is exactly 0, so
  every other example's batches are identical in both worlds (zero-out adjacency: the
  clipped sum changes by at most ζ per participation, which is what the accountant
  bounds).

Every iterate is recorded (all intermediate models are released in the threat model);
:mod:`keras_noisecurve.audit.scoring` turns each canary's trajectory into the
observations y = p − σz̃ and scores them with the log-likelihood ratio whitened by the
claimed C (and by the noise covariance estimated on the probes), and
:func:`keras_noisecurve.audit.report.summarize` gives the ε lower bound.

The canaries' coordinates are disjoint and the noise is independent across coordinates,
so the canaries are independent trials given their inclusion bits: the Clopper–Pearson
bound applies, and with m canaries one run does the work of m runs.

``canary_kind="input"`` replaces the linear model and its embedding canaries by input
canaries through Dense, Conv1D, attention and LayerNormalization layers
(:mod:`keras_noisecurve.audit.input_canaries`).

``optimizer_factory``, ``dataset_factory`` and ``model_hook`` let a test audit a
deliberately broken variant of the same run (tests/audit); they are not needed otherwise.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np
from scipy import stats

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.audit import scoring
from keras_noisecurve.audit.mechanism import check_sampling
from keras_noisecurve.audit.report import AuditResult, summarize

__all__ = ["CANARY_TARGET", "STRATEGIES", "WhiteBoxAudit", "audit_whitebox", "build_mixing", "check_canary_headroom"]

STRATEGIES = ("dpsgd", "banded", "toeplitz", "blt")
CANARY_KINDS = ("embedding", "input")
SCORINGS = ("claimed/plan", "empirical/plan", "empirical/any-step", "claimed/poisson", "empirical/poisson")

#: thresholds on the log-likelihood-ratio scores, fixed before any score is seen (Bonferroni):
#: log LR = 0 is "as likely in as out"; the grid is fine near 0 (small μ) and reaches e^12
LLR_GRID = tuple(np.round(np.concatenate([-np.geomspace(0.02, 4, 12)[::-1], [0.0], np.geomspace(0.02, 12, 28)]), 6))

#: the canaries' regression target: far enough that the clipped gradient is always −ζ
CANARY_TARGET = 1.0e4


def build_mixing(*, strategy: str, steps: int, bands: int = 4, buffers: int = 2, participations: int = 1,
                 separation: Optional[int] = None):
    """The mixing strategy of an audit: C = I for T steps (``"dpsgd"``), DP-BandMF
    (``"banded"``, b bands), banded Toeplitz (``"toeplitz"``, b coefficients) or BLT
    (``"blt"``, d buffers, solved for ``participations`` fixed-epoch participations
    ``separation`` apart): the registry's solver of that kind, under the bandmf objective,
    given the arguments that kind takes (the others are ignored)."""
    from keras_noisecurve.mixing.strategies_solve import solve_strategy

    strategy = check_choice("strategy", strategy, STRATEGIES)
    return solve_strategy(strategy, steps=steps, objective="bandmf", bands=bands, buffers=buffers,
                          participations=participations, separation=separation, ignore_unused=True)


@dataclasses.dataclass
class WhiteBoxAudit:
    """What an audit trained and observed (for inspection and further scoring).

    Attributes:
      run: the ``PrivateRun``.
      included: (m,) bool, the canaries' inclusion bits.
      observations: (T, m) y of the canaries (eq. 1 of ``scoring``).
      probe_observations: (T, N) y of the probes.
      patterns: (T, m) planned participations of every canary slot (from the sampler).
      scores: ``{name: (m,) scores}``.
      result: the :class:`~keras_noisecurve.audit.report.AuditResult`.
    """

    run: object
    included: np.ndarray
    observations: np.ndarray
    probe_observations: np.ndarray
    patterns: np.ndarray
    scores: dict
    result: AuditResult


def _dataset_arrays(rng, real, features, m, included):
    n = real + m
    feats = np.zeros((n, features), np.float32)
    feats[:real] = rng.normal(size=(real, features))
    target = np.zeros((n, 1), np.float32)
    w_true = rng.normal(size=(features, 1))
    target[:real] = feats[:real] @ w_true + 0.1 * rng.normal(size=(real, 1))
    ids = np.zeros((n,), np.int32)
    ids[real:] = np.arange(m, dtype=np.int32)
    gate = np.zeros((n, 1), np.float32)
    gate[real:, 0] = included.astype(np.float32)
    target[real:, 0] = np.where(included, CANARY_TARGET, 0.0)
    return {"features": feats, "canary": ids, "gate": gate}, target


def _model(features, rows):
    import keras

    feat = keras.Input((features,), name="features")
    ids = keras.Input((), dtype="int32", name="canary")
    gate = keras.Input((1,), name="gate")
    dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="real")(feat)
    table = keras.layers.Embedding(rows, 1, embeddings_initializer="zeros", name="canaries")
    emb = table(ids)
    out = keras.layers.Add()([dense, keras.layers.Multiply()([gate, emb])])
    return keras.Model({"features": feat, "canary": ids, "gate": gate}, out, name="audit_linear"), table


def _reload(private):
    """The private model saved to a ``.keras`` file and loaded back (optimizer state included)."""
    import os
    import tempfile

    import keras

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "resume.keras")
        private.save(path)
        return keras.models.load_model(path)


def _patterns(run, real, m):
    """(T, m) 0/1: the steps at which each canary SLOT is sampled (the same in both worlds)."""
    sampler = run.sampler()
    out = np.zeros((run.steps, m))
    for t in range(run.steps):
        idx, mask, _ = sampler.batch(t)
        idx = np.asarray(idx)[np.asarray(mask) > 0]
        slots = idx[idx >= real] - real
        np.add.at(out[t], slots, 1.0)
    return out


#: a participation count gets its own bound when at least this many canaries are in and out
MIN_GROUP = 20


def _summarize_by_participations(*, scores, included, counts, confidence, info, **kwargs):
    """The audit's result with a bound per participation count (docs/audit.md).

    Canaries are grouped by how many steps their slot takes part in (the plan's count, the
    same in both worlds). With one count (fixed epochs) the pooled bound is that count's.
    With several (cyclic Poisson), the pooled scores and every count with at least
    ``MIN_GROUP`` canaries in and out are bounded separately, each at confidence
    1 − α/(G + 1) (union bound), and the largest is reported: a leak concentrated on the
    canaries that took part most is not averaged away by the others.
    ``info["bounds_by_participations"]``: ``{k: {"canaries", "epsilon_lower", "best"}}``.
    """
    values = sorted(set(counts.tolist()))
    groups = [k for k in values
              if np.sum(included & (counts == k)) >= MIN_GROUP and np.sum(~included & (counts == k)) >= MIN_GROUP]
    if len(values) == 1:
        result = summarize(scores=scores, included=included, confidence=confidence, info=info, **kwargs)
        result.info["bounds_by_participations"] = {str(values[0]): {
            "canaries": int(counts.size), "epsilon_lower": result.epsilon_lower, "best": result.best}}
        return result
    each = 1.0 - (1.0 - confidence) / (len(groups) + 1)
    pooled = summarize(scores=scores, included=included, confidence=each, info=info, **kwargs)
    by_count, bounds = {}, dict(pooled.bounds)
    best, lower = pooled.best, pooled.epsilon_lower
    for k in groups:
        keep = counts == k
        part = summarize(scores={name: np.asarray(v)[keep] for name, v in scores.items()}, included=included[keep],
                         confidence=each, info=info, **kwargs)
        by_count[str(k)] = {"canaries": int(keep.sum()), "epsilon_lower": part.epsilon_lower, "best": part.best}
        bounds.update({f"k={k}:{name}": bound for name, bound in part.bounds.items()})
        if part.epsilon_lower > lower:
            best, lower = f"k={k}:{part.best}", part.epsilon_lower
    info = dict(pooled.info, bounds_by_participations=by_count,
                pooled_bound={"epsilon_lower": pooled.epsilon_lower, "best": pooled.best})
    return dataclasses.replace(pooled, confidence=confidence, epsilon_lower=lower, best=best, bounds=bounds,
                               verdict="violation" if lower > pooled.claimed_epsilon else "consistent", info=info)


def check_canary_headroom(*, run, learning_rate: float, l2_norm_clip: float, canaries: int) -> None:
    """Refuse, before training, a ζ too large for the canary target.

    A canary's clipped gradient is exactly −ζ only while its coordinate w_i stays below
    ``CANARY_TARGET`` − ζ. With plain SGD, w_i after s steps is (ηζ/B)·(its participations
    − σ·Σ_{t<s} z̃_t), z̃ = C⁻¹z; the prefix sums are Gaussian with standard deviation
    ‖row s of cumsum(C⁻¹)‖. Bounding them by Φ⁻¹(1 − 10⁻⁶/(mT)) standard deviations (a
    canary crosses with probability below 10⁻⁶) gives the largest usable ζ,
    ``CANARY_TARGET`` / (1 + (η/B)(k + σ·z·max_s std_s)).

    Raises:
      ValueError: naming ζ, the largest allowed value and what to change.
    """
    steps, batch = run.steps, run.batch_size
    inverse = np.asarray(run.mixing.inverse_apply(np.eye(steps)), np.float64) if run.mixing.has_plan \
        else np.eye(steps)
    spread = float(np.max(np.linalg.norm(np.cumsum(inverse, axis=0), axis=1)))
    level = float(stats.norm.isf(1e-6 / (canaries * steps)))
    reach = run.spec.participations() + run.noise_multiplier * level * spread
    largest = CANARY_TARGET / (1.0 + learning_rate / batch * reach)
    if l2_norm_clip > largest:
        raise ValueError(
            f"l2_norm_clip={l2_norm_clip:g} is too large for the canary target {CANARY_TARGET:g}: the canaries' "
            f"coordinates may reach {learning_rate * l2_norm_clip / batch * reach:.4g} (eta={learning_rate:g}, "
            f"B={batch}, sigma={run.noise_multiplier:.4g}) and must stay below the target minus zeta for their "
            f"clipped gradient to be exactly -zeta; use l2_norm_clip <= {largest:.4g} or a smaller learning_rate.")


def _column(table):
    """Column 0 of the canary table's embeddings, as a numpy copy (any backend)."""
    import keras

    return np.array(keras.ops.convert_to_numpy(table.embeddings.value)[:, 0])


def audit_whitebox(
    *,
    strategy: str = "banded",
    epsilon: float = 4.0,
    delta: float = 1e-5,
    canaries: int = 2000,
    probes: Optional[int] = None,
    epochs: int = 2,
    steps_per_epoch: int = 8,
    sampling: str = "fixed_epochs",
    bands: int = 4,
    buffers: int = 2,
    real_examples: int = 256,
    features: int = 4,
    learning_rate: float = 0.5,
    l2_norm_clip: float = 1.0,
    confidence: float = 0.95,
    scorings: Optional[Sequence[str]] = None,
    thresholds: str = "grid",
    seed: int = 0,
    mixing=None,
    optimizer_factory: Optional[Callable] = None,
    dataset_factory: Optional[Callable] = None,
    model_hook: Optional[Callable] = None,
    resume_at: Optional[int] = None,
    canary_kind: str = "embedding",
) -> WhiteBoxAudit:
    """Train one private run with white-box gradient canaries and bound its ε from below.

    Args:
      strategy: ``"dpsgd"``, ``"banded"`` (DP-BandMF), ``"toeplitz"`` or ``"blt"``
        (ignored when ``mixing`` is given).
      epsilon, delta: the target the run's σ is calibrated for (the claim is the
        accountant's ε of the calibrated run, ≤ epsilon).
      canaries: m ≥ 2, each included with probability ½.
      probes: N coordinates no example touches (noise covariance estimate); default
        max(1000, 20·T).
      epochs, steps_per_epoch: T = epochs·⌈n/B⌉ with B = ⌈n/steps_per_epoch⌉,
        n = real_examples + canaries.
      sampling: ``"fixed_epochs"`` (canaries participate once per epoch, no amplification)
        or ``"cyclic_poisson"`` (b partitions, rate q = B·b/n; banded kinds only).
      bands: b for banded/Toeplitz C; buffers: d for BLT.
      real_examples, features: the ordinary regression data beside the canaries.
      learning_rate, l2_norm_clip: η (plain SGD) and ζ.
      confidence: overall 1 − α of the bound (split over the scorings and estimators).
      thresholds: ``"grid"`` (Bonferroni over ``LLR_GRID``, thresholds on the log-likelihood
        ratio fixed in advance) or ``"split"`` (chosen on half of the canaries).
      scorings: names from ``SCORINGS``; default ``claimed/plan``, ``empirical/plan``,
        ``empirical/any-step`` for fixed epochs and ``claimed/poisson``,
        ``empirical/poisson`` for cyclic Poisson.
      seed: seeds the inclusion bits, the data, the sampler, the noise and (through
        ``keras.utils.set_random_seed``) Keras's global generators. A fixed seed
        is what an audit needs (the auditor knows the plan); it voids the guarantee for
        anyone else, which is irrelevant for an audit run.
      mixing: a mixing strategy with at least T steps, instead of ``strategy``.
      optimizer_factory: ``f(run=, learning_rate=, l2_norm_clip=, seed=)`` returning the
        optimizer (default ``NoiseCurveOptimizer``); dataset_factory: ``f(run, x, y)``
        returning what ``fit`` trains on (default ``run.dataset(x, y)``, a ``RunData``); model_hook:
        ``f(private_model)`` called after ``compile`` (and after the reload of a resumed
        run). For tests of broken variants.
      resume_at: stop ``fit`` after this many steps, save the private model to a
        ``.keras`` file, load it back (as a new process would: a new ``PrivateRun`` object
        of the same plan, the key and noise state from the file) and train the rest of
        the plan: the audit then covers the resume path.
      canary_kind: ``"embedding"`` (the linear model above: gradient canaries on embedding
        rows, independent, Clopper–Pearson and Gaussian-DP bounds) or ``"input"``
        (:mod:`keras_noisecurve.audit.input_canaries`: input canaries through a model with
        Dense, Conv1D, MultiHeadAttention and LayerNormalization layers, scored by the
        alignment of each update with the canary's own clipped gradient; one-run bound,
        pooled and per layer; ``sampling="fixed_epochs"``, the ``"claimed/plan"`` scoring
        and no ``resume_at`` only; ``features`` is ignored).

    Returns:
      a :class:`WhiteBoxAudit` whose ``result`` holds the claim, the bound and the verdict;
      ``result.info["bounds_by_participations"]`` the bound of each participation count
      (:func:`_summarize_by_participations`).

    Raises:
      ValueError / TypeError: before any training, for every argument out of range (naming
        the value and what is allowed), a ``resume_at`` outside 1 … T−1, an
        ``l2_norm_clip`` too large for the canary target (:func:`check_canary_headroom`),
        and a run whose batches (the run's pipeline over the whole plan,
        :func:`keras_noisecurve.audit.mechanism.check_sampling`) break the sampling the
        accountant assumed: such a run is not scored.
    """
    import keras

    import keras_noisecurve as knc

    m = check_int("canaries", canaries, minimum=2)
    epochs = check_int("epochs", epochs, minimum=1)
    spe = check_int("steps_per_epoch", steps_per_epoch, minimum=1)
    sampling = check_choice("sampling", sampling, ("fixed_epochs", "cyclic_poisson"))
    real = check_int("real_examples", real_examples, minimum=1)
    features = check_int("features", features, minimum=1)
    eta = check_float("learning_rate", learning_rate, positive=True)
    clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
    seed = check_int("seed", seed, minimum=0)
    check_float("epsilon", epsilon, positive=True)
    check_float("delta", delta, open_unit=True)
    check_float("confidence", confidence, open_unit=True)
    check_choice("thresholds", thresholds, ("grid", "split"))
    check_int("bands", bands, minimum=1)
    check_int("buffers", buffers, minimum=1)
    canary_kind = check_choice("canary_kind", canary_kind, CANARY_KINDS)
    if canary_kind == "input":
        if sampling != "fixed_epochs" or resume_at is not None or (
                scorings is not None and tuple(scorings) != ("claimed/plan",)):
            raise ValueError(
                "canary_kind='input' supports sampling='fixed_epochs', scorings=None or ['claimed/plan'] and "
                f"resume_at=None only, got sampling={sampling!r}, scorings={scorings!r}, resume_at={resume_at!r}.")
        scorings = ("claimed/plan",)
    for name, value in (("optimizer_factory", optimizer_factory), ("dataset_factory", dataset_factory),
                        ("model_hook", model_hook)):
        if value is not None and not callable(value):
            raise TypeError(f"{name} must be a callable or None, got {value!r} ({type(value).__name__}).")
    if mixing is None:
        check_choice("strategy", strategy, STRATEGIES)
    n = real + m
    batch = -(-n // spe)
    steps = epochs * (-(-n // batch))
    if resume_at is not None:
        check_int("resume_at", resume_at, minimum=1, maximum=steps - 1)
    probes = max(1000, 20 * steps) if probes is None else check_int("probes", probes, minimum=steps + 1)
    if scorings is None:
        scorings = (("claimed/plan", "empirical/plan", "empirical/any-step") if sampling == "fixed_epochs"
                    else ("claimed/poisson", "empirical/poisson"))
    for s in scorings:
        check_choice("scorings", s, SCORINGS)
        if s.endswith("/plan") and sampling != "fixed_epochs":
            raise ValueError(f"scoring {s!r} needs sampling='fixed_epochs' (the plan of cyclic Poisson is secret).")
    if mixing is None:
        mixing = build_mixing(strategy=strategy, steps=steps, bands=bands, buffers=buffers, participations=epochs,
                              separation=-(-n // batch))
        name = strategy
    else:
        name = getattr(mixing, "metadata", {}).get("strategy", type(mixing).__name__)
    run = knc.PrivateRun(num_examples=n, batch_size=batch, steps=steps, mixing=mixing, epsilon=epsilon,
                         delta=delta, sampling=sampling, seed=seed)
    if canary_kind == "embedding":
        check_canary_headroom(run=run, learning_rate=eta, l2_norm_clip=clip, canaries=m)
    sampling_check = check_sampling(run=run)
    if not sampling_check.passed:
        raise ValueError("the run's batches do not follow the sampling the accountant analysed, so the claimed "
                         f"epsilon does not describe them; the audit refuses to score them. {sampling_check.line}")
    claimed = run.epsilon()
    if canary_kind == "input":
        from keras_noisecurve.audit import input_canaries

        info = {"strategy": name, "sampling": sampling, "steps": steps, "batch_size": run.batch_size,
                "bands": run.bands, "noise_multiplier": run.noise_multiplier, "target_epsilon": float(epsilon),
                "canaries": m, "epochs": epochs, "steps_per_epoch": run.steps_per_epoch,
                "claimed_mu": run.spec.fixed_epoch_sensitivity(epochs) / run.noise_multiplier}
        out = input_canaries.run_input_audit(
            run=run, real=real, m=m, eta=eta, clip=clip, seed=seed, delta=delta, confidence=confidence,
            claimed=claimed, info=info, patterns_of=_patterns, optimizer_factory=optimizer_factory,
            dataset_factory=dataset_factory, model_hook=model_hook)
        return WhiteBoxAudit(run=run, included=out.included, observations=out.observations,
                             probe_observations=np.zeros((steps, 0)), patterns=out.patterns, scores=out.scores,
                             result=out.result)
    patterns = _patterns(run, real, m)

    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    x, y = _dataset_arrays(rng, real, features, m, included)

    keras.utils.set_random_seed(seed)
    model, table = _model(features, m + probes)
    private = knc.make_private(model)
    factory = optimizer_factory or knc.NoiseCurveOptimizer
    optimizer = factory(run=run, learning_rate=eta, l2_norm_clip=clip, seed=seed)
    private.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError())
    if model_hook is not None:
        model_hook(private)

    trajectory = [_column(table)]
    current = {"table": table}

    class _Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            _ = self.model  # on JAX, reading the model copies the step's weights back to its variables
            trajectory.append(_column(current["table"]))
            if resume_at is not None and len(trajectory) - 1 == resume_at:
                self.model.stop_training = True

    def dataset(plan):
        return dataset_factory(plan, x, y) if dataset_factory is not None else plan.dataset(x, y)

    private.fit(dataset(run), callbacks=[_Record()], verbose=0)
    if resume_at is not None:
        private = _reload(private)
        current["table"] = private.inner.get_layer("canaries")
        if model_hook is not None:
            model_hook(private)
        resumed = knc.PrivateRun.from_config(run.get_config())  # a new object: the key comes from the file
        private.fit(dataset(resumed), callbacks=[_Record()], verbose=0)
    iterates = np.stack(trajectory)
    if iterates.shape[0] != steps + 1:
        raise RuntimeError(f"recorded {iterates.shape[0] - 1} steps, expected the plan's {steps}.")
    if np.any(iterates[:, :m][:, included] > CANARY_TARGET - clip):
        raise RuntimeError("a canary coordinate came within ζ of its target: its clipped gradient is no longer −ζ.")

    obs_all = scoring.observations_from_iterates(iterates=iterates, learning_rate=eta,
                                                 batch_size=run.batch_size, l2_norm_clip=clip)
    obs, probe_obs = obs_all[:, :m], obs_all[:, m:]
    dense = np.asarray(run.mixing.to_dense())[:steps, :steps]
    precisions = {"claimed": scoring.claimed_precision(mixing_dense=dense, noise_multiplier=run.noise_multiplier)}
    if any(s.startswith("empirical/") for s in scorings):
        precisions["empirical"] = scoring.empirical_precision(probe_observations=probe_obs)
    q = run.spec.sampling_probability
    scores = {}
    for s in scorings:
        kind, rule = s.split("/")
        lam = precisions[kind]
        if rule == "plan":
            scores[s] = scoring.plan_scores(observations=obs, patterns=patterns, precision=lam)
        elif rule == "poisson":
            scores[s] = scoring.poisson_log_likelihood_ratio(observations=obs, precision=lam, bands=run.bands,
                                                             rate=q)
        else:
            rate = 1.0 / run.steps_per_epoch if sampling == "fixed_epochs" else q / run.bands
            scores[s] = scoring.any_step_scores(observations=obs, precision=lam, rate=rate)
    whitened = dense @ probe_obs / run.noise_multiplier  # under the claim: i.i.d. N(0, 1) entries
    probe_cov = whitened @ whitened.T / probes
    cov_error = float(np.max(np.abs(probe_cov - np.eye(steps))))
    threshold = float(np.sqrt(2.0 / probes) * stats.norm.isf(0.001 / (steps * (steps + 1))))
    info = {
        "strategy": name, "sampling": sampling, "steps": steps, "batch_size": run.batch_size,
        "bands": run.bands, "noise_multiplier": run.noise_multiplier, "target_epsilon": float(epsilon),
        "canaries": m, "probes": probes, "epochs": epochs, "resume_at": resume_at, "steps_per_epoch": run.steps_per_epoch,
        # under the claim C·y_probe/σ is N(0, I): its mean square is 1 (± a few / sqrt(T·N))
        "probe_whitened_variance": float(np.mean(whitened**2)),
        # ... and their (T, T) covariance is I: largest entry of |Ĉov − I|; each entry has standard
        # deviation ≤ sqrt(2/N), so the threshold is passed by chance with probability ≤ 0.1 %
        "probe_covariance_error": cov_error,
        "probe_threshold": threshold,
        "noise_matches_claim": bool(cov_error <= threshold),
    }
    if sampling == "fixed_epochs":
        info["claimed_mu"] = run.spec.fixed_epoch_sensitivity(epochs) / run.noise_multiplier
    methods = ("clopper-pearson", "gaussian-dp") if sampling == "fixed_epochs" else ("clopper-pearson", "one-run")
    result = _summarize_by_participations(
        scores=scores, included=included, counts=patterns.sum(axis=0).astype(int), claimed_epsilon=claimed,
        delta=delta, confidence=confidence, gaussian_claim=sampling == "fixed_epochs", seed=seed, info=info,
        methods=methods, grid=np.array(LLR_GRID) if thresholds == "grid" else None)
    return WhiteBoxAudit(run=run, included=included, observations=obs, probe_observations=probe_obs,
                         patterns=patterns, scores=scores, result=result)

