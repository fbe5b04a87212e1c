"""Argument checks of ``NoiseCurveOptimizer``: refused Keras optimizer arguments,
the inner optimizer, σ, B, the seed, the learning rate, and the (C, σ, B) of a run.

Each check raises a one-line ``ValueError`` (``TypeError`` for a wrong type) that
names the value received and what is allowed. No optimizer state lives here.
"""

from __future__ import annotations

import keras

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.mixing.strategies import load_mixing

__all__ = [
    "REFUSED",
    "IGNORED_DEFAULTS",
    "InnerLearningRate",
    "check_backend",
    "check_inner",
    "check_kwargs",
    "check_noise_arguments",
    "check_learning_rate",
    "from_run",
]

# kwarg -> (value that means "off", reason)
REFUSED = {
    "clipnorm": (None, "it would clip the NOISY sum; per-example clipping is l2_norm_clip"),
    "clipvalue": (None, "it would clip the NOISY sum; per-example clipping is l2_norm_clip"),
    "global_clipnorm": (None, "it would clip the NOISY sum; per-example clipping is l2_norm_clip"),
    "use_ema": (False, "the mixing-matrix objective assumes the plain iterate w ← w − η·ĝ"),
    "loss_scale_factor": (None, "the optimizer receives clipped sums, not scaled losses"),
    "gradient_accumulation_steps": (
        None,
        "one optimizer step must be one noisy step of the privacy plan; use a larger "
        "expected_batch_size (and microbatch_size in make_private to bound memory) instead",
    ),
    "weight_decay": (
        None,
        "it changes the dynamics the mixing matrix was optimised for; add a kernel "
        "regularizer (data-independent, so it is not clipped) to the loss instead, or give "
        "the decay to an inner optimizer (inner=keras.optimizers.AdamW(...) or "
        "keras.optimizers.SGD(weight_decay=...))",
    ),
}
# accepted with their defaults only (they appear in the Keras base class config)
IGNORED_DEFAULTS = {"ema_momentum": 0.99, "ema_overwrite_frequency": None}

_NOISY_CLIP = (
    "it would clip the NOISY mean ĝ_t, not each example's gradient: harmless for privacy "
    "(post-processing) but misleading, since it bounds no example's contribution (that is "
    "l2_norm_clip), and it changes the update the mixing matrix was optimised for"
)
# attribute of an inner optimizer -> why a value other than None/False is refused
_INNER_REFUSED = {
    "clipnorm": _NOISY_CLIP,
    "clipvalue": _NOISY_CLIP,
    "global_clipnorm": _NOISY_CLIP,
    "use_ema": "the private optimizer never updates or finalizes an inner optimizer's weight average",
    "gradient_accumulation_steps": "one optimizer step must be one noisy step of the privacy plan; use "
    "a larger expected_batch_size (and microbatch_size in make_private to bound memory) instead",
    "loss_scale_factor": "the private optimizer receives clipped sums, not scaled losses",
}


def check_backend():
    """Refuse a Keras backend this library does not run on (``RuntimeError``, from
    ``keras_noisecurve.backend.name``): TensorFlow and JAX are supported; then let the backend
    get ready for the optimizer's first variable (``devices.before_first_variable``)."""
    from keras_noisecurve import backend

    backend.module("devices").before_first_variable()


def check_kwargs(kwargs: dict) -> dict:
    """``kwargs`` without the Keras optimizer arguments this optimizer refuses (each must
    be off, else ``ValueError``) or accepts at their defaults only."""
    for name, (off, reason) in REFUSED.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value is not None and value is not off and not (off is None and value is False):
                raise ValueError(
                    f"{name}={value!r} is not supported by private optimizers: {reason}."
                )
    for name, default in IGNORED_DEFAULTS.items():
        if name in kwargs:
            value = kwargs.pop(name)
            if value != default:
                raise ValueError(f"{name}={value!r} is not supported by private optimizers (EMA is refused).")
    return kwargs


def check_inner(inner, private_type):
    """Refuse an ``inner`` optimizer that cannot post-process ĝ_t faithfully
    (``ValueError``; ``TypeError`` for a non-optimizer). ``private_type``: the private
    optimizer class (an instance of it would add the noise twice)."""
    if isinstance(inner, private_type):
        raise ValueError(
            f"inner={type(inner).__name__}(name={inner.name!r}) is itself a private optimizer: the noise "
            "would be added twice and no privacy accounting describes that. Pass a plain Keras optimizer "
            "as inner, e.g. inner=keras.optimizers.Adam(1e-3)."
        )
    if isinstance(inner, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "inner=keras.optimizers.LossScaleOptimizer is not supported: the private optimizer receives "
            "clipped sums of per-example gradients, not scaled losses, and a skipped step would break the "
            "privacy plan (one step per noise draw). Pass the wrapped optimizer itself "
            "(inner=loss_scale_optimizer.inner_optimizer)."
        )
    if not isinstance(inner, keras.optimizers.Optimizer):
        raise TypeError(
            f"inner must be a keras.optimizers.Optimizer (e.g. keras.optimizers.SGD(0.1, momentum=0.9)) "
            f"or None; got {inner!r} ({type(inner).__name__})."
        )
    for name, reason in _INNER_REFUSED.items():
        value = getattr(inner, name, None)
        if value is not None and value is not False:
            raise ValueError(
                f"the inner optimizer {type(inner).__name__} has {name}={value!r}, which is not supported: "
                f"{reason}. Create it without {name}."
            )


