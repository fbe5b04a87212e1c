"""Step time of non-private training, DP-SGD (b = 1), banded noise (b = 16) and BLT (d = 4).

Models (defined here; see keras_noisecurve.apps.models for the shared builders):
- the paper's small GroupNorm CNN on 32×32×3 (≈41k parameters), batch 256;
- an MLP (784 → 128 → 10), batch 256; ``mlp512``: 784 → 512 → 512 → 10 (≈670k parameters);
- a 1-block transformer on (32, 64) inputs; ``transformer64``: on (64, 64) inputs.

All configurations are timed in ONE process, interleaved (repeat r runs every
configuration once), and the median per-step time over repeats is reported with
the ratios DP-SGD / non-private and banded (BLT) / DP-SGD, plus the noise-state memory
(bytes of the ring buffers). Targets: DP-SGD ≤ 2.5× non-private on the CNN;
banded b = 16 ≤ 1.15× and BLT d = 4 ≤ 1.05× DP-SGD (``NOISE_TARGETS``).

    python benchmarks/bench_step.py --models cnn mlp --repeats 5 --steps 5

To add a configuration (e.g. another clipping engine), append to ``CONFIGS``.

The cost of correlated noise over DP-SGD (targets: banded b = 16 ≤ 1.15×, BLT d = 4
≤ 1.05×), and ``--noise-bandwidth``: the noise recurrence alone (its fused XLA form and
the unfused reference) in bytes of state read + written per second, against a plain
memory copy (numpy) moving the same number of bytes, interleaved in the same process::

    python benchmarks/bench_step.py --models mlp512 --configs dpsgd banded16 blt4 --noise-bandwidth
    python benchmarks/bench_step.py --models transformer64 --batch-size 64 --configs dpsgd banded16 blt4

(Every private configuration clips with the library's default engine, ``"auto"``: ghost
norms where a layer has a rule, the fast private step against which the noise's share is
measured. ``--clipping vectorized`` times the reference engine instead, an exact
per-example loop: P batch-of-one gradients per step, far slower.)

Ghost clipping (``"ghost"`` config, ghost-norm engine) with the transformer block
and the peak step memory (TensorFlow's CPU allocator statistics); the line
"engine only" times ``ghost_clipped_sum`` against a plain gradient, without the
optimizer and its noise, and "noise floor" is the DP-SGD noise's share of a step
(it does not shrink with the batch, so small models at small batches sit near it)::

    python benchmarks/bench_step.py --models mlp transformer cnn --configs non-private ghost

``--memory-batch-sizes 64 128 256 512`` adds the peak step memory of every
configuration at those batch sizes (untimed).

TensorFlow picks its CPU kernels (oneDNN or Eigen) by the CPU's instructions, and
the ghost conv rule's formulation follows the kernels. ``--onednn both`` runs the
whole benchmark twice in one invocation, as child processes with
``TF_ENABLE_ONEDNN_OPTS=0`` and ``=1``, and ends with their ratio lines side by side::

    python benchmarks/bench_step.py --models cnn --configs non-private ghost --onednn both

``--strategies`` adds, on each model, a side-by-side of the noise strategies
(``STRATEGY_CONFIGS``: banded b = 64, Toeplitz b = 64, BLT d = 4, BISR p = 64, with
DP-SGD as the floor), measured in the same process and interleaved like the rest:
noise-state bytes, full step time and optimizer-update time, with ratios to banded
b = 64. ``--configs`` with no names skips the configurations above::

    python benchmarks/bench_step.py --models cnn mlp --configs --strategies

``--zoo`` runs ``benchmarks/bench_zoo.py`` instead (KerasHub transformers, LoRA, RNNs,
a GroupNorm ResNet, a recommender: private / non-private step, side by side).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_noisecurve.mixing import MixingMatrix  # noqa: E402
from keras_noisecurve.mixing.strategies import BISRMixing, BLTMixing, ToeplitzMixing  # noqa: E402
from keras_noisecurve.training import NoiseCurveOptimizer, make_private  # noqa: E402

LEARNING_RATE = 0.05

#: name -> None (non-private) or dict(clipping=engine name, bands=b). The private
#: configurations clip with the library's default engine, ``"auto"`` (``make_private``'s
#: default: ghost norms where a layer has a rule, its own per-layer product elsewhere);
#: ``--clipping vectorized`` times the reference per-example loop instead (slow: P
#: batch-of-one gradients per step).
CONFIGS = {
    "non-private": None,
    "dpsgd": {"clipping": "auto", "bands": 1},
    "banded16": {"clipping": "auto", "bands": 16},
    "blt4": {"clipping": "auto", "strategy": ("blt", 4)},
    # ghost-norm clipping (keras_noisecurve.backend.tensorflow.ghost), DP-SGD noise
    "ghost": {"clipping": "ghost", "bands": 1},
}

#: --strategies: name -> dict(clipping=engine name, strategy=(kind, size)); size is b
#: (banded, toeplitz), d (blt) or p (bisr). "dpsgd" is the no-state floor.
STRATEGY_CONFIGS = {
    "dpsgd": {"clipping": "auto", "bands": 1},
    "banded64": {"clipping": "auto", "strategy": ("banded", 64)},
    "toeplitz64": {"clipping": "auto", "strategy": ("toeplitz", 64)},
    "blt4": {"clipping": "auto", "strategy": ("blt", 4)},
    "bisr64": {"clipping": "auto", "strategy": ("bisr", 64)},
}


# ------------------------------------------------------------------- models
def groupnorm_cnn(dense_size=64, groups=4):
    """Conv(3→16,k3,s1)+GN+ReLU, Conv(16→32,k3,s2)+GN+ReLU, Conv(32→64,k3,s2)+GN+ReLU,
    AvgPool to 2×2, Dense(256→dense_size)+ReLU, Dense(→10). ≈41k parameters."""
    layers = keras.layers
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            layers.Conv2D(16, 3, strides=1, padding="same"),
            layers.GroupNormalization(groups=groups),
            layers.ReLU(),
            layers.Conv2D(32, 3, strides=2, padding="same"),
            layers.GroupNormalization(groups=groups),
            layers.ReLU(),
            layers.Conv2D(64, 3, strides=2, padding="same"),
            layers.GroupNormalization(groups=groups),
            layers.ReLU(),
            layers.AveragePooling2D(pool_size=4),  # 8×8 → 2×2
            layers.Flatten(),
            layers.Dense(dense_size, activation="relu"),
            layers.Dense(10),
        ],
        name="groupnorm_cnn",
    )


def mlp():
    return keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(128, activation="relu"), keras.layers.Dense(10)], name="mlp"
    )


def transformer_block(length=32, width=64, heads=4):
    """One pre-pooled transformer encoder block on (length, width) inputs:
    MultiHeadAttention (EinsumDense projections) + residual + LayerNorm, Dense(4·width,
    gelu) → Dense(width) + residual + LayerNorm, average over positions, Dense(10)."""
    layers = keras.layers
    inputs = keras.Input((length, width))
    h = layers.MultiHeadAttention(heads, width // heads)(inputs, inputs)
    h = layers.LayerNormalization()(inputs + h)
    f = layers.Dense(4 * width, activation="gelu")(h)
    h = layers.LayerNormalization()(h + layers.Dense(width)(f))
    outputs = layers.Dense(10)(layers.GlobalAveragePooling1D()(h))
    return keras.Model(inputs, outputs, name="transformer_block")


def mlp512():
    """784 → 512 → 512 → 10 with ReLU (669,706 parameters)."""
    layers = keras.layers
    return keras.Sequential(
        [keras.Input((784,)), layers.Dense(512, activation="relu"), layers.Dense(512, activation="relu"),
         layers.Dense(10)],
        name="mlp512",
    )


MODELS = {"cnn": (groupnorm_cnn, (32, 32, 3)), "mlp": (mlp, (784,)), "mlp512": (mlp512, (784,))}
MODELS["transformer"] = (transformer_block, (32, 64))
MODELS["transformer64"] = (lambda: transformer_block(length=64), (64, 64))

#: whole-step targets of the noise over DP-SGD (config name -> ratio)
NOISE_TARGETS = {"banded16": 1.15, "blt4": 1.05}


def time_ghost_engine(model_name, x, y, repeats, steps):
    """The clipping engine alone (no optimizer, no noise): ``ghost_clipped_sum`` vs the
    plain gradient of the summed loss, interleaved; step time and peak memory."""
    from keras_noisecurve.backend.tensorflow.ghost import ghost_clipped_sum

    keras.utils.set_random_seed(0)
    model = MODELS[model_name][0]()
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    variables = model.trainable_variables

    @tf.function
    def plain(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(per_example(y, model(x, training=True)))
        return {"loss": loss, "grads": tape.gradient(loss, variables)}

    @tf.function
    def ghost(x, y):
        out = ghost_clipped_sum(model, per_example, x, y, None, l2_norm_clip=1.0)
        return {"loss": tf.reduce_sum(out.per_example_loss), "grads": out.grads}

    fns = {"gradient": plain, "ghost": ghost}
    for fn in fns.values():
        fn(x, y)
    peaks = {name: peak_step_memory(fn, x, y) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for r in range(repeats):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:  # alternate which runs first
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(steps):
                out = fn(x, y)
            float(out["loss"])
            times[name].append((time.perf_counter() - start) / steps)
    median = {name: 1000 * float(np.median(t)) for name, t in times.items()}
    paired = float(np.median(np.array(times["ghost"]) / np.array(times["gradient"])))
    mem = ", ".join(f"{n} {p / 2**20:.1f} MiB" for n, p in peaks.items() if p is not None)
    print(f"   engine only ({model_name}): gradient {median['gradient']:.1f} ms, ghost clipped sum "
          f"{median['ghost']:.1f} ms = {median['ghost'] / median['gradient']:.2f}x; paired by round "
          f"{paired:.2f}x; peak {mem}")
    return paired


def peak_step_memory(step, x, y):
    """Peak allocator bytes above the resting level during one step, from
    ``tf.config.experimental.get_memory_info('CPU:0')`` (TensorFlow's CPU allocator
    statistics; None if this TensorFlow build does not keep them)."""
    try:
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        float(step(x, y)["loss"])
        return tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    except (ValueError, RuntimeError):
        return None




def memory_by_batch(model_name, configs, batch_sizes, steps_planned):
    """Peak step memory of each configuration at each batch size (one step each, after
    one warm-up step), and the ratio to the first configuration: constant in the batch
    size when a configuration's memory grows like the activations (batch × activations)
    and not like batch × parameters."""
    rng = np.random.default_rng(1)
    for batch_size in batch_sizes:
        x = tf.constant(rng.normal(size=(batch_size, *MODELS[model_name][1])).astype("float32"))
        y = tf.constant(rng.integers(0, 10, batch_size))
        peaks = {}
        for name in configs:
            step = step_function(build(model_name, CONFIGS[name], batch_size, steps_planned))
            step(x, y)
            peaks[name] = peak_step_memory(step, x, y)
        if any(p is None for p in peaks.values()):
            print("   (no CPU allocator statistics in this TensorFlow build)")
            return
        first = configs[0]
        print(f"   peak step memory ({model_name}, batch {batch_size:4d}): "
              + ", ".join(f"{n} {p / 2**20:7.1f} MiB" for n, p in peaks.items())
              + "".join(f"; {n} / {first} {peaks[n] / max(peaks[first], 1):.2f}" for n in configs[1:]))


# ------------------------------------------------------------------- helpers
def banded_mixing(steps, bands, seed=0):
    """A valid T×T b-banded C (random band, positive diagonal, unit columns), built
    from band values directly (no dense T×T matrix)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(scale=0.3, size=(steps, bands))
    values[:, 0] = 1.0
    for j in range(1, bands):
        values[:j, j] = 0.0
    sq = np.zeros(steps)
    for j in range(bands):
        sq[: steps - j] += values[j:, j] ** 2
    norms = np.sqrt(sq)
    for j in range(bands):
        values[j:, j] /= norms[: steps - j]
    return MixingMatrix(values, {"objective": "benchmark"})


