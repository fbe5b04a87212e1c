"""Worker of ``bench_peers.py`` for TensorFlow Privacy 0.9 (Keras 2): one model, one configuration.

Runs under the TF Privacy environment's interpreter (Python 3.11, tensorflow 2.15.1, whose
``tf.keras`` is Keras 2.15, the Keras TF Privacy 0.9 is written against). The model is the
same definition as in the Keras 3 columns (``_peer_common.build_model`` with ``tf.keras``).

- ``tfp-fast``: ``tensorflow_privacy.DPModel``-style model class
  (``make_dp_model_class(tf.keras.Model)``) with a layer registry of every fast-clipping
  rule TF Privacy 0.9 ships (Dense, Embedding, EinsumDense, LayerNormalization,
  MultiHeadAttention); ``use_xla=False``. If a trainable layer has no rule (Conv2D,
  GroupNormalization), TF Privacy falls back on its own to per-example gradients by
  ``tf.vectorized_map``; the result's notes say which path ran.
- ``tfp-vectorized``: ``VectorizedDPKerasSGDOptimizer`` with ``num_microbatches = B``
  (per-example clipping), loss with ``reduction=NONE`` as that optimizer requires.

Both clip at ζ = 1 with noise multiplier σ = 1, SGD with learning rate 0.05.

    /tmp/tfp09/bin/python benchmarks/_peer_tfp.py --model mlp --config tfp-fast --out /tmp/r.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peer_common as common  # noqa: E402

CONFIGS = ("tfp-fast", "tfp-vectorized")


def _registry(tf):
    from tensorflow_privacy.privacy.fast_gradient_clipping import layer_registry
    from tensorflow_privacy.privacy.fast_gradient_clipping.registry_functions import (
        einsum_dense, layer_normalization, multi_head_attention)

    registry = layer_registry.make_default_layer_registry()  # Dense, Embedding
    registry.insert(tf.keras.layers.EinsumDense, einsum_dense.einsum_layer_computation)
    registry.insert(tf.keras.layers.LayerNormalization, layer_normalization.layer_normalization_computation)
    registry.insert(tf.keras.layers.MultiHeadAttention, multi_head_attention.multi_head_attention_layer_computation)
    return registry


def build(model_name, config, batch_size, tf):
    tf.keras.utils.set_random_seed(0)
    inner = common.build_model(model_name, tf.keras)
    notes = {}
    if config == "tfp-fast":
        from tensorflow_privacy.privacy.keras_models.dp_keras_model import make_dp_model_class

        model = make_dp_model_class(tf.keras.Model)(
            l2_norm_clip=common.L2_NORM_CLIP, noise_multiplier=common.NOISE_MULTIPLIER,
            use_xla=False, layer_registry=_registry(tf), inputs=inner.inputs, outputs=inner.outputs,
        )
        fast = bool(getattr(model, "_enable_fast_peg_computation", False))
        notes["path"] = "fast clipping" if fast else "per-example tf.vectorized_map (a layer has no fast rule)"
        model.compile(optimizer=tf.keras.optimizers.SGD(common.LEARNING_RATE),
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model, notes
    if config == "tfp-vectorized":
        from tensorflow_privacy.privacy.optimizers.dp_optimizer_keras_vectorized import (
            VectorizedDPKerasSGDOptimizer)

        optimizer = VectorizedDPKerasSGDOptimizer(
            l2_norm_clip=common.L2_NORM_CLIP, noise_multiplier=common.NOISE_MULTIPLIER,
            num_microbatches=batch_size, learning_rate=common.LEARNING_RATE,
        )
        inner.compile(optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction=tf.keras.losses.Reduction.NONE))
        return inner, notes
    raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")


def _versions():
    from importlib import metadata

    out = {}
    for name in ("tensorflow", "tensorflow-privacy", "tf-keras"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    return out


def main(argv=None):
    args = common.parse_worker_args(sys.argv[1:] if argv is None else argv, CONFIGS)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    batch_size = common.MODELS[args.model][0]
    total = args.warmup + args.steps
    model, notes = build(args.model, args.config, batch_size, tf)
    x, y = common.make_data(args.model, total)
    timer = common.step_timer(tf.keras)
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    median, steps = common.summarise(timer.ends, args.warmup)
    versions = _versions()
    versions["keras (tf.keras)"] = getattr(tf.keras, "__version__", None) or tf.__version__
    common.write_result(
        args.out, model=args.model, config=args.config, median_ms=median, steps_ms=steps,
        warmup=args.warmup, parameters=int(model.count_params()), versions=versions,
        backend="tensorflow (Keras 2)", notes=notes,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
