"""Step times of private training on the Keras JAX backend, for a GPU (or any JAX device).

One command, one table. For six models (issue 31's: an MLP 784-512-512-10 at B = 1024, a
GroupNorm CNN on 28×28×1 at B = 512, a one-block transformer of 0.84M parameters at
L = 64, B = 256, and a 2-block transformer of 14.5M parameters, d = 512, 8 heads,
vocabulary 16000, at L = 128, B = 64, all built from plain Keras layers below; and
KerasHub's GPT-2 124M causal LM, built from its config without weights, at B = 16, L = 128
(``gpt2``) and B = 32, L = 256 (``gpt2_long``), next-token loss over every position) it
times one training step of:

- ``plain``: the model compiled with ``keras.optimizers.SGD`` and run by Keras's own JAX
  trainer (``train_on_batch``, jitted);
- ``DP-SGD``, ``banded b=16``, ``BLT d=4``: this library's private step through the public
  API (``knc.make_private(model)`` compiled with ``knc.NoiseCurveOptimizer(mixing=...,
  noise_multiplier=1, l2_norm_clip=1, expected_batch_size=B)``), C = I, a random banded C
  with 16 bands, a BLT strategy with 4 buffers;
- ``jax_privacy``: jax_privacy's Keras API (``jax_privacy.keras_api.make_private`` in
  jax-privacy 2.0, ``jax_privacy.keras.keras_api`` before it; DP-SGD) when that package is
  installed, else "not installed";
- ``DP-SGD, vectorized clipping``: DP-SGD with ``make_private(model, clipping="vectorized")``
  (per-example gradients of the whole model by ``jax.vmap``) instead of the default
  per-layer ghost norms (``clipping="auto"``, :mod:`keras_noisecurve.backend.jax.ghost`).

The GPT-2 rows run plain, DP-SGD, banded and jax_privacy unless ``--configs`` names others
(their first steps compile in 12 s, 23 s and 37 s for plain, DP-SGD and banded on a 2-core
CPU: each configuration more is about half a minute).

Each cell is the median of ``--repeats`` single steps after ``--warmup`` steps, each step
ended by a host sync (the logs ``train_on_batch`` returns are host numbers, and the first
trainable variable is waited on with ``jax.block_until_ready``); the configurations of one
model are interleaved (rotating order) so that drift of the device's clocks hits them
alike. Private cells show the ratio to the plain step of the same run. A configuration
that fails prints its error in its cell; the table always prints.

Two more tables follow, same models and configurations: the **time to the first step** (the
first ``train_on_batch`` of a fresh model: tracing, compilation and one step; the plain step's
ratio beside each), and the **memory of one step** as XLA plans it: the step compiled alone
(``jax.jit(model.train_step, donate_argnums=0)`` on the state Keras's trainer passes) and its
``memory_analysis()``: arguments + outputs + temporaries − the donated buffers updated in place,
in MiB (``--no-memory`` skips that extra compilation), and where that compilation's time goes:
tracing (``lower``: Keras and this library build the step in Python) and XLA's ``compile``,
each timed alone. The ghost engine needs no per-example
gradient of the whole model, so its step should plan about the plain step's memory plus
per-layer terms; the vectorized engine's holds P copies of the gradient. On a GPU the
footer adds the device's own ``peak_bytes_in_use``.

The last row is the noise recurrence alone: one banded step (b = 16) of
z̃_t = (z_t − Σ_{j=1}^{b−1} c_j z̃_{t−j}) / c_0 over a ring of b − 1 float32 buffers of
124M parameters, in jax.numpy, jitted with the ring donated (updated in place), against a
plain jitted copy of the same number of bytes; both in GB/s counting bytes read and
written once ((b + 1)·p·4 bytes per step: b − 1 ring rows and z_t read, one row written).

Needs only JAX, Keras (3.15) and this package's own dependencies (numpy, scipy,
dp-accounting), and KerasHub for the GPT-2 rows; never TensorFlow::

    KERAS_BACKEND=jax python benchmarks/bench_gpu.py                 # the full table (all six models; minutes)
    KERAS_BACKEND=jax python benchmarks/bench_gpu.py --small         # tiny sizes, the first four models (~2 min on 2 CPU cores)
    KERAS_BACKEND=jax python benchmarks/bench_gpu.py --small --models gpt2 gpt2_long   # a 2-layer GPT-2
    KERAS_BACKEND=jax python benchmarks/bench_gpu.py --models mlp gn_cnn --repeats 30
    KERAS_BACKEND=jax python benchmarks/bench_gpu.py --small --max-seconds 45   # bounded (tests/e2e)

On the project's GPU machines (Python 3.12 with JAX 0.11 on CUDA, and numpy, scipy,
absl-py, rich, h5py, ml-dtypes, attrs, wrapt, mpmath, regex, tokenizers and sentencepiece
there, but no Keras, no KerasHub and no TensorFlow; KerasHub imports without TensorFlow and
kagglehub, which it needs only to download presets)
the missing wheels travel in ``.whl/`` (ignored by git: ``/.whl/`` in ``.git/info/exclude``),
filled once on a machine with pip::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
        keras==3.15.1 namex==0.1.0 optree==0.20.0 dm-tree==0.1.10 dp-accounting==0.6.0 keras-hub==0.32.0

(the machine's own ml-dtypes, h5py, rich and absl-py are left in place: a second ml-dtypes
beside jaxlib's would break it). The device command, from the repository root, with
``.whl`` carried (the GPT-2 rows first, and ``--max-seconds 300``: no private configuration is
started after 5 minutes, so that the call ends inside the device's limit however long the
compilations take there)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD KERAS_BACKEND=jax PYTHONUNBUFFERED=1 && python3 benchmarks/bench_gpu.py --models gpt2 gpt2_long mlp gn_cnn transformer_small transformer_14m --max-seconds 300 2>&1 | tee $OUT/bench_gpu.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

MODELS = ("mlp", "gn_cnn", "transformer_small", "transformer_14m", "gpt2", "gpt2_long")
SMALL_MODELS = MODELS[:4]  # --small's default: the GPT-2 rows need KerasHub and a minute more
CONFIGS = ("plain", "dpsgd", "banded16", "blt4", "jax_privacy", "dpsgd_vectorized")
HEADERS = {
    "plain": "plain Keras-JAX step",
    "dpsgd": "DP-SGD (this library)",
    "banded16": "banded b = 16",
    "blt4": "BLT d = 4",
    "jax_privacy": "jax_privacy Keras API (DP-SGD)",
    "dpsgd_vectorized": "DP-SGD, vectorized clipping",
}
# what the GPT-2 rows run unless --configs names others: the issue-31 targets (DP-SGD against
# plain, banded against DP-SGD) and the peer; the other two compile ~30 s more each (2-core CPU)
GPT2_CONFIGS = ("plain", "dpsgd", "banded16", "jax_privacy")
LEARNING_RATE = 0.05

# name -> (batch size, sizes): full and --small
SIZES = {
    "mlp": ({"batch": 1024, "width": 512}, {"batch": 64, "width": 64}),
    "gn_cnn": ({"batch": 512}, {"batch": 32}),
    "transformer_small": ({"batch": 256, "length": 64, "vocab": 5000, "dim": 128, "heads": 4, "mlp": 512, "blocks": 1},
                          {"batch": 16, "length": 16, "vocab": 500, "dim": 32, "heads": 4, "mlp": 64, "blocks": 1}),
    "transformer_14m": ({"batch": 64, "length": 128, "vocab": 16000, "dim": 512, "heads": 8, "mlp": 2048, "blocks": 2},
                        {"batch": 8, "length": 16, "vocab": 1000, "dim": 64, "heads": 8, "mlp": 128, "blocks": 2}),
}
# KerasHub's GPT-2 124M ("gpt2_base_en": 50257 tokens, 12 layers, 12 heads, d = 768, MLP 3072,
# 1024 positions; the output layer is the token embedding, tied), built from its config (no
# weights), dropout off; --small: 2 layers of d = 64 over 1000 tokens
GPT2_124M = {"vocab": 50257, "layers": 12, "heads": 12, "dim": 768, "mlp": 3072, "positions": 1024}
GPT2_TINY = {"vocab": 1000, "layers": 2, "heads": 4, "dim": 64, "mlp": 128, "positions": 64}
SIZES["gpt2"] = ({"batch": 16, "length": 128, **GPT2_124M}, {"batch": 4, "length": 16, **GPT2_TINY})
SIZES["gpt2_long"] = ({"batch": 32, "length": 256, **GPT2_124M}, {"batch": 4, "length": 32, **GPT2_TINY})
RECURRENCE = {"full": 124_000_000, "small": 1_000_000}
BANDS = 16


# ------------------------------------------------------------------------------ models
def mlp(width):
    import keras

    inp = keras.Input((784,))
    h = keras.layers.Dense(width, activation="relu")(inp)
    h = keras.layers.Dense(width, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h), name="mlp")


def gn_cnn():
    """Conv 16@8×8/2, max-pool 2/1, GroupNorm(4), Conv 32@4×4/2, max-pool 2/1, Dense 32, Dense 10
    on 28×28×1 (26,042 parameters)."""
    import keras

    inp = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu")(inp)
    h = keras.layers.MaxPooling2D(2, strides=1)(h)
    h = keras.layers.GroupNormalization(groups=4)(h)
    h = keras.layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu")(h)
    h = keras.layers.MaxPooling2D(2, strides=1)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    return keras.Model(inp, keras.layers.Dense(10)(h), name="gn_cnn")


def transformer(*, length, vocab, dim, heads, mlp, blocks, **_):
    """Embedding → blocks × (multi-head self-attention + residual + LayerNorm, GELU MLP +
    residual + LayerNorm) → mean over positions → Dense 2 (no positional embedding)."""
    import keras

    inp = keras.Input((length,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(inp)
    for _ in range(blocks):
        a = keras.layers.MultiHeadAttention(heads, dim // heads)(h, h)
        h = keras.layers.LayerNormalization()(h + a)
        f = keras.layers.Dense(mlp, activation="gelu")(h)
        f = keras.layers.Dense(dim)(f)
        h = keras.layers.LayerNormalization()(h + f)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(2)(h), name="transformer")


def gpt2(*, vocab, layers, heads, dim, mlp, positions, **_):
    """KerasHub's ``GPT2CausalLM`` (no preprocessor) on a ``GPT2Backbone`` of this config, built
    without weights: token ids and padding mask in, next-token logits (B, L, vocab) out."""
    import keras_hub

    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocab, num_layers=layers, num_heads=heads,
                                             hidden_dim=dim, intermediate_dim=mlp, max_sequence_length=positions,
                                             dropout=0.0)
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def build_model(name, size):
    if name == "mlp":
        return mlp(size["width"])
    if name == "gn_cnn":
        return gn_cnn()
    if name.startswith("gpt2"):
        return gpt2(**size)
    return transformer(**size)


def batch_data(name, size, rng):
    b = size["batch"]
    if name == "mlp":
        return rng.normal(size=(b, 784)).astype(np.float32), rng.integers(0, 10, size=b).astype(np.int32)
    if name == "gn_cnn":
        return rng.normal(size=(b, 28, 28, 1)).astype(np.float32), rng.integers(0, 10, size=b).astype(np.int32)
    x = rng.integers(0, size["vocab"], size=(b, size["length"])).astype(np.int32)
    if name.startswith("gpt2"):  # a language model's batch: every token real, the next token its label
        ids = x + (x == 0)
        return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, axis=1)
    return x, rng.integers(0, 2, size=b).astype(np.int32)


# ------------------------------------------------------------------------------ mixings
def banded_mixing(steps, bands, seed=0):
    """A valid T×T b-banded C (random band, positive diagonal, unit columns)."""
    from keras_noisecurve import MixingMatrix

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


def blt_mixing(steps, buffers=4):
    from keras_noisecurve import BLTMixing

    theta = np.array([0.99, 0.9, 0.6, 0.2, 0.05, 0.01])[:buffers]
    return BLTMixing(theta=theta, omega=np.full(buffers, 0.1), steps=steps, metadata={"objective": "benchmark"})


# ------------------------------------------------------------------------------ steps
def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _jax_privacy_keras_api():
    """jax_privacy's Keras API module: ``jax_privacy.keras_api`` (jax-privacy 2.0), else
    ``jax_privacy.keras.keras_api`` (older releases); ImportError when neither imports."""
    try:
        from jax_privacy import keras_api
    except ImportError as new_layout:
        try:
            from jax_privacy.keras import keras_api
        except ImportError:
            raise new_layout from None
    return keras_api


def compiled(name, config, size, steps_planned):
    """A model of ``name`` compiled for ``config``, ready for ``train_on_batch``."""
    import keras

    model = build_model(name, size)
    batch = size["batch"]
    if config == "plain":
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=_loss())
        return model
    if config == "jax_privacy":
        keras_api = _jax_privacy_keras_api()  # optional; ImportError -> "not installed"

        params = keras_api.DPKerasConfig(
            epsilon=8.0, delta=1e-5, clipping_norm=1.0, batch_size=batch, gradient_accumulation_steps=1,
            train_steps=steps_planned, train_size=batch * steps_planned, seed=0,
        )
        model = keras_api.make_private(model, params)
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=_loss())
        return model
    import keras_noisecurve as knc

    mixing = {"dpsgd": lambda: "dpsgd", "banded16": lambda: banded_mixing(steps_planned, BANDS),
              "blt4": lambda: blt_mixing(steps_planned, 4), "dpsgd_vectorized": lambda: "dpsgd"}[config]()
    private = knc.make_private(model, clipping="vectorized" if config == "dpsgd_vectorized" else "auto")
    private.compile(
        optimizer=knc.NoiseCurveOptimizer(learning_rate=LEARNING_RATE, mixing=mixing, l2_norm_clip=1.0,
                                          noise_multiplier=1.0, expected_batch_size=batch, seed=0),
        loss=_loss(),
    )
    return private


def step_fn(model, x, y):
    import jax

    def step():
        logs = model.train_on_batch(x, y, return_dict=True)
        jax.block_until_ready(model.trainable_variables[0].value)
        return logs

    return step


def step_compile(model, x, y):
    """The jitted ``train_step`` of ``model`` on ``(x, y)``, as Keras's JAX trainer calls it (state
    donated), lowered and compiled alone: ``{"trace": s, "compile": s, "bytes": int or None}``,
    the seconds of ``lower`` (tracing: Keras and this library build the step in Python) and of
    ``compile`` (XLA), and the bytes XLA plans for one step: arguments + outputs + temporaries −
    aliased (``memory_analysis()``; ``None`` where the platform reports none)."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    jax.clear_caches()  # traced and compiled anew, as a fresh model's first step (a cached plain step costs 0 s)
    start = time.perf_counter()
    lowered = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y, None))
    traced = time.perf_counter()
    executable = lowered.compile()
    done = time.perf_counter()
    analysis = executable.memory_analysis()
    planned = None if analysis is None else int(
        analysis.argument_size_in_bytes + analysis.output_size_in_bytes + analysis.temp_size_in_bytes
        - analysis.alias_size_in_bytes)
    return {"trace": traced - start, "compile": done - traced, "bytes": planned}


