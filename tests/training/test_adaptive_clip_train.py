"""AdaptiveClip in training (TensorFlow): ζ_t follows the target quantile of the norms.

Each check compares the library with a computation written here:

- the optimizer driven directly with synthetic norms: every step's ζ_{t+1} equals the
  numpy update ``ζ_t·exp(−η·((below − real/2 + s_b·n_t)/B + ½ − γ))`` with ``below``,
  ``real`` counted in numpy (padding rows left out) and ``n_t`` the N(0, 1) draw of the
  noise key's Philox stream ``COUNT_STREAM`` at step t; after 200 steps ζ is within 10 %
  of the distribution's quantile (from numpy);
- η = 0 with ζ_0 a power of two trains bit for bit like a fixed clip at ζ_0;
- a private model's per-example norms from a numpy formula (a linear model whose weights
  do not move): the logged ``l2_norm_clip`` of every step follows the numpy recursion and
  ends near the median norm; one example with a huge gradient moves the update by ζ_t;
- resume from a ``.keras`` file: ζ and the weights equal the uninterrupted run's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_noisecurve as knc
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from keras_noisecurve.training.noise import key_from_seed, standard_normal
from tests.training.adaptive_reference import (adaptive_dp_sgd, count_normal, dp_sgd_case, linear_model,
                                               reference_next)
from tests.training.helpers import noiseless, random_banded_c

# fits without a PrivateRun (fixed batches, norms known in numpy) warn that ε is not tracked
pytestmark = pytest.mark.filterwarnings("ignore:this optimizer has no PrivateRun")


# ------------------------------------------------------------ the optimizer alone
@pytest.mark.parametrize("quantile", [0.5, 0.9])
def test_zeta_tracks_the_quantile_of_a_known_norm_distribution(quantile):
    """200 steps of B = 250 expected examples (Poisson, padded to 300 rows of weight 0),
    norms ~ lognormal(0, 1): ζ_200 is within 10 % of the quantile, each step as numpy's."""
    B, P, steps, seed = 250, 300, 200, 5
    rule = knc.AdaptiveClip(target_quantile=quantile)  # ζ_0 = 0.1, η = 0.2, s_b = B/20
    variable = keras.Variable(np.zeros(4, np.float32))
    opt = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=rule, noise_multiplier=1.0, expected_batch_size=B,
                              seed=seed)
    opt.build([variable])
    assert float(opt.current_clip()) == np.float32(0.1) and opt.adaptive_clip is rule
    rng = np.random.default_rng(1)
    clips, seen = [], []
    for t in range(steps):
        real = min(P, int(rng.poisson(B)))
        norms = rng.lognormal(0.0, 1.0, size=P).astype(np.float32)
        weights = np.zeros(P, np.float32)
        weights[rng.permutation(P)[:real]] = rng.uniform(0.5, 2.0, real)  # any weight > 0 is an example
        zeta = np.float32(opt.current_clip())
        opt.apply_clipped_sum([tf.zeros(4)], [variable], norms=norms, sample_weight=weights)
        below = int(np.sum((norms <= zeta) & (weights > 0)))
        want = reference_next(np.float64(zeta), below, real, count_normal(seed, t), B, rule)
        np.testing.assert_allclose(float(opt.current_clip()), want, rtol=2e-6, err_msg=f"step {t}")
        clips.append(float(opt.current_clip()))
        seen.append(norms[weights > 0])
    assert int(opt.iterations.numpy()) == steps
    target = float(np.quantile(np.concatenate(seen), quantile))  # the norms' quantile, numpy
    assert target == pytest.approx(np.exp({0.5: 0.0, 0.9: 1.2815515655446004}[quantile]), rel=0.05)
    assert abs(clips[-1] - target) / target <= 0.10, (clips[-1], target)
    assert abs(np.exp(np.mean(np.log(clips[-100:]))) - target) / target <= 0.05
    assert clips[0] > 0.1  # moved up from ζ_0, far below the quantile


