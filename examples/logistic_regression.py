"""The convex case: private last-layer training (softmax regression) on frozen public features.

The feature extractor is fitted on PUBLIC data only (PCA of scikit-learn's digits),
so it costs no privacy; the private part is a softmax-regression head on MNIST-5k,
trained with Keras ``fit`` three ways at the same (ε, δ): DP-SGD, DP-BandMF and
NoiseCurve. The head is small, so the spectrum is the exact Hessian
(``estimate_spectrum(method="exact")``) after random-label pre-training on the
public features (paper §4.2: for logistic regression this Hessian upper-bounds the
Hessian along training).

    python examples/logistic_regression.py            # about 1-2 min
    python examples/logistic_regression.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def public_pca(public_images, dim):
    """(mean, basis) of a PCA with ``dim`` components fitted on the public images."""
    import numpy as np

    flat = public_images.reshape(len(public_images), -1).astype(np.float64)
    mean = flat.mean(axis=0)
    _, _, vt = np.linalg.svd(flat - mean, full_matrices=False)
    return mean, vt[:dim].T


def featurize(images, mean, basis):
    """PCA projection, each feature vector scaled to unit L2 norm (float32)."""
    import numpy as np

    z = (images.reshape(len(images), -1) - mean) @ basis
    return (z / np.maximum(np.linalg.norm(z, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epsilon", type=float, default=2.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--pca-dim", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--steps", type=int, default=280, help="T (default 280 = 4 epochs)")
    parser.add_argument("--bands", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=8.0)
    parser.add_argument("--clip", type=float, default=0.5)
    parser.add_argument("--objective", default=None, help="curvature objective (default: the library default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="T = 40, b = 4, PCA 16: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.bands, args.pca_dim = 40, 4, 16
    for name in ("epsilon", "batch_size", "steps", "bands", "learning_rate", "clip", "pca_dim"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")

    import keras
    import numpy as np

    import keras_noisecurve as knc
    from keras_noisecurve.apps import data
    from keras_noisecurve.apps.demo import NOISECURVE_OBJECTIVE
    from keras_noisecurve.apps.models import softmax_regression
    from keras_noisecurve.spectrum import clipping_scale

    objective = args.objective or NOISECURVE_OBJECTIVE
    splits = data.load_mnist5k()
    public = data.load_public_digits()
    mean, basis = public_pca(public, args.pca_dim)
    f_train, f_test, f_public = (featurize(x, mean, basis) for x in (splits.x_train, splits.x_test, public))
    y_train, y_test = splits.y_train, splits.y_test
    n = len(y_train)
    print(f"features: PCA({args.pca_dim}) fitted on {len(public)} public digits; private n={n}; "
          f"objective {objective!r}", flush=True)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    head = softmax_regression((args.pca_dim,), 10)
    head.compile(loss=loss)
    spectrum = knc.estimate_spectrum(head, f_public, pretrain_epochs=5, pretrain_learning_rate=1.0,
                                     method="exact", seed=args.seed)
    scale = clipping_scale(head, f_public, l2_norm_clip=args.clip, seed=args.seed)
    curvature = spectrum.scaled(scale)
    print(f"exact spectrum: p={spectrum.dimension}, mu_max={spectrum.max_eigenvalue:.4g}; clipping scale {scale:.3f}",
          flush=True)

    mixings = {
        "DP-SGD": knc.MixingMatrix.identity(args.steps),
        "DP-BandMF": knc.solve_mixing_matrix(steps=args.steps, bands=args.bands, objective="bandmf"),
    }
    extra = {"blend_weight": "auto"} if objective == "noisecurve-blend" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # recorded in the artifact's metadata["diagnostics"]
        mixings["NoiseCurve"] = knc.solve_mixing_matrix(
            steps=args.steps, bands=args.bands, objective=objective, spectrum=curvature,
            learning_rate=args.learning_rate, tol=1e-3, **extra)

    print("| method | b | sigma | epsilon spent | test accuracy | seconds |")
    print("|---|---|---|---|---|---|")
    for name, mixing in mixings.items():
        start = time.perf_counter()
        b = mixing.bands
        # the run, described once: sigma calibrated for (epsilon, delta) with C's b bands
        run = knc.PrivateRun(num_examples=n, batch_size=args.batch_size, steps=args.steps, mixing=mixing,
                             epsilon=args.epsilon, delta=args.delta)
        sigma = run.noise_multiplier
        model = softmax_regression((args.pca_dim,), 10)
        private = knc.make_private(model)
        private.compile(optimizer=knc.NoiseCurveOptimizer(
            run=run, learning_rate=args.learning_rate, l2_norm_clip=args.clip), loss=loss)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history = private.fit(run.dataset(f_train, y_train), epochs=1, steps_per_epoch=args.steps, verbose=0,
                                  callbacks=[knc.callbacks.PrivacyBudget(run=run, verbose=0)])
        acc = float(np.mean(np.argmax(model.predict(f_test, verbose=0), axis=1) == y_test))
        spent = history.history.get("epsilon", [float("nan")])[-1]
        print(f"| {name} | {b} | {sigma:.3f} | {spent:.3f} | {100 * acc:.2f} % | {time.perf_counter() - start:.1f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
