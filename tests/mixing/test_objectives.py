"""The objective registry (keras_noisecurve.mixing.objectives): names, needs, dense workloads."""

import numpy as np
import pytest

from keras_noisecurve import Spectrum
from keras_noisecurve.mixing import UpdateRule
from keras_noisecurve.mixing.objectives import REGISTRY, Objective, get_objective
from keras_noisecurve.mixing.rule_workloads import PLAIN_ONLY_OBJECTIVES
from keras_noisecurve.mixing.toeplitz_loss import ToeplitzWorkload
from keras_noisecurve.mixing.workloads import (
    CURVATURE_OBJECTIVES,
    LOSS_SCALES,
    OBJECTIVES,
    check_curvature_inputs,
    workload_matrix,
)

# name: (curvature: spectrum + learning rate, blend weight, plain SGD only, reduces to DP-BandMF at λ = 1)
EXPECTED = {
    "dpsgd": (False, False, False, False),
    "bandmf": (False, False, False, True),
    "noisecurve": (True, False, False, False),
    "noisecurve-convergence": (True, False, True, False),
    "noisecurve-all-iterates": (True, False, True, False),
    "noisecurve-blend": (True, True, False, True),
}
SPECTRUM = Spectrum(np.concatenate([np.geomspace(1.0, 1e-3, 6), [0.0]]))
RULES = [None, UpdateRule(momentum=0.9), UpdateRule(schedule="cosine"), UpdateRule(momentum=0.5, schedule="cosine")]


def test_registry_names_and_tables():
    assert tuple(REGISTRY) == OBJECTIVES == tuple(EXPECTED)
    assert CURVATURE_OBJECTIVES == ("noisecurve", "noisecurve-convergence", "noisecurve-all-iterates",
                                    "noisecurve-blend")
    assert PLAIN_ONLY_OBJECTIVES == ("noisecurve-convergence", "noisecurve-all-iterates")
    for name in OBJECTIVES:
        objective = get_objective(name)
        assert isinstance(objective, Objective) and objective.name == name
        assert objective.loss_scale == LOSS_SCALES[name] and objective.loss_scale


@pytest.mark.parametrize("bad", ["noisecurv", "", None, 3, "NoiseCurve"])
def test_unknown_name_is_refused_with_the_allowed_names(bad):
    with pytest.raises(ValueError) as info:
        get_objective(bad)
    message = str(info.value)
    assert repr(bad) in message
    for name in OBJECTIVES:
        assert repr(name) in message


@pytest.mark.parametrize("name", list(EXPECTED))
def test_needs_and_flags(name):
    curvature, blend, plain_only, reduces = EXPECTED[name]
    objective = get_objective(name)
    assert (objective.curvature, objective.blend, objective.plain_sgd_only) == (curvature, blend, plain_only)
    assert objective.reduces_to_bandmf(1.0) == reduces
    assert not objective.reduces_to_bandmf(0.5) or name == "bandmf"
    if not curvature:
        with pytest.raises(ValueError, match="does not use a spectrum or a learning rate"):
            objective.check_unused(spectrum=SPECTRUM, learning_rate=None, blend_weight=None)
    if not blend:
        with pytest.raises(ValueError, match="blend_weight is only used by objective='noisecurve-blend'"):
            objective.check_unused(spectrum=None, learning_rate=None, blend_weight=0.5)
    objective.check_unused(spectrum=SPECTRUM if curvature else None, learning_rate=0.4 if curvature else None,
                           blend_weight=0.5 if blend else None)
    objective.check_rule(UpdateRule(momentum=0.0, schedule="constant"))
    if plain_only:
        with pytest.raises(ValueError, match="only derived for plain constant-rate SGD"):
            objective.check_rule(UpdateRule(momentum=0.9))
    else:
        objective.check_rule(UpdateRule(momentum=0.9, schedule="cosine"))
    if name == "dpsgd":
        with pytest.raises(ValueError, match="bands=1"):
            objective.check_bands(2)
    else:
        objective.check_bands(2)
    objective.check_bands(1)
    assert objective.toeplitz == (name in ("bandmf", "noisecurve", "noisecurve-blend"))
    if not objective.toeplitz:
        with pytest.raises(ValueError, match="not supported for Toeplitz strategies.*'bandmf', 'noisecurve'"):
            objective.toeplitz_workload(ToeplitzWorkload, steps=4)
    else:  # the Toeplitz form is the same W as the dense workload
        inputs = check_curvature_inputs(objective=name, spectrum=SPECTRUM, learning_rate=0.4) if curvature else None
        tw = objective.toeplitz_workload(ToeplitzWorkload, steps=6, inputs=inputs, blend_weight=0.3 if blend else None)
        dense = workload_matrix(objective=name, steps=6, spectrum=SPECTRUM if curvature else None,
                                learning_rate=0.4 if curvature else None, blend_weight=0.3 if blend else None)
        np.testing.assert_allclose(tw.dense(), dense, rtol=1e-12, atol=1e-15)


def test_plain_only_table_agrees_with_the_flags():
    assert set(PLAIN_ONLY_OBJECTIVES) == {name for name in OBJECTIVES if get_objective(name).plain_sgd_only}


def test_rule_loss_scale_only_differs_for_bandmf():
    for name, objective in REGISTRY.items():
        assert objective.loss_scale_for(plain_sgd=True) == LOSS_SCALES[name]
        other = objective.loss_scale_for(plain_sgd=False)
        assert (other != LOSS_SCALES[name]) == (name == "bandmf")


# every objective under every rule it accepts (the plain-only ones: plain SGD only)
CASES = [(name, i) for name in EXPECTED for i in range(len(RULES)) if i == 0 or not EXPECTED[name][2]]


@pytest.mark.parametrize("name, rule_index", CASES)
def test_dense_workload_equals_workload_matrix(name, rule_index):
    steps = 9
    rule = RULES[rule_index]
    objective = get_objective(name)
    kwargs = {}
    inputs = lam = None
    if objective.curvature:
        kwargs = dict(spectrum=SPECTRUM, learning_rate=0.4)
        inputs = check_curvature_inputs(objective=name, spectrum=SPECTRUM, learning_rate=0.4, update_rule=rule,
                                        steps=steps)
    if objective.blend:
        kwargs["blend_weight"] = lam = 0.3
    want = workload_matrix(objective=name, steps=steps, update_rule=rule, **kwargs)
    got = objective.workload(steps=steps, inputs=inputs, blend_weight=lam, update_rule=rule)
    assert got.shape == (steps, steps)
    np.testing.assert_array_equal(got, want)
