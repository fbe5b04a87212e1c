"""Time to the first step: a one-step ``fit`` of a freshly compiled model, private / non-private.

The first ``fit`` of a model traces its train step (TensorFlow builds the graph in Python,
op by op) before it runs it; for small models and short runs, e.g. every test of this
repository, tracing is most of the time. For each model of ``bench_zoo.py``'s zoo, in
ONE process: a fresh non-private model (Keras ``train_step``, SGD) and a fresh private
one (``make_private``, ``clipping="auto"``, DP-SGD noise) each run ``fit`` for one step
(B examples, one epoch), timed from the call to its return, and the number of times the
train step was traced; medians over ``--repeats`` fresh builds, interleaved.

    PYTHONPATH=. python benchmarks/bench_first_fit.py --models gpt2-lm bert efficientnetb0 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.training.zoo
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_zoo

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench_zoo import MODELS  # noqa: E402
from keras_noisecurve.training import NoiseCurveOptimizer, make_private  # noqa: E402
from tests.training import zoo  # noqa: E402


def first_fit(name, size, private):
    """(seconds of the first one-step ``fit``, traces of the train step) of a fresh model."""
    keras.utils.set_random_seed(0)
    case = MODELS[name](np.random.default_rng(0), size=size)
    if private:
        model = make_private(case.model)
        optimizer = NoiseCurveOptimizer(learning_rate=0.01, mixing="dpsgd", l2_norm_clip=1.0, noise_multiplier=1.0,
                                        expected_batch_size=size.batch)
    else:
        model, optimizer = case.model, keras.optimizers.SGD(0.01)
    model.compile(optimizer=optimizer, loss=case.loss)
    traces = []
    step = model.train_step
    model.train_step = lambda data: traces.append(1) or step(data)
    x, y = tf.nest.map_structure(lambda t: t[: size.batch], (case.x, case.y))
    start = time.perf_counter()
    model.fit(x, y, batch_size=size.batch, epochs=1, verbose=0)
    return time.perf_counter() - start, len(traces)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["gpt2-lm", "bert", "llama-lm", "efficientnetb0"],
                        choices=sorted(MODELS))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--length", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batch_size < 1:
        parser.error(f"--repeats and --batch-size must be at least 1, got {args.repeats} and {args.batch_size}")
    print(f"TF {tf.__version__}, Keras {keras.__version__}, TF_ENABLE_ONEDNN_OPTS="
          f"{os.environ.get('TF_ENABLE_ONEDNN_OPTS', '(unset)')}, B = {args.batch_size}", flush=True)
    print("| model | variables | non-private first fit s (traces) | private first fit s (traces) | ratio |")
    print("|---|---|---|---|---|")
    for name in args.models:
        size = zoo.Size(batch=args.batch_size, length=args.length, vocab=args.vocab, width=args.width)
        runs = {False: [], True: []}
        for r in range(args.repeats):
            for private in (False, True)[:: 1 if r % 2 == 0 else -1]:
                runs[private].append(first_fit(name, size, private))
                keras.backend.clear_session()
        t = {k: float(np.median([s for s, _ in v])) for k, v in runs.items()}
        traces = {k: v[0][1] for k, v in runs.items()}
        variables = len(MODELS[name](np.random.default_rng(0), size=size).model.trainable_variables)
        print(f"| {name} | {variables} | {t[False]:.2f} ({traces[False]}) | {t[True]:.2f} ({traces[True]}) | "
              f"{t[True] / t[False]:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
