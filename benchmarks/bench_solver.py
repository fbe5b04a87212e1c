"""Time and loss of the mixing-matrix solver over a grid of (T, b) and objectives.

Columns: wall seconds and CPU seconds (time.process_time) of the whole call. Run with
``OMP_NUM_THREADS=1`` on a shared machine.

Spectrum: μ_i = 1/i, i = 1 … 2000, η = 0.5 (the solver's speed target, docs/mixing.md
"Solver speed": T = 2000, b = 16, ``noisecurve``, relative optimality 1e-6 in ≤ 20 s on
2 cores).

Usage::

    python benchmarks/bench_solver.py                 # T ∈ {500, 2000, 10000} × b ∈ {4, 16, 64}
    python benchmarks/bench_solver.py --quick         # T ∈ {200} × b ∈ {4, 16}
    python benchmarks/bench_solver.py --steps 2000 --bands 16 --objectives noisecurve
    python benchmarks/bench_solver.py --compare-jax-privacy [options of bench_jax_privacy.py]

``--compare-jax-privacy`` runs every strategy (banded, toeplitz, blt, bisr) side by side
with jax_privacy's solvers for the same problems instead (``bench_jax_privacy.py``:
prefix-sum workload, each solve pinned to one core, every loss from one independent
evaluation); it needs jax-privacy in its own venv (``--jax-python``, default
/tmp/jaxp/bin/python) and says how to make one if it is missing.

Memory: a curvature objective needs the dense T×T workload W (8·T² bytes: 800 MB at
T = 10⁴, plus about as much again for the exact final evaluation) — fine on 24 GB.
The DP-BandMF solve (run first for every (T, b); it is the initial point and the
baseline of the curvature objectives) is cached and its time is reported on its own row.
numpy/scipy only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from keras_noisecurve.mixing import solve_mixing_matrix
from keras_noisecurve.mixing import solver as solver_module


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--compare-jax-privacy" in argv:
        argv.remove("--compare-jax-privacy")
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_jax_privacy

        return bench_jax_privacy.main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[500, 2000, 10000])
    parser.add_argument("--bands", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--objectives", nargs="+", default=["bandmf", "noisecurve"],
                        choices=["bandmf", "noisecurve", "noisecurve-all-iterates", "noisecurve-convergence"])
    parser.add_argument("--tol", type=float, default=1e-6)
    parser.add_argument("--max-iterations", type=int, default=10_000)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true", help="tiny grid: T = 200, b ∈ {4, 16}")
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    steps_list, bands_list = (([200], [4, 16]) if args.quick else (args.steps, args.bands))
    spectrum = 1.0 / np.arange(1, 2001)
    header = (f"{'objective':<24}{'T':>6}{'b':>4}{'seconds':>10}{'cpu s':>9}{'iters':>7}{'converged':>10}"
              f"{'rel.opt':>10}{'loss':>14}{'bandmf loss':>14}{'dpsgd loss':>14}{'rank':>6}")
    print(header)
    for steps in steps_list:
        for bands in bands_list:
            if bands > steps:
                continue
            solver_module._BANDMF_CACHE.clear()
            for objective in args.objectives:
                kw = {} if objective == "bandmf" else dict(spectrum=spectrum, learning_rate=args.learning_rate)
                start, cpu_start = time.perf_counter(), time.process_time()
                mixing = solve_mixing_matrix(steps=steps, bands=bands, objective=objective, tol=args.tol,
                                             max_iterations=args.max_iterations, verbose=args.verbose, **kw)
                wall = time.perf_counter() - start
                cpu = time.process_time() - cpu_start  # the machine is shared: CPU time is the fairer number
                meta = mixing.metadata
                stats = meta["solver"]
                print(f"{objective:<24}{steps:>6}{bands:>4}{wall:>10.2f}{cpu:>9.2f}{stats['iterations']:>7}"
                      f"{str(stats['converged']):>10}{stats['relative_optimality']:>10.2e}{meta['loss']:>14.6g}"
                      f"{meta['baseline_losses']['bandmf']:>14.6g}{meta['baseline_losses']['dpsgd']:>14.6g}"
                      f"{meta['workload_rank']:>6}", flush=True)
                if objective != "bandmf":
                    print(f"{'':<24}(optimisation only: {stats['seconds']:.2f} s; DP-BandMF initial solve "
                          f"included in the wall time if not cached)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