def _decaying_coefficients(bands):
    """The first b coefficients of (1 − x)^(−1/2): c_0 = 1, c_k = c_{k−1}·(k − ½)/k
    (positive and decreasing, so the inverse recurrence is stable)."""
    c = np.ones(bands)
    for k in range(1, bands):
        c[k] = c[k - 1] * (k - 0.5) / k
    return c


def strategy_mixing(kind, size, steps):
    """A valid C of each strategy kind for the --strategies comparison (T = ``steps``)."""
    if kind == "toeplitz":
        return ToeplitzMixing.normalised(_decaying_coefficients(size), steps=steps, metadata={"objective": "benchmark"})
    if kind == "banded":  # the same band as Toeplitz, every column normalised: a general banded C
        values = np.tile(_decaying_coefficients(size), (steps, 1))
        for j in range(1, size):
            values[:j, j] = 0.0
        sq = np.zeros(steps)
        for j in range(size):
            sq[: steps - j] += values[j:, j] ** 2
        for j in range(size):
            values[j:, j] /= np.sqrt(sq[: steps - j])
        return MixingMatrix(values, {"objective": "benchmark"})
    if kind == "blt":
        theta = np.array([0.99, 0.9, 0.6, 0.2, 0.05, 0.01])[:size]
        return BLTMixing(theta=theta, omega=np.full(size, 0.1), steps=steps, metadata={"objective": "benchmark"})
    if kind == "bisr":
        return BISRMixing.closed_form(steps=steps, bands=size)
    raise ValueError(f"unknown strategy kind {kind!r}")


