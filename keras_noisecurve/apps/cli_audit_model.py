"""``noisecurve audit --model FILE.keras --data FILE.npz``: the mechanism checks
(:mod:`keras_noisecurve.audit.mechanism`) on the user's own model, data, run and optimizer.

The model file is what ``model.save("FILE.keras")`` writes. A ``PrivateModel``
(``make_private(model)``) compiled with ``NoiseCurveOptimizer(run=run, ...)`` carries its
run, ζ, inner optimizer and loss; a plain model needs ``--run RUN.json`` (the
``run.get_config()`` of its ``PrivateRun``), ``--clip`` and, if it was saved without a
compiled loss, ``--loss``. The data file holds ``x`` (or one ``x_NAME`` array per named
input) and ``y``, optionally ``sample_weight`` and, for a user-level run
(``PrivateRun(privacy_unit="user")``), ``users``: the user id of every example (ints or
strings), which its clipping check needs (``--batch-size`` then counts users).

One line per check (``PASS``/``FAIL`` with its number), then the time each took. Exit
status 0 when every check passes, 3 when one fails, 2 for bad arguments or files (one
line on stderr).
"""

from __future__ import annotations

import functools
import json
import os
import sys

__all__ = ["add_arguments", "check_arguments", "run_checks"]


def add_arguments(parser) -> None:
    """The options of the mechanism checks (added to ``noisecurve audit``'s parser)."""
    group = parser.add_argument_group(
        "mechanism checks on your own model (--model): clipping, sampling and noise, exit status 0 or 3")
    group.add_argument("--model", metavar="FILE.keras", default=None,
                       help="your model (a make_private model compiled with NoiseCurveOptimizer(run=...), or a plain "
                            "model with --run and --clip): run the mechanism checks instead of a canary audit")
    group.add_argument("--data", metavar="FILE.npz", default=None,
                       help="examples: 'x' (or 'x_NAME' per named input), 'y', optional 'sample_weight' and, for a "
                            "user-level run, 'users' (the user id of every example)")
    group.add_argument("--run", metavar="RUN.json", default=None,
                       help="the run's PrivateRun.get_config() as JSON (default: the compiled optimizer's run)")
    group.add_argument("--clip", type=float, default=None, help="zeta (default: the compiled optimizer's)")
    group.add_argument("--loss", default=None,
                       help="a Keras loss name (default: the model's compiled loss); --from-logits for logits")
    group.add_argument("--from-logits", action="store_true", help="the --loss takes logits")
    group.add_argument("--learning-rate", type=float, default=0.1,
                       help="eta of the plain-SGD optimizer built from --run when the model file has none")
    group.add_argument("--batches", type=int, default=2, help="batches of the clipping check (default 2)")
    group.add_argument("--batch-size", type=int, default=16,
                       help="examples (users, for a user-level run) per clipping batch (default 16)")
    group.add_argument("--tolerance", type=float, default=1e-3, help="relative tolerance of the clipping check")
    group.add_argument("--noise-steps", type=int, default=32, help="steps T' of the noise check (default 32)")


def check_arguments(args) -> None:
    """Refuse bad options before anything is loaded (``ValueError`` with one line)."""
    if args.data is None:
        raise ValueError("--model needs --data FILE.npz (the examples to check the clipping on)")
    for option, path in (("--model", args.model), ("--data", args.data), ("--run", args.run)):
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"{option} {path}: no such file")
    if not args.model.endswith(".keras"):
        raise ValueError(f"--model must be a .keras file (model.save('FILE.keras')), got {args.model}")
    if args.clip is not None and not args.clip > 0:
        raise ValueError(f"--clip must be > 0, got {args.clip}")
    if not 0 < args.tolerance < 1:
        raise ValueError(f"--tolerance must lie in (0, 1), got {args.tolerance}")
    for option, value, least in (("--batches", args.batches, 1), ("--batch-size", args.batch_size, 1),
                                 ("--noise-steps", args.noise_steps, 2)):
        if value < least:
            raise ValueError(f"{option} must be >= {least}, got {value}")
    if not args.learning_rate > 0:
        raise ValueError(f"--learning-rate must be > 0, got {args.learning_rate}")