def _short(exc) -> str:
    if isinstance(exc, ImportError) and "jax_privacy" in str(exc):
        return "not installed"
    text = f"{type(exc).__name__}: {exc}".replace("|", "/").replace("\n", " ")
    return text[:90] + ("…" if len(text) > 90 else "")


def time_model(name, size, configs, *, warmup, repeats, rng, verbose, deadline=None, memory=True):
    """``(results, params, first, planned)``: {config: median seconds or an error string}, the
    parameter count, {config: seconds of the first step (compilation included)} and {config:
    :func:`step_compile`'s dict (tracing and compilation seconds, planned bytes) or an error string}. Past
    ``deadline`` (a ``time.perf_counter()`` value) only the plain step is still started."""
    x, y = batch_data(name, size, rng)
    steps_planned = max(warmup + repeats + 8, 4 * BANDS)
    runs, results, params, first, planned = {}, {}, None, {}, {}
    for config in configs:
        if deadline is not None and config != "plain" and time.perf_counter() > deadline:
            results[config] = "not run (--max-seconds)"
            continue
        try:
            model = compiled(name, config, size, steps_planned)
            step = step_fn(model, x, y)
            start = time.perf_counter()
            step()  # the first step: tracing and compilation included
            first[config] = time.perf_counter() - start
            for _ in range(warmup - 1):
                step()
            runs[config] = (model, step)
            if params is None:
                params = int(sum(int(np.prod(v.shape)) for v in model.trainable_variables))
        except Exception as exc:  # noqa: BLE001 - every failure goes into its cell
            results[config] = _short(exc)
            if verbose:
                traceback.print_exc()
    times = {config: [] for config in runs}
    names = list(runs)
    for r in range(repeats):
        shift = r % max(1, len(names))
        for config in names[shift:] + names[:shift]:
            if config in results:
                continue
            try:
                start = time.perf_counter()
                runs[config][1]()
                times[config].append(time.perf_counter() - start)
            except Exception as exc:  # noqa: BLE001
                results[config] = _short(exc)
    for config, values in times.items():
        if config not in results:
            results[config] = float(np.median(values))
    if memory:  # after the timing: step_compile clears JAX's caches, which would compile every step again
        for config, (model, _) in runs.items():
            try:
                planned[config] = step_compile(model, x, y)
            except Exception as exc:  # noqa: BLE001 - a step that cannot be compiled alone
                planned[config] = _short(exc)
    return results, params, first, planned


