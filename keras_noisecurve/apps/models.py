"""Small Keras 3 models used by the demo, the examples and the benchmarks.

- ``small_groupnorm_cnn``: the paper's "CNN with GroupNorm" (Appendix A, Table
  "Network architectures of two small-scale CNN models", left):

  ======================================  =====================================
  Layer                                    Parameters
  ======================================  =====================================
  Conv2d + GroupNorm + ReLU                3 → 16, kernel 3×3, stride 1
  Conv2d + GroupNorm + ReLU                16 → 32, kernel 3×3, stride 2
  Conv2d + GroupNorm + ReLU                32 → 64, kernel 3×3, stride 2
  AdaptiveAvgPool2d                        output 2×2
  Linear + ReLU                            256 → dense_size
  Linear                                   dense_size → num_classes
  ======================================  =====================================

  With ``dense_size=64`` and a 32×32×3 input it has 40,906 parameters (≈41k).
- ``mlp``: a fully connected ReLU network.
- ``softmax_regression``: multinomial logistic regression (convex).

The CNN normalises with :class:`keras_noisecurve.apps.layers.GroupNorm` (exact second
derivatives, for the spectrum of a Hessian upper bound) and pools with
:class:`keras_noisecurve.apps.layers.AdaptiveAveragePooling2D`.
"""

from __future__ import annotations

import keras
from keras import layers

from keras_noisecurve._validation import check_int
from keras_noisecurve.apps.layers import AdaptiveAveragePooling2D, GroupNorm

__all__ = ["mlp", "small_groupnorm_cnn", "softmax_regression"]


def _check_shape(input_shape, ndim):
    shape = tuple(input_shape)
    if len(shape) != ndim or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"input_shape must be a tuple of {ndim} positive integers, got {input_shape!r}.")
    return shape


def small_groupnorm_cnn(
    input_shape=(32, 32, 3),
    num_classes: int = 10,
    dense_size: int = 64,
    groups: int = 8,
    *,
    padding: str = "same",
    seed: int | None = None,
    name: str = "small_groupnorm_cnn",
) -> keras.Model:
    """The paper's small CNN with GroupNorm (Appendix A), for any image size.

    Conv(16, 3×3, stride 1) → GroupNorm → ReLU → Conv(32, 3×3, stride 2) → GroupNorm →
    ReLU → Conv(64, 3×3, stride 2) → GroupNorm → ReLU → adaptive average pool to 2×2 →
    flatten (256) → Dense(dense_size) → ReLU → Dense(num_classes) (logits, no softmax).

    Args:
      input_shape: (height, width, channels), channels last; e.g. (32, 32, 3) for
        CIFAR-10, (28, 28, 1) for MNIST.
      num_classes: number of output logits.
      dense_size: width of the hidden dense layer (64 gives 40,906 parameters at
        32×32×3; 32 gives 32,362).
      groups: GroupNorm groups per layer; must divide 16 (1, 2, 4, 8 or 16).
      padding: ``"same"`` or ``"valid"`` for the convolutions (parameter count is the same).
      seed: seed of the weight initialisers (None: Keras' global RNG).

    Returns:
      an uncompiled ``keras.Model`` mapping (batch, *input_shape) images to
      (batch, num_classes) logits.
    """
    input_shape = _check_shape(input_shape, 3)
    num_classes = check_int("num_classes", num_classes, minimum=2)
    dense_size = check_int("dense_size", dense_size, minimum=1)
    groups = check_int("groups", groups, minimum=1)
    if 16 % groups:
        raise ValueError(f"groups must divide 16, 32 and 64 (1, 2, 4, 8 or 16); got {groups}.")
    if padding not in ("same", "valid"):
        raise ValueError(f"padding must be 'same' or 'valid', got {padding!r}.")
    init = _initializers(seed)
    inputs = keras.Input(shape=input_shape, name="image")
    x = inputs
    for i, (filters, stride) in enumerate(((16, 1), (32, 2), (64, 2))):
        x = layers.Conv2D(
            filters, 3, strides=stride, padding=padding, kernel_initializer=init(), name=f"conv{i + 1}"
        )(x)
        x = GroupNorm(groups=groups, name=f"groupnorm{i + 1}")(x)
        x = layers.ReLU(name=f"relu{i + 1}")(x)
    if x.shape[1] < 2 or x.shape[2] < 2:
        raise ValueError(f"input_shape {input_shape} is too small: the last feature map is {x.shape[1:3]}.")
    x = AdaptiveAveragePooling2D((2, 2), name="adaptive_avg_pool")(x)
    x = layers.Flatten(name="flatten")(x)
    x = layers.Dense(dense_size, activation="relu", kernel_initializer=init(), name="dense")(x)
    outputs = layers.Dense(num_classes, kernel_initializer=init(), name="logits")(x)
    return keras.Model(inputs, outputs, name=name)


def mlp(
    input_shape=(28, 28, 1),
    num_classes: int = 10,
    hidden_sizes=(64,),
    *,
    seed: int | None = None,
    name: str = "mlp",
) -> keras.Model:
    """A fully connected ReLU network: flatten → Dense(h) → ReLU … → Dense(num_classes).

    Args:
      input_shape: shape of one example (flattened first).
      num_classes: number of output logits.
      hidden_sizes: widths of the hidden layers (may be empty: softmax regression).
      seed: seed of the weight initialisers.

    Returns:
      an uncompiled ``keras.Model`` producing (batch, num_classes) logits. Parameter
      count: Σ (fan_in + 1)·fan_out over the dense layers.
    """
    input_shape = tuple(check_int("input_shape entry", s, minimum=1) for s in input_shape)
    num_classes = check_int("num_classes", num_classes, minimum=2)
    hidden_sizes = tuple(check_int("hidden_sizes entry", h, minimum=1) for h in hidden_sizes)
    init = _initializers(seed)
    inputs = keras.Input(shape=input_shape, name="input")
    x = layers.Flatten(name="flatten")(inputs) if len(input_shape) > 1 else inputs
    for i, width in enumerate(hidden_sizes):
        x = layers.Dense(width, activation="relu", kernel_initializer=init(), name=f"hidden{i + 1}")(x)
    outputs = layers.Dense(num_classes, kernel_initializer=init(), name="logits")(x)
    return keras.Model(inputs, outputs, name=name)


def softmax_regression(
    input_shape=(28, 28, 1), num_classes: int = 10, *, name: str = "softmax_regression"
) -> keras.Model:
    """Multinomial logistic regression: flatten → Dense(num_classes) logits, zero-initialised.

    Convex in its (prod(input_shape) + 1)·num_classes parameters. Zero initialisation
    makes the starting point the maximally uncertain model (paper §4.2).
    """
    input_shape = tuple(check_int("input_shape entry", s, minimum=1) for s in input_shape)
    num_classes = check_int("num_classes", num_classes, minimum=2)
    inputs = keras.Input(shape=input_shape, name="input")
    x = layers.Flatten(name="flatten")(inputs) if len(input_shape) > 1 else inputs
    outputs = layers.Dense(num_classes, kernel_initializer="zeros", name="logits")(x)
    return keras.Model(inputs, outputs, name=name)


def _initializers(seed):
    counter = iter(range(10**6))

    def make():
        if seed is None:
            return "glorot_uniform"
        return keras.initializers.GlorotUniform(seed=seed * 1000 + next(counter))

    return make
