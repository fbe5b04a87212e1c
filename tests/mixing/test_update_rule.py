"""Update rules (heavy-ball momentum, learning-rate schedules) and their workloads.

* ``UpdateRule``: its multipliers against Keras's own schedule and hand-computed values,
  validation, the metadata record, the comparison with an optimizer.
* The prefix map ``A_rule`` and its workload against Keras's SGD itself and an
  independent numpy loop over unit gradients; the eq.-1 workload of a rule against a
  forward simulation of impulses (not the backward recursion of the library); both
  against the plain workloads for plain SGD.
* Monte Carlo on a quadratic (as ``test_theorem31.py``): heavy-ball SGD with noise
  σ·(C⁻¹z)_t, the sample means against ``(η²σ²/2)·objective_value`` and
  ``η²σ²·objective_value``.
* The solver: a C solved for the rule beats the plain-SGD C under the rule's workload.
"""

import json
import warnings

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from keras_noisecurve.mixing import MixingMatrix, UpdateRule, objective_value, solve_mixing_matrix, workload_matrix
from keras_noisecurve.mixing.banded import valid_mask
from keras_noisecurve.mixing.rule_workloads import (
    PrefixMap,
    final_loss_factor,
    final_loss_workload,
    prefix_map_matrix,
)
from keras_noisecurve.mixing.surrogate import Problem
from keras_noisecurve.mixing.workloads import check_curvature_inputs, curvature_workload, prefix_workload
from keras_noisecurve.spectrum.artifact import Spectrum

RULES = [
    UpdateRule(momentum=0.9, schedule="cosine"),
    UpdateRule(momentum=0.9, schedule="linear-cooldown"),
    UpdateRule(momentum=0.5, schedule="linear-cooldown", cooldown_fraction=0.6),
    UpdateRule(momentum=0.0, schedule="cosine"),
    UpdateRule(momentum=0.95),
]
RULE_IDS = ["mom0.9-cosine", "mom0.9-cooldown", "mom0.5-cooldown0.6", "cosine", "mom0.95"]


# ------------------------------------------------------------------------- UpdateRule
def test_cosine_multipliers_equal_keras_cosine_decay():
    import keras

    for steps in (1, 7, 40):
        schedule = keras.optimizers.schedules.CosineDecay(1.0, decay_steps=steps)
        keras_values = np.array([float(schedule(t)) for t in range(steps)])
        np.testing.assert_allclose(UpdateRule(schedule="cosine").multipliers(steps), keras_values,
                                   rtol=1e-6, atol=1e-7)  # Keras computes in float32


@pytest.mark.parametrize(
    "steps, fraction, expected",
    [
        # T − T_c = round(0.3·10) = 3 cooldown steps from T_c = 7: 1 − (t − 7)/3
        (10, 0.3, [1, 1, 1, 1, 1, 1, 1, 1, 2 / 3, 1 / 3]),
        # round(2.5) = 2 (Python rounds half to even): T_c = 8
        (10, 0.25, [1, 1, 1, 1, 1, 1, 1, 1, 1, 0.5]),
        # the whole run cools down: 1 − t/4
        (4, 1.0, [1, 0.75, 0.5, 0.25]),
        # round(0.3) = 0 → at least one cooldown step, whose multiplier is still 1
        (3, 0.1, [1, 1, 1]),
    ],
)
def test_linear_cooldown_golden_values(steps, fraction, expected):
    rule = UpdateRule(schedule="linear-cooldown", cooldown_fraction=fraction)
    np.testing.assert_allclose(rule.multipliers(steps), expected, rtol=1e-15, atol=0)


