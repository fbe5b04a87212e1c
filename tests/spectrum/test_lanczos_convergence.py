"""Lanczos top-k by a stated criterion: every returned eigenvalue's residual is below
tol·max|θ| by default (thick restarts within the matvec budget), or a RuntimeWarning
names those that are not once the budget is spent; deterministic for a seed. The
reference is numpy.linalg.eigvalsh of the dense matrix."""

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
    res, caught = _run(a, max_steps=40)  # a budget of one basis is too few for the cluster
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


def test_defaults_converge_without_a_warning(clustered):
    a, _ = clustered
    res, caught = _run(a)  # the default basis and budget: thick restarts until converged
    assert res.converged.all() and not caught and res.num_restarts > 0
    np.testing.assert_allclose(res.eigenvalues, np.linalg.eigvalsh(a)[::-1][:K], rtol=1e-7)


def _clustered_spectrum(seed, p):
    """Tight clusters at the top (gaps down to 1e-7 relative) over a dense bulk.

    Not exactly repeated values: a single-vector Krylov method (this one, ARPACK too) sees
    one copy of an exactly repeated eigenvalue (docs/spectrum.md)."""
    rng = np.random.default_rng(seed)
    top = np.concatenate([5.0 + 5e-4 * rng.random(8), 4.0 + 4e-2 * rng.random(8), 3.5 + 1e-6 * np.arange(3)])
    bulk = 3.4 * rng.random(p - top.size) ** 2
    q, _ = np.linalg.qr(rng.standard_normal((p, p)))
    a = (q * np.concatenate([top, bulk])) @ q.T
    return 0.5 * (a + a.T)


@pytest.mark.parametrize("seed", range(8))
def test_clustered_top_eigenvalues_converge_for_every_seed(seed):
    """The bound holds seed by seed: |θ_i − λ_i| ≤ tol·λ_1 for every i ≤ k, no warning."""
    p, k = 400, 20
    a = _clustered_spectrum(seed, p)
    true = np.linalg.eigvalsh(a)[::-1][:k]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        res = lanczos_top_k(lambda v: a @ v, dimension=p, k=k, seed=seed)
    assert res.converged.all()
    assert res.num_matvecs <= min(20 * 40, max(p, 80))  # within the documented default budget
    assert np.max(np.abs(res.eigenvalues - true)) <= 1e-8 * true[0]
    # the stated criterion, checked independently of the recurrence: ‖A·y − θ·y‖ ≤ tol·max|θ|
    res = lanczos_top_k(lambda v: a @ v, dimension=p, k=k, seed=seed, return_vectors=True)
    y = res.eigenvectors
    actual = np.linalg.norm(a @ y - y * res.eigenvalues, axis=0)
    assert np.all(actual <= 1e-8 * true[0] + 1e-12)


def test_basis_memory_stays_at_num_steps(clustered):
    a, true = clustered
    res, caught = _run(a, num_steps=12, max_steps=3000)
    assert res.converged.all() and not caught and res.num_restarts > 1
    np.testing.assert_allclose(res.eigenvalues, true, rtol=1e-7)
