"""The paper's small GroupNorm CNN, trained privately with DP-SGD, DP-BandMF and NoiseCurve.

Data:
- ``--dataset mnist`` (default): the bundled MNIST-5k (private) and scikit-learn's
  digits as unlabeled public data; nothing is downloaded.
- ``--dataset cifar10 --data-dir DIR``: CIFAR-10 through tensorflow-datasets from
  data ALREADY on disk (``tfds.load(..., data_dir=DIR, download=False)``; install
  the ``tfds`` extra: ``pip install "keras-noisecurve[tfds]"``). Public data: the
  images of ``--public-tfds`` (default ``cifar100``) in the same folder, labels
  dropped. This script never downloads anything; a missing data set is an error.

Spectrum: random-label pre-training on the public images, then Lanczos top-k +
SLQ + power-law tail (paper §4), scaled by the clipping factor.

    python examples/small_cnn.py                      # MNIST-5k, about 5-8 min on 2 cores
    python examples/small_cnn.py --quick              # a 1-minute smoke run
    python examples/small_cnn.py --dataset cifar10 --data-dir ~/tensorflow_datasets
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def load_tfds_images(name, split, data_dir, limit=None):
    """(images float32 in [0, 1], labels) of a tfds data set already on disk; never downloads."""
    import numpy as np

    try:
        import tensorflow_datasets as tfds
    except ImportError as exc:  # pragma: no cover - optional extra
        raise SystemExit('error: --dataset cifar10 needs tensorflow-datasets: pip install "keras-noisecurve[tfds]"') from exc
    if limit:
        split = f"{split}[:{int(limit)}]"
    try:
        ds = tfds.load(name, split=split, data_dir=data_dir, download=False, as_supervised=True, batch_size=-1)
    except Exception as exc:  # tfds raises several types for missing data
        raise SystemExit(f"error: {name} ({split}) is not prepared under --data-dir {data_dir!r} and this script never "
                         f"downloads: {type(exc).__name__}: {exc}") from exc
    x, y = tfds.as_numpy(ds)
    return (x.astype(np.float32) / 255.0), y.astype(np.int64)


def load_data(args):
    from keras_noisecurve.apps import data

    if args.dataset == "mnist":
        splits = data.load_mnist5k()
        public = data.load_public("digits", max_examples=args.public_size, seed=args.seed)
        return splits.x_train, splits.y_train, splits.x_test, splits.y_test, public
    if not args.data_dir:
        raise SystemExit("error: --dataset cifar10 needs --data-dir DIR (tensorflow-datasets data already on disk)")
    x_train, y_train = load_tfds_images("cifar10", "train", args.data_dir, args.train_size)
    x_test, y_test = load_tfds_images("cifar10", "test", args.data_dir)
    public, _ = load_tfds_images(args.public_tfds, "train", args.data_dir, args.public_size)
    return x_train, y_train, x_test, y_test, public


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=("mnist", "cifar10"), default="mnist")
    parser.add_argument("--data-dir", default=None, help="tensorflow-datasets folder (cifar10 only)")
    parser.add_argument("--public-tfds", default="cifar100", help="public tfds data set for cifar10 (labels dropped)")
    parser.add_argument("--train-size", type=int, default=None, help="use the first N private training images")
    parser.add_argument("--public-size", type=int, default=1024)
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--bands", type=int, default=7)
    parser.add_argument("--learning-rate", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=32)
    parser.add_argument("--objective", default=None, help="curvature objective (default: the library default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 epochs, 128 public images, top-8: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.public_size, args.top_k, args.bands = 1, 128, 8, 2
        args.train_size = args.train_size or 1000
    for name in ("epsilon", "epochs", "batch_size", "bands", "learning_rate", "clip", "public_size", "top_k"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")

    import keras
    import numpy as np

    import keras_noisecurve as knc
    from keras_noisecurve.apps.demo import NOISECURVE_OBJECTIVE
    from keras_noisecurve.apps.models import small_groupnorm_cnn
    from keras_noisecurve.spectrum import clipping_scale

    objective = args.objective or NOISECURVE_OBJECTIVE
    x_train, y_train, x_test, y_test, public = load_data(args)
    if args.train_size:
        x_train, y_train = x_train[: args.train_size], y_train[: args.train_size]
    if args.quick:
        x_test, y_test = x_test[:500], y_test[:500]
    n = len(y_train)
    steps_per_epoch = max(1, round(n / args.batch_size))
    steps = args.epochs * steps_per_epoch
    bands = min(args.bands, steps)
    if args.batch_size * bands > n:
        parser.error(f"--batch-size x --bands = {args.batch_size * bands} exceeds the {n} training images")
    shape = x_train.shape[1:]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(args.seed)
    base = small_groupnorm_cnn(shape, 10, dense_size=32, seed=args.seed)
    base.compile(loss=loss)
    init = base.get_weights()
    print(f"{args.dataset}: private n={n}, public {len(public)}, test {len(y_test)}; CNN with "
          f"{base.count_params():,} parameters; T={steps}, b={bands}; objective {objective!r}", flush=True)

    start = time.perf_counter()
    spectrum = knc.estimate_spectrum(base, public, pretrain_epochs=1 if args.quick else 3, method="lanczos",
                                     top_k=args.top_k, slq_probes=2 if args.quick else 8,
                                     slq_steps=8 if args.quick else 40, seed=args.seed)
    curvature = spectrum.scaled(clipping_scale(base, public, l2_norm_clip=args.clip, seed=args.seed))
    print(f"spectrum in {time.perf_counter() - start:.0f}s: {spectrum}", flush=True)

    extra = {"blend_weight": "auto"} if objective == "noisecurve-blend" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # excursion warnings are recorded in metadata["diagnostics"]
        mixings = {
            "DP-SGD": knc.MixingMatrix.identity(steps),
            "DP-BandMF": knc.solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf"),
            "NoiseCurve": knc.solve_mixing_matrix(steps=steps, bands=bands, objective=objective, spectrum=curvature,
                                                  learning_rate=args.learning_rate, tol=1e-3, **extra),
        }
    print("| method | b | sigma | test accuracy | seconds |")
    print("|---|---|---|---|---|")
    for name, mixing in mixings.items():
        start = time.perf_counter()
        run = knc.PrivateRun(num_examples=n, batch_size=args.batch_size, steps=steps, mixing=mixing,
                             epsilon=args.epsilon, delta=args.delta)
        sigma = run.noise_multiplier
        model = small_groupnorm_cnn(shape, 10, dense_size=32)
        model.set_weights(init)
        private = knc.make_private(model)
        private.compile(optimizer=knc.NoiseCurveOptimizer(
            run=run, learning_rate=args.learning_rate, l2_norm_clip=args.clip), loss=loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private.fit(run.dataset(x_train, y_train), epochs=1, steps_per_epoch=steps, verbose=0)
        acc = float(np.mean(np.argmax(model.predict(x_test, batch_size=500, verbose=0), axis=1) == y_test))
        print(f"| {name} | {mixing.bands} | {sigma:.3f} | {100 * acc:.2f} % | {time.perf_counter() - start:.0f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