def test_the_count_noise_is_drawn_and_scaled_by_count_stddev():
    """All norms equal (every example below ζ or every one above): without noise the update
    is a fixed factor, so log(ζ_{t+1}/ζ_t) reveals s_b·n_t; it equals s_b·n_t of
    COUNT_STREAM, for s_b = B/20 and an explicit count_stddev."""
    B, seed = 40, 9
    for rule, stddev in ((knc.AdaptiveClip(initial=1.0), B / 20),
                         (knc.AdaptiveClip(initial=1.0, count_stddev=7.0), 7.0)):
        variable = keras.Variable(np.zeros(2, np.float32))
        opt = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=rule, noise_multiplier=1.0, expected_batch_size=B,
                                  seed=seed)
        opt.build([variable])
        for t in range(5):
            before = float(opt.current_clip())
            w_before = variable.numpy().astype(np.float64)
            norms = np.full(B, 1e-3 if t % 2 else 1e3, np.float32)  # all below / all above
            opt.apply_clipped_sum([tf.zeros(2)], [variable], norms=norms)  # no sample_weight: all rows count
            below = B if t % 2 else 0
            got_noise = (-np.log(float(opt.current_clip()) / before) / rule.learning_rate + rule.target_quantile
                         - 0.5 - (below - B / 2) / B) * B
            np.testing.assert_allclose(got_noise, stddev * count_normal(seed, t), rtol=1e-4, atol=1e-4)
            # the step's gradient noise is ζ_t·σ·z_t, at the clip BEFORE this step's update
            z = standard_normal(key_from_seed(seed), t, 0, (2,)).numpy().astype(np.float64)
            np.testing.assert_allclose(variable.numpy() - w_before, -0.1 * before * 1.0 * z / B, rtol=1e-5, atol=1e-9)


def test_optimizer_defaults_config_and_current_clip():
    fixed = NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=4, seed=0)
    assert fixed.l2_norm_clip == 1.0 and fixed.adaptive_clip is None and fixed.current_clip() == 1.0
    assert NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=0.3, noise_multiplier=1.0, expected_batch_size=4,
                               seed=0).current_clip() == 0.3
    rule = knc.AdaptiveClip(initial=0.25, target_quantile=0.8, learning_rate=0.4, count_stddev=2.0)
    opt = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=rule, noise_multiplier=1.0, expected_batch_size=4,
                              seed=0)
    config = opt.get_config()
    assert config["l2_norm_clip"] == rule.to_config()
    again = NoiseCurveOptimizer.from_config(config)
    assert again.adaptive_clip == rule and again.l2_norm_clip == 0.25
    variables = [keras.Variable(np.zeros(3, np.float32))]
    opt.build(variables)
    assert opt._clip.name == "l2_norm_clip" and opt._clip.dtype == "float32" and tuple(opt._clip.shape) == ()
    assert float(opt.current_clip()) == 0.25
    assert any(v is opt._clip for v in opt.variables)  # saved and restored with the optimizer
    # from a run: its adaptive clip, l2_norm_clip left out
    run = knc.PrivateRun(num_examples=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5, seed=0,
                         adaptive_clip=rule)
    from_run = NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=0)
    assert from_run.adaptive_clip == rule and from_run.l2_norm_clip == 0.25
    same = NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=rule.to_config(), seed=0)  # the same clip
    assert same.adaptive_clip == rule


# ----------------------------------------------------------------- refusals
def test_refusals():
    rule = knc.AdaptiveClip()
    plan = dict(num_examples=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5, seed=0)
    without = knc.PrivateRun(**plan)
    with pytest.raises(ValueError, match="but the run has no adaptive clip"):
        NoiseCurveOptimizer(run=without, learning_rate=0.1, l2_norm_clip=rule)
    with_clip = knc.PrivateRun(**plan, adaptive_clip=rule)
    with pytest.raises(ValueError, match="differs from the run's adaptive clip"):
        NoiseCurveOptimizer(run=with_clip, learning_rate=0.1, l2_norm_clip=knc.AdaptiveClip(initial=0.2))
    with pytest.raises(ValueError, match="differs from the run's adaptive clip"):
        NoiseCurveOptimizer(run=with_clip, learning_rate=0.1, l2_norm_clip=0.1)
    # apply_clipped_sum without the norms
    opt = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=rule, noise_multiplier=1.0, expected_batch_size=4,
                              seed=0)
    variable = keras.Variable(np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="needs the step's per-example norms"):
        opt.apply_clipped_sum([tf.zeros(3)], [variable])
    np.testing.assert_array_equal(variable.numpy(), np.zeros(3))  # nothing applied
    assert int(opt.iterations.numpy()) == 0 and float(opt.current_clip()) == np.float32(0.1)


def test_mirrored_strategy_with_two_replicas_is_refused():
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the 2 logical CPU devices created by tests/conftest.py")
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:2]])
    with strategy.scope():
        variables = [keras.Variable(np.zeros(3, np.float32))]
        opt = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=knc.AdaptiveClip(), noise_multiplier=1.0,
                                  expected_batch_size=4, seed=0)
        with pytest.raises(ValueError, match="not supported under tf.distribute with 2 replicas"):
            opt.build(variables)
        fixed = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4,
                                    seed=0)
        fixed.build(variables)  # a fixed clip is fine there