def _load_data(path):
    import numpy as np

    with np.load(path, allow_pickle=False) as data:
        names = list(data.files)
        if "y" not in names:
            raise ValueError(f"--data {path} has no 'y' array (found {', '.join(names)})")
        if "x" in names:
            x = data["x"]
        else:
            x = {name[2:]: data[name] for name in names if name.startswith("x_")}
            if not x:
                raise ValueError(f"--data {path} has neither 'x' nor 'x_NAME' arrays (found {', '.join(names)})")
        weight = data["sample_weight"] if "sample_weight" in names else None
        users = data["users"] if "users" in names else None
        return x, data["y"], weight, users


def _load_model(path):
    import keras

    import keras_noisecurve  # noqa: F401 - registers PrivateModel and NoiseCurveOptimizer
    import keras_noisecurve.apps.layers  # noqa: F401 - the bundled GroupNorm

    try:  # KerasHub models are registered when keras_hub is imported
        import keras_hub  # noqa: F401
    except ImportError:  # pragma: no cover - keras-hub is optional
        pass
    return keras.models.load_model(path)


def _inputs(args):
    """(model, x, y, sample_weight, users, run, optimizer, loss)."""
    import keras

    import keras_noisecurve as knc

    model = _load_model(args.model)
    x, y, weight, users = _load_data(args.data)
    run, optimizer = None, getattr(model, "optimizer", None)
    if not isinstance(optimizer, knc.NoiseCurveOptimizer):
        optimizer = None
    if args.run is not None:
        with open(args.run, encoding="utf-8") as handle:
            run = knc.PrivateRun.from_config(json.load(handle))
        if optimizer is not None and optimizer.run is not None and not run.same_plan(optimizer.run):
            raise ValueError(f"--run {args.run} is another plan than the one the model's optimizer was made for")
    if optimizer is None and run is not None:
        if args.clip is None:
            raise ValueError("a model without a compiled NoiseCurveOptimizer needs --clip (zeta)")
        optimizer = knc.NoiseCurveOptimizer(run=run, l2_norm_clip=args.clip, learning_rate=args.learning_rate)
    loss = None
    if args.loss is not None:
        loss = keras.losses.get(args.loss)  # a name: "sparse_categorical_crossentropy", "mse", ...
        if args.from_logits:
            loss = (type(loss)(from_logits=True) if isinstance(loss, keras.losses.Loss)
                    else functools.partial(loss, from_logits=True))
    return model, x, y, weight, users, run, optimizer, loss


def run_checks(args) -> int:
    """Load, check, print one line per check; the exit status (0 all pass, 3 a failure, 2 bad input)."""
    import time

    from keras_noisecurve.audit.mechanism import check_mechanism

    start = time.perf_counter()
    try:
        model, x, y, weight, users, run, optimizer, loss = _inputs(args)
        print(f"audit of {args.model} on {args.data}: mechanism checks (clipping, sampling, noise)", flush=True)
        report = check_mechanism(model=model, x=x, y=y, run=run, loss=loss, l2_norm_clip=args.clip,
                                 optimizer=optimizer, sample_weight=weight, users=users, batches=args.batches,
                                 batch_size=args.batch_size, tolerance=args.tolerance, noise_steps=args.noise_steps,
                                 seed=args.seed, verbose=True)
    except (ValueError, TypeError, OSError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"noisecurve audit: error: {message}", file=sys.stderr)
        return 2
    total = time.perf_counter() - start
    times = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in report.seconds.items())
    print(f"time: {total:.1f} s in all ({times}; the rest loading the model and data)")
    failed = [name for name, check in report.checks.items() if not check.passed]
    print("verdict: every mechanism check passed" if not failed else
          f"verdict: MECHANISM CHECK FAILED ({', '.join(failed)}) - the run does not do what its accountant assumes")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({**report.to_dict(), "total_seconds": total}, handle, indent=2, default=str)
    return 0 if report.passed else 3
