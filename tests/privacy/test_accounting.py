"""Accounting tests: every ε is checked against a dp_accounting event built here,
independently of keras_noisecurve's own event construction."""

import math
import subprocess
import sys

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy import special

from keras_noisecurve.mixing.matrix import MixingMatrix
from keras_noisecurve.privacy import accounting as acc

DELTA = 1e-5


def independent_epsilon(sigma, *, n, B, T, b, accountant, delta=DELTA):
    """ε of ⌈T/b⌉ compositions of a q = B·b/n Poisson-subsampled Gaussian."""
    q = B * b / n
    count = (T + b - 1) // b
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count
    )
    if accountant == "pld":
        a = pld.PLDAccountant(value_discretization_interval=1e-4)
    else:
        a = rdp.RdpAccountant()
    return a.compose(event).get_epsilon(delta)


# (n, B, T, b, epsilon)
RDP_GRID = [
    (10_000, 100, 300, 1, 1.0),
    (10_000, 100, 300, 4, 2.0),
    (5_000, 50, 101, 7, 4.0),  # T not divisible by b
    (2_000, 40, 10, 10, 8.0),  # b = T: one composition
]
PLD_GRID = [
    (10_000, 100, 200, 1, 2.0),
    (6_000, 60, 50, 5, 1.0),
]


@pytest.mark.parametrize("n,B,T,b,eps", RDP_GRID)
def test_calibration_rdp_rechecks_against_independent_event(n, B, T, b, eps):
    sigma = acc.calibrate_noise_multiplier(
        epsilon=eps, delta=DELTA, num_examples=n, batch_size=B, steps=T, bands=b, accountant="rdp"
    )
    recheck = independent_epsilon(sigma, n=n, B=B, T=T, b=b, accountant="rdp")
    assert recheck <= eps * (1 + 1e-9)
    assert abs(recheck - eps) / eps < 1e-3
    # minimality: 0.1 % less noise overspends
    assert independent_epsilon(sigma * 0.999, n=n, B=B, T=T, b=b, accountant="rdp") > eps
    # compute_epsilon agrees with the independent construction at other σ too
    for s in (0.7 * sigma, 1.3 * sigma):
        ours = acc.compute_epsilon(
            noise_multiplier=s, delta=DELTA, num_examples=n, batch_size=B, steps=T, bands=b, accountant="rdp"
        )
        assert ours == pytest.approx(independent_epsilon(s, n=n, B=B, T=T, b=b, accountant="rdp"), rel=1e-12)


@pytest.mark.parametrize("n,B,T,b,eps", PLD_GRID)
def test_calibration_pld_rechecks_against_independent_event(n, B, T, b, eps):
    sigma = acc.calibrate_noise_multiplier(
        epsilon=eps, delta=DELTA, num_examples=n, batch_size=B, steps=T, bands=b
    )
    recheck = independent_epsilon(sigma, n=n, B=B, T=T, b=b, accountant="pld")
    assert recheck <= eps * (1 + 1e-9)
    assert abs(recheck - eps) / eps < 1e-3
    # PLD is tighter than RDP, so it needs less noise than the RDP calibration.
    assert independent_epsilon(sigma, n=n, B=B, T=T, b=b, accountant="rdp") > eps


def test_compute_epsilon_pld_matches_independent_event():
    ours = acc.compute_epsilon(noise_multiplier=0.9, delta=DELTA, num_examples=8000, batch_size=80, steps=60, bands=3)
    assert ours == pytest.approx(independent_epsilon(0.9, n=8000, B=80, T=60, b=3, accountant="pld"), rel=1e-12)


def test_dp_event_structure_matches_bandmf_formula():
    event = acc.dp_event(num_examples=1000, batch_size=10, steps=25, bands=4, noise_multiplier=1.5)
    expected = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(10 * 4 / 1000, dp_accounting.GaussianDpEvent(1.5)), 7
    )
    assert event == expected
    fixed = acc.dp_event(num_examples=1000, batch_size=10, steps=300, bands=4, noise_multiplier=1.5,
                         sampling="fixed_epochs", epochs=3)
    assert fixed == dp_accounting.GaussianDpEvent(1.5 / math.sqrt(3))


