"""Replace BatchNormalization so that a model can be trained privately.

In training mode BatchNormalization normalises each example with statistics of the
whole batch, so one example's gradient depends on the others and per-example clipping
does not bound its influence: private training refuses it. The usual fix (Opacus's
``ModuleValidator.fix``, the NF/GroupNorm ResNets of the DP literature) is a
normalisation over each example alone. :func:`replace_batch_normalization` rebuilds a
functional or Sequential model with ``GroupNormalization`` (or ``LayerNormalization``)
in place of every ``BatchNormalization``, keeping every other layer's weights.
"""

from __future__ import annotations

import keras

from keras_noisecurve._validation import check_choice, check_int

__all__ = ["replace_batch_normalization"]

NORMS = ("group", "layer")


def _groups_for(channels: int, groups: int) -> int:
    """The largest divisor of ``channels`` that is ≤ ``groups``."""
    return max(g for g in range(1, min(groups, channels) + 1) if channels % g == 0)


def _replacement(layer, norm: str, groups: int):
    axis = layer.axis if isinstance(layer.axis, int) else list(layer.axis)
    common = dict(epsilon=layer.epsilon, center=layer.center, scale=layer.scale, dtype=layer.dtype_policy,
                  name=f"{layer.name}_{norm}norm")
    if norm == "layer":
        return keras.layers.LayerNormalization(axis=axis, **common)
    if not isinstance(axis, int):
        raise ValueError(f"BatchNormalization layer '{layer.name}' normalises over several axes {axis}: "
                         "use norm='layer'.")
    channels = layer.gamma.shape[0] if layer.gamma is not None else layer.moving_mean.shape[0]
    return keras.layers.GroupNormalization(groups=_groups_for(int(channels), groups), axis=axis, **common)


def replace_batch_normalization(model, *, norm: str = "group", groups: int = 32):
    """A copy of ``model`` with every BatchNormalization replaced by a per-example norm.

    Args:
      model: a built functional or Sequential ``keras.Model`` (e.g. ``keras.applications``
        ResNet50 or MobileNetV2). Subclassed models cannot be rebuilt from their graph:
        change their code instead.
      norm: ``"group"`` (``GroupNormalization`` with the largest divisor of the channels
        that is ≤ ``groups``, on BatchNormalization's axis) or ``"layer"``
        (``LayerNormalization`` over the same axis).
      groups: the number of groups to aim for (32, as in the GroupNorm paper).

    Returns:
      a new model with the same inputs and outputs. Every other layer's weights are
      copied; each new normalisation starts from the batch norm's ``gamma``/``beta``
      (its moving mean and variance have no counterpart and are dropped). Fine-tune
      before relying on a pretrained model's accuracy.

    Raises:
      ValueError: for a subclassed or unbuilt model, or a bad ``norm``/``groups``.
    """
    norm = check_choice("norm", norm, NORMS)
    groups = check_int("groups", groups, minimum=1)
    if not isinstance(model, keras.Model):
        raise ValueError(f"model must be a keras.Model, got {type(model).__name__}.")
    if not model.built:
        raise ValueError(f"model '{model.name}' is not built: build it (or call it once) first.")
    pairs = []

    def clone(layer):
        if isinstance(layer, keras.layers.BatchNormalization):
            new = _replacement(layer, norm, groups)
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    def call(layer, *args, **kwargs):
        if isinstance(layer, (keras.layers.GroupNormalization, keras.layers.LayerNormalization)):
            kwargs.pop("mask", None)  # BatchNormalization's call takes a mask; the per-example norms do not
            kwargs.pop("training", None)
        return layer(*args, **kwargs)

    try:
        if isinstance(model, keras.Sequential):  # layers are listed, not called: no call_function
            rebuilt = keras.models.clone_model(model, clone_function=clone)
        else:
            rebuilt = keras.models.clone_model(model, clone_function=clone, call_function=call)
    except ValueError as error:  # e.g. a subclassed model
        raise ValueError(f"cannot rebuild model '{model.name}' (only functional and Sequential models can be; "
                         f"replace BatchNormalization in a subclassed model's code): {error}") from None
    for old, new in pairs:
        if isinstance(old, keras.layers.BatchNormalization):
            for name in ("gamma", "beta"):
                if getattr(old, name) is not None and getattr(new, name, None) is not None:
                    getattr(new, name).assign(getattr(old, name))
        elif old.weights:
            new.set_weights(old.get_weights())
    return rebuilt
