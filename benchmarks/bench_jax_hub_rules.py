"""The LoRA, RMS-norm and KerasHub-embedding kernels on JAX (``backend/common/ghost_lora.py``,
``ghost_scale.py``, ``ghost_embedding.py``) against the per-layer fallback, in one process:
a private DP-SGD step (``clipping="ghost"``) of a tiny KerasHub Gemma with its tied output head,
traced once with every rule ("with the hub rules") and once with only the rules of ``BASE``
(Dense, EinsumDense, Embedding, LayerNormalization, GroupNormalization: ReversibleEmbedding, the
RMS norms and LoRA layers then go through the fallback), and a plain Keras step; the steps are
timed interleaved (plain, with, without, plain, ...) so that a loaded machine's drift hits all
three alike. Median step times in ms and the ratio to the plain step.

    KERAS_BACKEND=jax PYTHONPATH=. python benchmarks/bench_jax_hub_rules.py [--lora]
"""
import argparse
import os
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

from keras_noisecurve import NoiseCurveOptimizer, make_private  # noqa: E402
from keras_noisecurve.backend.common import kernel_rules  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--length", type=int, default=32)
parser.add_argument("--vocabulary", type=int, default=8000)
parser.add_argument("--dim", type=int, default=64)
parser.add_argument("--lora", action="store_true", help="backbone.enable_lora(4) (only the LoRA factors train)")
args = parser.parse_args()
B, L, V, D = args.batch, args.length, args.vocabulary, args.dim


def model():
    """A 2-layer Gemma backbone and its tied output head (the token embedding's reverse call)."""
    keras.utils.set_random_seed(0)
    bb = keras_hub.models.GemmaBackbone(vocabulary_size=V, num_layers=2, hidden_dim=D, intermediate_dim=2 * D,
                                        num_query_heads=4, num_key_value_heads=1, head_dim=D // 4)
    ids = keras.Input((L,), dtype="int32", name="token_ids")
    mask = keras.Input((L,), dtype="int32", name="padding_mask")
    h = bb({"token_ids": ids, "padding_mask": mask})
    if args.lora:
        bb.enable_lora(4)
    return keras.Model({"token_ids": ids, "padding_mask": mask}, bb.token_embedding(h, reverse=True))


rng = np.random.default_rng(0)
x = {"token_ids": rng.integers(0, V, (B, L)).astype("int32"), "padding_mask": np.ones((B, L), "int32")}
y = rng.integers(0, V, (B, L)).astype("int32")
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
plain = model()
plain.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
models = {"plain": plain}
full = kernel_rules.RULES
BASE = ("Dense", "EinsumDense", "Embedding", "LayerNormalization", "GroupNormalization")
base = tuple(rule for rule in full if rule[0] in BASE)
for name, rules in (("with the hub rules", full), ("without (fallback)", base)):
    m = make_private(model(), clipping="ghost")
    m.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.01, noise_multiplier=1.0, l2_norm_clip=1.0,
                                            expected_batch_size=B, seed=0), loss=loss)
    kernel_rules.RULES = rules
    try:
        m.train_on_batch(x, y)  # traced and compiled with these rules
    finally:
        kernel_rules.RULES = full
    models[name] = m
times = {k: [] for k in models}
for _ in range(4):
    for k, m in models.items():
        m.train_on_batch(x, y)
        for _ in range(3):
            start = time.perf_counter()
            m.train_on_batch(x, y)
            times[k].append(time.perf_counter() - start)
print(f"tiny Gemma + tied head{' + LoRA' if args.lora else ''}, B={B}, L={L}, d={D}, vocab {V}, 2 layers; "
      "median of 12 interleaved steps")
for k, v in times.items():
    print(f"{k}: {1e3 * np.median(v):.1f} ms ({np.median(v) / np.median(times['plain']):.2f}x plain)")
