"""The recurrent ghost kernel (``backend/common/ghost_rnn.py``) on JAX against the per-layer fallback, in one
process: the clipping step alone (``ghost_clipped_sum``, jitted: per-example norms and the clipped
sum) of a small text classifier ``Embedding(vocab, d) → LSTM|GRU|SimpleRNN(n) → Dense(2)``, traced
once with every rule ("rule") and once without the recurrent rule (the recurrent layer then goes
through the exact per-layer fallback, ``jax.vmap`` of its VJP), and a plain ``jax.grad`` of the
summed loss for scale. The three are timed interleaved (plain, rule, fallback, plain, ...) so that a
loaded machine's drift hits them alike; the two clipped sums are checked to agree first. Median
step times in ms over 5 rounds of 5 calls.

    KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/bench_jax_rnn_rule.py --cell lstm --batch 32 --length 16
"""
import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_noisecurve.backend.common import ghost_rnn  # noqa: E402
from keras_noisecurve.backend.common import kernel_rules  # noqa: E402
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum  # noqa: E402

CELLS = {"lstm": keras.layers.LSTM, "gru": keras.layers.GRU, "simple": keras.layers.SimpleRNN}
parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--cell", choices=sorted(CELLS), default="lstm")
parser.add_argument("--batch", type=int, default=32)
parser.add_argument("--length", type=int, default=16)
parser.add_argument("--units", type=int, default=32)
parser.add_argument("--dim", type=int, default=32, help="embedding width d")
parser.add_argument("--vocabulary", type=int, default=1000)
args = parser.parse_args()
B, L = args.batch, args.length

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((L,), dtype="int32"), keras.layers.Embedding(args.vocabulary, args.dim),
                          CELLS[args.cell](args.units), keras.layers.Dense(2)])
rng = np.random.default_rng(0)
x = jnp.asarray(rng.integers(0, args.vocabulary, (B, L)).astype("int32"))
y = jnp.asarray(rng.integers(0, 2, (B,)).astype("int32"))
w = jnp.ones((B,), jnp.float32)
tv = [v.value for v in model.trainable_variables]
ntv = [v.value for v in model.non_trainable_variables]


def loss_fn(y_true, y_pred):
    return keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def clip_step():
    return jax.jit(lambda tv, ntv, x, y, w: ghost_clipped_sum(
        model, loss_fn, tv, ntv, x, y, w, l2_norm_clip=1.0, clipping="ghost")[:2])


def plain_loss(tv, ntv, x, y):
    pred, _ = model.stateless_call(tv, ntv, x, training=True)
    return jnp.sum(loss_fn(y, pred))


steps = {"plain grad": jax.jit(jax.grad(plain_loss))}
full = kernel_rules.RULES
for name, rules in (("rule", full), ("fallback", tuple((k, r) for k, r in full if r is not ghost_rnn.recurrent))):
    step = clip_step()
    kernel_rules.RULES = rules
    try:
        jax.block_until_ready(step(tv, ntv, x, y, w))  # traced and compiled with these rules
    finally:
        kernel_rules.RULES = full
    steps[name] = step
(s_rule, n_rule), (s_fb, n_fb) = steps["rule"](tv, ntv, x, y, w), steps["fallback"](tv, ntv, x, y, w)
np.testing.assert_allclose(np.asarray(n_rule), np.asarray(n_fb), rtol=1e-4)
for a, b in zip(s_rule, s_fb):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
arguments = {"plain grad": (tv, ntv, x, y)}
times = {k: [] for k in steps}
for _ in range(5):
    for k, step in steps.items():
        a = arguments.get(k, (tv, ntv, x, y, w))
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(step(*a))
            times[k].append(time.perf_counter() - start)
print(f"{args.cell.upper()}({args.units}) on Embedding({args.vocabulary}, {args.dim}), B={B}, L={L}, "
      f"{jax.devices()[0].platform}; median of 25 interleaved calls")
for k, v in times.items():
    print(f"{k}: {1e3 * np.median(v):.2f} ms ({np.median(v) / np.median(times['plain grad']):.2f}x plain grad)")
