"""``solve_mixing_matrix(strategy=...)`` and ``objective_value`` for every strategy.

Losses are checked against a dense ``Tr(W X⁻¹)`` (np.linalg.inv of the dense C, W from
``workload_matrix``): an independent computation.
"""

import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.mixing import BISRMixing, BLTMixing, ToeplitzMixing, objective_value, solve_mixing_matrix
from keras_noisecurve.mixing.workloads import workload_matrix

EIGS = np.geomspace(1e-3, 1.0, 30)


def _dense_loss(C, objective, **kw):
    W = workload_matrix(objective=objective, steps=C.shape[0], **kw)
    Cinv = np.linalg.inv(C)
    return float(np.trace(W @ Cinv @ Cinv.T))


STRATEGIES = [
    ToeplitzMixing.normalised([1.0, 0.5, 0.3, 0.2], steps=80),
    BLTMixing([0.9, 0.4], [0.3, 0.2], steps=80),
    BISRMixing.closed_form(steps=80, bands=5),
]


@pytest.mark.parametrize("mixing", STRATEGIES, ids=lambda m: m.kind)
@pytest.mark.parametrize("objective,kw", [
    ("bandmf", {}),
    ("noisecurve", {"spectrum": EIGS, "learning_rate": 0.5}),
    ("noisecurve-blend", {"spectrum": EIGS, "learning_rate": 0.5, "blend_weight": 0.3}),
], ids=["bandmf", "noisecurve", "blend"])
def test_objective_value_of_every_strategy_matches_dense(mixing, objective, kw):
    got = objective_value(mixing, objective=objective, **kw)
    assert got == pytest.approx(_dense_loss(mixing.to_dense(), objective, **kw), rel=1e-9)


def test_bisr_is_the_closed_form_scored_under_the_objective():
    m = solve_mixing_matrix(steps=120, bands=6, strategy="bisr")
    assert isinstance(m, BISRMixing) and m.inverse_bands == 6
    assert m.metadata["loss"] == pytest.approx(_dense_loss(m.to_dense(), "bandmf"), rel=1e-9)
    # C⁻¹ holds the first 6 coefficients of (1 - x)^(1/2), up to scale
    inv = np.linalg.inv(m.to_dense())[:, 0]
    f = inv[:6] / inv[0]
    assert np.allclose(f, [1, -1 / 2, -1 / 8, -1 / 16, -5 / 128, -7 / 256], atol=1e-12)
    assert np.allclose(inv[6:], 0.0, atol=1e-12)


def test_banded_strategy_records_its_kind():
    m = solve_mixing_matrix(steps=40, bands=3)
    assert isinstance(m, knc.MixingMatrix) and m.metadata["strategy"] == "banded"
    assert m.metadata["loss"] == pytest.approx(_dense_loss(m.to_dense(), "bandmf"), rel=1e-9)


@pytest.mark.parametrize("kwargs,match", [
    ({"strategy": "circulant", "bands": 2}, "strategy"),
    ({"strategy": "banded"}, "needs bands"),
    ({"strategy": "banded", "bands": 2, "buffers": 3}, "buffers=3 does not apply"),
    ({"strategy": "banded", "bands": 2, "participations": 3}, "participations=3 does not apply"),
    ({"strategy": "blt", "bands": 4}, "bands=4 does not apply"),
    ({"strategy": "blt"}, "needs buffers"),
    ({"strategy": "toeplitz"}, "needs bands"),
    ({"strategy": "toeplitz", "bands": 2, "buffers": 2}, "buffers=2 does not apply"),
    ({"strategy": "bisr"}, "needs bands"),
    ({"strategy": "bisr", "bands": 2, "max_iterations": 5}, "max_iterations=5 does not apply"),
    ({"strategy": "toeplitz", "bands": 2, "objective": "noisecurve-convergence"}, "supports objective in"),
    ({"strategy": "bisr", "bands": 2, "update_rule": knc.UpdateRule(momentum=0.9)}, "plain SGD"),
    ({"strategy": "toeplitz", "bands": 2, "initial": STRATEGIES[0]}, "initial="),
])
def test_arguments_that_do_not_apply_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        solve_mixing_matrix(steps=40, **kwargs)


def test_objective_value_refuses_what_the_toeplitz_family_cannot_evaluate():
    with pytest.raises(ValueError, match="supports objective in"):
        objective_value(STRATEGIES[1], objective="noisecurve-all-iterates", spectrum=EIGS, learning_rate=0.5)
    with pytest.raises(ValueError, match="must be a MixingMatrix or a mixing strategy"):
        objective_value(np.eye(3), objective="bandmf")