def check_noise_arguments(*, l2_norm_clip, noise_multiplier, expected_batch_size, seed):
    """``(ζ, σ, B, seed)`` validated: ζ > 0, σ > 0 (required), B ≥ 1 (required), seed
    ``None`` or an int in [0, 2⁶³)."""
    l2_norm_clip = check_float("l2_norm_clip", l2_norm_clip, positive=True)
    if noise_multiplier is None:
        raise ValueError(
            "noise_multiplier (sigma) is required, got None: there is no safe default. Give the run "
            "(NoiseCurveOptimizer(run=PrivateRun(..., epsilon=...)), which calibrates it) or the sigma your "
            "accounting used."
        )
    noise_multiplier = check_float("noise_multiplier", noise_multiplier, positive=True)  # sigma = 0: no privacy
    if expected_batch_size is None:
        raise ValueError(
            "expected_batch_size is required: the noisy sum is divided by the EXPECTED batch "
            "size B of the sampler (e.g. banded_poisson_dataset's batch_size), got None."
        )
    expected_batch_size = check_int("expected_batch_size", expected_batch_size, minimum=1)
    if seed is not None:
        seed = check_int("seed", seed, minimum=0, maximum=2**63 - 1, secret=True)
    return l2_norm_clip, noise_multiplier, expected_batch_size, seed


class InnerLearningRate(keras.optimizers.schedules.LearningRateSchedule):
    """Stands in for the outer learning rate when there is an inner optimizer (creates no
    variable): the inner optimizer's current learning rate."""

    def __init__(self, inner):
        self._inner = inner

    def __call__(self, step):
        return self._inner.learning_rate

    def get_config(self):
        return {}


def check_learning_rate(learning_rate, inner):
    """The learning rate to give Keras's base optimizer: η > 0, a schedule or a
    callable without ``inner``; an ``InnerLearningRate`` with ``inner`` (where
    ``learning_rate`` must be left out)."""
    if inner is not None:
        if learning_rate is not None:
            raise ValueError(
                f"learning_rate={learning_rate!r} is given together with inner={type(inner).__name__}: "
                "the inner optimizer's learning rate (or schedule) is the one used. Leave learning_rate "
                f"out and give it to the inner optimizer, e.g. keras.optimizers.{type(inner).__name__}"
                "(learning_rate=...)."
            )
        return InnerLearningRate(inner)  # creates no variable of its own
    if learning_rate is None:
        raise ValueError(
            "learning_rate is required, got None (e.g. C.metadata['learning_rate'], which only curvature "
            "objectives record, is None for a bandmf or dpsgd C): give the rate you train with, e.g. "
            "learning_rate=0.5, or inner=keras.optimizers.SGD(...)."
        )
    if not isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule) and not callable(
        learning_rate
    ):
        learning_rate = check_float("learning_rate", learning_rate, positive=True)
    return learning_rate


def from_run(run, mixing, noise_multiplier, expected_batch_size):
    """(C, σ, B) of ``run``; any of them also given must agree with the run."""
    from keras_noisecurve.privacy.run import PrivateRun

    if not isinstance(run, PrivateRun):
        raise ValueError(f"run must be a keras_noisecurve.PrivateRun, got {type(run).__name__}.")
    given = {"mixing": mixing, "noise_multiplier": noise_multiplier, "expected_batch_size": expected_batch_size}
    planned = {"mixing": run.mixing, "noise_multiplier": run.noise_multiplier, "expected_batch_size": run.batch_size}
    for name, value in given.items():
        if value is None:
            continue
        same = load_mixing(value) == planned[name] if name == "mixing" else value == planned[name]
        if not same:
            raise ValueError(
                f"{name}={value!r} differs from the run's ({planned[name]!r}): with run=, leave {name} out "
                "(the run's is used)."
            )
    return planned["mixing"], planned["noise_multiplier"], planned["expected_batch_size"]


def resolve_clip(l2_norm_clip, run):
    """``(ζ_0, AdaptiveClip or None)`` of ``NoiseCurveOptimizer(l2_norm_clip=..., run=...)``.

    ``l2_norm_clip``: a number, an ``AdaptiveClip`` (or its config dict) or ``None``
    (the run's adaptive clip, else 1.0). An adaptive clip must be the run's own: the run's
    σ and ε include its count queries, and a run without one would report an ε that leaves
    them out. A run with an adaptive clip refuses a fixed number (its σ was calibrated for
    the count queries it would then not make)."""
    from keras_noisecurve.privacy.adaptive_clip import AdaptiveClip

    adaptive = AdaptiveClip.coerce(l2_norm_clip)
    planned = None if run is None else run.adaptive_clip
    if run is not None and planned is None and adaptive is not None:
        raise ValueError(
            f"l2_norm_clip={adaptive!r} but the run has no adaptive clip: its sigma and epsilon leave out the count "
            "queries an adaptive clip releases. Give it to the run, PrivateRun(..., adaptive_clip=...), and leave "
            "l2_norm_clip out here.")
    if planned is not None:
        if l2_norm_clip is not None and adaptive != planned:
            raise ValueError(
                f"l2_norm_clip={l2_norm_clip!r} differs from the run's adaptive clip ({planned!r}): with a run that "
                "has one, leave l2_norm_clip out (the run's is used).")
        adaptive = planned
    if adaptive is not None:
        return adaptive.initial, adaptive
    return (1.0 if l2_norm_clip is None else l2_norm_clip), None
