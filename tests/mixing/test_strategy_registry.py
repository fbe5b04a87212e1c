"""Every registered strategy, checked against independent dense computations.

For each kind of ``STRATEGY_CLASSES``: (a) the numpy recurrence (``inverse_apply``,
``stream_apply``) equals C⁻¹Z by a dense solve; (b) ``sensitivity`` equals the brute-force
maximum over participation patterns of the dense C (every start, k participations
exactly s apart; and over the leading block for ``steps``); (c) the file and the config
round-trip through ``load_mixing``; (d) the samplings follow bandedness.
"""

import itertools
import json

import numpy as np
import pytest

from keras_noisecurve.mixing import (
    STRATEGY_CLASSES,
    BISRMixing,
    BLTMixing,
    IdentityMixing,
    MixingMatrix,
    ToeplitzMixing,
    load_mixing,
)
from keras_noisecurve.mixing.stream import stream_apply
from keras_noisecurve.privacy.spec import RunSpec

STEPS = 12


def _banded(steps):
    """A b = 3 banded C with rows that differ from step to step, unit columns."""
    rng = np.random.default_rng(7)
    dense = np.zeros((steps, steps))
    for s in range(steps):
        col = np.zeros(steps)
        rows = np.arange(s, min(s + 3, steps))
        col[rows] = rng.uniform(0.2, 1.0, rows.size)
        col[s] += 1.0
        dense[:, s] = col / np.linalg.norm(col)
    return MixingMatrix.from_dense(dense, metadata={"objective": "test"})


EXAMPLES = {
    "banded": _banded,
    "toeplitz": lambda steps: ToeplitzMixing.normalised([1.0, 0.6, 0.3], steps=steps, metadata={"objective": "t"}),
    "blt": lambda steps: BLTMixing(theta=[0.8, 0.3], omega=[0.4, 0.2], steps=steps),
    "bisr": lambda steps: BISRMixing.closed_form(steps=steps, bands=3),
    "dpsgd": lambda steps: IdentityMixing(steps=steps),
}


def test_every_registered_kind_has_an_example_and_its_class_says_its_kind():
    assert set(EXAMPLES) == set(STRATEGY_CLASSES)
    for kind, cls in STRATEGY_CLASSES.items():
        strategy = EXAMPLES[kind](STEPS)
        assert type(strategy) is cls and strategy.kind == kind and strategy.steps == STEPS


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_numpy_recurrence_equals_the_dense_solve(kind):
    strategy = EXAMPLES[kind](STEPS)
    dense = strategy.to_dense()
    assert dense.shape == (STEPS, STEPS) and np.allclose(dense, np.tril(dense))
    z = np.random.default_rng(1).standard_normal((STEPS, 3, 2))
    expected = np.linalg.solve(dense, z.reshape(STEPS, -1)).reshape(z.shape)
    np.testing.assert_allclose(stream_apply(strategy.stream(), z), expected, rtol=0, atol=1e-11)
    np.testing.assert_allclose(strategy.inverse_apply(z), expected, rtol=0, atol=1e-11)
    # a prefix of the steps is the prefix of the noise (online: no look-ahead)
    np.testing.assert_allclose(stream_apply(strategy.stream(), z[:5]), expected[:5], rtol=0, atol=1e-11)
    assert strategy.buffers == strategy.stream().buffers