def test_linear_cooldown_default_fraction_and_constant():
    rule = UpdateRule(schedule="linear-cooldown")
    assert rule.cooldown_fraction == 0.25
    np.testing.assert_allclose(rule.multipliers(8), [1, 1, 1, 1, 1, 1, 1, 0.5])
    np.testing.assert_array_equal(UpdateRule().multipliers(5), np.ones(5))


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(momentum=1.0), ValueError, "momentum must lie in [0, 1)"),
        (dict(momentum=-0.1), ValueError, "momentum"),
        (dict(momentum="0.9"), TypeError, "momentum"),
        (dict(schedule="step"), ValueError, "schedule"),
        (dict(schedule="cosine", cooldown_fraction=0.2), ValueError, "only used by schedule='linear-cooldown'"),
        (dict(schedule="linear-cooldown", cooldown_fraction=0.0), ValueError, "cooldown_fraction must lie in (0, 1]"),
        (dict(schedule="linear-cooldown", cooldown_fraction=1.5), ValueError, "cooldown_fraction must lie in (0, 1]"),
        (dict(schedule=[1.0, 0.0]), ValueError, "finite and > 0"),
        (dict(schedule=[1.0, np.nan]), ValueError, "finite and > 0"),
        (dict(schedule=np.ones((2, 2))), ValueError, "1-D array"),
        (dict(schedule=[]), ValueError, "1-D array"),
    ],
)
def test_update_rule_validation(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        UpdateRule(**kwargs)


def test_custom_schedule_length_and_steps_are_checked():
    rule = UpdateRule(schedule=[1.0, 0.5, 0.25])
    assert rule.schedule == "custom"
    np.testing.assert_array_equal(rule.multipliers(3), [1.0, 0.5, 0.25])
    with pytest.raises(ValueError, match="3 multipliers; asked for steps=4"):
        rule.multipliers(4)
    with pytest.raises(ValueError, match="3 multipliers"):
        workload_matrix(objective="bandmf", steps=4, update_rule=rule)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        UpdateRule().multipliers(0)


def test_is_plain():
    assert UpdateRule().is_plain
    assert UpdateRule(schedule=[2.0, 2.0]).is_plain  # constant, if not 1
    assert not UpdateRule(momentum=0.1).is_plain
    assert not UpdateRule(schedule="cosine").is_plain
    assert not UpdateRule(schedule="linear-cooldown").is_plain


@pytest.mark.parametrize("rule", RULES + [UpdateRule(), UpdateRule(momentum=0.3, schedule=[1.0, 0.7, 0.2])],
                         ids=RULE_IDS + ["plain", "custom"])
def test_metadata_round_trip(rule):
    record = rule.to_metadata()
    assert record["optimizer"] == "sgd" and record["nesterov"] is False
    restored = UpdateRule.from_metadata(json.loads(json.dumps(record)))
    assert restored == rule and hash(restored) == hash(rule)
    np.testing.assert_array_equal(restored.multipliers(3), rule.multipliers(3))


def test_metadata_none_is_plain_and_bad_records_are_refused():
    assert UpdateRule.from_metadata(None) == UpdateRule()
    with pytest.raises(ValueError, match="must be a dict"):
        UpdateRule.from_metadata("sgd")
    with pytest.raises(ValueError, match="only heavy-ball SGD"):
        UpdateRule.from_metadata({"optimizer": "adam"})
    with pytest.raises(ValueError, match="only heavy-ball SGD"):
        UpdateRule.from_metadata({"optimizer": "sgd", "nesterov": True})


def test_mismatches():
    rule = UpdateRule(momentum=0.9, schedule="cosine")
    steps = 20
    rates = 0.1 * rule.multipliers(steps)
    assert rule.mismatches(momentum=0.9, learning_rates=rates, base_learning_rate=0.1) == []
    assert rule.mismatches(momentum=0.9) == []
    out = rule.mismatches(momentum=0.0, nesterov=True, learning_rates=np.full(steps, 0.1), base_learning_rate=0.2)
    assert len(out) == 4
    assert "Nesterov" in out[0]
    assert "momentum is 0" in out[1] and "0.9" in out[1]
    assert "'cosine' schedule" in out[2]
    assert "learning rate is 0.1" in out[3] and "0.2" in out[3]
    # a rescaled schedule is the same schedule (ratios to the first step), another base rate
    assert rule.mismatches(momentum=0.9, learning_rates=2 * rates) == []
    assert len(rule.mismatches(momentum=0.9, learning_rates=2 * rates, base_learning_rate=0.1)) == 1


# -------------------------------------------------------------------- the prefix map
def _simulate_prefix_map(rule, steps):
    """A_rule by running Keras's SGD update in numpy on T unit gradients (one coordinate
    each): row t is −(w_{t+1} − w_0) for η = 1."""
    s = rule.multipliers(steps)
    m = np.zeros(steps)
    w = np.zeros(steps)
    rows = []
    for t in range(steps):
        g = np.eye(steps)[t]
        m = rule.momentum * m - s[t] * g
        w = w + m
        rows.append(-w.copy())
    return np.array(rows)


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_prefix_map_against_unrolled_update(rule):
    steps = 23
    a = _simulate_prefix_map(rule, steps)
    np.testing.assert_allclose(prefix_map_matrix(steps, rule), a, rtol=1e-13, atol=1e-15)
    want = a.T @ a
    got = workload_matrix(objective="bandmf", steps=steps, update_rule=rule)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    np.testing.assert_allclose(PrefixMap(steps, rule).trace(), np.trace(want), rtol=1e-13)


def test_prefix_map_against_keras_sgd():
    """The same map from Keras's own ``SGD(momentum=β)`` with a per-step learning rate."""
    import keras

    steps = 12
    rule = UpdateRule(momentum=0.9, schedule="linear-cooldown", cooldown_fraction=0.5)
    eta = 0.1
    table = eta * rule.multipliers(steps)

    class Table(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return keras.ops.take(keras.ops.convert_to_tensor(table, dtype="float32"), step)

    var = keras.Variable(np.zeros(steps), dtype="float64")
    opt = keras.optimizers.SGD(learning_rate=Table(), momentum=rule.momentum)
    rows = []
    for t in range(steps):
        opt.apply_gradients([(keras.ops.convert_to_tensor(np.eye(steps)[t]), var)])
        rows.append(-np.asarray(var) / eta)
    a_keras = np.array(rows)
    np.testing.assert_allclose(prefix_map_matrix(steps, rule), a_keras, rtol=1e-6, atol=1e-7)


def test_prefix_workload_plain_rule_is_prefix_workload():
    for steps in (1, 2, 17, 200):
        np.testing.assert_array_equal(PrefixMap(steps).workload(), prefix_workload(steps))
        np.testing.assert_array_equal(PrefixMap(steps, UpdateRule(schedule=np.ones(steps))).workload(),
                                      prefix_workload(steps))
        assert PrefixMap(steps).trace() == steps * (steps + 1) / 2
        np.testing.assert_array_equal(workload_matrix(objective="bandmf", steps=steps, update_rule=UpdateRule()),
                                      prefix_workload(steps))


@pytest.mark.parametrize("rule", RULES[:3], ids=RULE_IDS[:3])
def test_banded_prefix_factor_gives_the_dense_trace_and_gradient(rule):
    """‖L⁻¹‖_F² with the (b+2)-banded L = C·diag(s)⁻¹(I − βS)(I − S) equals Tr(A_ruleᵀA_rule X⁻¹);
    its gradient (through ``PrefixMap.pullback``) matches central differences."""
    steps, bands = 30, 4
    rng = np.random.default_rng(3)
    ab = np.zeros((bands, steps))
    ab[0] = 1.0 + 0.2 * rng.random(steps)
    ab[1:] = 0.2 * rng.standard_normal((bands - 1, steps))
    ab *= valid_mask(bands, steps)
    dense = np.zeros((steps, steps))
    for d in range(bands):
        dense[np.arange(d, steps), np.arange(steps - d)] = ab[d, : steps - d]
    a = prefix_map_matrix(steps, rule)
    want = np.trace(a @ np.linalg.inv(dense.T @ dense) @ a.T)
    surrogate = Problem(objective="bandmf", steps=steps, update_rule=rule).surrogate
    value, grad = surrogate(ab)
    assert value == pytest.approx(want, rel=1e-10)
    eps = 1e-6
    numeric = np.zeros_like(ab)
    for d in range(bands):
        for c in range(steps - d):
            e = np.zeros_like(ab)
            e[d, c] = eps
            numeric[d, c] = (surrogate(ab + e, gradient=False)[0] - surrogate(ab - e, gradient=False)[0]) / (2 * eps)
    np.testing.assert_allclose(grad, numeric, rtol=0, atol=1e-6 * np.abs(numeric).max())


# --------------------------------------------------------------- the eq.-1 workload
def _impulse_final_deviation(mu, eta, rule, steps):
    """u(j) = −e_T/η for an impulse z̃_j = 1 (σ = 1), by simulating the deviation forward:
    δ_{t+1} = βδ_t − η_t(μ e_t + [t = j]), e_{t+1} = e_t + δ_{t+1}; all j at once."""
    s = rule.multipliers(steps)
    e = np.zeros(steps)  # one entry per impulse position j
    d = np.zeros(steps)
    for t in range(steps):
        impulse = (np.arange(steps) == t).astype(float)
        d = rule.momentum * d - eta * s[t] * (mu * e + impulse)
        e = e + d
    return -e / eta


def _dense_final_workload(mu, m, eta, rule, steps):
    out = np.zeros((steps, steps))
    for mu_i, m_i in zip(mu, m):
        u = _impulse_final_deviation(mu_i, eta, rule, steps)
        out += m_i * mu_i * np.outer(u, u)
    return out


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_final_loss_workload_against_forward_simulation(rule):
    rng = np.random.default_rng(7)
    mu = np.concatenate([10 ** rng.uniform(-4, 0.4, size=12), [0.0]])
    m = rng.integers(1, 4, size=mu.size).astype(float)
    eta, steps = 0.9, 29
    want = _dense_final_workload(mu, m, eta, rule, steps)
    got = workload_matrix(objective="noisecurve", steps=steps, spectrum=Spectrum(mu, m), learning_rate=eta,
                          update_rule=rule)
    np.testing.assert_allclose(got, want, rtol=1e-11, atol=1e-13 * np.abs(want).max())
    u = final_loss_factor(steps=steps, eigenvalues=mu[:3], learning_rate=eta, rule=rule)
    for i in range(3):
        np.testing.assert_allclose(u[:, i], _impulse_final_deviation(mu[i], eta, rule, steps), rtol=1e-11,
                                   atol=1e-14)


@pytest.mark.filterwarnings("ignore:learning_rate × max eigenvalue")  # ημ_max > 1 on purpose
def test_final_loss_workload_plain_rule_is_the_hankel_workload():
    rng = np.random.default_rng(11)
    for steps, eta in ((1, 0.5), (40, 0.9), (600, 0.7)):
        mu = np.concatenate([10 ** rng.uniform(-6, 0.3, size=50), [1.0 / eta]])  # includes ημ = 1 (r = 0)
        m = rng.integers(1, 5, size=mu.size).astype(float)
        inputs = check_curvature_inputs(objective="noisecurve", spectrum=Spectrum(mu, m), learning_rate=eta)
        hankel = curvature_workload(objective="noisecurve", steps=steps, inputs=inputs)
        got = final_loss_workload(steps=steps, eigenvalues=inputs.eigenvalues,
                                  multiplicities=inputs.multiplicities, learning_rate=eta)
        np.testing.assert_allclose(got, hankel, rtol=1e-12, atol=1e-12 * np.abs(hankel).max())
    # and through the public entry point a plain rule is the Hankel workload bit for bit
    kw = dict(objective="noisecurve", steps=40, spectrum=Spectrum(mu, m), learning_rate=0.9)
    np.testing.assert_array_equal(workload_matrix(**kw, update_rule=UpdateRule()), workload_matrix(**kw))


def test_final_loss_workload_chunks_over_eigenvalues(monkeypatch):
    from keras_noisecurve.mixing import rule_workloads

    rule = RULES[1]
    mu = np.geomspace(1.0, 1e-3, 37)
    kw = dict(steps=25, eigenvalues=mu, multiplicities=np.ones(mu.size), learning_rate=0.5, rule=rule)
    whole = final_loss_workload(**kw)
    monkeypatch.setattr(rule_workloads, "_CHUNK_ENTRIES", 25 * 4)  # 4 eigenvalues per chunk
    np.testing.assert_allclose(final_loss_workload(**kw), whole, rtol=1e-13, atol=0)


def test_blend_with_a_rule_is_the_normalised_mix():
    rule = RULES[0]
    spec = Spectrum(np.geomspace(1.0, 1e-3, 20))
    kw = dict(steps=30, spectrum=spec, learning_rate=0.8, update_rule=rule)
    curv = workload_matrix(objective="noisecurve", **kw)
    prefix = workload_matrix(objective="bandmf", steps=30, update_rule=rule)
    got = workload_matrix(objective="noisecurve-blend", blend_weight=0.3, **kw)
    np.testing.assert_allclose(got, 0.7 * curv / np.trace(curv) + 0.3 * prefix / np.trace(prefix), rtol=1e-12)


def test_plain_constant_multiplier_is_plain_sgd_at_the_scaled_rate():
    """β = 0 with s_t = c: SGD at rate ηc, i.e. W = c²·W_plain(ηc) (all-iterates and
    convergence accept it: it is plain constant-rate SGD)."""
    spec = Spectrum(np.geomspace(1.0, 1e-2, 15))
    c, eta, steps = 0.5, 0.8, 20
    rule = UpdateRule(schedule=np.full(steps, c))
    for objective in ("noisecurve", "noisecurve-all-iterates", "noisecurve-convergence"):
        got = workload_matrix(objective=objective, steps=steps, spectrum=spec, learning_rate=eta, update_rule=rule)
        want = workload_matrix(objective=objective, steps=steps, spectrum=spec, learning_rate=eta * c)
        np.testing.assert_allclose(got, c * c * want, rtol=1e-12)
    np.testing.assert_allclose(workload_matrix(objective="bandmf", steps=steps, update_rule=rule),
                               c * c * prefix_workload(steps), rtol=1e-15)


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("objective", ["noisecurve-all-iterates", "noisecurve-convergence"])
def test_plain_only_objectives_refuse_other_rules(objective):
    spec = Spectrum(np.geomspace(1.0, 1e-2, 5))
    for rule in (UpdateRule(momentum=0.9), UpdateRule(schedule="cosine")):
        for call in (
            lambda: workload_matrix(objective=objective, steps=10, spectrum=spec, learning_rate=0.5, update_rule=rule),
            lambda: solve_mixing_matrix(steps=10, bands=2, objective=objective, spectrum=spec, learning_rate=0.5,
                                        update_rule=rule),
            lambda: objective_value(MixingMatrix.identity(10), objective=objective, spectrum=spec,
                                    learning_rate=0.5, update_rule=rule),
        ):
            with pytest.raises(ValueError, match="only derived for plain constant-rate SGD") as info:
                call()
            assert "'noisecurve', 'noisecurve-blend' or 'bandmf'" in str(info.value)


def test_dpsgd_accepts_any_rule():
    rule = RULES[0]
    np.testing.assert_array_equal(workload_matrix(objective="dpsgd", steps=6, update_rule=rule), np.eye(6))
    mixing = solve_mixing_matrix(steps=6, bands=1, objective="dpsgd", update_rule=rule)
    assert mixing.metadata["update_rule"] == rule.to_metadata()
    assert objective_value(mixing, objective="dpsgd", update_rule=rule) == pytest.approx(6.0)


def test_unstable_rate_is_refused_with_the_numbers():
    spec = Spectrum([3.0, 1.0])
    rule = UpdateRule(momentum=0.5, schedule="cosine")
    # η·max(s)·μ_max = 1.0 × 1 × 3 = 3 >= 2(1 + 0.5) = 3
    with pytest.raises(ValueError, match=r"1\.0 × 1 × 3 = 3 >= 2\(1 \+ momentum\) = 3") as info:
        workload_matrix(objective="noisecurve", steps=8, spectrum=spec, learning_rate=1.0, update_rule=rule)
    assert "learning_rate < 1" in str(info.value)
    # just below the limit is accepted (plain SGD would refuse ημ_max = 2.9 >= 2), without a warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = workload_matrix(objective="noisecurve", steps=8, spectrum=spec, learning_rate=2.9 / 3, update_rule=rule)
    assert np.all(np.isfinite(w))
    # a custom schedule's largest multiplier counts
    custom = UpdateRule(momentum=0.5, schedule=[1.0, 2.0, 1.0, 0.5])
    with pytest.raises(ValueError, match="2 × 3 = 6"):
        workload_matrix(objective="noisecurve", steps=4, spectrum=spec, learning_rate=1.0, update_rule=custom)
    # momentum-free constant schedule at its effective rate: warns above 1 as plain SGD does
    with pytest.warns(UserWarning, match="Theorem 3.2"):
        workload_matrix(objective="noisecurve", steps=4, spectrum=spec, learning_rate=0.5,
                        update_rule=UpdateRule(schedule=np.full(4, 0.9)))


def test_update_rule_type_is_checked():
    with pytest.raises(TypeError, match="update_rule must be a keras_noisecurve.mixing.UpdateRule or None"):
        workload_matrix(objective="bandmf", steps=4, update_rule={"momentum": 0.9})
    with pytest.raises(TypeError, match="update_rule must be"):
        solve_mixing_matrix(steps=4, bands=2, objective="bandmf", update_rule=0.9)


# ----------------------------------------------------------------------- Monte Carlo
MC_STEPS = 40
MC_BANDS = 6
MC_ETA = 0.9
MC_SIGMA = 1.0
MC_TRIALS = 4000
MC_P = 200
MC_RULES = {"cosine": UpdateRule(momentum=0.9, schedule="cosine"),
            "cooldown": UpdateRule(momentum=0.9, schedule="linear-cooldown")}


def _mc_spectrum():
    rng = np.random.default_rng(4321)
    return Spectrum(np.sort(10 ** rng.uniform(-2, 0, size=MC_P))[::-1])


@pytest.fixture(scope="module", params=sorted(MC_RULES))
def mc(request):
    rule = MC_RULES[request.param]
    spec = _mc_spectrum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # excursion warnings of the eq.-1 C
        mats = {
            "noisecurve": solve_mixing_matrix(steps=MC_STEPS, bands=MC_BANDS, objective="noisecurve",
                                              spectrum=spec, learning_rate=MC_ETA, update_rule=rule),
            "plain": solve_mixing_matrix(steps=MC_STEPS, bands=MC_BANDS, objective="noisecurve",
                                         spectrum=spec, learning_rate=MC_ETA),
            "bandmf": solve_mixing_matrix(steps=MC_STEPS, bands=MC_BANDS, objective="bandmf", update_rule=rule),
        }
    sims = {name: _simulate(mixing, spec, rule, seed=500) for name, mixing in mats.items()}
    return rule, spec, mats, sims


def _simulate(mixing, spec, rule, *, seed):
    with threadpool_limits(limits=1, user_api="blas"):  # small BLAS calls: threads only contend
        return _simulate_impl(mixing, spec, rule, seed=seed)


def _simulate_impl(mixing, spec, rule, *, seed):
    """Per-trial statistics of Keras-form heavy-ball SGD on L(w) = ½(w−d)ᵀdiag(μ)(w−d):
    m ← βm − η_t(∇L(w) + σ z̃_t), w ← w + m, with z̃ = C⁻¹z (``inverse_apply``).

    Returns arrays of shape (MC_TRIALS,):
      final_gap: L(w̃_T) − L(w_T);
      iterate_noise: Σ_{t<T} ‖w̃⁰_{t+1} − w⁰_{t+1}‖² / p for the same noise and a zero
        Hessian (w⁰: the same update without curvature).
    """
    rng = np.random.default_rng(seed)
    mu = spec.expanded()
    beta = rule.momentum
    rates = MC_ETA * rule.multipliers(MC_STEPS)
    w0 = rng.standard_normal(MC_P)
    d = rng.standard_normal(MC_P)
    final, iterate = [], []
    chunk = 1000
    for _ in range(MC_TRIALS // chunk):
        z = rng.standard_normal((MC_STEPS, chunk * MC_P))
        zt = mixing.inverse_apply(z).reshape(MC_STEPS, chunk, MC_P)
        w = np.broadcast_to(w0, (chunk, MC_P)).copy()
        m = np.zeros((chunk, MC_P))
        wc, mc_ = w0.copy(), np.zeros(MC_P)  # noise-free
        flat_m = np.zeros((chunk, MC_P))  # zero Hessian: only the noise moves it
        flat_dev = np.zeros((chunk, MC_P))
        noise_sq = np.zeros(chunk)
        for t in range(MC_STEPS):
            m = beta * m - rates[t] * (mu * (w - d) + MC_SIGMA * zt[t])
            w = w + m
            mc_ = beta * mc_ - rates[t] * (mu * (wc - d))
            wc = wc + mc_
            flat_m = beta * flat_m - rates[t] * MC_SIGMA * zt[t]
            flat_dev = flat_dev + flat_m
            noise_sq += np.sum(flat_dev**2, axis=1) / MC_P
        loss = 0.5 * np.sum(mu * (w - d) ** 2, axis=1)
        loss_c = 0.5 * np.sum(mu * (wc - d) ** 2)
        final.append(loss - loss_c)
        iterate.append(noise_sq)
    return {"final_gap": np.concatenate(final), "iterate_noise": np.concatenate(iterate)}


def _within(samples, expected, n_se=4.0):
    mean = samples.mean()
    se = samples.std(ddof=1) / np.sqrt(samples.size)
    assert abs(mean - expected) <= n_se * se, (mean, expected, se)


def test_mc_final_gap_matches_the_rule_eq1_objective(mc):
    rule, spec, mats, sims = mc
    for name in ("noisecurve", "plain", "bandmf"):
        theory = MC_ETA**2 * MC_SIGMA**2 / 2 * objective_value(
            mats[name], objective="noisecurve", spectrum=spec, learning_rate=MC_ETA, update_rule=rule)
        _within(sims[name]["final_gap"], theory)
    # the C solved for the rule has the smallest simulated gap (paired differences, 4 s.e.)
    for other in ("plain", "bandmf"):
        diff = sims["noisecurve"]["final_gap"] - sims[other]["final_gap"]
        assert diff.mean() + 4 * diff.std(ddof=1) / np.sqrt(diff.size) < 0, other


def test_mc_iterate_noise_matches_the_rule_prefix_objective(mc):
    rule, spec, mats, sims = mc
    for name in ("noisecurve", "bandmf"):
        theory = MC_ETA**2 * MC_SIGMA**2 * objective_value(mats[name], objective="bandmf", update_rule=rule)
        _within(sims[name]["iterate_noise"], theory)
    # the plain prefix-sum workload is a different number: the rule matters
    plain = MC_ETA**2 * objective_value(mats["bandmf"], objective="bandmf")
    samples = sims["bandmf"]["iterate_noise"]
    assert abs(samples.mean() - plain) > 10 * samples.std(ddof=1) / np.sqrt(samples.size)


def test_mc_blend_is_the_normalised_combination_of_the_simulated_pieces(mc):
    rule, spec, mats, sims = mc
    lam = 0.4
    mixing, sim = mats["noisecurve"], sims["noisecurve"]
    identity = MixingMatrix.identity(MC_STEPS)
    curv_trace = objective_value(identity, objective="noisecurve", spectrum=spec, learning_rate=MC_ETA,
                                 update_rule=rule)
    prefix_trace = objective_value(identity, objective="bandmf", update_rule=rule)
    samples = ((1 - lam) * sim["final_gap"] * 2 / (MC_ETA**2 * MC_SIGMA**2) / curv_trace
               + lam * sim["iterate_noise"] / (MC_ETA**2 * MC_SIGMA**2) / prefix_trace)
    theory = objective_value(mixing, objective="noisecurve-blend", spectrum=spec, learning_rate=MC_ETA,
                             blend_weight=lam, update_rule=rule)
    _within(samples, theory)


# ---------------------------------------------------------------------------- solver
@pytest.mark.parametrize("rule", [UpdateRule(momentum=0.9, schedule="linear-cooldown"),
                                  UpdateRule(momentum=0.9, schedule="cosine")], ids=["cooldown", "cosine"])
def test_solving_for_the_rule_beats_the_plain_c_under_the_rule(rule):
    steps, bands, eta = 60, 5, 0.5
    spec = Spectrum(1.0 / np.arange(1, 201))
    kw = dict(spectrum=spec, learning_rate=eta)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = {"bandmf": solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf"),
                 "noisecurve": solve_mixing_matrix(steps=steps, bands=bands, objective="noisecurve", **kw)}
        matched = {"bandmf": solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf", update_rule=rule),
                   "noisecurve": solve_mixing_matrix(steps=steps, bands=bands, objective="noisecurve",
                                                     update_rule=rule, **kw)}
    for objective, extra in (("bandmf", {}), ("noisecurve", kw)):
        under_rule = {name: objective_value(c[objective], objective=objective, update_rule=rule, **extra)
                      for name, c in (("plain", plain), ("matched", matched))}
        assert under_rule["matched"] < under_rule["plain"] * (1 - 1e-3), (objective, under_rule)
        meta = matched[objective].metadata
        assert meta["update_rule"] == rule.to_metadata()
        assert meta["loss"] == pytest.approx(under_rule["matched"], rel=1e-10)
        assert meta["solver"]["converged"]
        assert plain[objective].metadata["update_rule"] == UpdateRule().to_metadata()
    # the curvature objective's baseline is the DP-BandMF C for the SAME rule
    base = matched["noisecurve"].metadata["baseline_losses"]
    assert base["bandmf"] == pytest.approx(
        objective_value(matched["bandmf"], objective="noisecurve", update_rule=rule, **kw), rel=1e-6)
    assert base["dpsgd"] == pytest.approx(
        objective_value(MixingMatrix.identity(steps), objective="noisecurve", update_rule=rule, **kw), rel=1e-12)
    assert matched["bandmf"].metadata["baseline_losses"]["dpsgd"] == pytest.approx(
        PrefixMap(steps, rule).trace(), rel=1e-12)


def test_objective_value_defaults_to_plain_not_to_the_recorded_rule():
    rule = UpdateRule(momentum=0.9, schedule="cosine")
    mixing = solve_mixing_matrix(steps=20, bands=3, objective="bandmf", update_rule=rule)
    recorded = UpdateRule.from_metadata(mixing.metadata["update_rule"])
    assert recorded == rule
    under_rule = objective_value(mixing, objective="bandmf", update_rule=recorded)
    assert under_rule == pytest.approx(mixing.metadata["loss"], rel=1e-12)
    plain = objective_value(mixing, objective="bandmf")
    dense = mixing.to_dense()
    assert plain == pytest.approx(np.trace(prefix_workload(20) @ np.linalg.inv(dense.T @ dense)), rel=1e-10)
    assert abs(plain - under_rule) > 0.1 * plain


def test_blend_auto_and_blend_one_with_a_rule():
    rule = UpdateRule(momentum=0.9, schedule="linear-cooldown")
    spec = Spectrum(1.0 / np.arange(1, 101))
    kw = dict(steps=40, bands=4, spectrum=spec, learning_rate=0.5, update_rule=rule)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        auto = solve_mixing_matrix(objective="noisecurve-blend", blend_weight="auto", **kw)
        one = solve_mixing_matrix(objective="noisecurve-blend", blend_weight=1.0, **kw)
    bandmf = solve_mixing_matrix(steps=40, bands=4, objective="bandmf", update_rule=rule)
    np.testing.assert_array_equal(one.band_values, bandmf.band_values)  # λ = 1 is the rule's DP-BandMF
    lam = auto.metadata["blend_weight"]
    assert auto.metadata["update_rule"] == rule.to_metadata()
    assert auto.metadata["loss"] == pytest.approx(
        objective_value(auto, objective="noisecurve-blend", blend_weight=lam, spectrum=spec, learning_rate=0.5,
                        update_rule=rule), rel=1e-10)


def test_plain_solves_are_unchanged_by_an_explicit_plain_rule():
    spec = Spectrum(1.0 / np.arange(1, 51))
    for objective, kw in (("bandmf", {}), ("noisecurve", dict(spectrum=spec, learning_rate=0.5))):
        a = solve_mixing_matrix(steps=30, bands=4, objective=objective, **kw)
        b = solve_mixing_matrix(steps=30, bands=4, objective=objective, update_rule=UpdateRule(), **kw)
        np.testing.assert_array_equal(a.band_values, b.band_values)
        assert a.metadata["loss"] == b.metadata["loss"]
        assert a.metadata["update_rule"] == b.metadata["update_rule"] == UpdateRule().to_metadata()


def test_loss_scale_of_the_rule_prefix_workload():
    rule = UpdateRule(momentum=0.5)
    assert "iterate noise" in solve_mixing_matrix(steps=8, bands=2, objective="bandmf", update_rule=rule).metadata[
        "loss_scale"]
    assert "running noise sum" in solve_mixing_matrix(steps=8, bands=2, objective="bandmf").metadata["loss_scale"]
