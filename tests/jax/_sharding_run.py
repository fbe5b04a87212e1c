"""Run by tests/jax/test_jax_sharding.py in a subprocess with 8 virtual CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set before JAX starts).

``python tests/jax/_sharding_run.py small``: a tiny Embedding/Dense model trained 3 private
steps with a fixed seed, for a banded C (b = 3) and BLT (d = 3), once on one device (no
distribution) and once under ``ModelParallel`` on a 2 × 4 (data × model) mesh whose
``LayoutMap`` splits the embedding table and both Dense kernels over ``model``; then the
optimizer step alone, compiled on the mesh. ``python tests/jax/_sharding_run.py gemma``: a
tiny KerasHub GemmaBackbone under its own ``GemmaBackbone.get_layout_map(mesh)``.
``python tests/jax/_sharding_run.py resume``: a sharded run saved after 2 steps and resumed
(``model.save`` / ``keras.models.load_model``) on the same mesh and on a 4 × 2 mesh.
Prints one JSON line (the weights, the shardings of every noise state and the compiled
step's collectives and array sizes) for the test to check.
"""

import json
import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_noisecurve as knc  # noqa: E402
from keras_noisecurve.mixing.strategies import BLTMixing  # noqa: E402
from tests.training.helpers import random_banded_c  # noqa: E402

STEPS = 4


def _mixing(kind):
    if kind == "banded":
        return random_banded_c(STEPS, 3, rng=np.random.default_rng(0), diag_scale=2.0)
    return BLTMixing(theta=[0.9, 0.6, 0.2], omega=[0.3, 0.2, 0.1], steps=STEPS, metadata={"objective": "test"})


def _mesh():
    return keras.distribution.DeviceMesh((2, 4), ("data", "model"), devices=jax.devices())


def _small_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((6,), dtype="int32"), keras.layers.Embedding(32, 16, name="embedding"),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(8, activation="tanh", name="hidden"),
        keras.layers.Dense(4, name="out")])