def test_monotonicity():
    kw = dict(delta=DELTA, num_examples=5000, batch_size=50, bands=2, accountant="rdp")
    eps_steps = [acc.compute_epsilon(noise_multiplier=1.0, steps=t, **kw) for t in (20, 40, 80, 160)]
    assert all(a < b for a, b in zip(eps_steps, eps_steps[1:]))
    eps_sigma = [acc.compute_epsilon(noise_multiplier=s, steps=80, **kw) for s in (0.6, 0.8, 1.2, 2.0)]
    assert all(a > b for a, b in zip(eps_sigma, eps_sigma[1:]))
    kw["accountant"] = "pld"
    a = acc.compute_epsilon(noise_multiplier=1.0, steps=40, **kw)
    b = acc.compute_epsilon(noise_multiplier=1.0, steps=80, **kw)
    assert a < b


def test_steps_not_divisible_by_bands_rounds_compositions_up():
    kw = dict(noise_multiplier=1.0, delta=DELTA, num_examples=3000, batch_size=30, bands=3, accountant="rdp")
    e9, e10, e12 = (acc.compute_epsilon(steps=t, **kw) for t in (9, 10, 12))
    # 10 steps: partition 0 is used at steps 0, 3, 6, 9 -> 4 participations, like 12 steps.
    assert e10 == pytest.approx(e12, rel=1e-12)
    assert e9 < e10
    assert acc.RunSpec(num_examples=3000, batch_size=30, steps=10, bands=3).compositions == 4


def test_bands_equal_steps_is_one_poisson_gaussian():
    n, B, T = 2000, 20, 16
    eps = acc.compute_epsilon(noise_multiplier=1.2, delta=DELTA, num_examples=n, batch_size=B, steps=T,
                              bands=T, accountant="rdp")
    single = rdp.RdpAccountant().compose(
        dp_accounting.PoissonSampledDpEvent(B * T / n, dp_accounting.GaussianDpEvent(1.2))
    ).get_epsilon(DELTA)
    assert eps == pytest.approx(single, rel=1e-12)


def test_fixed_epochs_is_gaussian_with_sqrt_k_sensitivity():
    n, B, k = 1000, 100, 4
    T = k * 10
    for accountant, a in (("rdp", rdp.RdpAccountant()), ("pld", pld.PLDAccountant(value_discretization_interval=1e-4))):
        ours = acc.compute_epsilon(noise_multiplier=3.0, delta=DELTA, num_examples=n, batch_size=B, steps=T,
                                   bands=5, sampling="fixed_epochs", epochs=k, accountant=accountant)
        # k compositions of a sensitivity-1 Gaussian: independent construction.
        ref = a.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(3.0), k)).get_epsilon(DELTA)
        assert ours == pytest.approx(ref, rel=2e-3 if accountant == "pld" else 1e-9)
    # a partial last epoch still counts as an epoch
    assert acc.RunSpec(num_examples=n, batch_size=B, steps=31, sampling="fixed_epochs", epochs=4).epochs == 4


def _random_banded_c(T, b, seed):
    rng = np.random.default_rng(seed)
    dense = np.tril(rng.uniform(0.2, 1.0, (T, T)))
    dense[np.subtract.outer(np.arange(T), np.arange(T)) >= b] = 0
    dense /= np.linalg.norm(dense, axis=0, keepdims=True)
    return MixingMatrix.from_dense(dense, bands=b)


def test_mixing_matrix_sets_bands_and_sensitivity():
    C = _random_banded_c(12, 3, 0)
    kw = dict(noise_multiplier=1.0, delta=DELTA, num_examples=3000, batch_size=30, steps=12, accountant="rdp")
    assert acc.compute_epsilon(mixing=C, **kw) == pytest.approx(acc.compute_epsilon(bands=3, **kw), rel=1e-12)
    assert acc.compute_epsilon(mixing=MixingMatrix.identity(12), **kw) == acc.compute_epsilon(bands=1, **kw)
    with pytest.raises(ValueError, match="does not match the mixing matrix"):
        acc.compute_epsilon(mixing=C, bands=2, **kw)
    with pytest.raises(ValueError, match="exceeds the mixing matrix"):
        acc.compute_epsilon(mixing=C, **{**kw, "steps": 13})
    # a C whose columns have norm 2 (built behind the artifact's back) halves the effective σ
    fake = object.__new__(MixingMatrix)
    fake._band_values = 2.0 * np.asarray(C.band_values)
    fake._metadata = {}
    doubled = acc.compute_epsilon(mixing=fake, **kw)
    assert doubled == pytest.approx(acc.compute_epsilon(bands=3, **{**kw, "noise_multiplier": 0.5}), rel=1e-12)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(num_examples=100, batch_size=30, steps=10, bands=4), "must be < 1"),
        (dict(num_examples=1000, batch_size=10, steps=3, bands=4), "cannot exceed steps"),
        (dict(num_examples=1000, batch_size=10, steps=10, sampling="shuffle"), "sampling must be one of"),
        (dict(num_examples=1000, batch_size=10, steps=10, epochs=2), "only meaningful"),
        (dict(num_examples=1000, batch_size=10, steps=150, sampling="fixed_epochs", epochs=1), "inconsistent"),
        (dict(num_examples=100, batch_size=50, steps=4, bands=3, sampling="fixed_epochs", epochs=2), "steps_per_epoch"),
        (dict(num_examples=1000, batch_size=0, steps=10), "batch_size must be >= 1"),
    ],
)
def test_validation_messages(kwargs, match):
    with pytest.raises(ValueError, match=match):
        acc.compute_epsilon(noise_multiplier=1.0, delta=DELTA, accountant="rdp", **kwargs)


