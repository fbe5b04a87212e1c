"""LoRA through ``model.save`` / ``keras.models.load_model`` of a private model.

Keras saves a LoRA layer (``Dense``/``EinsumDense`` after ``enable_lora``, e.g. by a
KerasHub backbone's ``enable_lora(rank)``) with its factors merged into the kernel and
loads it with zero factors; a KerasHub backbone's config does not say which layers had
LoRA nor which were frozen. A private model loaded that way would train every weight,
from LoRA factors A = B = 0 (whose gradients are 0), and Keras would skip loading its
optimizer state (another variable count), restarting the plan's step count at 0.

``PrivateModel`` therefore keeps, in its own config, which layers (by ``layer.path``) had
LoRA (rank, alpha) and which were frozen (:func:`lora_config`), re-applies both when it
is rebuilt (:func:`restore_structure`), so the trainable variables and the optimizer
state match the saved model's; and keeps each LoRA layer's frozen kernel and factors in
its own saved variables (:func:`save_values`). Keras loads the layers after the private
model's own variables, so the values are put back the first time the model trains
(:func:`apply_values`); until then the loaded model computes the same function (merged
kernel, zero factors).
"""

from __future__ import annotations

import numpy as np

from keras_noisecurve import _compat

__all__ = ["apply_values", "lora_config", "lora_layers", "restore_structure", "save_values", "stash_values"]


def lora_layers(model) -> list:
    """The layers of ``model`` with LoRA enabled (``lora_enabled``), depth first."""
    return [layer for layer in _compat.flatten_layers(model, include_self=False)
            if getattr(layer, "lora_enabled", False)]


def lora_config(model):
    """``{"layers": [[path, rank, alpha], ...], "frozen": [path, ...]}`` of ``model``, or
    ``None`` when no layer has LoRA (the config then stays as it was)."""
    layers = lora_layers(model)
    if not layers:
        return None
    frozen = [layer.path for layer in _compat.flatten_layers(model, include_self=False) if not layer.trainable]
    return {"layers": [[layer.path, int(layer.lora_rank), float(layer.lora_alpha)] for layer in layers],
            "frozen": frozen}


def restore_structure(model, config) -> None:
    """Freeze the layers and enable LoRA on the layers that ``config`` (of :func:`lora_config`)
    names, on the freshly deserialised ``model``.

    Raises:
      ValueError: a named layer is missing (the model's layer paths changed).
    """
    if not config:
        return
    by_path = {layer.path: layer for layer in _compat.flatten_layers(model, include_self=False)}
    missing = [p for p in config["frozen"] + [entry[0] for entry in config["layers"]] if p not in by_path]
    if missing:
        raise ValueError(f"the saved private model names layers this model does not have: {missing[:5]}; "
                         "its LoRA layers and frozen layers cannot be restored.")
    for path in config["frozen"]:
        by_path[path].trainable = False
    for path, rank, alpha in config["layers"]:
        layer = by_path[path]
        layer.trainable = True
        if not layer.lora_enabled:
            layer.enable_lora(int(rank), lora_alpha=alpha)


def save_values(model, store) -> None:
    """Write every LoRA layer's frozen kernel and factors into ``store`` (a Keras weights store)."""
    for i, layer in enumerate(lora_layers(model)):
        store[f"lora_{i}_kernel"] = np.asarray(_compat.unmerged_kernel(layer))
        store[f"lora_{i}_a"] = np.asarray(layer.lora_kernel_a.numpy())
        store[f"lora_{i}_b"] = np.asarray(layer.lora_kernel_b.numpy())


def stash_values(model, store):
    """The values :func:`save_values` wrote, read from ``store`` (a list of (kernel, a, b)),
    or ``None`` when it holds none."""
    layers = lora_layers(model)
    if not layers or f"lora_{len(layers) - 1}_kernel" not in store:
        return None
    return [tuple(np.asarray(store[f"lora_{i}_{name}"]) for name in ("kernel", "a", "b"))
            for i in range(len(layers))]


def apply_values(model, values) -> None:
    """Assign the stashed (kernel, a, b) of :func:`stash_values` to ``model``'s LoRA layers."""
    for layer, (kernel, a, b) in zip(lora_layers(model), values):
        _compat.unmerged_kernel(layer).assign(kernel)
        layer.lora_kernel_a.assign(a)
        layer.lora_kernel_b.assign(b)
