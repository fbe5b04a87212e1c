"""Run one of jax_privacy's own mixing-matrix (strategy) solvers and save the result.

A standalone helper of ``benchmarks/bench_jax_privacy.py``; run it with the separate
jax_privacy virtual environment, never the project's::

    python3.11 -m venv /tmp/jaxp && /tmp/jaxp/bin/pip install jax-privacy
    /tmp/jaxp/bin/python benchmarks/_jax_privacy_solve.py --strategy toeplitz \\
        --steps 2000 --bands 16 --out /tmp/jp.npz

It imports jax_privacy, jax, numpy and the standard library only (no keras_noisecurve,
no TensorFlow). The workload is always prefix sums (A = lower-triangular ones) and the
error is the mean squared error over the T prefix sums (jax_privacy's ``jnp.mean``
reduction; the benchmark's loss sens²·‖A C⁻¹‖_F² is T times jax_privacy's).

Strategies and the jax_privacy (2.0.0) calls used, all with jax_privacy's defaults:

``banded``
    ``banded.optimize(T, bands=b)``: column-normalised b-banded C, L-BFGS
    (``optimization.DEFAULT_OPTIMIZER``: memory 1, backtracking line search),
    ``max_optimizer_steps=100``, no early stop. Single participation; valid unchanged
    for k participations when b ≤ sep (sens² = k then), refused otherwise.
``toeplitz``
    ``toeplitz.optimize_banded_toeplitz(T, b)``: b Toeplitz coefficients, same
    optimiser, ``max_optimizer_steps=250``, initialised with the first b coefficients of
    (1 − x)^(−1/2). Optimises the single-participation loss; the same C is optimal for
    k participations when b ≤ sep (sens² = k·‖c‖²); for b > sep jax_privacy has no
    multi-participation banded-Toeplitz optimiser and this script says so (exit 3).
``blt``
    d > 0: ``buffered_toeplitz.optimize_loss(LossFn.build_min_sep(n=T, error="mean",
    min_sep=sep, max_participations=k), num_buffers=d)`` (L-BFGS memory 15 with a zoom
    line search, ``max_optimizer_steps=600``, ``Parameterization.buf_decay_pair``,
    rational-approximation initialisation). d = 0: ``buffered_toeplitz.optimize(n=T,
    min_sep=sep, max_participations=k, error="mean")``, which picks the number of buffers
    itself (0 … 10, adding one while the loss improves by ≥ 1 %).
``bisr``
    jax_privacy 2.0.0 has no BISR. The strategy is fixed (no optimisation): C⁻¹ is the
    banded Toeplitz matrix of ``toeplitz.optimal_max_error_noising_coefs(p)`` (the first
    p coefficients of (1 − x)^(1/2)) and C's first column is
    ``toeplitz.inverse_coef(noising, n=T)``, both jax_privacy functions.

Saved (``--out PATH.npz``): ``first_column`` (T,) float64 for toeplitz / blt / bisr;
``band_values`` (T, b) with ``band_values[t, j] == C[t, t − j]`` (columns normalised, as
jax_privacy's ``materialize``) and ``params`` (jax_privacy's raw (T, b) parameters) for
banded, plus ``dense`` for T ≤ 3000; ``seconds`` (wall time of the solve including JIT
compilation), ``compile_seconds`` / ``trace_seconds`` (from jax.monitoring),
``jax_privacy_loss`` (jax_privacy's own mean-error × sens², NaN when it has none) and
``info`` (a JSON string: versions, settings, iterations, loss trajectory, notes).
Exit status 0 on success, 3 when jax_privacy has no solver for the request (an npz with
``info`` holding the reason is still written), 1 on other errors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

STRATEGIES = ("banded", "toeplitz", "blt", "bisr")


class Unsupported(Exception):
    """jax_privacy has no solver for the requested configuration."""


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategy", required=True, choices=STRATEGIES)
    p.add_argument("--steps", type=int, required=True, help="T")
    p.add_argument("--bands", type=int, required=True,
                   help="bands b (banded / toeplitz / bisr) or buffers d (blt; 0 = jax_privacy picks)")
    p.add_argument("--participations", type=int, default=1, help="k (default 1)")
    p.add_argument("--min-separation", type=int, default=None,
                   help="sep, the minimum separation (default T // k for k > 1)")
    p.add_argument("--out", required=True, help="output .npz path")
    p.add_argument("--max-optimizer-steps", type=int, default=None,
                   help="override jax_privacy's default iteration count (default: keep it)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    if args.bands < (0 if args.strategy == "blt" else 1):
        p.error(f"--bands must be >= 1 (>= 0 for blt), got {args.bands}")
    if args.participations < 1:
        p.error(f"--participations must be >= 1, got {args.participations}")
    if args.min_separation is None:
        args.min_separation = 1 if args.participations == 1 else args.steps // args.participations
    if args.min_separation < 1:
        p.error(f"--min-separation must be >= 1, got {args.min_separation}")
    if args.participations > 1 and (args.participations - 1) * args.min_separation >= args.steps:
        p.error(f"k={args.participations} participations {args.min_separation} apart do not fit in T={args.steps}")
    return args


def _band_values_from_params(params: np.ndarray) -> np.ndarray:
    """(T, b) ``band_values[t, j] == C[t, t − j]`` of jax_privacy's ColumnNormalizedBanded.

    ``params[s, j]`` is C[s + j, s] before normalisation; each column is divided by its
    norm over the entries inside the T × T matrix (as ``ColumnNormalizedBanded.materialize``).
    """
    steps, bands = params.shape
    s = np.arange(steps)[:, None]
    j = np.arange(bands)[None, :]
    inside = (s + j) < steps
    raw = np.where(inside, params, 0.0)
    norms = np.sqrt((raw ** 2).sum(axis=1))
    col = raw / norms[:, None]          # col[s, j] = C[s + j, s]
    out = np.zeros_like(col)
    for jj in range(bands):
        out[jj:, jj] = col[: steps - jj, jj]
    return out


def main(argv=None) -> int:
    args = _parse(argv)
    T, b, k, sep = args.steps, args.bands, args.participations, args.min_separation
    out: dict = {}
    info: dict = {"strategy": args.strategy, "steps": T, "bands_or_buffers": b,
                  "participations": k, "min_separation": sep, "workload": "prefix sums",
                  "error_reduction": "mean over the T prefix sums", "notes": []}
    status = 0

    t0 = time.perf_counter()
    import jax  # noqa: E402  (timed: the import is not part of the solve)
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import jax_privacy
    from jax_privacy.matrix_factorization import banded, buffered_toeplitz, toeplitz
    import_seconds = time.perf_counter() - t0

    compile_events = {"trace": 0.0, "lower": 0.0, "backend": 0.0}
    names = {"/jax/core/compile/jaxpr_trace_duration": "trace",
             "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
             "/jax/core/compile/backend_compile_duration": "backend"}

    def _listener(event, duration, **_kw):
        key = names.get(event)
        if key is not None:
            compile_events[key] += float(duration)

    jax.monitoring.register_event_duration_secs_listener(_listener)

    info["versions"] = {"jax_privacy": jax_privacy.__version__, "jax": jax.__version__,
                        "numpy": np.__version__, "python": sys.version.split()[0]}
    info["device"] = str(jax.devices()[0])
    info["x64"] = "jax_enable_x64=True for the whole run (jax_privacy's optimisers switch it on "\
                  "internally anyway, but cast results back to the input dtype)"
    info["import_seconds"] = import_seconds
    trajectory: list = []

    def _callback(cb):
        trajectory.append(cb.loss)   # device array, no host sync inside the loop
        return None

    opt_kw = {} if args.max_optimizer_steps is None else {"max_optimizer_steps": args.max_optimizer_steps}
    jp_loss = float("nan")
    start = time.perf_counter()
    try:
        if args.strategy == "banded":
            if b > T:
                raise Unsupported(f"bands={b} > steps={T}")
            if k > 1 and sep < b:
                raise Unsupported(
                    f"banded.optimize is valid for k > 1 only when bands <= min_sep ({b} > {sep}); "
                    "jax_privacy has no banded optimiser for overlapping participations")
            steps_used = opt_kw.get("max_optimizer_steps", 100)
            C = banded.optimize(T, bands=b, callback=_callback, **opt_kw)
            params = np.asarray(jax.block_until_ready(C.params), dtype=np.float64)
            seconds = time.perf_counter() - start
            solve_events = dict(compile_events)
            err = np.asarray(banded.per_query_error(C), dtype=np.float64)
            sens2 = float(k)   # unit columns, b <= sep: k disjoint unit columns
            if k > 1:
                sens2 = float(banded.minsep_sensitivity_squared(C, min_sep=sep, max_participations=k, n=T))
            jp_loss = float(err.mean() * sens2)
            out["params"] = params
            out["band_values"] = _band_values_from_params(params)
            if T <= 3000:
                out["dense"] = np.asarray(C.materialize(), dtype=np.float64)
            info["solver"] = {"call": "banded.optimize(n, bands=b)", "max_optimizer_steps": steps_used,
                              "optimizer": "optimization.DEFAULT_OPTIMIZER = optax.lbfgs(memory_size=1, "
                                           "linesearch=scale_by_backtracking_linesearch(128))",
                              "init": "ColumnNormalizedBanded.default (first b coefs of (1-x)^(-1/2))",
                              "reduction_fn": "jnp.mean", "early_stop": False}
            info["iterations"] = steps_used
            if k > 1:
                info["notes"].append("single-participation optimum reused: with b <= sep the "
                                     "k-participation sensitivity is k for every column-normalised C")
        elif args.strategy == "toeplitz":
            if b > T:
                raise Unsupported(f"bands={b} > steps={T}")
            if k > 1 and sep < b:
                raise Unsupported(
                    f"toeplitz.optimize_banded_toeplitz optimises the single-participation loss; it is "
                    f"the k-participation optimum only for bands <= min_sep ({b} > {sep}); jax_privacy "
                    "2.0.0 has no banded-Toeplitz optimiser with min-sep sensitivity")
            steps_used = opt_kw.get("max_optimizer_steps", 250)
            coef = toeplitz.optimize_banded_toeplitz(T, b, **opt_kw)
            coef = np.asarray(jax.block_until_ready(coef), dtype=np.float64)
            seconds = time.perf_counter() - start
            solve_events = dict(compile_events)
            err = np.asarray(toeplitz.per_query_error(strategy_coef=jnp.asarray(coef), n=T), dtype=np.float64)
            sens2 = float(toeplitz.minsep_sensitivity_squared(jnp.asarray(coef), min_sep=sep,
                                                              max_participations=k, n=T, skip_checks=True))
            jp_loss = float(err.mean() * sens2)
            first = np.zeros(T)
            first[:b] = coef
            out["first_column"] = first
            out["coefficients"] = coef
            info["solver"] = {"call": "toeplitz.optimize_banded_toeplitz(n, bands)",
                              "max_optimizer_steps": steps_used,
                              "optimizer": "optimization.DEFAULT_OPTIMIZER = optax.lbfgs(memory_size=1, "
                                           "linesearch=scale_by_backtracking_linesearch(128))",
                              "init": "toeplitz.optimal_max_error_strategy_coefs(b)",
                              "reduction_fn": "jnp.mean", "early_stop": False,
                              "callback": "not accepted by optimize_banded_toeplitz: no trajectory"}
            info["iterations"] = steps_used
            if k > 1:
                info["notes"].append("single-participation optimum reused: with b <= sep, "
                                     "sens^2 = k*||c||^2 for every banded Toeplitz c")
        elif args.strategy == "blt":
            loss_fn = buffered_toeplitz.LossFn.build_min_sep(
                n=T, error="mean", min_sep=sep, max_participations=k)
            if b > 0:
                steps_used = opt_kw.get("max_optimizer_steps", 600)
                blt, loss = buffered_toeplitz.optimize_loss(loss_fn, num_buffers=b, callback=_callback, **opt_kw)
                jp_loss = float(loss)
                info["solver"] = {"call": "buffered_toeplitz.optimize_loss(LossFn.build_min_sep(n, "
                                          "error='mean', min_sep, max_participations), num_buffers=d)",
                                  "max_optimizer_steps": steps_used,
                                  "optimizer": "optax.lbfgs(memory_size=15, zoom linesearch "
                                               "max_linesearch_steps=100, curv_rtol=0.5, max_learning_rate=1, "
                                               "stepsize_precision=1e-20)",
                                  "parameterization": "Parameterization.buf_decay_pair()",
                                  "init": "get_init_blt: from_rational_approx_to_sqrt_x(d, max_buf_decay=1-1e-6, "
                                          "max_pillutla_score=1-1e-6)",
                                  "penalty_strength": loss_fn.penalty_strength, "early_stop": False}
                info["iterations"] = steps_used
            else:
                blt = buffered_toeplitz.optimize(n=T, min_sep=sep, max_participations=k, error="mean",
                                                 callback=_callback, **opt_kw)
                info["solver"] = {"call": "buffered_toeplitz.optimize(n, min_sep, max_participations, "
                                          "error='mean')",
                                  "min_buffers": 0, "max_buffers": 10, "rtol": 1.01,
                                  "max_optimizer_steps_per_buffer_count": opt_kw.get("max_optimizer_steps", 600)}
                info["iterations"] = len(trajectory)
            first = np.asarray(jax.block_until_ready(blt.toeplitz_coefs(T)), dtype=np.float64)
            seconds = time.perf_counter() - start
            solve_events = dict(compile_events)
            if b == 0:
                jp_loss = float(loss_fn.loss(blt))
            out["first_column"] = first
            out["theta"] = np.asarray(blt.buf_decay, dtype=np.float64)
            out["omega"] = np.asarray(blt.output_scale, dtype=np.float64)
            info["buffers"] = int(out["theta"].size)
            info["theta"] = out["theta"].tolist()
            info["omega"] = out["omega"].tolist()
        else:  # bisr
            if b > T:
                raise Unsupported(f"bands={b} > steps={T}")
            noising = toeplitz.optimal_max_error_noising_coefs(b)
            first = toeplitz.inverse_coef(noising, n=T)
            first = np.asarray(jax.block_until_ready(first), dtype=np.float64)
            seconds = time.perf_counter() - start
            solve_events = dict(compile_events)
            # per_query_error does not pad a short noising_coef to n: pad it explicitly.
            err = np.asarray(toeplitz.per_query_error(noising_coef=toeplitz.pad_coefs_to_n(noising, T), n=T),
                             dtype=np.float64)
            try:
                sens2 = float(toeplitz.minsep_sensitivity_squared(jnp.asarray(first), min_sep=sep,
                                                                  max_participations=k, n=T))
            except ValueError as e:   # coefficients not nonnegative non-increasing
                info["notes"].append(f"minsep_sensitivity_squared checks failed ({e}); skip_checks=True used")
                sens2 = float(toeplitz.minsep_sensitivity_squared(jnp.asarray(first), min_sep=sep,
                                                                  max_participations=k, n=T, skip_checks=True))
            jp_loss = float(err.mean() * sens2)
            out["first_column"] = first
            out["noising_coefficients"] = np.asarray(noising, dtype=np.float64)
            info["solver"] = {"call": "toeplitz.inverse_coef(toeplitz.optimal_max_error_noising_coefs(p), n)",
                              "note": "jax_privacy 2.0.0 has no BISR; fixed construction, no optimisation"}
            info["iterations"] = 0
    except Unsupported as e:
        seconds = time.perf_counter() - start
        solve_events = dict(compile_events)
        info["unsupported"] = str(e)
        status = 3

    if trajectory:
        traj = [float(x) for x in trajectory]
        info["loss_trajectory_first_last"] = [traj[0], traj[-1]]
        info["trajectory_length"] = len(traj)
        out["trajectory"] = np.asarray(traj)
    info["seconds"] = seconds
    info["compile_seconds"] = solve_events["lower"] + solve_events["backend"]
    info["trace_seconds"] = solve_events["trace"]
    info["jax_privacy_loss"] = jp_loss
    info["jax_privacy_loss_definition"] = "mean per-query squared error * sens^2 (x T = sens^2 ||A C^-1||_F^2)"
    np.savez(args.out, seconds=np.float64(seconds), compile_seconds=np.float64(info["compile_seconds"]),
             trace_seconds=np.float64(info["trace_seconds"]), jax_privacy_loss=np.float64(jp_loss),
             info=np.asarray(json.dumps(info)), **out)
    print(json.dumps({key: info[key] for key in ("strategy", "steps", "bands_or_buffers", "participations",
                                                 "seconds", "compile_seconds", "jax_privacy_loss")
                      if key in info} | ({"unsupported": info["unsupported"]} if status == 3 else {})))
    return status


if __name__ == "__main__":
    sys.exit(main())
