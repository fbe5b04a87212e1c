"""Black-box input-canary audit: mislabelled examples scored by their loss on the FINAL model.

The threat model users usually ask about: only the trained model is released, and the
attacker can query its loss. The run is the library's real path (``PrivateRun`` +
``make_private`` + ``NoiseCurveOptimizer``) on a small synthetic classification task
(Gaussian class blobs, a small MLP); the m canaries are out-of-distribution points (far
outside the blobs) with a WRONG label, each included with probability ½. An excluded canary
keeps its slot with sample weight 0 (its gradient is weighted 0 before clipping, so it
contributes nothing; every other example's batches are the same in both worlds).

Score of a canary: minus its loss under its wrong label on the final model (a
memorised canary has a low loss). The canaries share one model, so their scores are
NOT independent trials: the bound reported by default is the one-run bound
(Steinke, Nasr & Jagielski 2023), which needs no independence. Expect it to be far
below the claim — the final model hides most of what the intermediate models show;
a black-box audit near 0 says nothing about the white-box threat model the claim covers.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.audit.mechanism import check_sampling
from keras_noisecurve.audit.report import METHODS, AuditResult, summarize
from keras_noisecurve.audit.whitebox import STRATEGIES, build_mixing

__all__ = ["audit_blackbox"]


def audit_blackbox(
    *,
    strategy: str = "banded",
    epsilon: float = 4.0,
    delta: float = 1e-5,
    canaries: int = 500,
    real_examples: int = 500,
    features: int = 8,
    classes: int = 4,
    hidden: int = 32,
    canary_radius: float = 20.0,
    epochs: int = 20,
    batch_size: int = 50,
    sampling: str = "fixed_epochs",
    bands: int = 4,
    buffers: int = 2,
    learning_rate: float = 5.0,
    l2_norm_clip: float = 1.0,
    confidence: float = 0.95,
    methods: Sequence[str] = ("one-run",),
    seed: int = 0,
) -> AuditResult:
    """Train one private run with mislabelled input canaries; bound ε from the final model.

    Args:
      strategy: ``"dpsgd"``, ``"banded"``, ``"toeplitz"`` or ``"blt"``.
      epsilon, delta: the target σ is calibrated for.
      canaries: m ≥ 2 mislabelled examples, each included with probability ½.
      real_examples, features, classes, hidden: the task (Gaussian blobs, an MLP with one
        hidden ReLU layer of ``hidden`` units).
      canary_radius: the canaries lie on the sphere of this radius (the blobs' centres
        have norm ≈ 2·sqrt(features)): out of distribution, so easier to memorise.
      epochs, batch_size, sampling, bands, buffers: the plan (T = epochs·⌈n/B⌉).
      learning_rate, l2_norm_clip: η (plain SGD) and ζ.
      confidence: overall 1 − α.
      methods: estimators of :func:`keras_noisecurve.audit.report.summarize`; the default
        one-run bound is the only one valid for canaries that share a model.
      seed: seeds data, inclusion bits, sampler and noise.

    Returns:
      the :class:`~keras_noisecurve.audit.report.AuditResult`.
    """
    import keras

    import keras_noisecurve as knc

    m = check_int("canaries", canaries, minimum=2)
    real = check_int("real_examples", real_examples, minimum=1)
    features = check_int("features", features, minimum=1)
    classes = check_int("classes", classes, minimum=2)
    hidden = check_int("hidden", hidden, minimum=1)
    epochs = check_int("epochs", epochs, minimum=1)
    batch = check_int("batch_size", batch_size, minimum=1)
    sampling = check_choice("sampling", sampling, ("fixed_epochs", "cyclic_poisson"))
    seed = check_int("seed", seed, minimum=0)
    eta = check_float("learning_rate", learning_rate, positive=True)
    check_float("l2_norm_clip", l2_norm_clip, positive=True)
    check_float("canary_radius", canary_radius, positive=True)
    check_float("epsilon", epsilon, positive=True)
    check_float("delta", delta, open_unit=True)
    check_float("confidence", confidence, open_unit=True)
    check_int("bands", bands, minimum=1)
    check_int("buffers", buffers, minimum=1)
    check_choice("strategy", strategy, STRATEGIES)
    methods = tuple(methods) if not isinstance(methods, str) else (methods,)
    if not methods or any(method not in METHODS for method in methods):
        raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {list(methods)}.")
    if methods == ("gaussian-dp",) and sampling != "fixed_epochs":
        raise ValueError("methods=('gaussian-dp',) needs sampling='fixed_epochs' (a claim that is a Gaussian "
                         f"mechanism); got sampling={sampling!r}.")
    n = real + m
    steps = epochs * (-(-n // batch))

    rng = np.random.default_rng(seed)
    centers = 2.0 * rng.normal(size=(classes, features))
    labels = rng.integers(0, classes, size=n)
    x = (centers[labels] + rng.normal(size=(n, features))).astype(np.float32)
    y = labels.copy()
    # canaries: out of distribution (a random direction, far outside the blobs) with a
    # random label, the label its nearest blob would NOT get
    far = rng.normal(size=(m, features))
    x[real:] = (canary_radius * far / np.linalg.norm(far, axis=1, keepdims=True)).astype(np.float32)
    nearest = np.argmax(x[real:] @ centers.T, axis=1)
    y[real:] = (nearest + rng.integers(1, classes, size=m)) % classes
    included = rng.random(m) < 0.5
    weight = np.ones(n, np.float32)
    weight[real:] = included.astype(np.float32)

    mixing = build_mixing(strategy=strategy, steps=steps, bands=bands, buffers=buffers, participations=epochs,
                          separation=-(-n // batch))
    run = knc.PrivateRun(num_examples=n, batch_size=batch, steps=steps, mixing=mixing, epsilon=epsilon, delta=delta,
                         sampling=sampling, seed=seed)
    sampling_check = check_sampling(run=run)
    if not sampling_check.passed:
        raise ValueError("the run's batches do not follow the sampling the accountant analysed, so the claimed "
                         f"epsilon does not describe them; the audit refuses to score them. {sampling_check.line}")
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(classes)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=eta, l2_norm_clip=l2_norm_clip,
                                                      seed=seed), loss=loss)
    private.fit(run.dataset(x, y, sample_weight=weight), verbose=0)

    logits = model.predict(x[real:], verbose=0, batch_size=1024)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)(y[real:], logits)
    scores = -np.asarray(per_example, dtype=np.float64)
    info = {"strategy": strategy, "sampling": sampling, "steps": steps, "batch_size": batch,
            "noise_multiplier": run.noise_multiplier, "target_epsilon": float(epsilon), "canaries": m,
            "threat_model": "black-box (final model, loss queries)"}
    return summarize(scores={"loss": scores}, included=included, claimed_epsilon=run.epsilon(), delta=delta,
                     confidence=confidence, gaussian_claim=sampling == "fixed_epochs", methods=methods, seed=seed,
                     info=info)
