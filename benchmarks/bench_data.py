"""Throughput of the private input pipeline: in-memory vs streamed example sources.

The bundled MNIST training split (``keras_noisecurve.apps.data.load_mnist5k``: 3,500
images 28×28×1 float32 and int64 labels) is gathered in batches of P random
indices (with repeats, as the sampler's padding has) by ``ExampleSource.tf_gather``
in a ``tf.data`` map (``num_parallel_calls=AUTOTUNE``, ``prefetch``), from

- ``memory``:   the numpy arrays (``tf.gather`` on constant tensors);
- ``memmap``:   the same images saved as a ``.npy`` and opened with
  ``np.load(path, mmap_mode="r")`` (labels in memory): rows read by numpy;
- ``sequence``: a Python sequence whose ``__getitem__(i)`` returns ``(x[i], y[i])``.

All sources are timed in ONE process, interleaved: repeat r runs every source
once, in an order rotated by r, so neighbouring timings share the machine's load.
Reported: the median batches/s of each source over the repeats, the process CPU
time per batch, and the median over repeats of the per-repeat throughput ratios
(b)/(a) = memmap/memory and (c)/(a) = sequence/memory, with their inverse, the
slowdown (the issue's target for the streamed memmap path: slowdown <= 1.5)::

    python benchmarks/bench_data.py                       # P = 256, 300 batches per timing, 15 repeats
    python benchmarks/bench_data.py --batch 64 --steps 1000

By default the batches are consumed inside TensorFlow (``Dataset.reduce``, as
Keras ``fit`` consumes them inside its ``tf.function``): the pipeline alone.
``--consumer python`` iterates in a Python ``for`` loop instead (a custom loop).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from keras_noisecurve.apps.data import load_mnist5k  # noqa: E402
from keras_noisecurve.privacy.sources import as_source  # noqa: E402

SOURCES = ("memory", "memmap", "sequence")


class ExampleList:
    """A random-access sequence of (image, label) examples over numpy arrays."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def pipeline(source, indices):
    ds = tf.data.Dataset.from_tensor_slices(indices)
    ds = ds.map(source.tf_gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)


def timed(ds, steps, consumer):
    """(batches per second, process CPU seconds per batch) of one pass over ``ds``."""
    start, cpu = time.perf_counter(), time.process_time()
    if consumer == "python":
        count = 0
        for _ in ds:
            count += 1
    else:
        count = int(ds.reduce(np.int64(0), lambda c, _: c + 1))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert count == steps, (count, steps)
    return steps / elapsed, cpu / steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256, help="P, rows per batch (default 256)")
    parser.add_argument("--steps", type=int, default=300, help="batches per timing (default 300)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats (default 15)")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--consumer", choices=("graph", "python"), default="graph")
    args = parser.parse_args(argv)

    splits = load_mnist5k()
    x, y = splits.x_train, splits.y_train
    n = len(x)
    rng = np.random.default_rng(0)
    indices = rng.integers(0, n, size=(args.steps, args.batch)).astype(np.int64)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x_train.npy")
        np.save(path, x)
        make = {
            "memory": lambda: as_source(x, y),
            "memmap": lambda: as_source(np.load(path, mmap_mode="r"), y),
            "sequence": lambda: as_source(ExampleList(x, y)),
        }
        print(f"data: {n} examples {x.shape[1:]} {x.dtype} ({x.nbytes / 2**20:.1f} MiB), P = {args.batch}, "
              f"{args.steps} batches per timing, {args.repeats} repeats, consumer = {args.consumer}, "
              f"{os.cpu_count()} CPUs")
        datasets = {name: pipeline(make[name](), indices) for name in args.sources}
        for ds in datasets.values():  # warm up: trace, fill the page cache and TensorFlow's buffers
            timed(ds.take(50), 50, args.consumer)
        rates = {name: [] for name in datasets}
        cpus = {name: [] for name in datasets}
        names = list(datasets)
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                rate, cpu = timed(datasets[name], args.steps, args.consumer)
                rates[name].append(rate)
                cpus[name].append(cpu)
        print("\nsource     batches/s (median, min..max)     CPU ms/batch")
        for name in names:
            low, high = min(rates[name]), max(rates[name])
            print(f"  {name:9s} {statistics.median(rates[name]):7,.0f}  ({low:,.0f}..{high:,.0f})"
                  f"   {1e3 * statistics.median(cpus[name]):6.2f}")
        if "memory" in rates:
            for label, name in (("(b)", "memmap"), ("(c)", "sequence")):
                if name in rates:
                    ratio = statistics.median(b / a for a, b in zip(rates["memory"], rates[name]))
                    cpu = statistics.median(cpus[name]) / statistics.median(cpus["memory"])
                    print(f"{label}/(a) {name}/memory throughput: {ratio:.2f} (slowdown {1 / ratio:.2f}x"
                          + (", target <= 1.5" if name == "memmap" else "") + f"); CPU per batch {cpu:.2f}x")


if __name__ == "__main__":
    main()
