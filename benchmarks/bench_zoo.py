"""Private / non-private step time of models the library did not write (the test zoo).

Every model of ``tests/training/zoo.py`` — KerasHub BERT, GPT-2, Llama and Gemma (with
and without LoRA), LSTM and GRU classifiers, a GroupNorm ResNet, an embedding-heavy
recommender, attention next to a custom layer — is built at a benchmark size and timed
in ONE process: the non-private step (Keras ``train_step`` with SGD) and the private
step (``make_private`` with ``clipping="auto"``, DP-SGD noise), interleaved over
``--repeats`` rounds; the median per-step times and their ratio are printed, with the
layers the per-layer fallback clips (``generic``) and, for the embedding-heavy model,
the share of the step taken by the optimizer's noisy update alone (one Gaussian per
parameter, over the whole tables).

    python benchmarks/bench_zoo.py --batch-size 32 --repeats 5 --steps 5
    python benchmarks/bench_step.py --zoo          # the same, through bench_step
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.training.zoo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_zoo_conv

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_noisecurve.training import NoiseCurveOptimizer, make_private  # noqa: E402
from keras_noisecurve.backend.tensorflow.ghost import plan  # noqa: E402
from keras_noisecurve.backend.tensorflow.engine_fallback import GenericRule  # noqa: E402
from tests.training import zoo  # noqa: E402
from tests.training import zoo_extra, zoo_norms  # noqa: E402
from bench_zoo_conv import CONV_TARGETS, CONV_ZOO  # noqa: E402  (benchmark-only convolution models)

#: every model this benchmark builds: the test zoo, T5, the norms recognised by computation +
#: TimeDistributed, and the benchmark-only convolutions
MODELS = {**zoo.ZOO, "t5": zoo_extra.t5_seq2seq, **zoo_norms.NORMS, **CONV_ZOO}

#: targets of private / non-private on this CPU, by model
TARGETS = {"bert": 1.5, "bert-lora": 1.5, "gpt2-lm": 1.5, "gpt2-lm-lora": 1.5, "llama-lm": 1.5,
           "llama-lm-lora": 1.5, "gemma-lm": 1.5, "gemma-lm-lora": 1.5, "attention-custom": 1.5, "groupnorm-resnet": 1.6,
           "lstm": 3.0, "gru": 3.0}
TARGETS.update({"t5": 1.5, "qwen3-lm": 1.5, "phi3-lm": 1.5, "qwen-lm": 1.5, "timedistributed": 1.5})
TARGETS.update(CONV_TARGETS)


def _steps(name, size, batch):
    rng = np.random.default_rng(0)
    keras.utils.set_random_seed(0)
    plain = MODELS[name](rng, size=size)
    plain.model.compile(optimizer=keras.optimizers.SGD(0.01), loss=plain.loss, jit_compile=False)
    keras.utils.set_random_seed(0)
    case = MODELS[name](np.random.default_rng(0), size=size)
    private = make_private(case.model)
    optimizer = NoiseCurveOptimizer(learning_rate=0.01, mixing="dpsgd", l2_norm_clip=1.0, noise_multiplier=1.0,
                                    expected_batch_size=batch)
    private.compile(optimizer=optimizer, loss=case.loss)
    x, y = case.x, case.y

    def timed(model):
        step = tf.function(lambda x, y: model.train_step((x, y)), reduce_retracing=True)
        return lambda: step(x, y)

    return timed(plain.model), timed(private), private, case.model


def update_time(private, repeats=20):
    """Seconds of the optimizer's noisy update alone (a zero clipped sum): the DP-SGD noise
    over every trainable weight plus the SGD step, the floor of a private step."""
    variables = private.trainable_variables
    zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
    update = tf.function(lambda: private.optimizer.apply_clipped_sum(zeros, variables))
    update()
    start = time.perf_counter()
    for _ in range(repeats):
        update()
    float(tf.reduce_sum(variables[0]))
    return (time.perf_counter() - start) / repeats


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(zoo.ZOO), choices=sorted(MODELS),
                        help="default: the test zoo; the convolution models (bench_zoo_conv.py) by name")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence (image side: 16)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"TF {tf.__version__}, Keras {keras.__version__}, TF_ENABLE_ONEDNN_OPTS="
          f"{os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(unset)')}, B = {args.batch_size}", flush=True)
    rows = []
    for name in args.models:
        length = 16 if name == "groupnorm-resnet" else args.length
        size = zoo.Size(batch=args.batch_size, length=length, vocab=args.vocab, width=args.width)
        plain, private, model, inner = _steps(name, size, args.batch_size)
        for step in (plain, private, plain, private):  # trace and warm up
            step()
        times = {"plain": [], "private": []}
        for r in range(args.repeats):
            for key, step in (("plain", plain), ("private", private))[:: 1 if r % 2 else -1]:
                start = time.perf_counter()
                for _ in range(args.steps):
                    out = step()
                float(out["loss"])
                times[key].append((time.perf_counter() - start) / args.steps)
        t = {k: float(np.median(v)) for k, v in times.items()}
        generic = [f"{layer.name} ({type(layer).__name__})" for layer, rule, _ in plan(inner)
                   if isinstance(rule, GenericRule)]
        share = update_time(model) / t["private"] if name == "recommender" else None
        rows.append((name, inner.count_params(), t, generic, share))
        print(f"[{name}] plain {1000 * t['plain']:.1f} ms, private {1000 * t['private']:.1f} ms, "
              f"{t['private'] / t['plain']:.2f}x", flush=True)
    print("\n| model | parameters | non-private ms | private ms | ratio | target | per-layer fallback |")
    print("|---|---|---|---|---|---|---|")
    for name, params, t, generic, share in rows:
        extra = ", ".join(generic) or "—"
        if share is not None:
            extra += f"; the noisy update alone = {share:.0%} of the private step"
        target = TARGETS.get(name)
        print(f"| {name} | {params:,} | {1000 * t['plain']:.1f} | {1000 * t['private']:.1f} | "
              f"{t['private'] / t['plain']:.2f}x | {'≤ %.1fx' % target if target else '—'} | {extra} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
