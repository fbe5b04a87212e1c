"""Time the JAX noise of one step: the draw z_t of every variable (Philox + Box–Muller,
``variable_normals``) and the banded ring step z̃_t = (z_t − Σ_j V[t, j]·z̃_{t−j}) / V[t, 0]
(``StreamNoise`` with ``JaxOps``, state donated so XLA writes the ring slot in place),
under ``jax.jit``, against a plain ``jnp.copy`` of the ring's bytes.

    python benchmarks/bench_jax_noise.py --parameters 10000000 --bands 16

Prints the median of ``--repeats`` calls after one warm-up (compile) call of each.
Needs only JAX (no TensorFlow).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from keras_noisecurve.backend.jax.noise import JaxOps, key_words, step_seed, variable_normals
from keras_noisecurve.training.noise import StreamNoise, key_from_seed


def _median_seconds(function, *args, repeats):
    jax.block_until_ready(function(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(function(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=10_000_000, help="model parameters (default 10M)")
    parser.add_argument("--variables", type=int, default=10, help="variables they are split into (default 10)")
    parser.add_argument("--bands", type=int, default=16, help="b of the banded C (ring of b − 1 buffers)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    size = args.parameters // args.variables
    shapes = [(size,)] * args.variables
    rng = np.random.default_rng(0)
    table = rng.uniform(-0.1, 0.1, size=(1000, args.bands))
    table[:, 0] = 1.0
    noise = StreamNoise(table, ops=JaxOps)
    key = jnp.asarray(key_words(key_from_seed(0)))
    step = jnp.int32(7)

    draw = jax.jit(lambda k, t: variable_normals(step_seed(k, t), shapes))

    def ring(t, zs, states):
        coefficients = noise.step_coefficients(t, jnp.float32)
        out, new = [], []
        for z, state in zip(zs, states):
            z_tilde, write = noise.advance(z, t, state, coefficients)
            out.append(z_tilde)
            new.append(noise.apply_write(state, write))
        return out, new

    ring_step = jax.jit(ring, donate_argnums=(2,))
    full_step = jax.jit(lambda k, t, states: ring(t, variable_normals(step_seed(k, t), shapes), states),
                        donate_argnums=(2,))
    copy = jax.jit(lambda states: [jnp.copy(s) for s in states])

    def fresh_states():
        return [jnp.zeros(noise.state_shape(shape), jnp.float32) for shape in shapes]

    zs = draw(key, step)
    timings = {"draw z_t (Philox + Box–Muller)": _median_seconds(draw, key, step, repeats=args.repeats)}
    states = fresh_states()

    def run_ring(t, zs):
        nonlocal states
        out, states = ring_step(t, zs, states)
        return out

    timings[f"ring step b = {args.bands} (given z_t)"] = _median_seconds(run_ring, step, zs, repeats=args.repeats)

    def run_full(k, t):
        nonlocal states
        out, states = full_step(k, t, states)
        return out

    timings["draw + ring step"] = _median_seconds(run_full, key, step, repeats=args.repeats)
    timings[f"jnp.copy of the ring ({args.bands - 1} × parameters floats)"] = _median_seconds(
        copy, states, repeats=args.repeats)
    ring_bytes = (args.bands - 1) * args.parameters * 4
    print(f"{args.parameters / 1e6:.1f}M parameters in {args.variables} variables, banded b = {args.bands}, "
          f"{jax.devices()[0].device_kind} ({jax.default_backend()}), median of {args.repeats}:")
    for name, seconds in timings.items():
        print(f"  {name:48s} {seconds * 1e3:9.1f} ms")
    copy_time = timings[f"jnp.copy of the ring ({args.bands - 1} × parameters floats)"]
    print(f"  ring bytes {ring_bytes / 1e6:.0f} MB; draw + ring step / copy = "
          f"{timings['draw + ring step'] / copy_time:.2f}; ring step / copy = "
          f"{timings[f'ring step b = {args.bands} (given z_t)'] / copy_time:.2f}")


if __name__ == "__main__":
    main()
