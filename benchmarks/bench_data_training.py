"""Private training throughput with the data in memory vs memory-mapped on disk.

The demo's GroupNorm CNN (``make_private`` + ``NoiseCurveOptimizer(run=...)``) trains
on the bundled MNIST training split through ``PrivateRun.dataset``, once from the
numpy arrays and once from the same images saved as ``.npy`` and opened with
``np.load(path, mmap_mode="r")`` (only each batch's rows are read). Same run, keys and
initial weights; the first ``--warmup`` steps of each fit trace the step and are not
timed. The two are timed alternately in one process, ``--repeats`` times, and the
ratio (memmap time / in-memory time) is printed per repeat and as a median (the
order alternates between repeats)::

    python benchmarks/bench_data_training.py                  # B = 250, 30 steps, 4 repeats

``benchmarks/bench_data.py`` times the input pipeline alone (no training step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_noisecurve as knc  # noqa: E402
from keras_noisecurve.apps import data  # noqa: E402
from keras_noisecurve.apps.models import small_groupnorm_cnn  # noqa: E402


def steps_per_second(x, y, *, batch, steps, warmup):
    run = knc.PrivateRun(num_examples=len(y), batch_size=batch, steps=steps, noise_multiplier=1.0, delta=1e-5,
                         seed=1)  # fixed keys: both sources train on the same batches and noise
    model = knc.make_private(small_groupnorm_cnn((28, 28, 1), 10, dense_size=32, seed=0))
    model.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=1.0, seed=2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(run.dataset(x, y), epochs=1, steps_per_epoch=warmup, verbose=0)
        start = time.perf_counter()
        model.fit(run.dataset(x, y), epochs=1, steps_per_epoch=steps - warmup, verbose=0)
    return (steps - warmup) / (time.perf_counter() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=250, help="expected batch size B (default 250)")
    parser.add_argument("--steps", type=int, default=30, help="steps per fit, warm-up included (default 30)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed first steps (default 5)")
    parser.add_argument("--repeats", type=int, default=4, help="alternating repeats (default 4)")
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        parser.error(f"need 0 < --warmup < --steps, got --warmup {args.warmup} --steps {args.steps}")
    splits = data.load_mnist5k()
    x, y = splits.x_train, splits.y_train
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x.npy")
        np.save(path, x)
        x_disk = np.load(path, mmap_mode="r")
        ratios = []
        for r in range(args.repeats):
            timed = {}
            for name in (("memory", "disk") if r % 2 == 0 else ("disk", "memory")):  # alternate the order
                timed[name] = steps_per_second(x if name == "memory" else x_disk, y, batch=args.batch,
                                               steps=args.steps, warmup=args.warmup)
            memory, disk = timed["memory"], timed["disk"]
            ratios.append(memory / disk)
            print(f"repeat {r}: in memory {memory:.2f} steps/s, memory-mapped {disk:.2f} steps/s, "
                  f"time ratio memmap/memory {ratios[-1]:.3f}", flush=True)
        del x_disk
    print(f"median time ratio memmap/memory over {args.repeats} repeats: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
