"""The numpy models of benchmarks/accuracy.py against independent computations (fast)."""

import pathlib
import runpy

import numpy as np
import pytest

BENCH = runpy.run_path(str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy.py"),
                       run_name="bench_models")


def _loss(model, w, x, y):
    p = BENCH["softmax"](model.logits(w, x))
    return -np.mean(np.log(p[np.arange(len(y)), y]))


@pytest.fixture(params=["softmax", "mlp"])
def setup(request):
    rng = np.random.default_rng(0)
    x = np.hstack([rng.standard_normal((12, 4)), np.ones((12, 1))])
    y = rng.integers(0, 3, 12)
    if request.param == "softmax":
        model = BENCH["SoftmaxRegression"](5, 3)
        w = rng.standard_normal(model.p) * 0.3
    else:
        model = BENCH["TinyMLP"](5, 3, 4)
        w = model.init(rng) + 0.1
    return model, w, x, y


def test_gradient_matches_finite_differences(setup):
    model, w, x, y = setup
    g = model.mean_gradient(w, x, y)
    fd = np.array([(_loss(model, w + e, x, y) - _loss(model, w - e, x, y)) / 2e-6 for e in np.eye(model.p) * 1e-6])
    np.testing.assert_allclose(g, fd, atol=1e-7)


def test_per_example_norms_and_clipped_sum_match_explicit_gradients(setup):
    model, w, x, y = setup
    per = np.stack([model.mean_gradient(w, x[i : i + 1], y[i : i + 1]) for i in range(len(y))])
    norms, _ = model.per_example(w, x, y)
    np.testing.assert_allclose(norms, np.linalg.norm(per, axis=1), rtol=1e-10)
    clip = float(np.median(norms))
    expected = (per * np.minimum(1.0, clip / norms)[:, None]).sum(axis=0)
    np.testing.assert_allclose(model.clipped_sum(w, x, y, clip), expected, rtol=1e-10, atol=1e-12)


def test_softmax_hessian_matches_finite_differences():
    rng = np.random.default_rng(1)
    model = BENCH["SoftmaxRegression"](4, 3)
    x, y = rng.standard_normal((10, 4)), rng.integers(0, 3, 10)
    w = rng.standard_normal(model.p) * 0.5
    fd = np.stack([(model.mean_gradient(w + e, x, y) - model.mean_gradient(w - e, x, y)) / 2e-6
                   for e in np.eye(model.p) * 1e-6], axis=1)
    np.testing.assert_allclose(model.hessian(w, x, y), fd, atol=1e-7)


def test_cyclic_poisson_batches_use_one_partition_per_step():
    rng = np.random.default_rng(2)
    batches = BENCH["cyclic_poisson_batches"](100, 10, 4, 12, rng)
    owner = {}
    for t, idx in enumerate(batches):
        for i in idx:
            owner.setdefault(int(i), set()).add(t % 4)
    assert all(len(parts) == 1 for parts in owner.values())  # an example lives in one partition
    assert abs(np.mean([len(b) for b in batches]) - 10) < 4


def test_mlp_hvp_matches_finite_differences_along_a_random_direction():
    rng = np.random.default_rng(3)
    model = BENCH["TinyMLP"](5, 3, 4)
    x = np.hstack([rng.standard_normal((20, 4)), np.ones((20, 1))])
    y = rng.integers(0, 3, 20)
    w = model.init(rng) + 0.1
    v = rng.standard_normal(model.p)
    fd = (model.mean_gradient(w + 1e-6 * v, x, y) - model.mean_gradient(w - 1e-6 * v, x, y)) / 2e-6
    np.testing.assert_allclose(model.hvp(w, x, y, v), fd, rtol=1e-5, atol=1e-8)
    h = model.hessian(w, x, y)
    np.testing.assert_allclose(h @ v, model.hvp(w, x, y, v), atol=1e-10)
