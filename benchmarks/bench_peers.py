"""Private training step time of this library against its peers, on the same Keras model definitions.

Models (``benchmarks/_peer_common.py``; the CNN and the transformer are bench_step.py's
``groupnorm_cnn`` and ``transformer_block``, evaluated from its source for every library):
MLP 784-512-512-10 at B = 256, the GroupNorm CNN (32×32×3, ≈41k parameters) at B = 128,
one transformer encoder block (L = 64, width 64, 4 heads) at B = 64. Every private
configuration clips per example at ζ = 1 and adds Gaussian noise with σ = 1; SGD, η = 0.05.

Columns (one process per model × column; the worker scripts are ``_peer_keras3.py`` and ``_peer_tfp.py``):

=================  ==============================================================  ===========
column             what runs                                                       interpreter
=================  ==============================================================  ===========
keras-tf           plain Keras 3, TensorFlow backend (non-private)                 this one
keras-jax          plain Keras 3, JAX backend (non-private)                        --jax-python
ours-dpsgd         ``make_private(model)`` + ``NoiseCurveOptimizer`` DP-SGD        this one
ours-banded16      the same, banded mixing b = 16                                  this one
jax-privacy        jax_privacy 2.0 ``keras_api.make_private`` (DP-SGD, JAX)        --jax-python
tfp-fast           TF Privacy 0.9 ``make_dp_model_class`` + fast-clipping registry  --tfp-python
tfp-vectorized     TF Privacy 0.9 ``VectorizedDPKerasSGDOptimizer``, B microbatches --tfp-python
=================  ==============================================================  ===========

Each worker trains one ``fit`` over warm-up + timed batches; a step is the time between
the ends of consecutive batches (the loss is waited for), the first ``--warmup`` (3) are
dropped and the median of the next ``--steps`` (15) is the cell. Rounds (``--rounds``) run
every model × column once, rotating the column order from round to round, so no library
always runs first or last on a shared machine; with several rounds a cell shows the
median over rounds and the range of the rounds' medians. The ratio is to plain Keras
(TensorFlow) of the same model. Peak memory: each worker's ``ru_maxrss`` (interpreter,
framework and data included), the largest over rounds.

The peers are never dependencies of this library: they live in their own virtual
environments, given by flags (defaults under /tmp). A missing environment skips its
columns with a note and the commands that create it. Versions that work (pinned here)::

    python3.11 -m venv /tmp/jaxp && /tmp/jaxp/bin/pip install jax-privacy==2.0.0 "jax[cpu]==0.10.2" keras==3.15.1
    python3.11 -m venv /tmp/tfp09 && /tmp/tfp09/bin/pip install tensorflow-privacy==0.9.0 \\
        tensorflow==2.15.1 tf-keras==2.15.1

(TF Privacy 0.9 imports tensorflow_estimator, which TensorFlow ≥ 2.16 breaks; with
TensorFlow 2.15 ``tf.keras`` is Keras 2.15, the Keras TF Privacy is written for.)

Usage::

    python benchmarks/bench_peers.py                                # all models and columns, 1 round
    python benchmarks/bench_peers.py --rounds 2 --out /tmp/peers.md --json /tmp/peers.json
    python benchmarks/bench_peers.py --models mlp --columns keras-tf ours-dpsgd tfp-fast
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _peer_common as common  # noqa: E402

#: column -> (worker script, interpreter key, header)
COLUMNS = {
    "keras-tf": ("_peer_keras3.py", "self", "plain Keras (TF)"),
    "keras-jax": ("_peer_keras3.py", "jax", "plain Keras (JAX)"),
    "ours-dpsgd": ("_peer_keras3.py", "self", "this library, DP-SGD"),
    "ours-banded16": ("_peer_keras3.py", "self", "this library, banded b = 16"),
    "jax-privacy": ("_peer_keras3.py", "jax", "jax_privacy 2.0 Keras API (JAX), DP-SGD"),
    "tfp-fast": ("_peer_tfp.py", "tfp", "TF Privacy 0.9 DPModel, fast clipping (Keras 2)"),
    "tfp-vectorized": ("_peer_tfp.py", "tfp", "TF Privacy 0.9 vectorized optimizer (Keras 2)"),
}
REFERENCE = "keras-tf"
#: what each column needs its interpreter to import
NEEDS = {
    "keras-tf": "keras, tensorflow", "ours-dpsgd": "keras, tensorflow, keras_noisecurve",
    "ours-banded16": "keras, tensorflow, keras_noisecurve", "keras-jax": "keras, jax",
    "jax-privacy": "keras, jax, jax_privacy", "tfp-fast": "tensorflow_privacy",
    "tfp-vectorized": "tensorflow_privacy",
}
SETUP = {
    "jax": ("python3.11 -m venv {path} && {path}/bin/pip install jax-privacy==2.0.0 "
            "\"jax[cpu]==0.10.2\" keras==3.15.1"),
    "tfp": ("python3.11 -m venv {path} && {path}/bin/pip install tensorflow-privacy==0.9.0 "
            "tensorflow==2.15.1 tf-keras==2.15.1"),
}


def interpreters(args):
    return {"self": sys.executable, "jax": args.jax_python, "tfp": args.tfp_python}


def check_columns(columns, pythons):
    """Columns whose interpreter can import what they need; prints why and how to fix the others."""
    usable, skipped, probed = [], {}, {}
    for column in columns:
        key = COLUMNS[column][1]
        python = pythons[key]
        if not Path(python).exists():
            skipped[column] = f"no interpreter at {python}"
        else:
            if (python, NEEDS[column]) not in probed:
                probed[(python, NEEDS[column])] = subprocess.run(
                    [python, "-c", f"import {NEEDS[column]}"], env=worker_env(key), capture_output=True,
                    text=True, timeout=300)
            proc = probed[(python, NEEDS[column])]
            if proc.returncode:
                last = (proc.stderr.strip().splitlines() or ["import failed"])[-1]
                skipped[column] = f"{python} cannot import {NEEDS[column]} ({last})"
        if column in skipped:
            flag = {"jax": "--jax-python", "tfp": "--tfp-python"}.get(key)
            hint = ""
            if flag:
                venv = str(Path(python).parent.parent)
                hint = f"; create it with:\n    {SETUP[key].format(path=venv)}\n  or pass {flag} PATH"
            print(f"skipping {column}: {skipped[column]}{hint}", flush=True)
        else:
            usable.append(column)
    return usable, skipped


def worker_env(key):
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["PYTHONPATH"] = str(ROOT) if key == "self" else ""
    if key == "jax":  # importing keras there must not look for TensorFlow
        env["KERAS_BACKEND"] = "jax"
    return env


def run_one(model, column, args, pythons):
    script, key, _ = COLUMNS[column]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [pythons[key], str(HERE / script), "--model", model, "--config", column,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(out)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=worker_env(key), capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.timeout} s"}
        wall = time.perf_counter() - start
        if proc.returncode or not out.exists():
            tail = (proc.stderr.strip().splitlines() or ["(no stderr)"])[-1]
            return {"error": f"exit {proc.returncode}: {tail}"}
        result = json.loads(out.read_text())
        result["wall_s"] = wall
        return result


def _median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def _ms(value):
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def cell(results, reference):
    """'12.3 ms (1.40×)' or with several rounds '12.3 ms [11.9–13.0] (1.40×)'."""
    good = [r for r in results if "median_ms" in r]
    if not good:
        return results[0].get("error", "failed") if results else "—"
    medians = [r["median_ms"] for r in good]
    text = f"{_ms(_median(medians))} ms"
    if len(medians) > 1:
        text += f" [{_ms(min(medians))}–{_ms(max(medians))}]"
    if reference:
        text += f" ({_median(medians) / reference:.2f}×)"
    notes = good[0].get("notes") or {}
    if "path" in notes and notes["path"] != "fast clipping":
        text += " †"
    return text


def table(results, models, columns, skipped, header_lines):
    """The markdown report: header, step-time table, peak-memory table, notes."""
    lines = list(header_lines) + [""]
    lines.append("| model, batch | " + " | ".join(COLUMNS[c][2] for c in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for model in models:
        ref = [r["median_ms"] for r in results.get((model, REFERENCE), []) if "median_ms" in r]
        ref_ms = _median(ref) if ref else None
        cells = [cell(results.get((model, c), []), None if c == REFERENCE else ref_ms) for c in columns]
        lines.append(f"| {common.MODEL_TITLES[model]} | " + " | ".join(cells) + " |")
    lines += ["", "Peak resident memory of each worker process (MiB, interpreter and framework included):", ""]
    lines.append("| model, batch | " + " | ".join(COLUMNS[c][2] for c in columns) + " |")
    lines.append("|---|" + "---|" * len(columns))
    for model in models:
        cells = []
        for c in columns:
            peaks = [r["peak_rss_mib"] for r in results.get((model, c), []) if "peak_rss_mib" in r]
            cells.append(f"{max(peaks):.0f}" if peaks else "—")
        lines.append(f"| {common.MODEL_TITLES[model]} | " + " | ".join(cells) + " |")
    notes = []
    for (model, column), runs in sorted(results.items()):
        for r in runs:
            path = (r.get("notes") or {}).get("path")
            if path and path != "fast clipping":
                notes.append(f"† {column} on {model}: {path}.")
                break
    for column, why in skipped.items():
        notes.append(f"{column} skipped: {why}.")
    if notes:
        lines += [""] + [f"- {n}" for n in dict.fromkeys(notes)]
    return "\n".join(lines) + "\n"


def versions_line(results):
    seen = {}
    for runs in results.values():
        for r in runs:
            for name, version in (r.get("versions") or {}).items():
                seen.setdefault(name, set()).add(f"{version} (Python {r.get('python', '?')})")
    return "; ".join(f"{name} {', '.join(sorted(v))}" for name, v in sorted(seen.items()))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(common.MODELS), choices=list(common.MODELS))
    parser.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS))
    parser.add_argument("--rounds", type=int, default=1, help="times every model × column runs (interleaved)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches (compilation) per run")
    parser.add_argument("--steps", type=int, default=15, help="timed batches per run (median reported)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds allowed to one worker")
    parser.add_argument("--jax-python", default="/tmp/jaxp/bin/python",
                        help="interpreter with keras 3, jax and jax_privacy (keras-jax, jax-privacy)")
    parser.add_argument("--tfp-python", default="/tmp/tfp09/bin/python",
                        help="interpreter with tensorflow_privacy 0.9 (tfp-fast, tfp-vectorized)")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--json", help="also write every worker's result to this JSON file")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.rounds < 1 or args.warmup < 0 or args.steps < 1:
        parser.error(f"need --rounds >= 1, --warmup >= 0, --steps >= 1; got {args.rounds}, {args.warmup}, "
                     f"{args.steps}")
    pythons = interpreters(args)
    columns, skipped = check_columns(args.columns, pythons)
    results = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    for r in range(args.rounds):
        shift = r % max(len(columns), 1)
        order = columns[shift:] + columns[:shift]
        for model in args.models:
            for column in order:
                res = run_one(model, column, args, pythons)
                results.setdefault((model, column), []).append(res)
                shown = f"{res['median_ms']:.1f} ms/step" if "median_ms" in res else res["error"]
                print(f"[round {r + 1}/{args.rounds}] {model:>11} {column:>15}: {shown}", flush=True)
    header = [
        f"Private training step, median of {args.steps} steps after {args.warmup} warm-ups, one process per "
        f"model × column, {args.rounds} interleaved round(s) (started {started}); ζ = 1, σ = 1, SGD.",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU(s), {platform.system()}; "
        "shared with other jobs.",
        f"Versions: {versions_line(results)}.",
        "Command: python benchmarks/bench_peers.py " + " ".join(sys.argv[1:] if argv is None else argv),
    ]
    report = table(results, args.models, columns, skipped, header)
    print("\n" + report)
    if args.out:
        Path(args.out).write_text(report, encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"model": m, "column": c, **res} for (m, c), runs in results.items() for res in runs], indent=1))
    return 0 if any("median_ms" in r for runs in results.values() for r in runs) or not columns else 1


if __name__ == "__main__":
    raise SystemExit(main())
