"""Benchmark: top-k Hessian eigenvalues of the paper's small GroupNorm CNN.

Our ``lanczos_top_k`` vs ``scipy.sparse.linalg.eigsh`` (implicitly restarted Lanczos,
ARPACK) on the same ``HessianOperator`` (wrapped as a ``LinearOperator``): wall time,
number of Hessian-vector products, and agreement of the eigenvalues.

Model (paper App. C, Table "CNN with GroupNorm"): 3×(Conv3×3 + GroupNorm + ReLU) with
3→16 (stride 1), 16→32 (stride 2), 32→64 (stride 2), adaptive average pool to 2×2,
Dense 256→64 + ReLU, Dense 64→10: 40,906 parameters on 32×32×3 inputs. Public data:
sklearn ``load_digits`` images upsampled 8×8 → 32×32 and repeated over 3 channels,
random labels (paper §4.1), no pre-training (weights at initialisation).

Run (the defaults are the setting measured in docs/spectrum.md, "Cost"; smaller
settings for a quick look)::

    python benchmarks/bench_spectrum.py                  # 512 examples, top-100
    python benchmarks/bench_spectrum.py --examples 128 --top-k 20
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402


def groupnorm_cnn(num_classes=10, dense_size=64, seed=0):
    """The paper's small GroupNorm CNN (channels-last Keras version)."""
    import keras

    keras.utils.set_random_seed(seed)
    inp = keras.Input((32, 32, 3))
    h = inp
    for filters, stride in ((16, 1), (32, 2), (64, 2)):
        h = keras.layers.Conv2D(filters, 3, strides=stride, padding="same")(h)
        h = keras.layers.GroupNormalization(groups=4)(h)
        h = keras.layers.ReLU()(h)
    # Adaptive average pool to 2×2 (8×8 feature map → 4×4 windows).
    h = keras.layers.AveragePooling2D(pool_size=h.shape[1] // 2)(h)
    h = keras.layers.Flatten()(h)
    h = keras.layers.Dense(dense_size, activation="relu")(h)
    out = keras.layers.Dense(num_classes)(h)
    return keras.Model(inp, out)


def public_data(n):
    from sklearn.datasets import load_digits

    img = load_digits().images[:n] / 16.0
    img = np.kron(img, np.ones((1, 4, 4)))  # 8×8 → 32×32
    return np.repeat(img[..., None], 3, axis=-1).astype("float32")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--tol", type=float, default=1e-5, help="relative residual tolerance (float32 model)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-scipy", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)

    import keras
    from scipy.sparse.linalg import LinearOperator, eigsh

    from keras_noisecurve.spectrum.hvp import HessianOperator
    from keras_noisecurve.spectrum.lanczos import lanczos_top_k
    from keras_noisecurve.spectrum.losses import random_labels

    model = groupnorm_cnn(seed=args.seed)
    x = public_data(args.examples)
    y = random_labels(args.examples, num_outputs=10, label_kind="sparse", seed=args.seed)
    op = HessianOperator(
        model, x, y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), batch_size=args.batch_size
    )
    p = op.dimension
    op.matvec(np.ones(p))  # trace once, not timed
    t0 = time.perf_counter()
    op.matvec(np.ones(p))
    hvp_seconds = time.perf_counter() - t0
    results = {"parameters": p, "examples": args.examples, "k": args.top_k, "seconds_per_hvp": hvp_seconds}
    print(f"p = {p}, n = {args.examples}, one HVP {hvp_seconds:.3f} s")

    start = op.num_hvps
    t0 = time.perf_counter()
    ours = lanczos_top_k(op.matvec, dimension=p, k=args.top_k, tol=args.tol, seed=args.seed, verbose=True)
    results["ours"] = {
        "seconds": time.perf_counter() - t0,
        "hvps": op.num_hvps - start,
        "converged": int(ours.num_converged),
        "max_residual": float(ours.residuals.max()),
        "top5": ours.eigenvalues[:5].tolist(),
    }
    print("ours :", json.dumps(results["ours"]))

    if not args.skip_scipy:
        start = op.num_hvps
        lin = LinearOperator((p, p), matvec=lambda v: op.matvec(np.asarray(v).reshape(-1)), dtype=np.float64)
        v0 = np.random.default_rng(args.seed).standard_normal(p)
        t0 = time.perf_counter()
        vals = np.sort(eigsh(lin, k=args.top_k, which="LA", tol=args.tol, v0=v0, return_eigenvectors=False))[::-1]
        results["scipy_eigsh"] = {"seconds": time.perf_counter() - t0, "hvps": op.num_hvps - start, "top5": vals[:5].tolist()}
        rel = np.abs(ours.eigenvalues - vals) / np.abs(vals).max()
        results["max_rel_difference_vs_eigsh"] = float(rel.max())
        results["ours_uses_no_more_hvps"] = results["ours"]["hvps"] <= results["scipy_eigsh"]["hvps"]
        print("eigsh:", json.dumps(results["scipy_eigsh"]))
        print(f"max |ours − eigsh| / μ_max over top-{args.top_k}: {rel.max():.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
