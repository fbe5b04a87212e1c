"""AdaptiveClip: the accounting of its count queries, its update formula, its validation.

Every ε is checked against a computation written here: the exact Gaussian mechanism
(Balle & Wang 2018, solved with brentq) for ``fixed_epochs``, a ``dp_accounting`` event
built by hand for ``cyclic_poisson``, at the noise multiplier of one participation's
(gradient, count) pair, ``(s²/σ² + 1/σ_c²)^(−1/2)`` (k participations at once for fixed
epochs: ``μ² = Δ_k²/σ² + k/σ_c²``). The update ζ ← ζ·exp(−η·(b̃ − γ)) is checked
against numpy. No model is built (``keras.ops`` runs the update on the default backend).
"""

import json
import math

import dp_accounting
import keras
import numpy as np
import pytest
from dp_accounting import pld, rdp
from scipy import optimize, special

import keras_noisecurve as knc
from keras_noisecurve.mixing.strategies import BLTMixing
from keras_noisecurve.privacy import accounting as acc
from keras_noisecurve.privacy import choice
from keras_noisecurve.privacy.adaptive_clip import AdaptiveClip, clip_count
from keras_noisecurve.privacy.spec import RunSpec

DELTA = 1e-5


# ------------------------------------------------------------------ references
def _gaussian_delta(eps, mu):
    """δ(ε) of the Gaussian mechanism N(μ, 1) vs N(0, 1) (Balle & Wang 2018, Thm. 8)."""
    return special.ndtr(mu / 2 - eps / mu) - math.exp(eps) * special.ndtr(-mu / 2 - eps / mu)


def exact_gaussian_epsilon(mu, delta=DELTA):
    hi = 1.0
    while _gaussian_delta(hi, mu) > delta:
        hi *= 2
    return optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-14, rtol=1e-15)


def poisson_epsilon(sigma_eff, *, q, compositions, accountant, delta=DELTA):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma_eff)), compositions)
    a = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant(value_discretization_interval=1e-4)
    return a.compose(event).get_epsilon(delta)


def _dense_worst(C, k, sep):
    """max over starts p < sep of ‖Σ_{i<k, p+i·sep<T} C[:, p + i·sep]‖ (brute force)."""
    best = 0.0
    for p in range(sep):
        cols = [p + i * sep for i in range(k) if p + i * sep < C.shape[0]]
        best = max(best, float(np.linalg.norm(C[:, cols].sum(axis=1))))
    return best


# ------------------------------------------------------------- fixed epochs
@pytest.mark.parametrize("sigma,sigma_c,k", [(2.0, 5.0, 3), (0.8, 2.5, 1), (4.0, 12.5, 6)])
def test_fixed_epochs_is_the_exact_gaussian_with_the_counts(sigma, sigma_c, k):
    n, B = 1000, 100
    mu = math.sqrt(k / sigma**2 + k / sigma_c**2)
    want = exact_gaussian_epsilon(mu)
    got = acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, count_noise_multiplier=sigma_c, num_examples=n,
                              batch_size=B, epochs=k, sampling="fixed_epochs")
    assert got == pytest.approx(want, rel=1e-6)
    # the counts cost something: without them, μ² = k/σ² only
    without = acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, num_examples=n, batch_size=B, epochs=k,
                                  sampling="fixed_epochs")
    assert without == pytest.approx(exact_gaussian_epsilon(math.sqrt(k) / sigma), rel=1e-6)
    assert got > without
    # the run's ledger: the same exact Gaussian
    run = knc.PrivateRun(num_examples=n, batch_size=B, epochs=k, sampling="fixed_epochs", noise_multiplier=sigma,
                         delta=DELTA, adaptive_clip=AdaptiveClip(count_stddev=sigma_c / 2), seed=0)
    assert run.spec.count_noise_multiplier == sigma_c
    assert run.epsilon() == pytest.approx(want, rel=1e-6)
    # after one epoch (10 steps): one participation
    assert run.epsilon(10) == pytest.approx(exact_gaussian_epsilon(math.sqrt(1 / sigma**2 + 1 / sigma_c**2)),
                                            rel=1e-6)