def _brute_force(dense, participations, separation):
    """max over starts p of ‖Σ_{i<k} C[:, p + i·s]‖ (patterns inside the T steps)."""
    steps = dense.shape[0]
    best = 0.0
    for start in range(steps - (participations - 1) * separation):
        cols = start + separation * np.arange(participations)
        best = max(best, float(np.linalg.norm(dense[:, cols].sum(axis=1))))
    return best


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_sensitivity_is_the_worst_participation_pattern_of_the_dense_c(kind):
    strategy = EXAMPLES[kind](STEPS)
    dense = strategy.to_dense()
    assert strategy.sensitivity() == pytest.approx(np.linalg.norm(dense, axis=0).max(), rel=1e-12)
    for steps in (1, 4, STEPS):  # the leading steps×steps block
        block = dense[:steps, :steps]
        assert strategy.sensitivity(steps=steps) == pytest.approx(np.linalg.norm(block, axis=0).max(), rel=1e-12)
    for k, s in itertools.product((2, 3), (1, 2, 3, 4, 5)):
        if (k - 1) * s >= STEPS:
            continue
        disjoint = strategy.banded and s >= strategy.bands
        if kind == "banded" and not disjoint:  # overlapping columns of an arbitrary C: refused, not guessed
            with pytest.raises(ValueError, match="overlap"):
                strategy.sensitivity(participations=k, separation=s)
            continue
        worst = _brute_force(dense, k, s)
        value = strategy.sensitivity(participations=k, separation=s)
        assert value >= worst * (1 - 1e-12), (k, s)
        # √k·max norm is exact when the pattern from step 0 has k full columns
        full = np.allclose(np.linalg.norm(dense[:, s * np.arange(k)], axis=0), 1.0, rtol=0, atol=1e-12)
        if not disjoint or full:
            assert value == pytest.approx(worst, rel=1e-10), (k, s)


def test_identity_without_a_plan_has_unit_columns_at_any_separation():
    identity = IdentityMixing()
    assert not identity.has_plan and identity.is_identity and identity.buffers == 0
    assert identity.sensitivity(participations=5, separation=1) == pytest.approx(np.sqrt(5), rel=1e-15)
    with pytest.raises(ValueError, match="needs a step plan"):
        identity.to_dense()


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_file_and_config_round_trip_through_the_registry(kind, tmp_path):
    strategy = EXAMPLES[kind](STEPS).with_metadata(note="kept")
    path = tmp_path / f"{kind}.npz"
    strategy.save(path)
    loaded = load_mixing(path)
    assert type(loaded) is type(strategy) and loaded == strategy
    assert loaded.metadata["note"] == "kept" and loaded.digest() == strategy.digest()
    config = json.loads(json.dumps(strategy.to_config()))
    again = load_mixing(config)
    assert type(again) is type(strategy) and again == strategy and again.metadata == strategy.metadata
    z = np.random.default_rng(2).standard_normal(STEPS)
    np.testing.assert_array_equal(again.inverse_apply(z), strategy.inverse_apply(z))


def test_identity_without_a_plan_round_trips(tmp_path):
    identity = IdentityMixing()
    identity.save(tmp_path / "i.npz")
    assert load_mixing(tmp_path / "i.npz") == identity == load_mixing(identity.to_config()) == load_mixing("dpsgd")
    assert identity != IdentityMixing(steps=3) and identity.digest() != IdentityMixing(steps=3).digest()


@pytest.mark.parametrize("kind", sorted(EXAMPLES))
def test_samplings_follow_bandedness_and_the_accountant_asks_the_strategy(kind):
    strategy = EXAMPLES[kind](STEPS)
    assert strategy.allows_sampling("fixed_epochs")
    assert strategy.allows_sampling("cyclic_poisson") == strategy.banded
    if strategy.banded:
        setup = RunSpec(num_examples=60, batch_size=5, steps=STEPS, sampling="cyclic_poisson",
                                 mixing=strategy)
        assert setup.bands == strategy.bands and setup.sensitivity == pytest.approx(1.0, rel=1e-12)
    else:
        with pytest.raises(ValueError, match="needs a banded C"):
            RunSpec(num_examples=60, batch_size=5, steps=STEPS, sampling="cyclic_poisson", mixing=strategy)
    # fixed epochs: ⌈24/4⌉ = 6 steps per epoch, so T = 12 steps are 2 epochs 6 steps apart
    setup = RunSpec(num_examples=24, batch_size=4, steps=STEPS, sampling="fixed_epochs", epochs=2,
                             mixing=strategy)
    dense = strategy.to_dense()
    assert setup.fixed_epoch_sensitivity(2) == pytest.approx(_brute_force(dense, 2, 6), rel=1e-10)
