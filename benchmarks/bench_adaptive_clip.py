"""What an adaptive clip costs per step: the demo CNN's private step with a fixed clip and with
``knc.AdaptiveClip()``, measured in one run, interleaved (A B A B …), on the backend in use.

The adaptive step adds the count query (a comparison and two sums over the batch's norms), one
Philox N(0, 1) draw, and reads ζ_t from a variable instead of a constant. Each round trains
``--steps`` steps of a fresh ``fit`` per variant (the first ``--warmup`` steps, which compile,
are left out of the time) and reports the median seconds per step and the ratio adaptive / fixed.

    python benchmarks/bench_adaptive_clip.py                    # TensorFlow
    KERAS_BACKEND=jax python benchmarks/bench_adaptive_clip.py  # JAX
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import numpy as np


class _StepTimes:
    def __init__(self):
        self.times = []
        self._t = None

    def callback(self):
        import keras

        outer = self

        class Timer(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                outer._t = time.perf_counter()

            def on_train_batch_end(self, batch, logs=None):
                outer.times.append(time.perf_counter() - outer._t)

        return Timer()


def one_round(adaptive, args, x, y):
    import keras

    import keras_noisecurve as knc
    from keras_noisecurve.apps.models import small_groupnorm_cnn

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixed seeds: a benchmark
        run = knc.PrivateRun(num_examples=len(y), batch_size=args.batch_size, steps=args.steps + args.warmup,
                             noise_multiplier=1.0, delta=1e-6, seed=0,
                             adaptive_clip=knc.AdaptiveClip() if adaptive else None)
        model = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=0)
        private = knc.make_private(model)
        private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=1,
                                                          l2_norm_clip=None if adaptive else 1.0),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        timer = _StepTimes()
        private.fit(run.dataset(x, y), epochs=1, steps_per_epoch=args.steps + args.warmup, verbose=0,
                    callbacks=[timer.callback()])
    return float(np.median(timer.times[args.warmup:]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    import keras

    from keras_noisecurve.apps import data as kdata

    splits = kdata.load_mnist5k(seed=0)
    x, y = splits.x_train, splits.y_train
    fixed, adaptive = [], []
    for r in range(args.rounds):
        fixed.append(one_round(False, args, x, y))
        adaptive.append(one_round(True, args, x, y))
        print(f"round {r}: fixed {1e3 * fixed[-1]:.1f} ms/step, adaptive {1e3 * adaptive[-1]:.1f} ms/step", flush=True)
    f, a = float(np.median(fixed)), float(np.median(adaptive))
    print(f"{keras.backend.backend()}: demo CNN, B = {args.batch_size}, median of {args.rounds} interleaved rounds "
          f"of {args.steps} steps: fixed {1e3 * f:.1f} ms/step, adaptive {1e3 * a:.1f} ms/step, "
          f"ratio adaptive / fixed = {a / f:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
