"""Noise throughput: normals per second of this library's JAX draw beside XLA's and
TensorFlow's own generators, same sizes, one run.

Rows (each jitted, float32, the time of one call ended by ``jax.block_until_ready``):

- ``keras-noisecurve, one variable``: ``keras_noisecurve.backend.jax.noise.standard_normal``
  (z_t of one variable: Philox-4×32-10 + Box–Muller, bit for bit TensorFlow's Philox
  words), traced step and index;
- ``keras-noisecurve, 10 variables``: the same number of normals split into 10 variables
  of one step, ``variable_normals(step_seed(key, t), shapes)`` (what the optimizer draws
  per step);
- ``jax.random.normal (threefry)``: JAX's default generator;
- ``lax.rng_bit_generator (RNG_PHILOX), uint32``: XLA's own Philox, n uint32 words (not
  TensorFlow's stream: JAX's key/counter layout cannot hold TensorFlow's counter), and
  ``+ Box–Muller``: those words turned into n normals the way this library does;
- ``tf.random.stateless_normal (philox)``: TensorFlow's stateless normal in a
  ``tf.function`` (without and with XLA), where TensorFlow imports; else one line says it
  is skipped.

The ratio column is throughput / ``jax.random.normal``'s at the same size; "first call"
is the first call of a fresh function (tracing + compilation + one run). Repeats are
interleaved in rotating order, so that load from other processes hits every row alike;
each cell is the median::

    KERAS_BACKEND=jax python benchmarks/bench_noise.py                    # 1M and 16M normals
    KERAS_BACKEND=jax python benchmarks/bench_noise.py --sizes 1000000 --repeats 9 --no-tensorflow
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package

REFERENCE = "jax.random.normal (threefry)"


def _box_muller(words, n):
    """n float32 normals from n uint32 words: radius words first, angle words second."""
    import jax.numpy as jnp

    half = (n + 1) // 2
    u = (words[:half].astype(jnp.float32) + 0.5) * (2.0**-32)
    radius = jnp.sqrt(-2.0 * jnp.log(u))
    theta = words[half:2 * half].astype(jnp.float32) * (2.0 * math.pi * 2.0**-32)
    return jnp.concatenate([radius * jnp.cos(theta), radius * jnp.sin(theta)])[:n]


def jax_rows(n):
    """{row name: (function, args)} of the JAX generators for n normals (fresh jits)."""
    import jax
    import jax.numpy as jnp

    from keras_noisecurve.backend.jax import noise
    from keras_noisecurve.training.noise import key_from_seed

    words = jnp.asarray(noise.key_words(key_from_seed(0)))
    step, index = jnp.int32(7), jnp.int32(3)
    parts = [n // 10 + (1 if k < n % 10 else 0) for k in range(10)]
    state = jnp.asarray([1, 2, 3, 4], jnp.uint32)
    philox = jax.lax.RandomAlgorithm.RNG_PHILOX
    bits = lambda s, m: jax.lax.rng_bit_generator(s, (m,), dtype=jnp.uint32, algorithm=philox)[1]  # noqa: E731
    return {
        "keras-noisecurve, one variable": (jax.jit(lambda k, t, i: noise.standard_normal(k, t, i, (n,))),
                                           (words, step, index)),
        "keras-noisecurve, 10 variables": (
            jax.jit(lambda k, t: noise.variable_normals(noise.step_seed(k, t), [(m,) for m in parts])), (words, step)),
        REFERENCE: (jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32)), (jax.random.key(0),)),
        "lax.rng_bit_generator (RNG_PHILOX), uint32": (jax.jit(lambda s: bits(s, n)), (state,)),
        "lax.rng_bit_generator (RNG_PHILOX) + Box–Muller": (
            jax.jit(lambda s: _box_muller(bits(s, 2 * ((n + 1) // 2)), n)), (state,)),
    }


def tensorflow_rows(n):
    """The TensorFlow rows, or a string saying why there are none."""
    try:
        import tensorflow as tf
    except ImportError as exc:  # also a blocked import (sys.modules["tensorflow"] = None)
        return f"tf.random.stateless_normal: skipped, TensorFlow does not import ({type(exc).__name__})"
    seed = tf.constant([7, 3], tf.int64)

    def make(jit):
        @tf.function(jit_compile=jit)
        def draw(s):
            return tf.random.stateless_normal([n], s, dtype=tf.float32, alg="philox")

        return draw, (seed,)

    return {"tf.random.stateless_normal (philox)": make(False),
            "tf.random.stateless_normal (philox), XLA": make(True)}


def _sync(value):
    import jax

    if hasattr(value, "numpy") and not hasattr(value, "block_until_ready"):  # a TensorFlow tensor
        return value.shape
    return jax.block_until_ready(value)


def time_rows(rows, repeats):
    """{name: (first call s, median s)}: the first call of each, then ``repeats`` rounds
    in rotating order."""
    first, times = {}, {name: [] for name in rows}
    for name, (function, args) in rows.items():
        start = time.perf_counter()
        _sync(function(*args))
        first[name] = time.perf_counter() - start
    names = list(rows)
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            function, args = rows[name]
            start = time.perf_counter()
            _sync(function(*args))
            times[name].append(time.perf_counter() - start)
    return {name: (first[name], float(np.median(times[name]))) for name in names}


def table(results, sizes):
    """The markdown table: one row per generator, per size time, M normals/s, ratio."""
    names = list(dict.fromkeys(name for n in sizes for name in results[n]))
    head = "| generator | " + " | ".join(f"{_count(n)}: ms | M/s | × threefry | first call s" for n in sizes) + " |"
    lines = [head, "|---|" + "---|---|---|---|" * len(sizes)]
    for name in names:
        cells = []
        for n in sizes:
            if name not in results[n]:
                cells.append("– | – | – | –")
                continue
            first, seconds = results[n][name]
            reference = results[n].get(REFERENCE)
            ratio = f"{reference[1] / seconds:.2f}" if reference else "–"
            cells.append(f"{1e3 * seconds:.2f} | {n / seconds / 1e6:.1f} | {ratio} | {first:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _count(n):
    if n % 10**6 == 0:
        return f"{n // 10**6}M"
    return f"{n // 1000}k" if n % 1000 == 0 else str(n)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 16_000_000], help="normals per draw")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per row and size (median)")
    parser.add_argument("--no-tensorflow", action="store_true", help="leave TensorFlow's rows out")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.sizes) or args.repeats < 1:
        parser.error(f"sizes and repeats must be positive, got {args.sizes} and {args.repeats}")

    import jax

    print("# bench_noise, normals/s")
    print(f"devices: {', '.join(f'{d.platform}:{d.device_kind}' for d in jax.devices())}; "
          f"{os.cpu_count()} CPU cores; {platform.machine()}")
    print(f"jax {jax.__version__}, python {platform.python_version()}; median of {args.repeats} calls, "
          "interleaved; first call = trace + compile + run")
    results, notes = {}, []
    for n in args.sizes:
        rows = jax_rows(n)
        if not args.no_tensorflow:
            tf_rows = tensorflow_rows(n)
            if isinstance(tf_rows, str):
                notes.append(tf_rows)
            else:
                rows.update(tf_rows)
        results[n] = time_rows(rows, args.repeats)
    if args.no_tensorflow:
        notes.append("tf.random.stateless_normal: skipped (--no-tensorflow)")
    print()
    print("\n".join(table(results, args.sizes)))
    for note in dict.fromkeys(notes):
        print(note)
    return results


if __name__ == "__main__":
    main()