# ------------------------------------------------------------------------------ recurrence
def time_recurrence(p, bands, *, warmup, repeats):
    """(recurrence GB/s, copy GB/s) for one banded ring step over p float32 parameters."""
    import jax
    import jax.numpy as jnp

    slots = bands - 1
    rng = np.random.default_rng(0)
    coeffs = np.r_[1.0, 0.3 * rng.normal(size=slots)].astype(np.float32)
    order = np.array([[coeffs[1 + (t - 1 - s) % slots] for s in range(slots)] for t in range(slots)], np.float32)

    def step(ring, z, weights, t):
        # weights[s] is the coefficient of the z̃ held in ring slot s at step t (slot t mod (b−1)
        # holds z̃_{t−b+1}, the oldest, and is overwritten by z̃_t).
        return ring.at[t % slots].set((z - weights @ ring) / coeffs[0])

    ring_step = jax.jit(step, donate_argnums=(0,))
    copy = jax.jit(lambda a: a + 1.0, donate_argnums=(0,))
    nbytes = (bands + 1) * p * 4
    ring = jnp.zeros((slots, p), jnp.float32)
    z = jax.random.normal(jax.random.PRNGKey(0), (p,), jnp.float32)
    buffer = jnp.zeros(((bands + 1) * p) // 2, jnp.float32)  # read + write = nbytes
    weights = [jnp.asarray(order[t]) for t in range(slots)]
    ring_times, copy_times = [], []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        ring = jax.block_until_ready(ring_step(ring, z, weights[i % slots], i))
        middle = time.perf_counter()
        buffer = jax.block_until_ready(copy(buffer))
        end = time.perf_counter()
        if i >= warmup:
            ring_times.append(middle - start)
            copy_times.append(end - middle)
    del ring, buffer
    return nbytes / np.median(ring_times) / 1e9, nbytes / np.median(copy_times) / 1e9


# ------------------------------------------------------------------------------ table
def _cell(value, plain):
    if isinstance(value, str):
        return value
    text = f"{1000 * value:.2f} ms"
    if isinstance(plain, float) and plain > 0:
        text += f" ({value / plain:.2f}×)"
    return text


def _measured(value, plain, kind, unit):
    """A cell of the extra tables: ``value`` in ``unit`` (``"s"`` seconds, ``"MiB"`` bytes) with
    its ratio to ``plain``; an error string as it is; ``–`` for nothing."""
    if not isinstance(value, kind):
        return "–" if value is None else str(value)
    text = f"{value:.2f} s" if unit == "s" else f"{value / 2**20:.1f} MiB"
    if isinstance(plain, kind) and plain > 0:
        text += f" ({value / plain:.2f}×)"
    return text


def _seconds(value, plain):
    return _measured(value, plain, float, "s")


def _mib(value, plain):
    return _measured(value, plain, int, "MiB")


def _part(planned, config, key, failed):
    """One part of :func:`step_compile`'s result for ``config``, or its error string, or ``None``."""
    value = planned.get(config, failed.get(config))
    return value.get(key) if isinstance(value, dict) else value


def _split(value, plain):
    """A cell of the tracing/compilation table: ``"trace + compile s (a× + b×)"``."""
    if not isinstance(value, dict):
        return "–" if value is None else str(value)
    text = f"{value['trace']:.2f} + {value['compile']:.2f} s"
    if isinstance(plain, dict) and plain["trace"] > 0 and plain["compile"] > 0:
        text += f" ({value['trace'] / plain['trace']:.1f}× + {value['compile'] / plain['compile']:.1f}×)"
    return text


def _table(title, cols, rows) -> list[str]:
    return ["", title, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + [
        "| " + " | ".join(row) + " |" for row in rows]


def header_lines(args) -> list[str]:
    import jax
    import keras

    devices = ", ".join(f"{d.platform}:{getattr(d, 'device_kind', '?')}" for d in jax.devices())
    return [
        f"# bench_gpu ({'--small' if args.small else 'full sizes'}), KERAS_BACKEND={keras.backend.backend()}",
        f"devices: {devices}",
        f"jax {jax.__version__}, keras {keras.__version__}, numpy {np.__version__}, python {sys.version.split()[0]}",
        f"median of {args.repeats} steps after {args.warmup} warm-up steps; ratios to the plain step of this run",
        "",
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None,
                        help=f"default: all ({', '.join(MODELS)}); with --small the first four")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=None,
                        help=f"default: all ({', '.join(CONFIGS)}); the GPT-2 rows {', '.join(GPT2_CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per cell (default 15; 3 with --small)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --small)")
    parser.add_argument("--small", action="store_true", help="tiny sizes: the whole script in < 1 min on 2 CPU cores")
    parser.add_argument("--recurrence-params", type=int, default=None,
                        help="parameters of the recurrence row (default 124M; 1M with --small; 0 skips it)")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a failing cell")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the memory table (one more compilation of each step)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="start no private configuration after this many seconds (the plain steps and the "
                             "recurrence still run; their cells say 'not run'); default: no limit")
    args = parser.parse_args(argv)
    args.models = args.models or list(SMALL_MODELS if args.small else MODELS)
    args.repeats = args.repeats or (3 if args.small else 15)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 3)
    if args.repeats < 1 or args.warmup < 1:
        parser.error(f"--repeats and --warmup must be >= 1 (the first step is timed apart: it compiles), got "
                     f"{args.repeats} and {args.warmup}.")
    import keras

    if keras.backend.backend() != "jax":
        parser.error(f"run with KERAS_BACKEND=jax (Keras is on {keras.backend.backend()!r}).")
    rng = np.random.default_rng(0)
    started = time.perf_counter()
    lines = header_lines(args)
    configs = list(args.configs or CONFIGS)
    cols = ["model", "parameters", "B"] + [HEADERS[c] for c in configs]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    print("\n".join(lines), flush=True)
    first_rows, memory_rows, split_rows = [], [], []
    for name in args.models:
        size = SIZES[name][1 if args.small else 0]
        deadline = None if args.max_seconds is None else started + args.max_seconds
        own = [c for c in configs if args.configs or not name.startswith("gpt2") or c in GPT2_CONFIGS]
        results, params, first, planned = time_model(
            name, size, own, warmup=args.warmup, repeats=args.repeats, rng=rng, verbose=args.verbose,
            deadline=deadline, memory=args.memory)
        for c in configs:
            results.setdefault(c, "not run (name it in --configs)")
        plain = results.get("plain")
        label = name + (f" L = {size['length']}" if "length" in size else "")
        count = "?" if not params else (f"{params / 1e6:.2f}M" if params >= 100_000 else f"{params / 1e3:.1f}k")
        row = [label, count, str(size["batch"])]
        row += [_cell(results[c], plain if c != "plain" else None) for c in configs]
        print("| " + " | ".join(row) + " |", flush=True)
        failed = {c: results[c] for c in configs if isinstance(results.get(c), str)}  # the error, in every table
        first_rows.append([label] + [_seconds(first[c] if c in first else failed.get(c),
                                              first.get("plain") if c != "plain" else None) for c in configs])
        memory_rows.append([label] + [_mib(_part(planned, c, "bytes", failed),
                                           _part(planned, "plain", "bytes", {}) if c != "plain" else None)
                                      for c in configs])
        split_rows.append([label] + [_split(planned.get(c, failed.get(c)), planned.get("plain")) for c in configs])
    p = args.recurrence_params if args.recurrence_params is not None else RECURRENCE["small" if args.small else "full"]
    if p > 0:
        try:
            ring, copy = time_recurrence(p, BANDS, warmup=args.warmup, repeats=max(args.repeats, 5))
            cells = [f"ring step {ring:.0f} GB/s", f"copy {copy:.0f} GB/s", f"{100 * ring / copy:.0f} % of copy"]
        except Exception as exc:  # noqa: BLE001
            cells = [_short(exc), "", ""]
        if len(cols) - 3 < len(cells):  # few columns: one cell says it all
            cells = ["; ".join(c for c in cells if c)]
        row = [f"noise recurrence alone, b = {BANDS}", f"{p / 1e6:g}M float32", "–"] + cells
        row += [""] * (len(cols) - len(row))
        print("| " + " | ".join(row[: len(cols)]) + " |", flush=True)
    heads = ["model"] + [HEADERS[c] for c in configs]
    print("\n".join(_table("Time to the first step (tracing + compilation + one step; ratio to plain):", heads,
                           first_rows)), flush=True)
    if args.memory:
        print("\n".join(_table("Memory of one step as XLA plans it (arguments + outputs + temporaries − donated; "
                               "ratio to plain):", heads, memory_rows)), flush=True)
        print("\n".join(_table("Where the compilation goes: the step lowered (tracing, in Python) + compiled (XLA) "
                               "alone, seconds; ratios to plain:", heads, split_rows)), flush=True)
    import jax

    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    if stats and "peak_bytes_in_use" in stats:
        print(f"\ndevice peak_bytes_in_use over the whole run: {stats['peak_bytes_in_use'] / 2**20:.0f} MiB", flush=True)
    print(f"\n({time.perf_counter() - started:.0f} s; tensorflow imported: {sys.modules.get('tensorflow') is not None})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