def config_mixing(config, steps_planned):
    """The mixing of a private configuration: DP-SGD, a random banded C, or a strategy."""
    if "strategy" in config:
        return strategy_mixing(*config["strategy"], steps_planned)
    return "dpsgd" if config["bands"] == 1 else banded_mixing(steps_planned, config["bands"])


def build(model_name, config, batch_size, steps_planned):
    builder, _ = MODELS[model_name]
    keras.utils.set_random_seed(0)
    model = builder()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if config is None:
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=loss, jit_compile=False)
        return model
    mixing = config_mixing(config, steps_planned)
    private = make_private(model, clipping=config["clipping"])
    private.compile(
        optimizer=NoiseCurveOptimizer(
            learning_rate=LEARNING_RATE, mixing=mixing, l2_norm_clip=1.0, noise_multiplier=1.0,
            expected_batch_size=batch_size,
        ),
        loss=loss,
    )
    return private


def step_function(model):
    @tf.function(reduce_retracing=True)
    def step(x, y):
        return model.train_step((x, y))

    return step


def time_updates(model_name, batch_size, repeats, steps, mixings=None):
    """Time the optimizer update alone (zero clipped sums): the part of a step that the
    noise source changes, measured without the (noisy) per-example gradient cost.

    ``mixings``: (name, mixing) pairs; default DP-SGD and a random banded C with b = 16.
    """
    builder, _ = MODELS[model_name]
    variables = builder().trainable_variables
    grads = [tf.zeros(v.shape) for v in variables]
    fns = {}
    sgd = keras.optimizers.SGD(LEARNING_RATE)
    fns["sgd"] = tf.function(lambda g: sgd.apply(g, variables))
    if mixings is None:
        mixings = [("dpsgd", "dpsgd"), ("banded16", banded_mixing(repeats * steps + 64, 16))]
    for name, mixing in mixings:
        opt = NoiseCurveOptimizer(learning_rate=LEARNING_RATE, mixing=mixing, noise_multiplier=1.0,
                                  expected_batch_size=batch_size)
        fns[name] = tf.function(lambda g, opt=opt: opt.apply_clipped_sum(g, variables))
    for fn in fns.values():
        fn(grads)
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        shift = r % len(names)  # rotate the order: no configuration always runs first
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(steps):
                fn(grads)
            variables[0].numpy()
            times[name].append((time.perf_counter() - start) / steps)
    medians = {name: float(np.median(t)) for name, t in times.items()}
    print(f"   optimizer update only ({model_name}): "
          + ", ".join(f"{n} {1000 * t:.2f} ms" for n, t in medians.items()))
    return medians


