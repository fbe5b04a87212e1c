"""Correctness cross-check against TF Privacy: the same DP-SGD reaches the same accuracy distribution.

Softmax regression (784 → 10, zero weights) on the bundled MNIST images
(``keras_noisecurve.apps.data.load_mnist5k``: 3,500 train / 1,000 test), trained with DP-SGD
by this library (``make_private`` + ``NoiseCurveOptimizer(mixing="dpsgd")``) and by
TensorFlow Privacy 0.9 (``make_dp_model_class``, fast clipping), at the same clip ζ,
noise multiplier σ, learning rate η (plain SGD), batch size B and number of steps.
Sampling is fixed-size batches (a fresh permutation of the training set every epoch,
cut into batches of B): seed s draws the batch sequence once and BOTH libraries train
on it, so a pair of runs differs only in the libraries' Gaussian draws. Each library runs
in its own process (``_peer_xcheck.py``; TF Privacy in its own virtual environment).
When ``--jax-python`` names an interpreter with jax_privacy 2.0, its Keras API
(``rescale_to_unit_norm=False``) is compared the same way.

Printed: both test-accuracy distributions over the paired seeds (mean, sd, quartiles),
Welch's two-sample t-test and the Mann–Whitney U test (H0: same distribution), and a
paired TOST equivalence test (H1: |mean difference| < ``--margin``). A control run of
this library at ``--control-factor`` × σ shows the tests can tell a different noise
level apart (the same comparison should then reject).

    python benchmarks/crosscheck_peers.py                        # 20 seeds, σ = 1, ζ = 1, B = 250, 5 epochs
    python benchmarks/crosscheck_peers.py --seeds 40 --noise-multiplier 2 --tfp-python /tmp/tfp09/bin/python

TF Privacy's environment (see bench_peers.py)::

    python3.11 -m venv /tmp/tfp09 && /tmp/tfp09/bin/pip install tensorflow-privacy==0.9.0 \\
        tensorflow==2.15.1 tf-keras==2.15.1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def batch_orders(n, batch_size, epochs, seeds):
    """(len(seeds), epochs·⌊n/B⌋, B) training indices: per epoch a permutation cut into batches of B."""
    per_epoch = n // batch_size
    orders = []
    for seed in seeds:
        rng = np.random.default_rng(10_000 + seed)
        steps = [rng.permutation(n)[: per_epoch * batch_size].reshape(per_epoch, batch_size)
                 for _ in range(epochs)]
        orders.append(np.concatenate(steps))
    return np.stack(orders)


def run_worker(python, library, data_path, args, seeds, noise_multiplier, tmp):
    out = Path(tmp) / f"{library}-{noise_multiplier}.json"
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(ROOT) if library == "ours" else "")
    if library == "jax-privacy":
        env["KERAS_BACKEND"] = "jax"
    cmd = [python, str(HERE / "_peer_xcheck.py"), "--library", library, "--data", str(data_path),
           "--clip", str(args.clip), "--noise-multiplier", str(noise_multiplier),
           "--learning-rate", str(args.learning_rate), "--seeds", *map(str, seeds), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{library} worker failed:\n{proc.stderr[-3000:]}")
    return np.asarray(json.loads(out.read_text())["accuracy"])


def describe(name, acc):
    q1, q2, q3 = np.percentile(acc, [25, 50, 75])
    return (f"{name:>26}: mean {100 * acc.mean():6.2f} %  sd {100 * acc.std(ddof=1):5.2f}  "
            f"quartiles {100 * q1:6.2f} / {100 * q2:6.2f} / {100 * q3:6.2f}  (n = {len(acc)})")


def compare(a, b, margin, label):
    """Welch t, Mann–Whitney U and paired TOST (margin in accuracy units) of a against b."""
    from scipy import stats

    welch = stats.ttest_ind(a, b, equal_var=False)
    mwu = stats.mannwhitneyu(a, b, alternative="two-sided")
    d = a - b
    lower = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
    upper = stats.ttest_1samp(d, margin, alternative="less").pvalue
    tost = max(lower, upper)
    print(f"{label}: mean difference {100 * d.mean():+.2f} pp (paired sd {100 * d.std(ddof=1):.2f}); "
          f"Welch t p = {welch.pvalue:.3f}; Mann-Whitney U p = {mwu.pvalue:.3f}; "
          f"TOST (|difference| < {100 * margin:.1f} pp) p = {tost:.4f}")
    return {"welch_p": float(welch.pvalue), "mannwhitney_p": float(mwu.pvalue), "tost_p": float(tost),
            "mean_difference": float(d.mean())}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20, help="number of paired seeds")
    parser.add_argument("--clip", type=float, default=1.0, help="ζ, per-example L2 clip")
    parser.add_argument("--noise-multiplier", type=float, default=1.0, help="σ")
    parser.add_argument("--learning-rate", type=float, default=1.0, help="η of plain SGD")
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--margin", type=float, default=0.01, help="TOST margin, accuracy units (0.01 = 1 pp)")
    parser.add_argument("--control-factor", type=float, default=4.0,
                        help="also run this library at this multiple of σ (0: no control)")
    parser.add_argument("--tfp-python", default="/tmp/tfp09/bin/python")
    parser.add_argument("--jax-python", default="/tmp/jaxp/bin/python",
                        help="interpreter with jax_privacy 2.0 and keras 3 (skipped when missing)")
    parser.add_argument("--json", help="write the accuracies and p-values here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if not Path(args.tfp_python).exists():
        print(f"no TF Privacy interpreter at {args.tfp_python}; create it with:\n"
              "    python3.11 -m venv /tmp/tfp09 && /tmp/tfp09/bin/pip install tensorflow-privacy==0.9.0 "
              "tensorflow==2.15.1 tf-keras==2.15.1\nor pass --tfp-python PATH. Skipped.")
        return 0
    sys.path.insert(0, str(ROOT))
    from keras_noisecurve.apps.data import load_mnist5k

    splits = load_mnist5k()
    x = splits.x_train.reshape(len(splits.x_train), -1)
    x_test = splits.x_test.reshape(len(splits.x_test), -1)
    seeds = list(range(args.seeds))
    orders = batch_orders(len(x), args.batch_size, args.epochs, seeds)
    print(f"softmax regression, MNIST-5k ({len(x)} train / {len(x_test)} test), ζ = {args.clip}, "
          f"σ = {args.noise_multiplier}, η = {args.learning_rate}, B = {args.batch_size}, "
          f"{orders.shape[1]} steps ({args.epochs} epochs of fixed-size batches), {args.seeds} paired seeds",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        data_path = Path(tmp) / "data.npz"
        np.savez(data_path, x_train=x, y_train=splits.y_train.astype("int32"), x_test=x_test,
                 y_test=splits.y_test.astype("int32"), batches=orders)
        ours = run_worker(sys.executable, "ours", data_path, args, seeds, args.noise_multiplier, tmp)
        tfp = run_worker(args.tfp_python, "tfp", data_path, args, seeds, args.noise_multiplier, tmp)
        jaxp = None
        if Path(args.jax_python).exists():
            jaxp = run_worker(args.jax_python, "jax-privacy", data_path, args, seeds, args.noise_multiplier, tmp)
        else:
            print(f"no jax_privacy interpreter at {args.jax_python}: its column is skipped")
        control = None
        if args.control_factor > 0:
            control = run_worker(sys.executable, "ours", data_path, args, seeds,
                                 args.control_factor * args.noise_multiplier, tmp)
    print(describe("this library", ours))
    print(describe("TF Privacy 0.9", tfp))
    report = {"ours": ours.tolist(), "tfp": tfp.tolist(), "args": vars(args)}
    report["ours_vs_tfp"] = compare(ours, tfp, args.margin, "this library vs TF Privacy")
    if jaxp is not None:
        print(describe("jax_privacy 2.0", jaxp))
        report["jax_privacy"] = jaxp.tolist()
        report["ours_vs_jax_privacy"] = compare(ours, jaxp, args.margin, "this library vs jax_privacy")
    if control is not None:
        print(describe(f"control: this library, {args.control_factor:g}σ", control))
        report["control"] = control.tolist()
        report["control_vs_tfp"] = compare(control, tfp, args.margin, f"control ({args.control_factor:g}σ) vs TF Privacy")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
