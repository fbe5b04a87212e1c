"""The training configuration ``noisecurve demo`` uses for each method, as data.

``CONFIGS`` maps each method of the demo ("DP-SGD", "DP-BandMF", "NoiseCurve") to a
plain dict; edit the numbers here (and ``PROVENANCE``, which the demo prints and
stores in ``results.json``) to change what the demo trains. The table is checked when
this module is imported (``validate_configs``), so a typo fails at once with a message
naming the method and the field, not after minutes of spectrum estimation.

Fields (every method has all of them; ``objective`` only NoiseCurve):

``learning_rate``
    η > 0, the base SGD learning rate.
``clip``
    ζ > 0, the per-example L2 clipping norm.
``momentum``
    β ∈ [0, 1), heavy-ball momentum (``keras.optimizers.SGD(momentum=β)``).
``schedule``
    learning-rate schedule: one of ``"constant"``, ``"cosine"``, ``"linear-cooldown"``
    (``keras_noisecurve.mixing.SCHEDULES``; multipliers as ``UpdateRule`` defines them).
``bands``
    b, the band width of C: 1 for DP-SGD (C = I), ≥ 2 for DP-BandMF and NoiseCurve, or
    ``AUTO`` (``"auto"``): DP-BandMF's b and C are ``choose_mixing``'s choice for the demo's
    run and update rule (what ``PrivateRun(mixing="auto")`` trains), and NoiseCurve's b is
    DP-BandMF's (its C solved for its curvature objective at that b, at the same σ(b)).
``objective``
    NoiseCurve only: the curvature objective its C is solved for (one of
    ``keras_noisecurve.mixing.CURVATURE_OBJECTIVES``).

The demo's ``--learning-rate``, ``--clip``, ``--momentum`` and ``--bands`` flags, when
given, override the value of every method (``--bands`` every correlated method, in place
of the auto choice; DP-SGD is b = 1 by definition), and ``--objective`` NoiseCurve's
objective.

numpy/scipy only: importing this module never starts TensorFlow.
"""

from __future__ import annotations

import math

from keras_noisecurve.mixing import DEFAULT_OBJECTIVE as _LIBRARY_DEFAULT
from keras_noisecurve.mixing import workloads as _workloads

__all__ = [
    "AUTO", "CONFIGS", "CURVATURE_OBJECTIVES", "FIELDS", "METHODS", "NOISECURVE_OBJECTIVE", "OBJECTIVE_SOURCE",
    "PROVENANCE", "SCHEDULES", "is_auto", "validate_configs",
]

#: The methods the demo trains, in table order.
METHODS = ("DP-SGD", "DP-BandMF", "NoiseCurve")

#: Learning-rate schedules a demo configuration may name (``UpdateRule``'s named ones).
SCHEDULES = ("constant", "cosine", "linear-cooldown")

#: Fields every method's configuration has (NoiseCurve also has ``objective``).
FIELDS = ("learning_rate", "clip", "momentum", "schedule", "bands")

CURVATURE_OBJECTIVES = tuple(_workloads.CURVATURE_OBJECTIVES)

#: ``bands`` of a correlated method: b from ``choose_mixing`` for the demo's run.
AUTO = "auto"

#: The curvature objective of the NoiseCurve row: ``keras_noisecurve.mixing.DEFAULT_OBJECTIVE``
#: when that is a curvature objective, else the one with the best VALIDATION accuracy for
#: this CNN in ``benchmarks/accuracy_cnn.py`` (docs/results.md, "The demo's CNN, through the
#: library"), pooled over the tuning seed and the four final seeds: ``noisecurve`` (paper
#: eq. 1) at 80.7 % against ``noisecurve-blend``'s 79.2 %, with momentum 0.9. No curvature
#: objective beat DP-BandMF in the numpy benchmarks, so the library default is "bandmf" and
#: the demo names its curvature objective here.
_BEST_CURVATURE_OBJECTIVE = "noisecurve"
NOISECURVE_OBJECTIVE = (
    _LIBRARY_DEFAULT if _LIBRARY_DEFAULT in CURVATURE_OBJECTIVES else _BEST_CURVATURE_OBJECTIVE
)
OBJECTIVE_SOURCE = (
    "keras_noisecurve.mixing.DEFAULT_OBJECTIVE"
    if _LIBRARY_DEFAULT in CURVATURE_OBJECTIVES
    else "keras_noisecurve.apps.demo_configs.NOISECURVE_OBJECTIVE"
)