def compare_strategies(model_name, x, y, args, planned):
    """--strategies: noise-state bytes, step time and update time of ``STRATEGY_CONFIGS``
    on one model, interleaved in this process; ratios to banded b = 64."""
    runs = {}
    for name, config in STRATEGY_CONFIGS.items():
        model = build(model_name, config, args.batch_size, planned)
        step = step_function(model)
        for _ in range(args.warmup):
            step(x, y)
        runs[name] = (model, step)
    times = {name: [] for name in runs}
    names = list(runs)
    for r in range(args.repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            step = runs[name][1]
            start = time.perf_counter()
            for _ in range(args.steps):
                out = step(x, y)
            float(out["loss"])
            times[name].append((time.perf_counter() - start) / args.steps)
    update_steps = 20
    update_plan = args.repeats * update_steps + 64
    updates = time_updates(model_name, args.batch_size, args.repeats, update_steps,
                           mixings=[(name, config_mixing(config, update_plan))
                                    for name, config in STRATEGY_CONFIGS.items()])
    params = runs[names[0]][0].count_params()
    median = {name: float(np.median(t)) for name, t in times.items()}
    ref = "banded64"
    ref_bytes = runs[ref][0].optimizer.noise_state_bytes()
    print(f"\n== noise strategies on {model_name}: {params} parameters, batch {args.batch_size}, "
          f"T = {planned} (medians of {args.repeats} interleaved rounds; ratios to {ref}) ==")
    print(f"{'':>12}  {'buffers':>7}  {'noise state':>15}  {'/' + ref:>9}  {'ms/step':>8}  {'/' + ref:>9}  "
          f"{'update ms':>9}  {'/' + ref:>9}")
    for name in names:
        opt = runs[name][0].optimizer
        mixing = opt.mixing
        buffers = 0 if isinstance(mixing, str) else mixing.buffers
        nbytes = opt.noise_state_bytes()
        print(f"{name:>12}  {buffers:>7d}  {nbytes:>15,d}  {nbytes / ref_bytes:>8.3f}x  {1000 * median[name]:>8.1f}  "
              f"{median[name] / median[ref]:>8.3f}x  {1000 * updates[name]:>9.2f}  "
              f"{updates[name] / updates[ref]:>8.3f}x")
    blt_bytes = runs["blt4"][0].optimizer.noise_state_bytes()
    print(f"blt4 / banded64 ({model_name}): noise state {blt_bytes / ref_bytes:.3f}x, "
          f"step {median['blt4'] / median[ref]:.3f}x, update {updates['blt4'] / updates[ref]:.3f}x")
    return median, updates


def noise_bandwidth(model_name, repeats, steps=20):
    """--noise-bandwidth: the noise recurrence alone, banded b = 16 and BLT d = 4, in its
    fused form (``StreamNoise.advance_in_place``: one XLA function per variable) and the
    unfused reference (``fused=False``: ``advance`` and a TensorFlow scatter), against a
    numpy copy that moves the same bytes; all interleaved (rotated order), medians.

    Bytes per step, n parameters in float32: banded, the b − 1 slots read and one
    written, 4·b·n; BLT, the d accumulators read and written, 8·d·n. The draw z_t is fixed
    (drawn once): only the recurrence is timed. The copy reads and writes half of the
    noise's bytes each (``np.copyto``), so its GB/s is the same traffic per second."""
    from keras_noisecurve.training.noise import StreamNoise

    variables = MODELS[model_name][0]().trainable_variables
    params = sum(int(np.prod(v.shape)) for v in variables)
    plan = 4096
    zs = [tf.random.normal(v.shape, seed=k) for k, v in enumerate(variables)]
    fns, traffic = {}, {}
    for label, kind, size in (("banded16", "banded", 16), ("blt4", "blt", 4)):
        stream = strategy_mixing(kind, size, plan).stream()
        traffic[label] = 4 * params * (size if kind == "banded" else 2 * size)
        for fused in (True, False):
            noise = StreamNoise(stream, fused=fused)
            states = [tf.Variable(tf.zeros(noise.state_shape(v.shape))) for v in variables]
            step = tf.Variable(0, dtype=tf.int64)

            @tf.function
            def run(noise=noise, states=states, step=step):
                coefficients = noise.step_coefficients(step, tf.float32)
                last = [noise.advance_in_place(z, step, s, coefficients) for z, s in zip(zs, states)]
                step.assign(tf.math.floormod(step + 1, plan))
                return last[-1][0]

            fns[f"{label} {'fused' if fused else 'unfused'}"] = run
    for label in list(traffic):
        half = traffic[label] // 8  # float32 elements moved each way
        src, dst = np.random.default_rng(0).random(half, dtype=np.float32), np.empty(half, np.float32)
        fns[f"copy {label}"] = lambda src=src, dst=dst: np.copyto(dst, src)
    for fn in fns.values():
        fn()
        fn()
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            start = time.perf_counter()
            for _ in range(steps):
                out = fn()
            if out is not None:
                float(out)
            times[name].append((time.perf_counter() - start) / steps)
    median = {name: float(np.median(t)) for name, t in times.items()}
    print(f"\n== noise bandwidth on {model_name}: {params:,d} parameters (medians of {repeats} interleaved "
          f"rounds of {steps} steps; GB/s = bytes of state read + written per step / time) ==")
    for label, nbytes in traffic.items():
        copy = median[f"copy {label}"]
        parts = [f"copy {1000 * copy:.2f} ms = {nbytes / copy / 1e9:.1f} GB/s"]
        for form in ("fused", "unfused"):
            t = median[f"{label} {form}"]
            parts.append(f"{form} {1000 * t:.2f} ms = {nbytes / t / 1e9:.1f} GB/s ({copy / t:.2f} of the copy)")
        print(f"noise bandwidth {label} ({nbytes / 1e6:.1f} MB/step): " + "; ".join(parts))
    return median


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--zoo" in argv:  # private / non-private step of the model zoo (benchmarks/bench_zoo.py)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_zoo

        return bench_zoo.main([a for a in argv if a != "--zoo"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=sorted(MODELS))
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=sorted(CONFIGS),
                        help="configurations to time (none: only --strategies)")
    parser.add_argument("--strategies", action="store_true",
                        help="also compare the noise strategies (STRATEGY_CONFIGS) on each model")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--clipping", choices=("vectorized", "ghost", "auto"), default=None,
                        help="clipping engine of every private configuration but 'ghost' (default: each "
                             "configuration's own, 'auto', the library's default engine; 'vectorized' is "
                             "the reference per-example loop, slow)")
    parser.add_argument("--noise-bandwidth", action="store_true",
                        help="also time the noise recurrence alone (fused and unfused) against a memory copy")
    parser.add_argument("--memory-batch-sizes", nargs="*", type=int, default=[],
                        help="also report each configuration's peak step memory at these batch sizes")
    parser.add_argument("--onednn", choices=("default", "0", "1", "both"), default="default",
                        help="TF_ENABLE_ONEDNN_OPTS for the run; 'both' runs 0 and 1 as child processes")
    args = parser.parse_args(argv)
    if args.onednn == "both":
        return run_both_kernel_paths(sys.argv[1:] if argv is None else list(argv))
    if args.onednn != "default" and os.environ.get("TF_ENABLE_ONEDNN_OPTS") != args.onednn:
        raise SystemExit(f"--onednn {args.onednn} must be set before TensorFlow starts: "
                         f"run with TF_ENABLE_ONEDNN_OPTS={args.onednn} or --onednn both")
    from keras_noisecurve.backend.tensorflow import engine_rules

    print(f"TF_ENABLE_ONEDNN_OPTS={os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(unset)')}: ghost conv rule takes "
          f"{engine_rules.conv_chunk(tf.float32)} example(s) per Conv2DBackpropFilter", flush=True)

    if args.clipping is not None:
        for table in (CONFIGS, STRATEGY_CONFIGS):
            for name, config in table.items():
                if config is not None and name != "ghost":
                    table[name] = {**config, "clipping": args.clipping}
    planned = max(args.warmup + args.repeats * args.steps + 1, 64)
    rng = np.random.default_rng(0)
    for model_name in args.models:
        shape = MODELS[model_name][1]
        x = tf.constant(rng.normal(size=(args.batch_size, *shape)).astype("float32"))
        y = tf.constant(rng.integers(0, 10, args.batch_size))
        if args.strategies:
            compare_strategies(model_name, x, y, args, planned)
        if args.noise_bandwidth:
            noise_bandwidth(model_name, args.repeats)
        if not args.configs:
            continue
        runs = {}
        for name in args.configs:
            model = build(model_name, CONFIGS[name], args.batch_size, planned)
            step = step_function(model)
            for _ in range(args.warmup):
                step(x, y)
            runs[name] = (model, step)
        peaks = {name: peak_step_memory(step, x, y) for name, (_, step) in runs.items()}
        times = {name: [] for name in runs}
        names = list(runs)
        for r in range(args.repeats):
            shift = r % len(names)  # rotate the order: no configuration always runs first
            for name in names[shift:] + names[:shift]:
                step = runs[name][1]
                start = time.perf_counter()
                for _ in range(args.steps):
                    out = step(x, y)
                float(out["loss"])  # wait for the last step
                times[name].append((time.perf_counter() - start) / args.steps)
            print(f"[{model_name}] round {r + 1}/{args.repeats} done", flush=True)
        params = runs[args.configs[0]][0].count_params()
        print(f"\n== {model_name}: {params} parameters, batch {args.batch_size} ==")
        median = {name: float(np.median(t)) for name, t in times.items()}
        for name, t in median.items():
            opt = runs[name][0].optimizer
            mem = opt.noise_state_bytes() if hasattr(opt, "noise_state_bytes") else 0
            print(f"{name:>12}: {1000 * t:8.1f} ms/step   noise state {mem:>10,d} bytes")
        for name, peak in peaks.items():
            if peak is not None:
                print(f"{name:>12}: peak step memory {peak / 2**20:8.1f} MiB (CPU allocator stats)")
        if "non-private" in median and "ghost" in median:
            target = 1.6 if model_name == "cnn" else 1.5
            # paired: each round's ratio (the two ran seconds apart), median over rounds
            paired = float(np.median(np.array(times["ghost"]) / np.array(times["non-private"])))
            print(f"ghost / non-private: {median['ghost'] / median['non-private']:.2f}x; paired by round "
                  f"{paired:.2f}x (target <= {target})")
        if "non-private" in median and "dpsgd" in median:
            print(f"DP-SGD / non-private: {median['dpsgd'] / median['non-private']:.2f}x (target <= 2.5 on the CNN)")
        for name in median:
            if name in NOISE_TARGETS and "dpsgd" in median:
                # paired: the ratio within each round (the two ran seconds apart), median over
                # rounds; steadier than the ratio of medians when other processes load the CPU
                paired = float(np.median(np.array(times[name]) / np.array(times["dpsgd"])))
                print(f"{name} / DP-SGD: {median[name] / median['dpsgd']:.3f}x; paired by round {paired:.3f}x "
                      f"(target <= {NOISE_TARGETS[name]})")
        update_plan = args.repeats * 20 + 64
        updates = time_updates(model_name, args.batch_size, args.repeats, 20,
                               mixings=[("dpsgd", "dpsgd")] + [(n, config_mixing(CONFIGS[n], update_plan))
                                                               for n in names if CONFIGS[n] is not None
                                                               and n not in ("ghost", "dpsgd")])
        if "ghost" in args.configs:
            engine = time_ghost_engine(model_name, x, y, args.repeats, args.steps)
            if "non-private" in median:
                # The DP-SGD noise costs the same at every batch size (one Gaussian per
                # parameter per step); run after the gradients, it bounds the ghost step
                # from below (with spare threads TensorFlow may overlap it instead).
                noise = updates["dpsgd"] - updates["sgd"]
                print(f"   noise floor ({model_name}): DP-SGD update - SGD update = {1000 * noise:.2f} ms "
                      f"= {noise / median['non-private']:.2f}x the non-private step; without overlap the ghost "
                      f"step is >= engine only + noise = {engine + noise / median['non-private']:.2f}x")
        if args.memory_batch_sizes:
            memory_by_batch(model_name, args.configs, args.memory_batch_sizes, planned)
        # Two identical compiled models can differ by ~20 % in step time on a loaded
        # machine (docs/training.md, "Performance"), which swamps the cost of the noise. The noise source changes only the optimizer update, so
        # also report banded / DP-SGD = (step_dpsgd − update_dpsgd + update_banded) / step_dpsgd.
        if "dpsgd" in median:
            for name in median:
                if name in NOISE_TARGETS and name in updates:
                    derived = (median["dpsgd"] - updates["dpsgd"] + updates[name]) / median["dpsgd"]
                    print(f"{name} / DP-SGD from the update cost: {derived:.3f}x "
                          f"(target <= {NOISE_TARGETS[name]})")
    return 0


def run_both_kernel_paths(argv) -> int:
    """Run this benchmark with ``TF_ENABLE_ONEDNN_OPTS=0`` then ``=1``; print both ratio summaries."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--onednn":
            skip = True
        elif not a.startswith("--onednn="):
            rest.append(a)
    summaries = {}
    for value in ("0", "1"):
        print(f"\n######## TF_ENABLE_ONEDNN_OPTS={value} ########", flush=True)
        env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": value}
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--onednn", value],
                              env=env, stdout=subprocess.PIPE, text=True)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            return proc.returncode
        summaries[value] = [line for line in proc.stdout.splitlines()
                            if line.startswith("==") or "x (target" in line or "per Conv2DBackpropFilter" in line
                            or "engine only" in line]
    print("\n######## both kernel paths, side by side ########")
    for value, lines in summaries.items():
        print(f"-- TF_ENABLE_ONEDNN_OPTS={value}")
        for line in lines:
            print("   " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