def test_fixed_epochs_blt_uses_its_sensitivity_and_the_counts():
    n, B, per_epoch, k = 3500, 250, 14, 4
    steps = k * per_epoch
    mixing = BLTMixing([0.95, 0.6, 0.2], [0.25, 0.15, 0.1], steps=steps)
    sigma, sigma_c = 6.0, 4.0
    delta_k = _dense_worst(mixing.to_dense(), k, per_epoch)
    assert delta_k > math.sqrt(k)  # overlapping columns: not the banded √k
    want = exact_gaussian_epsilon(math.sqrt(delta_k**2 / sigma**2 + k / sigma_c**2))
    got = acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, count_noise_multiplier=sigma_c, num_examples=n,
                              batch_size=B, steps=steps, sampling="fixed_epochs", mixing=mixing)
    assert got == pytest.approx(want, rel=1e-6)
    run = knc.PrivateRun(num_examples=n, batch_size=B, steps=steps, mixing=mixing, noise_multiplier=sigma,
                         delta=DELTA, sampling="fixed_epochs", adaptive_clip=AdaptiveClip(count_stddev=sigma_c / 2),
                         seed=0)
    assert run.epsilon() == pytest.approx(want, rel=1e-6)
    delta_2 = _dense_worst(mixing.to_dense(), 2, per_epoch)
    assert run.epsilon(2 * per_epoch) == pytest.approx(
        exact_gaussian_epsilon(math.sqrt(delta_2**2 / sigma**2 + 2 / sigma_c**2)), rel=1e-6)


# ----------------------------------------------------------- cyclic Poisson
def _sigma_eff(sigma, sigma_c):
    return (1 / sigma**2 + 1 / sigma_c**2) ** -0.5


