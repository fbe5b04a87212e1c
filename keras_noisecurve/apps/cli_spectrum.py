"""``noisecurve spectrum``: estimate a Hessian-upper-bound spectrum from public data.

Example::

    noisecurve spectrum --model model.keras --public-x public.npz --key x \\
        --labels random --pretrain-epochs 10 --method auto --top-k 200 \\
        --out spectrum.npz --plot spectrum.png

``--labels``: ``random`` (default) draws labels uniformly over the output classes and
pre-trains a copy of the model on them for ``--pretrain-epochs``; ``none`` measures at the
saved weights with random labels and no pre-training (``--pretrain-epochs`` is ignored);
any other value is the name of an array in the ``--public-x`` file holding labels.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``spectrum`` options to ``parser``."""
    parser.add_argument("--model", required=True, help="saved Keras model (.keras)")
    parser.add_argument("--public-x", required=True, help=".npz (or .npy) file with public inputs")
    parser.add_argument("--key", default="x", help="array name of the inputs in the .npz (default: x)")
    parser.add_argument(
        "--labels",
        default="random",
        help="random (default) | none (current weights, random labels, no pre-training) | KEY of a label array",
    )
    parser.add_argument("--loss", default=None, help="loss name (default: the model's compiled loss, else inferred)")
    parser.add_argument("--pretrain-epochs", type=int, default=10)
    parser.add_argument("--pretrain-learning-rate", type=float, default=0.05)
    parser.add_argument("--method", choices=("auto", "exact", "lanczos"), default="auto")
    parser.add_argument("--top-k", type=int, default=200)
    parser.add_argument("--mu-min", type=float, default=1e-6)
    parser.add_argument("--slq-probes", type=int, default=16)
    parser.add_argument("--slq-steps", type=int, default=80)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--max-examples", type=int, default=None, help="use only the first N public examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="spectrum.npz", help="output spectrum file (default: spectrum.npz)")
    parser.add_argument("--plot", default=None, help="optional PNG: eigenvalues descending, log-log")
    parser.add_argument("--verbose", action="store_true")


def _load_arrays(path):
    import numpy as np

    if str(path).endswith(".npy"):
        return {"x": np.load(path, allow_pickle=False)}
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def plot_spectrum(spectrum, path) -> None:
    """Save a log-log plot of the eigenvalues (descending) against their index.

    The computed top-k (or all exact eigenvalues) are drawn as points, the fitted
    tail bins as a step line.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    values, mult = spectrum.eigenvalues, spectrum.multiplicities
    ends = np.cumsum(mult)
    starts = ends - mult + 1
    positive = values > 0
    meta = spectrum.metadata
    tail = meta.get("tail") or {}
    first_tail = int(tail.get("first_index", ends[-1] + 1)) if tail else int(ends[-1] + 1)
    top = positive & (starts < first_tail)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(starts[top], values[top], ".", ms=3, label=f"computed ({meta.get('method', '?')})")
    rest = positive & ~top
    if np.any(rest):
        xs = np.column_stack([starts[rest], ends[rest]]).reshape(-1)
        ys = np.repeat(values[rest], 2)
        ax.loglog(xs, ys, "-", lw=1.5, label="fitted tail (eq. 3, bin upper values)")
    ax.set_xlabel("index i (descending)")
    ax.set_ylabel("eigenvalue μ_i")
    ax.set_title(f"Hessian upper bound spectrum, p = {spectrum.dimension}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    """Run ``noisecurve spectrum``; returns the exit status (0 ok, 2 bad input)."""
    import keras
    import numpy as np

    from keras_noisecurve.spectrum.estimate import estimate_spectrum

    try:
        arrays = _load_arrays(args.public_x)
    except (OSError, ValueError) as exc:
        print(f"noisecurve spectrum: cannot read {args.public_x}: {exc}", file=sys.stderr)
        return 2
    if args.key not in arrays:
        print(f"noisecurve spectrum: {args.public_x} has no array {args.key!r}; it has {sorted(arrays)}.", file=sys.stderr)
        return 2
    x = arrays[args.key]
    y = None
    epochs = args.pretrain_epochs
    if args.labels == "none":
        epochs = 0
    elif args.labels != "random":
        if args.labels not in arrays:
            print(f"noisecurve spectrum: --labels {args.labels!r} is not an array in {args.public_x} ({sorted(arrays)}).", file=sys.stderr)
            return 2
        y = arrays[args.labels]
    if args.max_examples is not None:
        x = x[: args.max_examples]
        y = None if y is None else y[: args.max_examples]
    try:
        model = keras.models.load_model(args.model)
    except Exception as exc:  # noqa: BLE001 - Keras raises many types
        print(f"noisecurve spectrum: cannot load model {args.model}: {exc}", file=sys.stderr)
        return 2
    try:
        spec = estimate_spectrum(
            model,
            np.asarray(x),
            y,
            loss=args.loss,
            pretrain_epochs=epochs,
            pretrain_learning_rate=args.pretrain_learning_rate,
            method=args.method,
            top_k=args.top_k,
            mu_min=args.mu_min,
            slq_probes=args.slq_probes,
            slq_steps=args.slq_steps,
            batch_size=args.batch_size,
            seed=args.seed,
            verbose=args.verbose,
        )
    except (ValueError, TypeError) as exc:
        print(f"noisecurve spectrum: {exc}", file=sys.stderr)
        return 2
    spec.save(args.out)
    meta = spec.metadata
    summary = {
        k: meta.get(k)
        for k in ("method", "dimension", "k", "converged", "p_plus", "p_plus_stderr", "num_hvps", "seconds", "pretrain_epochs")
        if k in meta
    }
    summary["max_eigenvalue"] = spec.max_eigenvalue
    summary["trace"] = spec.trace()
    summary["out"] = str(args.out)
    if args.plot:
        plot_spectrum(spec, args.plot)
        summary["plot"] = str(args.plot)
    print(json.dumps(summary, indent=2))
    return 0
