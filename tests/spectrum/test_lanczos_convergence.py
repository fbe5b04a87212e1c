"""Lanczos top-k by a stated criterion: every returned eigenvalue's residual is below
tol·max|θ|, or a RuntimeWarning names those that are not; deterministic for a seed."""

import warnings

import numpy as np
import pytest

from keras_noisecurve.spectrum.lanczos import lanczos_top_k

P, K = 300, 6


@pytest.fixture(scope="module")
def clustered():
    """A = Q diag(λ) Qᵀ: two isolated eigenvalues over a dense cluster (slow convergence)."""
    rng = np.random.default_rng(0)
    eigs = np.concatenate([[10.0, 10.0, 3.0, 2.9], np.linspace(2.5, 0.01, P - 4)])
    q, _ = np.linalg.qr(rng.standard_normal((P, P)))
    return (q * eigs) @ q.T, np.sort(eigs)[::-1][:K]


def _run(a, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = lanczos_top_k(lambda v: a @ v, dimension=P, k=K, seed=1, **kw)
    return res, [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_unconverged_values_are_named_in_a_warning(clustered):
    a, true = clustered
    res, caught = _run(a)  # the default max_steps is too few for the cluster
    error = np.abs(res.eigenvalues - true) / true
    assert error.max() > 1e-4  # the values are off ...
    assert not res.converged.all()  # ... and flagged ...
    assert len(caught) == 1  # ... and the caller is told which
    message = str(caught[0].message)
    bad = np.flatnonzero(~res.converged).tolist()
    assert f"{len(bad)} of the top {K}" in message and str(bad[:10]) in message
    # the flags are honest: a value flagged converged is within its residual of an eigenvalue
    assert np.all(error[res.converged] * true[res.converged] <= res.residuals[res.converged] + 1e-12)


def test_enough_steps_converge_every_value_without_a_warning(clustered):
    a, true = clustered
    res, caught = _run(a, max_steps=P)
    assert res.converged.all() and not caught
    assert np.all(res.residuals <= 1e-8 * np.max(np.abs(res.eigenvalues)))
    np.testing.assert_allclose(res.eigenvalues, true, rtol=1e-7)


def test_deterministic_given_a_seed(clustered):
    a, _ = clustered
    first, _ = _run(a, max_steps=80)
    again, _ = _run(a, max_steps=80)
    np.testing.assert_array_equal(first.eigenvalues, again.eigenvalues)
    np.testing.assert_array_equal(first.residuals, again.residuals)