def test_cyclic_poisson_is_the_event_at_the_combined_noise_multiplier():
    n, B, T, b = 5000, 50, 60, 3
    sigma, sigma_c = 1.1, 5.0
    c = knc.MixingMatrix.from_dense(_unit_banded(T, b), bands=b, metadata={"objective": "test"})
    kw = dict(num_examples=n, batch_size=B, steps=T, mixing=c, accountant="rdp")
    got = acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, count_noise_multiplier=sigma_c, **kw)
    want = poisson_epsilon(_sigma_eff(sigma, sigma_c), q=B * b / n, compositions=-(-T // b), accountant="rdp")
    assert got == want
    without = acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, **kw)
    assert without == poisson_epsilon(sigma, q=B * b / n, compositions=-(-T // b), accountant="rdp")
    assert got > without
    # less count noise costs more; more count noise tends to the no-count ε
    gaps = [acc.compute_epsilon(noise_multiplier=sigma, delta=DELTA, count_noise_multiplier=sc, **kw) - without
            for sc in (2.0, 20.0, 200.0, 2e4)]
    assert all(g > 0 for g in gaps)
    assert all(a > b_ for a, b_ in zip(gaps, gaps[1:]))
    assert gaps[-1] < 1e-6 * without
    # the event itself
    event = acc.dp_event(noise_multiplier=sigma, spec=RunSpec(num_examples=n, batch_size=B, steps=T, mixing=c,
                                                              count_noise_multiplier=sigma_c))
    assert event == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(B * b / n, dp_accounting.GaussianDpEvent(_sigma_eff(sigma, sigma_c))),
        -(-T // b))


def _unit_banded(T, b):
    """A random banded C with unit columns (independent of the solver)."""
    rng = np.random.default_rng(4)
    dense = np.zeros((T, T))
    for t in range(T):
        for j in range(min(b, t + 1)):
            dense[t, t - j] = rng.uniform(0.2, 1.0)
    return dense / np.linalg.norm(dense, axis=0, keepdims=True)


# ---------------------------------------------------------------- PrivateRun
N, BATCH, STEPS, EPS = 2000, 50, 40, 2.0


@pytest.fixture(scope="module")
def calibrated_runs():
    clip = AdaptiveClip(initial=0.3, target_quantile=0.7, learning_rate=0.1)
    kw = dict(num_examples=N, batch_size=BATCH, steps=STEPS, epsilon=EPS, delta=DELTA, seed=0)
    return knc.PrivateRun(adaptive_clip=clip, **kw), knc.PrivateRun(**kw)


def test_private_run_calibrates_sigma_for_the_total(calibrated_runs):
    run, plain = calibrated_runs
    sigma_c = 2 * BATCH / 20
    assert run.adaptive_clip == AdaptiveClip(initial=0.3, target_quantile=0.7, learning_rate=0.1)
    assert run.spec.count_noise_multiplier == sigma_c
    assert plain.adaptive_clip is None and plain.spec.count_noise_multiplier is None
    # the total, counts included, is at most the target, and close to it
    q = BATCH / N
    total = poisson_epsilon(_sigma_eff(run.noise_multiplier, sigma_c), q=q, compositions=STEPS, accountant="pld")
    assert total <= EPS * (1 + 1e-9)
    assert abs(total - EPS) / EPS < 1e-3
    assert run.epsilon() <= EPS * (1 + 1e-9)
    assert abs(run.epsilon() - EPS) / EPS < 1e-3
    # the gradient alone at this σ spends less: the counts were paid for
    assert poisson_epsilon(run.noise_multiplier, q=q, compositions=STEPS, accountant="pld") < EPS * (1 - 1e-3)
    assert run.noise_multiplier > plain.noise_multiplier * (1 + 1e-3)


def test_private_run_ledger_agrees_with_compute_epsilon(calibrated_runs):
    run, _ = calibrated_runs
    sigma_c = run.adaptive_clip.count_noise_multiplier(BATCH)
    for step in (1, 13, STEPS):
        want = acc.compute_epsilon(noise_multiplier=run.noise_multiplier, delta=DELTA, count_noise_multiplier=sigma_c,
                                   num_examples=N, batch_size=BATCH, steps=step)
        assert run.epsilon(step) == pytest.approx(want, rel=1e-6)
        assert run.ledger.epsilon(step) == run.epsilon(step)
    want_rdp = poisson_epsilon(_sigma_eff(run.noise_multiplier, sigma_c), q=BATCH / N, compositions=STEPS,
                               accountant="rdp")
    rdp_run = knc.PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=run.noise_multiplier,
                             delta=DELTA, accountant="rdp", adaptive_clip=run.adaptive_clip, seed=0)
    assert rdp_run.epsilon() == pytest.approx(want_rdp, rel=1e-12)


def test_private_run_config_round_trip_and_fingerprint(calibrated_runs):
    run, plain = calibrated_runs
    config = run.get_config()
    assert config["adaptive_clip"] == {"class_name": "AdaptiveClip", "config": {
        "initial": 0.3, "target_quantile": 0.7, "learning_rate": 0.1, "count_stddev": None}}
    assert "adaptive_clip" not in plain.get_config()
    again = knc.PrivateRun.from_config(json.loads(json.dumps(config)))
    assert again.adaptive_clip == run.adaptive_clip
    assert again.noise_multiplier == run.noise_multiplier
    assert again.spec == run.spec
    assert again.fingerprint() == run.fingerprint()
    assert again.epsilon() == run.epsilon()
    assert plain.fingerprint() != run.fingerprint()
    # same σ, with and without the clip: still different plans
    same_sigma = knc.PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=run.noise_multiplier,
                                delta=DELTA, seed=0)
    assert same_sigma.fingerprint() != run.fingerprint()
    other_clip = knc.PrivateRun.from_config({**config, "adaptive_clip": AdaptiveClip(initial=0.5).to_config()})
    assert other_clip.fingerprint() != run.fingerprint()
    assert "adaptive_clip=AdaptiveClip(initial=0.3" in repr(run)
    plain_again = knc.PrivateRun.from_config(json.loads(json.dumps(plain.get_config())))
    assert plain_again.adaptive_clip is None and plain_again.fingerprint() == plain.fingerprint()


def test_private_run_refuses_a_number_as_adaptive_clip():
    with pytest.raises(TypeError, match="adaptive_clip must be a keras_noisecurve.AdaptiveClip"):
        knc.PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=1.0, delta=DELTA,
                       adaptive_clip=0.5)
    with pytest.raises(ValueError, match="AdaptiveClip config"):
        knc.PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=1.0, delta=DELTA,
                       adaptive_clip={"class_name": "AdaptiveClip", "config": {"initial": 0.1}})