#: Where the numbers in ``CONFIGS`` come from. Printed by the demo and stored in results.json.
PROVENANCE = (
    "learning rates, clip and momentum validation-tuned for this CNN by benchmarks/accuracy_cnn.py at "
    "eps = 2, T = 140, B = 250, b = 4, clip 1 (momentum 0 or 0.9 x effective learning rate "
    "eta/(1 - momentum) in {1, 2, 4, 8}, one tuning seed): momentum 0.9 won for every method, eta = 0.4 "
    "(DP-SGD, DP-BandMF) and 0.2 (NoiseCurve, eq. 1, chosen over noisecurve-blend on validation over five "
    "seeds); docs/results.md has the table. The demo runs eps = 8, B = 250, 5 epochs (T = 70; DP-SGD's sigma "
    "0.747 against 1.941 at the tuning point) with b chosen by choose_mixing: the learning rates were not "
    "re-tuned there"
)

CONFIGS = {
    "DP-SGD": {
        "learning_rate": 0.4,
        "clip": 1.0,
        "momentum": 0.9,
        "schedule": "constant",
        "bands": 1,
    },
    "DP-BandMF": {
        "learning_rate": 0.4,
        "clip": 1.0,
        "momentum": 0.9,
        "schedule": "constant",
        "bands": AUTO,
    },
    "NoiseCurve": {
        "learning_rate": 0.2,
        "clip": 1.0,
        "momentum": 0.9,
        "schedule": "constant",
        "bands": AUTO,
        "objective": NOISECURVE_OBJECTIVE,
    },
}


def is_auto(bands) -> bool:
    """``bands`` is ``AUTO`` (b from ``choose_mixing``)."""
    return isinstance(bands, str) and bands == AUTO


def _positive_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def validate_configs(configs, provenance=None) -> None:
    """Check a per-method configuration table (and, when given, its provenance string);
    raises ``ValueError`` naming the method and the field (unknown or missing method or
    field, a value out of range)."""
    if provenance is not None and (not isinstance(provenance, str) or not provenance.strip()):
        raise ValueError("demo_configs.PROVENANCE must be a non-empty string saying where the values come from.")
    if not isinstance(configs, dict):
        raise ValueError(f"demo configs must be a dict of method -> config, got {type(configs).__name__}.")
    unknown = sorted(set(configs) - set(METHODS))
    missing = [m for m in METHODS if m not in configs]
    if unknown or missing:
        raise ValueError(f"demo configs must name exactly the methods {METHODS}; "
                         f"unknown: {unknown}, missing: {missing}.")
    for method in METHODS:
        cfg = configs[method]
        where = f"demo config {method!r}"
        if not isinstance(cfg, dict):
            raise ValueError(f"{where} must be a dict, got {type(cfg).__name__}.")
        allowed = FIELDS + (("objective",) if method == "NoiseCurve" else ())
        unknown = sorted(set(cfg) - set(allowed))
        missing = [f for f in allowed if f not in cfg]
        if unknown or missing:
            raise ValueError(f"{where}: fields must be {allowed}; unknown: {unknown}, missing: {missing}.")
        for field in ("learning_rate", "clip"):
            if not _positive_number(cfg[field]):
                raise ValueError(f"{where}: {field} must be a finite number > 0, got {cfg[field]!r}.")
        beta = cfg["momentum"]
        if (not isinstance(beta, (int, float)) or isinstance(beta, bool) or not math.isfinite(beta)
                or not 0.0 <= beta < 1.0):
            raise ValueError(f"{where}: momentum must be a number in [0, 1), got {beta!r}.")
        if cfg["schedule"] not in SCHEDULES:
            raise ValueError(f"{where}: schedule must be one of {SCHEDULES}, got {cfg['schedule']!r}.")
        bands = cfg["bands"]
        auto = method != "DP-SGD" and is_auto(bands)
        if not auto and (isinstance(bands, bool) or not isinstance(bands, int)):
            raise ValueError(f"{where}: bands must be an integer" + ("" if method == "DP-SGD" else f" or {AUTO!r}")
                             + f", got {bands!r}.")
        if method == "DP-SGD" and bands != 1:
            raise ValueError(f"{where}: bands must be 1 (DP-SGD is C = I), got {bands}.")
        if method != "DP-SGD" and not auto and bands < 2:
            raise ValueError(f"{where}: bands must be >= 2 (b = 1 is DP-SGD) or {AUTO!r}, got {bands}.")
        if method == "NoiseCurve" and cfg["objective"] not in CURVATURE_OBJECTIVES:
            raise ValueError(f"{where}: objective must be one of {CURVATURE_OBJECTIVES}, got {cfg['objective']!r}.")


validate_configs(CONFIGS, PROVENANCE)