def _small_distribution(shape=(2, 4)):
    mesh = keras.distribution.DeviceMesh(shape, ("data", "model"), devices=jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*embedding/embeddings"] = (None, "model")
    layout_map[".*hidden/kernel"] = ("model", None)
    layout_map[".*out/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def _gemma_model():
    import keras_hub

    keras.utils.set_random_seed(4)
    backbone = keras_hub.models.GemmaBackbone(vocabulary_size=32, num_layers=1, num_query_heads=4,
                                              num_key_value_heads=4, hidden_dim=16, intermediate_dim=32,
                                              head_dim=8)
    ids = keras.Input((8,), dtype="int32", name="token_ids")
    mask = keras.Input((8,), dtype="int32", name="padding_mask")
    hidden = backbone({"token_ids": ids, "padding_mask": mask})
    return keras.Model({"token_ids": ids, "padding_mask": mask}, backbone.token_embedding(hidden, reverse=True))


def _gemma_distribution():
    import keras_hub

    layout_map = keras_hub.models.GemmaBackbone.get_layout_map(_mesh(), model_parallel_dim_name="model",
                                                              data_parallel_dim_name="data")
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def _spec(array):
    spec = getattr(array.sharding, "spec", None)
    return None if spec is None else [None if a is None else str(a) for a in spec]


def _train(make_model, kind, x, y, loss):
    model = make_model()
    private = knc.make_private(model)
    optimizer = knc.NoiseCurveOptimizer(learning_rate=0.1, mixing=_mixing(kind), noise_multiplier=1.0,
                                        l2_norm_clip=0.5, expected_batch_size=8, seed=3)
    private.compile(optimizer=optimizer, loss=loss)
    for _ in range(3):
        private.train_on_batch(x, y)
    states = []
    for variable, state in zip(optimizer._trainable_variables, optimizer._rings):
        if state is None:
            continue
        value, weight = state.value, variable.value
        states.append({
            "variable": variable.path, "variable_spec": _spec(weight),
            "variable_shards": sorted({tuple(s.data.shape) for s in weight.addressable_shards}),
            "shape": list(value.shape), "spec": _spec(value),
            "shards": sorted({tuple(s.data.shape) for s in value.addressable_shards}),
            "devices": len(value.addressable_shards),
        })
    weights = [np.asarray(w, np.float64).tolist() for w in model.get_weights()]
    return weights, states, optimizer, model


def _compiled_step(optimizer, model):
    """The optimizer's private step alone (noise draws, state updates, weight updates),
    compiled on the mesh from the current values: its collectives and array sizes."""
    trainable = [v.value for v in model.trainable_variables]
    grads = [jax.numpy.ones_like(v) for v in trainable]
    grads = [jax.device_put(g, v.sharding) for g, v in zip(grads, trainable)]
    opt_values = [v.value for v in optimizer.variables]

    def step(opt_values, grads, trainable):
        return optimizer.stateless_apply_clipped_sum(opt_values, grads, trainable)

    text = jax.jit(step).lower(opt_values, grads, trainable).compile().as_text()
    collectives = sorted(set(re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\b",
                                        text)))
    sizes = [int(np.prod([int(d) for d in dims.split(",")])) for dims in
             re.findall(r"\b(?:f32|u32|s32|pred)\[([0-9,]+)\]", text)]
    return {"collectives": collectives, "largest": max(sizes) if sizes else 0}


def _resume():
    """Three steps uninterrupted against two steps, ``model.save``, ``load_model`` and one
    more step: on the same 2 × 4 mesh, and on a 4 × 2 mesh (the model axis split 2 ways)."""
    import tempfile

    rng = np.random.default_rng(1)
    x = rng.integers(0, 32, size=(8, 6)).astype("int32")
    y = rng.normal(size=(8, 4)).astype("float32")

    def make():
        private = knc.make_private(_small_model())
        private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.1, mixing=_mixing("banded"),
                                                          noise_multiplier=1.0, l2_norm_clip=0.5,
                                                          expected_batch_size=8, seed=3), loss="mse")
        return private

    keras.distribution.set_distribution(_small_distribution())
    whole = make()
    for _ in range(3):
        whole.train_on_batch(x, y)
    first = make()
    for _ in range(2):
        first.train_on_batch(x, y)
    path = os.path.join(tempfile.mkdtemp(), "run.keras")
    first.save(path)
    out = {"whole": [np.asarray(w, np.float64).tolist() for w in whole.get_weights()]}
    for shape in ((2, 4), (4, 2)):
        keras.distribution.set_distribution(_small_distribution(shape))
        resumed = keras.models.load_model(path)
        resumed.train_on_batch(x, y)
        optimizer = resumed.optimizer
        out[f"{shape[0]}x{shape[1]}"] = {
            "weights": [np.asarray(w, np.float64).tolist() for w in resumed.get_weights()],
            "step": int(np.asarray(optimizer.iterations.value)),
            "states": [{"variable": v.path, "shape": list(v.shape),
                        "variable_shards": sorted({tuple(s.data.shape) for s in v.value.addressable_shards}),
                        "shards": sorted({tuple(s.data.shape) for s in r.value.addressable_shards})}
                       for v, r in zip(optimizer._trainable_variables, optimizer._rings) if r is not None]}
    keras.distribution.set_distribution(None)
    print(json.dumps(out))


def main(which):
    if which == "resume":
        return _resume()
    out = {}
    rng = np.random.default_rng(1)
    if which == "small":
        x = rng.integers(0, 32, size=(8, 6)).astype("int32")
        y = rng.normal(size=(8, 4)).astype("float32")
        make_model, make_distribution, loss = _small_model, _small_distribution, "mse"
    else:
        x = {"token_ids": rng.integers(1, 32, size=(8, 8)).astype("int32"), "padding_mask": np.ones((8, 8), "int32")}
        y = rng.integers(0, 32, size=(8, 8)).astype("int32")
        make_model, make_distribution = _gemma_model, _gemma_distribution
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    kinds = ["banded", "blt"] if which == "small" else ["banded"]
    for kind in kinds:
        keras.distribution.set_distribution(None)
        one, _, _, _ = _train(make_model, kind, x, y, loss)
        keras.distribution.set_distribution(make_distribution())
        sharded, states, optimizer, model = _train(make_model, kind, x, y, loss)
        out[kind] = {"one": one, "sharded": sharded, "states": states}
        if kind == "banded":
            out[kind]["step"] = _compiled_step(optimizer, model)
        keras.distribution.set_distribution(None)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
