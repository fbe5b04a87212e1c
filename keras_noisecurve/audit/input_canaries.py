"""White-box INPUT canaries: canaries that are ordinary examples of a model with Dense,
convolution, attention and LayerNormalization layers (TensorFlow).

The embedding canaries of :mod:`keras_noisecurve.audit.whitebox` own one embedding row
each, so a clipping bug in any other layer rule leaves them untouched. Here a canary is
an example (inputs, target) that passes through a layer of every trainable type; the
auditor scores it by the alignment of each step's update with the canary's OWN clipped
gradient at that step's weights.

**The model** (:func:`build_model`) sums four branches, each one trainable layer type
reduced to a scalar by a mean:

    out = gate · (Dense(features), mean Conv1D(seq), mean MultiHeadAttention(seq, seq),
                  mean LayerNormalization(seq))                                  (1)

(the attention's projections are EinsumDense layers). Real examples open every gate
(gate = 1). Canary i opens the gate of branch i mod 4 only (its gradient lives in that
branch's layers), has inputs of standard deviation ``CANARY_INPUT_SCALE`` and a target
±``CANARY_TARGET`` of random sign: its per-example gradient norm is ≫ ζ in its branch.
An excluded canary keeps its slot as an all-zero example (gate 0, target 0: gradient
exactly 0), as for the embedding canaries (zero-out adjacency).

**The observation.** The auditor knows the model and every iterate w_t (all intermediate
models are released in the threat model). At each step t it computes the canary's
per-example gradient g_{c,t} at w_t with a plain ``GradientTape`` through a clone of the
model (no code of the clipping engine), u_{c,t} = g_{c,t}/‖g_{c,t}‖, and

    y_{c,t} = −B·⟨w_{t+1} − w_t, u_{c,t}⟩ / (η·ζ)                                      (2)

With plain SGD, w_{t+1} − w_t = −(η/B)(Σ_i clip(g_i) + ζσ·z̃_t), so under the CLAIM an
included canary adds a_{c,t} = min(1, ‖g_{c,t}‖/ζ) at each step it takes part in (its
clipped gradient, projected on its own direction), and the noise adds σ⟨z̃_t, u_{c,t}⟩,
whose covariance over steps is σ²(C⁻¹C⁻ᵀ)_{ts}⟨u_{c,t}, u_{c,s}⟩ — the claimed Σ when the
canary's direction is stable over the run, exactly for DP-SGD (C = I). The score is the
plan score of :mod:`keras_noisecurve.audit.scoring` (eq. 2 there) with the pattern
p_t·a_{c,t} and the claimed precision CᵀC/σ². Other examples' gradients projected on
u_{c,t} (canaries of the same branch share its weights) add interference, so the scores
are NOT independent: only the one-run bound (Steinke, Nasr & Jagielski 2023), which
needs no independence, is used.

**What it catches.** If a layer rule's norm drops its layer's share, a canary of that
layer's branch has a computed norm of 0 in the other layers, its clip factor is 1 and
its whole raw gradient (≫ ζ) enters the update: y_{c,t} ≈ ‖g_{c,t}‖/ζ ≫ 1 instead of
a_{c,t} ≤ 1, and the included canaries of that branch separate from the excluded ones.
A leak in one branch is not averaged away by the other three: the bound is computed on
all canaries and on each branch's canaries (union bound over the five), and the largest
is reported (``info["bounds_by_layer"]``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from keras_noisecurve.audit import scoring
from keras_noisecurve.audit.report import summarize

__all__ = ["BRANCHES", "CANARY_INPUT_SCALE", "CANARY_TARGET", "build_model", "canary_gradients", "run_input_audit"]

#: the model's branches, in gate order: the trainable layer type each holds
BRANCHES = ("dense", "conv", "attention", "norm")
#: the magnitude of the input canaries' targets (sign random): |f − y| ≫ ζ keeps their gradients ≫ ζ
CANARY_TARGET = 100.0
#: standard deviation of the input canaries' inputs (the real examples' are 1)
CANARY_INPUT_SCALE = 3.0
_LENGTH, _WIDTH = 6, 32


def build_model(*, length: int = _LENGTH, width: int = _WIDTH):
    """Model (1): inputs ``features`` (B, width), ``seq`` (B, length, width), ``gate``
    (B, 4); output (B, 1). Layers ``dense``, ``conv`` (Conv1D, 4 filters of size 3),
    ``attention`` (MultiHeadAttention, 2 heads of key size 4) and ``norm``
    (LayerNormalization)."""
    import keras

    feat = keras.Input((width,), name="features")
    seq = keras.Input((length, width), name="seq")
    gate = keras.Input((len(BRANCHES),), name="gate")

    def mean(x):
        return keras.layers.GlobalAveragePooling1D()(keras.layers.Reshape((-1, 1))(x))

    dense = keras.layers.Dense(1, name="dense")(feat)
    conv = mean(keras.layers.Conv1D(4, 3, name="conv")(seq))
    attention = mean(keras.layers.MultiHeadAttention(2, 4, name="attention")(seq, seq))
    norm = mean(keras.layers.LayerNormalization(center=False, name="norm")(seq))
    branches = keras.layers.Concatenate()([dense, conv, attention, norm])
    out = keras.layers.Dot(axes=1)([branches, gate])
    return keras.Model({"features": feat, "seq": seq, "gate": gate}, out, name="audit_layers")


def _arrays(rng, real, m, included):
    """The training data (excluded canaries zeroed) and the canaries as the auditor knows them."""
    n = real + m
    x = {"features": rng.normal(size=(n, _WIDTH)).astype(np.float32),
         "seq": rng.normal(size=(n, _LENGTH, _WIDTH)).astype(np.float32),
         "gate": np.ones((n, len(BRANCHES)), np.float32)}
    y = (0.1 * rng.normal(size=(n, 1))).astype(np.float32)
    branch = np.arange(m) % len(BRANCHES)
    canary_x = {"features": CANARY_INPUT_SCALE * x["features"][real:], "seq": CANARY_INPUT_SCALE * x["seq"][real:],
                "gate": np.eye(len(BRANCHES), dtype=np.float32)[branch]}
    canary_y = (CANARY_TARGET * rng.choice([-1.0, 1.0], size=(m, 1))).astype(np.float32)
    keep = included.astype(np.float32)
    for key, value in canary_x.items():
        x[key][real:] = value * keep.reshape((m,) + (1,) * (value.ndim - 1))
    y[real:] = canary_y * keep[:, None]
    return x, y, canary_x, canary_y, branch


def canary_gradients(*, model, weights, canary_x, canary_y, function=None):
    """Per-canary gradients of the squared error (f(x_c) − y_c)² at the given weights.

    A plain jacobian through ``model`` (a clone of the audited model, no
    clipping engine).

    Args:
      model: a Keras model with the audited model's architecture; its trainable
        variables are overwritten with ``weights``.
      weights: list of arrays, one per trainable variable (``model.trainable_variables`` order).
      canary_x: dict of (m, ...) inputs; canary_y: (m, 1) targets.
      function: a :func:`gradient_function` of ``model`` to reuse (traced once).

    Returns:
      (m, P) float64 array, P = number of trainable parameters.
    """
    for variable, value in zip(model.trainable_variables, weights):
        variable.assign(value)
    jac = (function or gradient_function(model))(canary_x, canary_y)
    m = canary_y.shape[0]
    return np.concatenate([np.reshape(np.asarray(j), (m, -1)) for j in jac], axis=1).astype(np.float64)


def gradient_function(model):
    """A function (x, y) → per-example jacobians of (f(x) − y)² over ``model``'s trainable
    variables (one (m, *shape) array per variable): the backend's ``audit.loss_jacobian``
    (a ``tf.GradientTape`` jacobian on TensorFlow, ``jax.jacrev`` on JAX)."""
    from keras_noisecurve import backend

    return backend.module("audit").loss_jacobian(model)


@dataclasses.dataclass
class _Trained:
    included: np.ndarray
    observations: np.ndarray
    patterns: np.ndarray
    scores: dict
    result: object


def run_input_audit(*, run, real, m, eta, clip, seed, delta, confidence, claimed, info, patterns_of,
                    optimizer_factory=None, dataset_factory=None, model_hook=None):
    """Train ``run`` on model (1) with m input canaries and score them (eq. 2).

    ``patterns_of(run, real, m)`` gives the (T, m) planned participations of the canary
    slots. Returns the included bits, the (T, m) observations y, the patterns, the scores
    ``{"claimed/plan": (m,)}`` and the summarized result (one-run bound, pooled and per
    branch at confidence 1 − α/5 each, the largest reported).
    """
    import keras

    import keras_noisecurve as knc

    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    x, y, canary_x, canary_y, branch = _arrays(rng, real, m, included)
    keras.utils.set_random_seed(seed)
    model = build_model()
    auditor = keras.models.clone_model(model)
    private = knc.make_private(model)
    factory = optimizer_factory or knc.NoiseCurveOptimizer
    private.compile(optimizer=factory(run=run, learning_rate=eta, l2_norm_clip=clip, seed=seed),
                    loss=keras.losses.MeanSquaredError())
    if model_hook is not None:
        model_hook(private)
    def weights():
        return [np.array(keras.ops.convert_to_numpy(v.value)) for v in model.trainable_variables]

    trajectory = [weights()]

    class _Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch_index, logs=None):
            _ = self.model  # on JAX, reading the model copies the step's weights back to its variables
            trajectory.append(weights())

    data = dataset_factory(run, x, y) if dataset_factory is not None else run.dataset(x, y)
    started = time.perf_counter()
    private.fit(data, callbacks=[_Record()], verbose=0)
    trained = time.perf_counter()
    steps = run.steps
    if len(trajectory) != steps + 1:
        raise RuntimeError(f"recorded {len(trajectory) - 1} steps, expected the plan's {steps}.")
    flat = np.stack([np.concatenate([np.ravel(w) for w in ws]).astype(np.float64) for ws in trajectory])
    if not np.all(np.isfinite(flat)):
        raise RuntimeError("the model's weights became non-finite during the audited run.")
    obs = np.zeros((steps, m))
    claimed_share = np.zeros((steps, m))
    smallest = np.inf
    function = gradient_function(auditor)
    for t in range(steps):
        grads = canary_gradients(model=auditor, weights=trajectory[t], canary_x=canary_x, canary_y=canary_y,
                                 function=function)
        norms = np.linalg.norm(grads, axis=1)
        directions = grads / np.maximum(norms, 1e-30)[:, None]
        obs[t] = -run.batch_size * (directions @ (flat[t + 1] - flat[t])) / (eta * clip)
        claimed_share[t] = np.minimum(1.0, norms / clip)
        smallest = min(smallest, float(np.min(norms)) / clip)
    timing = {"train_seconds": trained - started, "score_seconds": time.perf_counter() - trained}
    patterns = patterns_of(run, real, m)
    dense = np.asarray(run.mixing.to_dense())[:steps, :steps]
    lam = scoring.claimed_precision(mixing_dense=dense, noise_multiplier=run.noise_multiplier)
    scores = {"claimed/plan": scoring.plan_scores(observations=obs, patterns=patterns * claimed_share,
                                                  precision=lam)}
    # the smallest canary gradient norm over the run, in units of ζ (≫ 1: every canary is clipped)
    info = dict(info, canary_kind="input", branches=list(BRANCHES), canary_gradient_norm_min=smallest, **timing)
    result = _summarize_by_branch(scores=scores, included=included, branch=branch, claimed=claimed, delta=delta,
                                  confidence=confidence, seed=seed, info=info)
    return _Trained(included=included, observations=obs, patterns=patterns, scores=scores, result=result)


def _summarize_by_branch(*, scores, included, branch, claimed, delta, confidence, seed, info):
    """One-run bounds on all canaries and on each branch's, each at 1 − α/(G + 1); the
    largest is the audit's bound (``info["bounds_by_layer"]``)."""
    each = 1.0 - (1.0 - confidence) / (len(BRANCHES) + 1)
    common = dict(claimed_epsilon=claimed, delta=delta, confidence=each, methods=("one-run",), seed=seed)
    pooled = summarize(scores=scores, included=included, info=info, **common)
    best, lower, bounds, by_layer = pooled.best, pooled.epsilon_lower, dict(pooled.bounds), {}
    for index, name in enumerate(BRANCHES):
        keep = branch == index
        part = summarize(scores={k: np.asarray(v)[keep] for k, v in scores.items()}, included=included[keep],
                         info=info, **common)
        by_layer[name] = {"canaries": int(keep.sum()), "epsilon_lower": part.epsilon_lower}
        bounds.update({f"{name}:{k}": v for k, v in part.bounds.items()})
        if part.epsilon_lower > lower:
            best, lower = f"{name}:{part.best}", part.epsilon_lower
    info = dict(pooled.info, bounds_by_layer=by_layer,
                pooled_bound={"epsilon_lower": pooled.epsilon_lower, "best": pooled.best})
    return dataclasses.replace(pooled, confidence=confidence, epsilon_lower=lower, best=best, bounds=bounds,
                               verdict="violation" if lower > claimed else "consistent", info=info)