def test_calibrate_noise_multiplier_takes_the_counts():
    kw = dict(epsilon=3.0, delta=DELTA, num_examples=N, batch_size=BATCH, steps=STEPS, accountant="rdp")
    with_counts = acc.calibrate_noise_multiplier(count_noise_multiplier=4.0, **kw)
    without = acc.calibrate_noise_multiplier(**kw)
    assert with_counts > without
    recheck = poisson_epsilon(_sigma_eff(with_counts, 4.0), q=BATCH / N, compositions=STEPS, accountant="rdp")
    assert recheck <= 3.0 * (1 + 1e-9) and abs(recheck - 3.0) / 3.0 < 1e-3


def test_sigma_cache_is_keyed_by_the_counts(monkeypatch):
    """``choice.sigma_for`` (the in-process σ cache of ``mixing="auto"``) gives each spec
    its own σ: asked first without counts, then with, it must not hand back the first σ."""
    monkeypatch.setattr(choice, "_SIGMAS", {})
    kw = dict(num_examples=N, batch_size=BATCH, steps=STEPS)
    plain = choice.sigma_for(RunSpec(**kw), epsilon=EPS, delta=DELTA, accountant="rdp")
    counted = choice.sigma_for(RunSpec(**kw, count_noise_multiplier=5.0), epsilon=EPS, delta=DELTA,
                               accountant="rdp")
    assert counted > plain * (1 + 1e-3)
    for sigma, sigma_eff in ((plain, plain), (counted, _sigma_eff(counted, 5.0))):
        recheck = poisson_epsilon(sigma_eff, q=BATCH / N, compositions=STEPS, accountant="rdp")
        assert recheck <= EPS * (1 + 1e-9) and abs(recheck - EPS) / EPS < 1e-3
    # and the other way round, in a fresh cache
    monkeypatch.setattr(choice, "_SIGMAS", {})
    assert choice.sigma_for(RunSpec(**kw, count_noise_multiplier=5.0), epsilon=EPS, delta=DELTA,
                            accountant="rdp") == counted
    assert choice.sigma_for(RunSpec(**kw), epsilon=EPS, delta=DELTA, accountant="rdp") == plain


# ------------------------------------------------------------- the update
def _np(x):
    return np.asarray(keras.ops.convert_to_numpy(x))


def _reference_next(clip, below, real, normal, B, *, eta, gamma, stddev):
    estimate = (below - 0.5 * real + stddev * normal) / B + 0.5
    return clip * np.exp(-eta * (estimate - gamma))


@pytest.mark.parametrize("config", [
    dict(),
    dict(initial=2.0, target_quantile=0.9, learning_rate=0.5),
    dict(initial=0.05, target_quantile=0.1, learning_rate=1.0, count_stddev=3.0),
    dict(learning_rate=0.0),
])
def test_next_clip_is_the_geometric_update(config):
    clip_rule = AdaptiveClip(**config)
    B = 120
    stddev = config.get("count_stddev", B / 20)
    rng = np.random.default_rng(0)
    for _ in range(20):
        clip = float(rng.uniform(0.01, 5.0))
        real = int(rng.integers(80, 160))
        below = int(rng.integers(0, real + 1))
        normal = float(rng.normal())
        got = _np(clip_rule.next_clip(np.float32(clip), np.float32(below), np.float32(real), np.float32(normal), B))
        want = _reference_next(clip, below, real, normal, B, eta=clip_rule.learning_rate,
                               gamma=clip_rule.target_quantile, stddev=stddev)
        assert got.dtype == np.float32 and got.shape == ()
        np.testing.assert_allclose(got, want, rtol=2e-6)
    if config.get("learning_rate", 0.2) == 0.0:  # η = 0: ζ never moves
        assert _np(clip_rule.next_clip(np.float32(0.5), 3.0, 100.0, 2.0, B)) == np.float32(0.5)
    # all examples below ζ and no noise: b̃ = 1, ζ shrinks by exp(−η(1 − γ)); none below: grows by exp(ηγ)
    eta, gamma = clip_rule.learning_rate, clip_rule.target_quantile
    np.testing.assert_allclose(_np(clip_rule.next_clip(1.0, B, B, 0.0, B)), np.exp(-eta * (1 - gamma)), rtol=1e-6)
    np.testing.assert_allclose(_np(clip_rule.next_clip(1.0, 0.0, B, 0.0, B)), np.exp(eta * gamma), rtol=1e-6)


