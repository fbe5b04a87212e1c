"""The KerasHub catalogue on JAX: every backbone of ``tests/training/catalogue.py`` through the
JAX engine against an independent per-example ``jax.grad`` loop.

For each backbone (tiny config in float32 — JAX runs without x64 —, a ``Dense(3)`` head over
its pooled outputs, P = 5):

- engine: what ``clipping="auto"`` ran: ``ghost`` (per-layer ghost norms) or ``vectorized``
  (handed to the whole-model ``vmap`` engine); fallback: layers (or callers clipped whole)
  the ghost engine sent to its per-layer fallback;
- norm error, sum error: the engine (``ghost_clipped_sum``, ``clipping="auto"``, ``jax.jit``,
  training=False) against one ``jax.grad`` of ``stateless_call`` per example, ζ = median norm,
  one example of weight 0 (max |Δnorm| / max norm; ‖Δ clipped sum‖₂ / ‖clipped sum‖₂);
- fit error: one private step through ``make_private`` + ``PrivateRun`` + ``fit`` (noise off,
  ζ = half the smallest norm), its clipped sum −B·Δw against the loop (relative ‖·‖₂);
- seconds: wall time of the row (build, loop, engine, fit; loaded machine).

Prints one Markdown row per backbone as it goes (the JAX table of docs/models.md)::

    KERAS_BACKEND=jax python benchmarks/catalogue_table_jax.py                 # every backbone
    KERAS_BACKEND=jax python benchmarks/catalogue_table_jax.py --models BertBackbone GPT2Backbone
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.training.catalogue

import keras  # noqa: E402

from tests.training import catalogue  # noqa: E402


TOL = 1e-4  # float32, as tests/jax/test_jax_catalogue.py


_SHORT = {
    "XLNetBackbone": "keras-hub's attention mask mixes the examples of a batch",
    "MiTBackbone": "hard-coded Dropout(0.1), on in the fit step only",
    "SegFormerBackbone": "its MiT encoder's hard-coded Dropout(0.1), on in the fit step only",
}


def verdict(name, norm_error, sum_error, fit_error):
    """The result column: ``trains`` within the tolerances of tests/jax/test_jax_catalogue.py
    (1e-4, or its FIT_RTOL_WIDER for a fit step with float32 round-off), ``fails as on
    TensorFlow`` for its XFAIL backbones, ``differs from the loop`` otherwise."""
    from tests.jax.test_jax_catalogue import FIT_RTOL_WIDER, XFAIL

    fit_tol, why = FIT_RTOL_WIDER.get(name, (TOL, None))
    if max(norm_error, sum_error) < TOL and fit_error < fit_tol:
        return "trains" if why is None else f"trains (fit held to {fit_tol:.0e}: float32 round-off, below)"
    if name in XFAIL:  # the reasons in full: tests/jax/test_jax_catalogue.py
        return f"fails as on TensorFlow ({_SHORT.get(name, 'see XFAIL')})"
    return f"differs from the loop (> {TOL:.0e})"


def row(name):
    from keras_noisecurve.backend.jax import ghost

    fallbacks = []
    original = ghost._fallback

    def spying(model, layer, *args, **kwargs):
        fallbacks.append(layer.name)
        return original(model, layer, *args, **kwargs)

    start = time.perf_counter()
    ghost._fallback = spying
    try:
        case = catalogue.make_case(name, dtype="float32")
        got = catalogue.compare_with_loop(case)
        n_fallback = len(set(fallbacks))
        fit_error = catalogue.fit_and_compare(case)  # the weights are untouched by the comparison
    finally:
        ghost._fallback = original
        keras.backend.clear_session()
    seconds = time.perf_counter() - start
    result = verdict(name, got.norm_error, got.sum_error, fit_error)
    return (f"| {name} | {result} | {got.engine} | {n_fallback} | {got.norm_error:.0e} | {got.sum_error:.0e} | "
            f"{fit_error:.0e} | {seconds:.0f} |")


def main(argv=None):
    if keras.backend.backend() != "jax":
        raise SystemExit(f"run with KERAS_BACKEND=jax (Keras runs on {keras.backend.backend()})")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(catalogue.BUILDERS), choices=sorted(catalogue.BUILDERS))
    args = parser.parse_args(argv)
    print("| backbone | result | engine | on the fallback | norm error | sum error | fit error | s |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.models:
        start = time.perf_counter()
        try:
            print(row(name), flush=True)
        except Exception as error:  # noqa: BLE001 - a row that fails is reported, not hidden
            first = (str(error).splitlines() or [""])[0][:200]
            print(f"| {name} | failed: {type(error).__name__}: {first} | | | | | | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