def test_tf_privacy_query_refuses_a_run_with_an_adaptive_clip():
    try:
        from keras_noisecurve.integrations.tf_privacy import BandedMatrixFactorizationQuery
    except ImportError:
        pytest.skip("needs tensorflow-privacy: the tf-privacy extra (Python <= 3.11)")
    run = knc.PrivateRun(num_examples=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5, seed=0,
                         adaptive_clip=knc.AdaptiveClip())
    with pytest.raises(ValueError, match="the run has an adaptive clip"):
        BandedMatrixFactorizationQuery.from_run(run, l2_norm_clip=1.0, template=[(3,)], seed=0)


# -------------------------------------------------------- η = 0 is a fixed clip
N, B, T = 60, 6, 8


def _data(n=N):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, :1] - 0.5 * x[:, 1:2] + 0.3).astype("float32")


def _initial_weights():
    keras.utils.set_random_seed(3)
    return _small().get_weights()


def _small():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


@pytest.mark.parametrize("kind", ["dpsgd", "banded"])
def test_learning_rate_zero_trains_exactly_like_a_fixed_clip(kind):
    mixing = "dpsgd" if kind == "dpsgd" else random_banded_c(T, 3, rng=np.random.default_rng(2), diag_scale=0.5)
    init = _initial_weights()
    results = []
    for clip in (knc.AdaptiveClip(initial=0.5, learning_rate=0.0), None):
        run = knc.PrivateRun(num_examples=N, batch_size=B, steps=T, mixing=mixing, noise_multiplier=1.3,
                             delta=1e-5, seed=7, adaptive_clip=clip)
        base = _small()
        base.set_weights(init)
        private = make_private(base)
        optimizer = (NoiseCurveOptimizer(run=run, learning_rate=0.5, seed=11) if clip is not None else
                     NoiseCurveOptimizer(run=run, learning_rate=0.5, l2_norm_clip=0.5, seed=11))
        private.compile(optimizer=optimizer, loss="mse")
        history = private.fit(run.dataset(*_data()), verbose=0)
        assert int(optimizer.iterations.numpy()) == T
        if clip is not None:
            assert float(optimizer.current_clip()) == 0.5
            assert all(v == 0.5 for v in history.history["l2_norm_clip"])
        else:
            assert "l2_norm_clip" not in history.history
        results.append(base.get_weights())
    adaptive, fixed = results
    for a, f, w0 in zip(adaptive, fixed, init):
        np.testing.assert_array_equal(a, f)
    assert any(not np.allclose(a, w0, atol=1e-3) for a, w0 in zip(adaptive, init))  # it trained


# ----------------------------------------- a private model: norms known in numpy
def _linear(weights=None):
    model = linear_model()
    if weights is not None:
        model.set_weights(weights)
    return model


def _linear_norms(model, x, y):
    """‖∇_(w, b) (w·x + b − y)²‖ = 2|r|·√(‖x‖² + 1), r the residual (numpy, float64)."""
    kernel, bias = (np.asarray(w, np.float64) for w in model.get_weights())
    r = x.astype(np.float64) @ kernel[:, 0] + bias[0] - y[:, 0]
    return 2 * np.abs(r) * np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=1) + 1)