def test_validation_of_budget_arguments():
    kw = dict(num_examples=1000, batch_size=10, steps=10)
    with pytest.raises(ValueError, match="delta"):
        acc.compute_epsilon(noise_multiplier=1.0, delta=1.0, **kw)
    with pytest.raises(ValueError, match="epsilon"):
        acc.calibrate_noise_multiplier(epsilon=0.0, delta=DELTA, **kw)
    with pytest.raises(ValueError, match="accountant"):
        acc.compute_epsilon(noise_multiplier=1.0, delta=DELTA, accountant="prv", **kw)
    with pytest.raises(TypeError, match="num_examples must be an integer"):
        acc.compute_epsilon(noise_multiplier=1.0, delta=DELTA, num_examples=1000.0, batch_size=10, steps=10)


def _exact_tail(m, q, P):
    """P[Binomial(m, q) > P] by summing the pmf in log space (math.lgamma)."""
    logs = [
        math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1) + k * math.log(q) + (m - k) * math.log1p(-q)
        for k in range(P + 1, m + 1)
    ]
    return float(np.exp(special.logsumexp(logs))) if logs else 0.0


@pytest.mark.parametrize("n,B,T,b,target", [(1000, 20, 100, 5, 1e-12), (500, 10, 50, 1, 1e-6)])
def test_padded_batch_size_is_smallest_with_overflow_bound(n, B, T, b, target):
    spec = acc.RunSpec(num_examples=n, batch_size=B, steps=T, bands=b)
    P = acc.padded_batch_size(spec=spec, overflow_probability=target)
    m = -(-n // b) + 1  # largest partition of a neighbouring dataset
    q = B * b / n
    assert T * _exact_tail(m, q, P) <= target
    assert T * _exact_tail(m, q, P - 1) > target
    p = acc.overflow_probability(spec=spec, padded_size=P)
    assert acc.padding(spec=spec, overflow_probability=target) == (P, p)
    assert p == pytest.approx(T * _exact_tail(m, q, P), rel=1e-6)
    assert acc.overflow_delta(epsilon=2.0, overflow_probability=p) == pytest.approx((1 + math.e**2) * p)


def test_calibrate_summary_is_consistent():
    res = acc.calibrate(epsilon=3.0, delta=DELTA, num_examples=4000, batch_size=40, steps=90, bands=4,
                        accountant="rdp")
    assert res.compositions == 23 and res.sampling_probability == pytest.approx(0.04)
    assert res.epsilon == pytest.approx(
        independent_epsilon(res.noise_multiplier, n=4000, B=40, T=90, b=4, accountant="rdp"), rel=1e-12)
    assert res.total_delta >= DELTA and res.total_delta - DELTA < 1e-9


def test_accounting_and_cli_do_not_import_tensorflow():
    import subprocess
    import sys

    code = (
        "import sys, keras_noisecurve as knc, keras_noisecurve.apps.cli_calibrate, keras_noisecurve.privacy.sampler;"
        "knc.compute_epsilon; knc.calibrate_noise_multiplier; knc.dp_event;"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_accounting_does_not_import_tensorflow():
    code = ("import sys, keras_noisecurve.privacy as p; import keras_noisecurve.privacy.events, "
            "keras_noisecurve.privacy.calibration, keras_noisecurve.privacy.overflow; "
            "p.compute_epsilon(noise_multiplier=1.0, delta=1e-5, num_examples=100, batch_size=10, steps=5, "
            "accountant='rdp'); assert 'tensorflow' not in sys.modules, 'tensorflow imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