def test_clip_count_leaves_out_padding_and_counts_nan_as_clipped():
    norms = np.array([0.1, 0.5, 0.5001, 2.0, np.nan, np.inf, 0.2, 0.3, 0.0], np.float32)
    weights = np.array([1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.0, 0.0, 2.0], np.float32)
    below, real = (_np(v) for v in clip_count(norms, weights, 0.5))
    # rows of weight 0 (the two before the last) are not examples, even below ζ
    real_rows = weights > 0
    with np.errstate(invalid="ignore"):
        want_below = np.sum((norms <= 0.5) & real_rows)
    assert real == np.sum(real_rows) == 7
    assert below == want_below == 3  # 0.1, 0.5 (≤ is below) and 0.0; nan and inf are clipped
    below_all, real_all = (_np(v) for v in clip_count(norms, None, 0.5))
    assert real_all == 9 and below_all == 5
    # a (P, 1) column of norms and weights is read as (P,)
    below_col, real_col = (_np(v) for v in clip_count(norms[:, None], weights[:, None], np.float32(0.5)))
    assert (below_col, real_col) == (3, 7)


def test_count_noise_multiplier_and_stddev():
    assert AdaptiveClip().count_noise_multiplier(250) == 2 * 250 / 20 == 25.0
    assert AdaptiveClip().stddev(100) == 5.0
    assert AdaptiveClip(count_stddev=3.0).count_noise_multiplier(250) == 6.0
    defaults = AdaptiveClip()
    assert (defaults.initial, defaults.target_quantile, defaults.learning_rate, defaults.count_stddev) == (
        0.1, 0.5, 0.2, None)


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(initial=0.0), ValueError, "initial must be > 0"),
    (dict(initial=-1.0), ValueError, "initial must be > 0"),
    (dict(initial=float("inf")), ValueError, "initial must be finite"),
    (dict(target_quantile=0.0), ValueError, "target_quantile must lie strictly between 0 and 1"),
    (dict(target_quantile=1.0), ValueError, "target_quantile must lie strictly between 0 and 1"),
    (dict(target_quantile=1.5), ValueError, "target_quantile must lie strictly between 0 and 1"),
    (dict(learning_rate=-0.1), ValueError, "learning_rate must be >= 0"),
    (dict(count_stddev=0.0), ValueError, "count_stddev must be > 0"),
    (dict(count_stddev=-2.0), ValueError, "count_stddev must be > 0"),
    (dict(initial="0.1"), TypeError, "initial must be a real number"),
    (dict(target_quantile=None), TypeError, "target_quantile must be a real number"),
    (dict(learning_rate=True), TypeError, "learning_rate must be a real number"),
    (dict(count_stddev="B/20"), TypeError, "count_stddev must be a real number"),
])
def test_validation(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdaptiveClip(**kwargs)


def test_arguments_are_keyword_only_and_config_round_trips():
    with pytest.raises(TypeError):
        AdaptiveClip(0.1)  # noqa
    clip = AdaptiveClip(initial=0.25, target_quantile=0.8, learning_rate=0.3, count_stddev=4.0)
    again = AdaptiveClip.coerce(json.loads(json.dumps(clip.to_config())))
    assert again == clip and hash(again) == hash(clip) and again is not clip
    assert AdaptiveClip.coerce(clip) is clip
    assert AdaptiveClip.coerce(1.0) is None
    assert clip != AdaptiveClip(initial=0.25, target_quantile=0.8, learning_rate=0.3)
    with pytest.raises(ValueError, match="exactly the keys"):
        AdaptiveClip.from_config({"initial": 0.1, "target_quantile": 0.5, "learning_rate": 0.2})
    assert repr(AdaptiveClip()) == ("AdaptiveClip(initial=0.1, target_quantile=0.5, learning_rate=0.2, "
                                    "count_stddev=B/20)")


def test_run_spec_validates_count_noise_multiplier():
    with pytest.raises(ValueError, match="count_noise_multiplier must be > 0"):
        RunSpec(num_examples=N, batch_size=BATCH, steps=STEPS, count_noise_multiplier=0.0)
    with pytest.raises(TypeError, match="count_noise_multiplier must be a real number"):
        RunSpec(num_examples=N, batch_size=BATCH, steps=STEPS, count_noise_multiplier="5")
    assert RunSpec(num_examples=N, batch_size=BATCH, steps=STEPS).count_noise_multiplier is None


def test_choose_mixing_scores_every_candidate_with_the_counts_and_a_run_passes_them():
    """Each candidate's σ includes the count queries (it equals that C's run calibrated with
    them), and PrivateRun(mixing="auto", adaptive_clip=...) chooses with them; a choice made
    with counts is refused by a run without them."""
    plan = dict(num_examples=1000, batch_size=100, steps=20, epsilon=4.0, delta=1e-6)
    counts = knc.AdaptiveClip(count_stddev=2.0).count_noise_multiplier(100)
    with_counts = knc.choose_mixing(max_bands=2, count_noise_multiplier=counts, **plan)
    without = knc.choose_mixing(max_bands=2, **plan)
    for a, b in zip(with_counts.candidates, without.candidates):
        assert a.label == b.label and a.noise_multiplier > b.noise_multiplier
    dpsgd = with_counts.candidates[0]
    assert dpsgd.noise_multiplier == pytest.approx(knc.calibrate_noise_multiplier(
        num_examples=1000, batch_size=100, steps=20, epsilon=4.0, delta=1e-6, count_noise_multiplier=counts),
        rel=1e-9)
    run = knc.PrivateRun(mixing="auto", adaptive_clip=knc.AdaptiveClip(count_stddev=2.0),
                         **plan)
    assert run.mixing_choice.plan["count_noise_multiplier"] == counts
    with pytest.raises(ValueError, match="count_noise_multiplier=4.0 there, None here"):
        knc.PrivateRun(mixing=with_counts, **plan)


def test_unit_weights_marks_rows_with_some_positive_weight_and_leaves_padding_out():
    from keras_noisecurve.privacy.adaptive_clip import clip_count, unit_weights

    positions = np.array([[1.0, 0.0], [0.0, 0.0], [0.5, 0.5], [0.0, 0.0]], "float32")  # rows 1, 3: padding
    rows = np.array([1.0, 1.0, 0.0, 1.0], "float32")  # row 2: weight 0
    np.testing.assert_array_equal(np.asarray(unit_weights(None, positions)), [1, 0, 1, 0])
    np.testing.assert_array_equal(np.asarray(unit_weights(rows, None)), [1, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(unit_weights(rows, positions)), [1, 0, 0, 0])
    assert unit_weights(None, None) is None
    below, real = clip_count(np.zeros(4, "float32"), unit_weights(None, positions), 1.0)
    assert (float(below), float(real)) == (2.0, 2.0)  # zero-norm padding rows would have added +1/2 each


def test_the_clip_stays_within_its_public_bounds():
    from keras_noisecurve.privacy.adaptive_clip import CLIP_RANGE

    clip = knc.AdaptiveClip(initial=0.5, learning_rate=50.0)
    low = float(clip.next_clip(0.5, 250.0, 250.0, 0.0, 250))  # everything unclipped: shrink a lot
    high = float(clip.next_clip(0.5, 0.0, 250.0, 0.0, 250))  # everything clipped: grow a lot
    assert low == pytest.approx(0.5 / CLIP_RANGE, rel=1e-6) and high == pytest.approx(0.5 * CLIP_RANGE, rel=1e-6)
