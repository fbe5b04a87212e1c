"""Our mixing-matrix solvers against jax_privacy's, on the prefix-sum workload.

For every strategy (banded, banded Toeplitz, BLT, BISR), T and b (bands; for BLT d,
buffers) this runs jax_privacy's own solver (``benchmarks/_jax_privacy_solve.py`` under
a separate virtual environment) and ours
(``keras_noisecurve.mixing.solve_mixing_matrix(..., strategy=..., objective="bandmf")``),
each in its own subprocess pinned to one CPU (``taskset -c 0``, ``--cpu``; one BLAS / OpenMP
thread), with a per-run timeout. Every loss printed is sens²·‖A C⁻¹‖_F² computed by
``benchmarks/_loss_check.py`` (numpy / scipy, independent of both solvers) from the
matrix the solver returned. ``seconds`` is the wall time of the solve call only (no
imports); for jax_privacy it includes JIT compilation (``compile s`` shows that part).

jax_privacy lives in its own environment (it needs jax; the project does not)::

    python3.11 -m venv /tmp/jaxp && /tmp/jaxp/bin/pip install jax-privacy

Usage::

    python benchmarks/bench_jax_privacy.py                      # T ∈ {2000, 10⁴, 10⁵}, b ∈ {16, 64}, d ∈ {3, 4}
    python benchmarks/bench_jax_privacy.py --steps 2000 --bands 16 --strategies toeplitz blt
    python benchmarks/bench_jax_privacy.py --participations 4   # k = 4 participations, sep = T // 4
    python benchmarks/bench_jax_privacy.py --only jax_privacy --json out.json

jax_privacy's dense banded optimiser back-propagates through a length-T scan whose state
is T × b, so it needs about 16·T²·b bytes (measured peak 1.1 GB at T = 2000, b = 16;
2.6 GB at b = 64; ≈ 24 GB at T = 10⁴, b = 16) and O(T²·b) time per step; runs whose
estimate exceeds ``--jax-memory-gb`` are reported as skipped rather than started.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _loss_check import prefix_loss  # noqa: E402

STRATEGIES = ("banded", "toeplitz", "blt", "bisr")
TOEPLITZ_KINDS = ("toeplitz", "blt", "bisr")
LIBRARIES = ("jax_privacy", "ours")
DEFAULT_JAX_PYTHON = "/tmp/jaxp/bin/python"
SETUP_HINT = ("create it with:\n    python3.11 -m venv /tmp/jaxp && /tmp/jaxp/bin/pip install jax-privacy\n"
              "or pass --jax-python PATH to an interpreter that can `import jax_privacy`.")
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                     "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}


# --------------------------------------------------------------------------- our solver
def ours(strategy: str, steps: int, bands: int, participations: int = 1, min_separation=None) -> dict:
    """Solve with keras_noisecurve in this process; returns seconds, kind and C's data.

    ``bands`` is b for banded / toeplitz / bisr and the number of buffers d for blt.
    ``participations`` / ``min_separation`` are passed only when solve_mixing_matrix
    accepts keywords of those names (a note says when they were dropped).
    """
    import inspect

    from keras_noisecurve.mixing import solve_mixing_matrix

    params = inspect.signature(solve_mixing_matrix).parameters
    kwargs = dict(steps=steps, objective="bandmf")
    notes = []
    if strategy == "blt" and "buffers" in params:
        kwargs["buffers"] = bands
    else:
        kwargs["bands"] = bands
    if "strategy" in params:
        kwargs["strategy"] = strategy
    elif strategy != "banded":
        raise RuntimeError(f"solve_mixing_matrix has no strategy= keyword yet; cannot solve {strategy!r}")
    else:
        notes.append("solve_mixing_matrix has no strategy= keyword: called without it (banded)")
    if participations > 1:
        sep = steps // participations if min_separation is None else min_separation
        if strategy == "blt":
            for names, value in ((("participations",), participations), (("separation", "min_separation"), sep)):
                name = next((n for n in names if n in params), None)
                if name is None:
                    notes.append(f"solve_mixing_matrix has no {names[0]}= keyword: solved for one participation")
                else:
                    kwargs[name] = value
        else:
            notes.append(f"{strategy}: solved for one participation (participations >= b apart do not "
                         "overlap, so k only scales the loss when b <= sep)")
    start = time.perf_counter()
    mixing = solve_mixing_matrix(**kwargs)
    seconds = time.perf_counter() - start
    kind = getattr(mixing, "kind", "banded")
    result = {"seconds": seconds, "kind": kind, "notes": notes}
    meta = getattr(mixing, "metadata", {}) or {}
    solver = meta.get("solver") if isinstance(meta, dict) else None
    if isinstance(solver, dict):
        result["iterations"] = solver.get("iterations")
        result["converged"] = solver.get("converged")
    if kind in TOEPLITZ_KINDS:
        first = mixing.first_column()
        result["first_column"] = np.asarray(first, dtype=np.float64)
    else:
        result["band_values"] = np.asarray(mixing.band_values, dtype=np.float64)
    return result


def _ours_worker(argv) -> int:
    strategy, steps, bands, k, sep, out = argv
    res = ours(strategy, int(steps), int(bands), int(k), None if sep == "none" else int(sep))
    arrays = {key: res.pop(key) for key in ("first_column", "band_values") if key in res}
    np.savez(out, info=np.asarray(json.dumps(res)), seconds=np.float64(res["seconds"]), **arrays)
    return 0


# --------------------------------------------------------------------------- subprocesses
PIN_CPU = "0"


def _pin_prefix() -> list:
    return ["taskset", "-c", PIN_CPU] if shutil.which("taskset") else []


def _run(cmd, timeout: float) -> tuple:
    """Run cmd in its own process group; returns (returncode or "timeout", elapsed, output tail)."""
    env = dict(os.environ, **SINGLE_THREAD_ENV)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=str(HERE.parent), start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)     # the group this call created
        output, _ = proc.communicate()
        code = "timeout"
    return code, time.perf_counter() - start, (output or "")[-2000:]


def _loss_from_npz(path: Path, steps: int, k: int, sep) -> float:
    with np.load(path) as z:
        if "first_column" in z:
            return prefix_loss(first_column=z["first_column"], steps=steps, participations=k, min_separation=sep)
        return prefix_loss(band_values=z["band_values"], steps=steps, participations=k, min_separation=sep)


def run_one(library: str, strategy: str, steps: int, bands: int, k: int, sep, args, workdir: Path) -> dict:
    row = {"strategy": strategy, "T": steps, "b_or_d": bands, "k": k, "sep": sep, "library": library,
           "seconds": None, "compile_seconds": None, "iterations": None, "loss": None, "status": "ok"}
    out = workdir / f"{library}_{strategy}_{steps}_{bands}_{k}.npz"
    sep_arg = "none" if sep is None else str(sep)
    if library == "jax_privacy":
        if strategy == "banded":
            need_gb = 16.0 * steps * steps * bands / 2 ** 30 + 0.5
            if need_gb > args.jax_memory_gb:
                row["status"] = f"skipped: banded.optimize needs ≈{need_gb:.0f} GB (> --jax-memory-gb)"
                return row
        cmd = _pin_prefix() + [args.jax_python, str(HERE / "_jax_privacy_solve.py"), "--strategy", strategy,
                               "--steps", str(steps), "--bands", str(bands), "--participations", str(k),
                               "--out", str(out)]
        if sep is not None:
            cmd += ["--min-separation", str(sep)]
    else:
        cmd = _pin_prefix() + [sys.executable, str(Path(__file__).resolve()), "--_ours-worker",
                               strategy, str(steps), str(bands), str(k), sep_arg, str(out)]
    code, elapsed, tail = _run(cmd, args.timeout)
    if code == "timeout":
        row["status"] = f"timed out (> {args.timeout:g} s)"
        return row
    if code == 3 and library == "jax_privacy":
        with np.load(out) as z:
            row["status"] = "unsupported: " + json.loads(str(z["info"])).get("unsupported", "")
        return row
    if code != 0 or not out.exists():
        last = [line for line in tail.strip().splitlines() if line.strip()]
        row["status"] = f"failed (exit {code}): " + (last[-1] if last else "no output")
        return row
    with np.load(out) as z:
        info = json.loads(str(z["info"]))
        row["seconds"] = float(z["seconds"])
        if "compile_seconds" in z:
            row["compile_seconds"] = float(z["compile_seconds"])
    row["iterations"] = info.get("iterations")
    row["info"] = info
    try:
        row["loss"] = _loss_from_npz(out, steps, k, sep)
    except Exception as e:  # noqa: BLE001  (report, keep benchmarking)
        row["status"] = f"loss check failed: {type(e).__name__}: {e}"
    return row


# --------------------------------------------------------------------------- main
def _check_jax_python(path: str) -> str:
    if not Path(path).exists():
        raise SystemExit(f"error: jax_privacy interpreter {path} does not exist; {SETUP_HINT}")
    try:
        proc = subprocess.run([path, "-c", "import jax_privacy, jax; print(jax_privacy.__version__, jax.__version__)"],
                              capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: {path} took over 120 s to import jax_privacy") from None
    if proc.returncode != 0:
        raise SystemExit(f"error: {path} cannot import jax_privacy:\n{proc.stderr.strip()[-800:]}\n{SETUP_HINT}")
    return proc.stdout.strip()


def _fmt(x, spec):
    width = int(spec.split(".")[0] or 0)
    return "—".rjust(width) if x is None else format(x, spec)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--_ours-worker":
        return _ours_worker(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, nargs="+", default=[2000, 10_000, 100_000])
    p.add_argument("--bands", type=int, nargs="+", default=[16, 64], help="b for banded / toeplitz / bisr")
    p.add_argument("--buffers", type=int, nargs="+", default=[3, 4],
                   help="d for blt (3: jax_privacy's get_init_blt / optimize_loss default; 0: let "
                        "buffered_toeplitz.optimize pick)")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    p.add_argument("--participations", type=int, nargs="+", default=[1], help="k values (default 1)")
    p.add_argument("--min-separation", type=int, default=None, help="sep (default T // k)")
    p.add_argument("--only", choices=LIBRARIES, default=None, help="run one library only")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per solver run (default 600)")
    p.add_argument("--jax-python", default=DEFAULT_JAX_PYTHON, help=f"default {DEFAULT_JAX_PYTHON}")
    p.add_argument("--jax-memory-gb", type=float, default=8.0,
                   help="skip jax_privacy banded runs estimated above this (default 8)")
    p.add_argument("--cpu", default="0", help="the CPU both solvers are pinned to (taskset -c; default 0)")
    p.add_argument("--json", default=None, help="write all rows (with solver info) to this JSON file")
    args = p.parse_args(argv)
    global PIN_CPU
    PIN_CPU = args.cpu
    libraries = [args.only] if args.only else list(LIBRARIES)
    versions = _check_jax_python(args.jax_python) if "jax_privacy" in libraries else None
    if versions:
        print(f"jax_privacy, jax: {versions}  ({args.jax_python})")
    print(f"pinning: {' '.join(_pin_prefix()) or 'taskset not found: unpinned'}; timeout {args.timeout:g} s")
    header = (f"{'strategy':<9}{'T':>8}{'b/d':>5}{'k':>3}  {'library':<12}{'seconds':>9}{'compile s':>10}"
              f"{'iters':>7}{'loss':>18}{'/ jax_privacy':>15}  status")
    print(header)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_jaxp_") as tmp:
        for strategy in args.strategies:
            sizes = args.buffers if strategy == "blt" else args.bands
            for steps in args.steps:
                for k in args.participations:
                    sep = args.min_separation if (k > 1 and args.min_separation is not None) else (
                        steps // k if k > 1 else None)
                    for bands in sizes:
                        if strategy != "blt" and bands > steps:
                            continue
                        ref = None
                        for library in libraries:
                            row = run_one(library, strategy, steps, bands, k, sep, args, Path(tmp))
                            if library == "jax_privacy":
                                ref = row["loss"]
                            row["ratio_to_jax_privacy"] = (row["loss"] / ref if (row["loss"] is not None and ref)
                                                           else None)
                            rows.append(row)
                            print(f"{strategy:<9}{steps:>8}{bands:>5}{k:>3}  {library:<12}"
                                  f"{_fmt(row['seconds'], '9.2f')}{_fmt(row['compile_seconds'], '10.2f')}"
                                  f"{_fmt(row['iterations'], '7')}{_fmt(row['loss'], '18.10e')}"
                                  f"{_fmt(row['ratio_to_jax_privacy'], '15.9f')}  {row['status']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": versions, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
