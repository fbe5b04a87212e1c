"""Worker of ``bench_peers.py`` for the Keras 3 columns: one model, one configuration, one process.

Configurations (the interpreter must have what each needs):

- ``keras-tf``: plain Keras 3, TensorFlow backend, SGD (non-private);
- ``keras-jax``: plain Keras 3, JAX backend, SGD (non-private);
- ``ours-dpsgd``: ``keras_noisecurve.training.make_private(model)`` (default clipping
  engine) + ``NoiseCurveOptimizer(mixing="dpsgd")``; TensorFlow backend;
- ``ours-banded16``: the same with a b = 16 banded mixing matrix (``bench_step.banded_mixing``);
- ``jax-privacy``: ``jax_privacy.keras_api.make_private(model, DPKerasConfig(...))``, JAX
  backend, SGD; per-example clipping by ``jax.vmap`` (``microbatch_size=None``).

Every private configuration clips at ζ = 1 with noise multiplier σ = 1. Writes one JSON
result (step times in ms, peak RSS, versions) to ``--out``.

    python benchmarks/_peer_keras3.py --model mlp --config keras-tf --out /tmp/r.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _peer_common as common  # noqa: E402

CONFIGS = ("keras-tf", "keras-jax", "ours-dpsgd", "ours-banded16", "jax-privacy")
JAX_CONFIGS = ("keras-jax", "jax-privacy")


def _versions(config):
    from importlib import metadata

    names = ["keras"] + (["jax", "jaxlib"] if config in JAX_CONFIGS else ["tensorflow"])
    if config == "jax-privacy":
        names.append("jax-privacy")
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    if config.startswith("ours"):
        import keras_noisecurve

        out["keras-noisecurve"] = keras_noisecurve.__version__
    return out


def build(model_name, config, batch_size, total_steps):
    import keras

    keras.utils.set_random_seed(0)
    model = common.build_model(model_name, keras)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config in ("keras-tf", "keras-jax"):
        model.compile(optimizer=keras.optimizers.SGD(common.LEARNING_RATE), loss=loss, jit_compile=False)
        return model, {}
    if config.startswith("ours"):
        from bench_step import banded_mixing

        from keras_noisecurve.training import NoiseCurveOptimizer, make_private

        mixing = "dpsgd" if config == "ours-dpsgd" else banded_mixing(max(total_steps + 1, 64), 16)
        private = make_private(model)
        private.compile(
            optimizer=NoiseCurveOptimizer(
                learning_rate=common.LEARNING_RATE, mixing=mixing, l2_norm_clip=common.L2_NORM_CLIP,
                noise_multiplier=common.NOISE_MULTIPLIER, expected_batch_size=batch_size,
            ),
            loss=loss,
        )
        return private, {"clipping engine": getattr(private, "_dp_clipping", "auto")}
    if config == "jax-privacy":
        from jax_privacy import keras_api

        params = keras_api.DPKerasConfig(
            # σ is fixed below; ε only has to be large enough to admit it
            epsilon=1e6, delta=1e-5, clipping_norm=common.L2_NORM_CLIP, batch_size=batch_size,
            gradient_accumulation_steps=1, train_steps=total_steps, train_size=total_steps * batch_size,
            noise_multiplier=common.NOISE_MULTIPLIER, rescale_to_unit_norm=False, seed=0,
        )
        private = keras_api.make_private(model, params)
        private.compile(optimizer=keras.optimizers.SGD(common.LEARNING_RATE), loss=loss)
        return private, {}
    raise ValueError(f"config must be one of {CONFIGS}, got {config!r}")


def main(argv=None):
    args = common.parse_worker_args(sys.argv[1:] if argv is None else argv, CONFIGS)
    os.environ["KERAS_BACKEND"] = "jax" if args.config in JAX_CONFIGS else "tensorflow"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    batch_size = common.MODELS[args.model][0]
    total = args.warmup + args.steps
    model, notes = build(args.model, args.config, batch_size, total)
    x, y = common.make_data(args.model, total)
    timer = common.step_timer(keras)
    model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
    median, steps = common.summarise(timer.ends, args.warmup)
    common.write_result(
        args.out, model=args.model, config=args.config, median_ms=median, steps_ms=steps,
        warmup=args.warmup, parameters=int(model.count_params()), versions=_versions(args.config),
        backend=keras.config.backend(), notes=notes,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