class _Clips(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logged, self.after = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.logged.append(float(logs["l2_norm_clip"]))
        self.after.append(float(self.model.optimizer.current_clip()))


def test_fit_logs_zeta_of_every_step_and_it_moves_to_the_median_norm():
    """The weights do not move (η tiny, σ = 0), so the norms are the numpy formula's at
    every step: ζ_t logged by fit follows the numpy recursion from ζ_0 and ends near
    their median."""
    n, batch, epochs, seed = 240, 24, 6, 13
    rng = np.random.default_rng(4)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x @ np.array([[1.0], [0.5], [-0.5]]) + rng.normal(size=(n, 1))).astype("float32")
    model = _linear()
    norms = _linear_norms(model, x, y)
    median = float(np.median(norms))
    rule = knc.AdaptiveClip(initial=median / 30, learning_rate=0.5)
    private = make_private(model)
    private.compile(optimizer=noiseless(NoiseCurveOptimizer(learning_rate=1e-30, l2_norm_clip=rule,
                                                            noise_multiplier=1.0, expected_batch_size=batch,
                                                            seed=seed)), loss="mse")
    clips = _Clips()
    weights = model.get_weights()
    history = private.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[clips])
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, b)  # the norms stayed those of the formula
    steps = epochs * n // batch
    assert len(clips.logged) == steps
    # the numpy recursion, step by step from the value the step used
    zeta = np.float64(np.float32(rule.initial))
    for t in range(steps):
        np.testing.assert_allclose(clips.logged[t], zeta, rtol=1e-5, err_msg=f"step {t}")
        batch_norms = norms[(t * batch) % n:(t * batch) % n + batch]
        below = int(np.sum(batch_norms <= clips.logged[t]))
        zeta = reference_next(np.float64(clips.logged[t]), below, batch, count_normal(seed, t), batch, rule)
        np.testing.assert_allclose(clips.after[t], zeta, rtol=1e-5, err_msg=f"step {t}")
    # one value per epoch in the history: ζ of the epoch's last step
    per_epoch = n // batch
    assert history.history["l2_norm_clip"] == pytest.approx(clips.logged[per_epoch - 1::per_epoch], rel=1e-7)
    assert len(history.history["l2_norm_clip"]) == epochs
    # toward the median, from 30× below it
    distance = [abs(np.log(z / median)) for z in clips.logged]
    assert distance[0] > 3.0
    assert max(distance[-per_epoch:]) < 0.25, (clips.logged[-per_epoch:], median)


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
def test_fit_equals_adaptive_dp_sgd_written_in_numpy(clipping):
    """A linear model's fit (DP-SGD, noise on) against the whole algorithm in float64 numpy:
    per-example gradients w_i·2r·[x, 1], clipped at ζ_t, plus ζ_t·σ·z_t (z_t the Philox draw
    of each variable), divided by B; ζ_{t+1} from the count of norms ≤ ζ_t among the rows of
    weight > 0, and n_t. Every clipping engine takes ζ_t, a tensor."""
    case = dp_sgd_case()
    model = _linear()
    private = make_private(model, clipping=clipping)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=case["eta"], l2_norm_clip=case["rule"],
                                                  noise_multiplier=case["sigma"], expected_batch_size=case["batch"],
                                                  seed=case["seed"]), loss="mse")
    clips = _Clips()
    private.fit(case["x"], case["y"], sample_weight=case["weights"].astype("float32"), batch_size=case["batch"],
                epochs=1, shuffle=False, verbose=0, callbacks=[clips])

    zetas, kernel, bias = adaptive_dp_sgd(**case)
    np.testing.assert_allclose(clips.logged, zetas[:-1], rtol=1e-5)
    assert abs(np.log(zetas[-1] / 0.5)) > 0.1  # ζ moved
    np.testing.assert_allclose(float(private.optimizer.current_clip()), zetas[-1], rtol=1e-5)
    got_kernel, got_bias = model.get_weights()
    np.testing.assert_allclose(got_kernel, kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_bias, bias, rtol=1e-5, atol=1e-6)


def test_one_huge_example_moves_the_step_by_at_most_zeta_t():
    """Two fits that differ only in one example of their last batch (weight 0, a padding row,
    in one; weight 1 in the other), its input × 1e4: with σ = 0 the final updates differ by
    η·clip(g, ζ_t)/B, of norm exactly ζ_t, ζ_t the logged clip of that step."""
    n, batch, eta, seed = 48, 8, 0.5, 3
    rng = np.random.default_rng(6)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = rng.normal(size=(n, 1)).astype("float32")
    x[-1] *= 1e4
    results = []
    for last_weight in (0.0, 1.0):
        weights = np.ones(n, np.float32)
        weights[-1] = last_weight
        model = _linear()
        private = make_private(model)
        private.compile(optimizer=noiseless(NoiseCurveOptimizer(
            learning_rate=eta, l2_norm_clip=knc.AdaptiveClip(initial=0.2, learning_rate=0.3), noise_multiplier=1.0,
            expected_batch_size=batch, seed=seed)), loss="mse")
        clips = _Clips()
        private.fit(x, y, sample_weight=weights, batch_size=batch, epochs=1, shuffle=False, verbose=0,
                    callbacks=[clips])
        results.append(([w.astype(np.float64) for w in model.get_weights()], clips))
    (w_without, c_without), (w_with, c_with) = results
    # the same run until the last step, which clips at the same ζ_t (it depends on earlier steps only)
    assert c_without.logged == c_with.logged
    zeta_t = c_with.logged[-1]
    assert zeta_t != pytest.approx(0.2, rel=1e-3)  # ζ moved before the last step
    diff = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(w_with, w_without))) * batch / eta
    assert diff <= zeta_t * (1 + 1e-4)
    assert diff == pytest.approx(zeta_t, rel=1e-3)  # clipped to ζ_t, no more and no less
    # its count: one more example, clipped (not below ζ): b̃ decreases by 1/(2B) → ζ grows by exp(η/(2B))
    np.testing.assert_allclose(c_with.after[-1] / c_without.after[-1], np.exp(0.3 / (2 * batch)), rtol=1e-5)


# ------------------------------------------------------------------- resume
RESUME_STEPS, RESUME_BANDS, RESUME_B = 8, 3, 6
C = random_banded_c(RESUME_STEPS, RESUME_BANDS, rng=np.random.default_rng(9), diag_scale=0.5)


def _resume_model(weights, seed=17):
    base = _small()
    base.set_weights(weights)
    model = make_private(base)
    model.compile(optimizer=NoiseCurveOptimizer(
        learning_rate=0.3, mixing=C, l2_norm_clip=knc.AdaptiveClip(initial=0.05, learning_rate=0.5),
        noise_multiplier=1.5, expected_batch_size=RESUME_B, seed=seed), loss="mse")
    return model


def _resume_fit(model, epochs):
    x, y = _data(2 * RESUME_B)  # one epoch = 2 steps
    return model.fit(x, y, batch_size=RESUME_B, epochs=epochs, shuffle=False, verbose=0)


def test_resume_from_a_keras_file_restores_zeta(tmp_path):
    init = _initial_weights()
    uninterrupted = _resume_model(init)
    _resume_fit(uninterrupted, RESUME_STEPS // 2)
    want_clip = uninterrupted.optimizer.current_clip().numpy()
    assert want_clip != np.float32(0.05)

    model = _resume_model(init)
    _resume_fit(model, 2)  # 4 of 8 steps
    saved_clip = model.optimizer.current_clip().numpy()
    assert saved_clip != np.float32(0.05)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.adaptive_clip == knc.AdaptiveClip(initial=0.05, learning_rate=0.5)
    assert loaded.optimizer.current_clip().numpy() == saved_clip
    _resume_fit(loaded, 2)
    assert int(loaded.optimizer.iterations.numpy()) == RESUME_STEPS
    assert loaded.optimizer.current_clip().numpy() == want_clip
    for a, b in zip(loaded.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # restarted without the optimizer state (ζ back at ζ_0): a different run
    fresh = _resume_model(init)
    fresh.set_weights(model.get_weights())
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.optimizer.iterations.assign(4)
    fresh.optimizer._noise_key.assign(model.optimizer._noise_key)
    for ring, saved in zip(fresh.optimizer._rings, model.optimizer._rings):
        if ring is not None:
            ring.assign(saved)
    _resume_fit(fresh, 2)
    assert fresh.optimizer.current_clip().numpy() != want_clip


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_step_refused_whatever_its_data_leaves_zeta_as_it_was():
    """Under XLA a step past the plan is refused as a tensor (its sum zeroed); its batch must
    not move ζ through the count either: ζ after it is the same whatever that batch holds."""
    from keras_noisecurve.mixing.matrix import MixingMatrix

    batch = 8
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3 * batch, 3)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    finals = []
    for scale in (1e-3, 1e3):  # the refused third batch: all unclipped, or all clipped
        third = x.copy()
        third[2 * batch:] *= scale
        optimizer = NoiseCurveOptimizer(learning_rate=1e-9, noise_multiplier=1.0, expected_batch_size=batch,
                                        mixing=MixingMatrix.identity(2), seed=1,
                                        l2_norm_clip=knc.AdaptiveClip(initial=0.5, learning_rate=1.0, count_stddev=0.5))
        private = make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, kernel_initializer="ones")]))
        private.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        jit_compile=True)
        with pytest.raises(RuntimeError, match="past the mixing matrix's plan"):
            private.fit(third, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        assert int(optimizer.iterations.numpy()) == 3
        finals.append(float(optimizer.current_clip().numpy()))
    assert finals[0] == finals[1] and finals[0] != 0.5


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_privacy_budget_refuses_a_run_without_the_optimizers_adaptive_clip():
    run = knc.PrivateRun(num_examples=200, batch_size=20, steps=10, noise_multiplier=1.0, delta=1e-5, seed=0)
    optimizer = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=knc.AdaptiveClip(count_stddev=0.25),
                                    noise_multiplier=1.0, expected_batch_size=20, mixing=run.mixing, seed=1)
    private = make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    private.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.ones((20, 3), "float32")
    with pytest.raises(ValueError, match="its count queries are part of epsilon"):
        private.fit(x, np.zeros(20, "int32"), batch_size=20, epochs=1, verbose=0,
                    callbacks=[knc.callbacks.PrivacyBudget(run=run, verbose=0)])
