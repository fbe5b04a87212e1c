"""BandedMatrixFactorizationQuery driven through TF Privacy's DPQuery API equals the optimizer."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip("keras_noisecurve.integrations.tf_privacy",
                    reason="needs tensorflow-privacy: the tf-privacy extra (Python <= 3.11)")

from keras_noisecurve.backend.tensorflow.tf_privacy_import import import_tf_privacy  # noqa: E402
from keras_noisecurve.integrations.tf_privacy import BandedMatrixFactorizationQuery  # noqa: E402
from keras_noisecurve.mixing import MixingMatrix  # noqa: E402
from keras_noisecurve.training import NoiseCurveOptimizer  # noqa: E402
from tests.training.helpers import random_banded_c  # noqa: E402

CLIP, SIGMA, SEED = 0.8, 1.3, 4
SHAPES = [(3, 4), (4,), (2, 2, 2)]


def _records(rng, n):
    return [[tf.constant(rng.normal(size=s) * 2, tf.float32) for s in SHAPES] for _ in range(n)]


def _clip(record, clip):
    norm = np.sqrt(sum(np.sum(r.numpy() ** 2) for r in record))
    return [r.numpy() * min(1.0, clip / norm) for r in record]


@pytest.mark.parametrize("bands", [1, 3])
def test_query_equals_optimizer_noise(bands):
    steps = 5
    c = MixingMatrix.identity(steps) if bands == 1 else random_banded_c(steps, bands, rng=np.random.default_rng(3))
    query = BandedMatrixFactorizationQuery(l2_norm_clip=CLIP, noise_multiplier=SIGMA, mixing=c,
                                           template=SHAPES, seed=SEED)
    assert isinstance(query, import_tf_privacy("privacy.dp_query.dp_query").SumAggregationDPQuery)

    # the optimizer with η = B = 1 and zero clipped sums: its update is −ζσ·z̃_t
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in SHAPES]
    opt = NoiseCurveOptimizer(learning_rate=1.0, mixing=c, l2_norm_clip=CLIP, noise_multiplier=SIGMA,
                              expected_batch_size=1, seed=SEED)

    rng = np.random.default_rng(0)
    global_state = query.initial_global_state()
    for t in range(steps):
        params = query.derive_sample_params(global_state)
        sample_state = query.initial_sample_state()
        records = _records(rng, 3)
        sample_state = query.accumulate_record(params, sample_state, records[0])
        sample_state = query.accumulate_record(params, sample_state, records[1])
        other = query.accumulate_record(params, query.initial_sample_state(), records[2])
        sample_state = query.merge_sample_states(sample_state, other)
        result, global_state, event = query.get_noised_result(sample_state, global_state)
        assert event == dp_accounting.GaussianDpEvent(SIGMA)

        before = [v.numpy() for v in variables]
        opt.apply_clipped_sum([tf.zeros(s) for s in SHAPES], variables)
        noise = [b - v.numpy() for b, v in zip(before, variables)]  # ζσ·z̃_t

        clipped_sum = [sum(parts) for parts in zip(*[_clip(r, CLIP) for r in records])]
        for got, s, z in zip(result, clipped_sum, noise):
            np.testing.assert_allclose(got.numpy(), s + z, rtol=1e-5, atol=1e-5)
    assert int(query.derive_metrics(global_state)["step"]) == steps
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        query.get_noised_result(query.initial_sample_state(), global_state)


def test_query_works_in_tf_function_and_validates():
    query = BandedMatrixFactorizationQuery(l2_norm_clip=1.0, noise_multiplier=1.0, mixing="dpsgd",
                                           template={"a": tf.zeros([2]), "b": tf.TensorSpec([3], tf.float32)}, seed=1)
    state = query.initial_global_state()

    @tf.function
    def step(state):
        params = query.derive_sample_params(state)
        sample = query.accumulate_record(params, query.initial_sample_state(), {"a": tf.ones([2]), "b": tf.ones([3])})
        result, state, _ = query.get_noised_result(sample, state)
        return result, state

    result, state = step(state)
    assert set(result) == {"a", "b"} and int(state.step) == 1
    with pytest.raises(ValueError, match="l2_norm_clip must be > 0"):
        BandedMatrixFactorizationQuery(l2_norm_clip=0.0, noise_multiplier=1.0, mixing="dpsgd", template=[(2,)])
    with pytest.raises(ValueError, match="no such file"):
        BandedMatrixFactorizationQuery(l2_norm_clip=1.0, noise_multiplier=1.0, mixing="/nope.npz", template=[(2,)])


def test_query_from_a_run_uses_its_mixing_and_sigma():
    from keras_noisecurve.privacy.run import PrivateRun

    c = random_banded_c(6, 2, rng=np.random.default_rng(5))
    run = PrivateRun(num_examples=60, batch_size=5, steps=6, mixing=c, noise_multiplier=SIGMA, delta=1e-5)
    query = BandedMatrixFactorizationQuery.from_run(run, l2_norm_clip=CLIP, template=SHAPES, seed=SEED)
    direct = BandedMatrixFactorizationQuery(l2_norm_clip=CLIP, noise_multiplier=SIGMA, mixing=c,
                                            template=SHAPES, seed=SEED)
    a, b = query.initial_global_state(), direct.initial_global_state()
    assert float(a.stddev) == float(b.stddev)
    np.testing.assert_array_equal(query.noise.row(3, tf.float64), direct.noise.row(3, tf.float64))
    with pytest.raises(ValueError, match="must be a keras_noisecurve.PrivateRun"):
        BandedMatrixFactorizationQuery.from_run(c, l2_norm_clip=CLIP, template=SHAPES)


def test_lazy_top_level_export():
    import keras_noisecurve

    assert keras_noisecurve.BandedMatrixFactorizationQuery is BandedMatrixFactorizationQuery


# ---------------------------------------------------------------- the query of a run
RUN_STEPS = 10


def _run(sampling, accountant, mixing="banded"):
    """A 10-step run whose C plans 30 steps (the query must stop at the run's 10, not C's 30)."""
    import warnings

    from keras_noisecurve.mixing.strategies import BLTMixing
    from keras_noisecurve.privacy.run import PrivateRun

    if mixing == "blt":  # not banded: fixed epochs only, Δ_k computed from C
        c = BLTMixing(theta=[0.9, 0.6], omega=[0.3, 0.2], steps=3 * RUN_STEPS)
    else:
        c = random_banded_c(3 * RUN_STEPS, 2, rng=np.random.default_rng(7))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FixedSeedWarning
        # cyclic Poisson: b = 2, q = 6·2/60; fixed epochs: ⌈60/12⌉ = 5 steps per epoch, 2 epochs
        return PrivateRun(num_examples=60, batch_size=6 if sampling == "cyclic_poisson" else 12, steps=RUN_STEPS,
                          mixing=c, noise_multiplier=SIGMA, delta=1e-5, sampling=sampling, accountant=accountant,
                          seed=0)


def _sample(query, state):
    params = query.derive_sample_params(state)
    record = [tf.ones(s) for s in SHAPES]
    return query.accumulate_record(params, query.initial_sample_state(), record)


def _epsilon_of(events, delta, accountant):
    from dp_accounting import pld, rdp

    from keras_noisecurve.privacy.events import PLD_VALUE_DISCRETIZATION, RDP_ORDERS

    acc = (pld.PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION) if accountant == "pld"
           else rdp.RdpAccountant(list(RDP_ORDERS)))
    return acc.compose(dp_accounting.ComposedDpEvent(list(events))).get_epsilon(delta)


@pytest.mark.parametrize("sampling, accountant, mixing", [
    ("cyclic_poisson", "pld", "banded"), ("cyclic_poisson", "rdp", "banded"),
    ("fixed_epochs", "pld", "banded"), ("fixed_epochs", "rdp", "banded"), ("fixed_epochs", "pld", "blt")])
def test_run_query_stops_at_the_plan_and_its_events_give_the_runs_epsilon(sampling, accountant, mixing):
    run = _run(sampling, accountant, mixing)
    assert run.mixing.steps == 3 * RUN_STEPS
    query = BandedMatrixFactorizationQuery.from_run(run, l2_norm_clip=CLIP, template=SHAPES, seed=SEED)
    assert query.steps == RUN_STEPS
    state, events = query.initial_global_state(), []
    for t in range(RUN_STEPS):
        _, state, event = query.get_noised_result(_sample(query, state), state)
        assert event == query.step_event(t)
        events.append(event)
        if t in (0, 4, 6):  # every prefix composes to the run's event after t + 1 steps
            assert _epsilon_of(events, run.delta, accountant) == pytest.approx(run.epsilon(t + 1), rel=1e-6)
    assert _epsilon_of(events, run.delta, accountant) == pytest.approx(run.epsilon(), rel=1e-6)
    assert int(state.step) == RUN_STEPS
    participating = [t for t, e in enumerate(events) if not isinstance(e, dp_accounting.NoOpDpEvent)]
    assert participating == ([0, 2, 4, 6, 8] if sampling == "cyclic_poisson" else [0, 5])
    if sampling == "cyclic_poisson":
        assert events[0] == dp_accounting.PoissonSampledDpEvent(
            run.spec.sampling_probability, dp_accounting.GaussianDpEvent(SIGMA / run.spec.sensitivity))

    # the 11th sample is refused, with no release: eagerly ...
    with pytest.raises(tf.errors.InvalidArgumentError, match="plans T = 10 steps"):
        query.get_noised_result(_sample(query, state), state)
    with pytest.raises(ValueError, match=r"step must be an int in 0 \.\.\. 9 \(the plan has 10 steps\); got 10"):
        query.step_event(RUN_STEPS)

    # ... and in a tf.function (fresh state: ten steps pass, the eleventh fails)
    traced = []

    @tf.function
    def step(state):
        result, state, event = query.get_noised_result(_sample(query, state), state)
        traced.append(event)
        return result, state

    state = query.initial_global_state()
    for _ in range(RUN_STEPS):
        result, state = step(state)
    assert int(state.step) == RUN_STEPS
    with pytest.raises(tf.errors.InvalidArgumentError, match="plans T = 10 steps"):
        step(state)
    # the step is symbolic when the function is traced, and this run's events depend on it
    assert traced and all(isinstance(e, dp_accounting.UnsupportedDpEvent) for e in traced)


def test_run_query_in_tf_function_reports_the_event_when_every_step_has_the_same():
    from keras_noisecurve.privacy.run import PrivateRun

    run = PrivateRun(num_examples=60, batch_size=6, steps=RUN_STEPS, noise_multiplier=SIGMA, delta=1e-5,
                     accountant="rdp")  # b = 1: every step adds PoissonSampled(q, Gaussian(σ))
    query = BandedMatrixFactorizationQuery.from_run(run, l2_norm_clip=CLIP, template=SHAPES)
    traced = []

    @tf.function
    def step(state):
        _, state, event = query.get_noised_result(_sample(query, state), state)
        traced.append(event)
        return state

    state = query.initial_global_state()
    for _ in range(RUN_STEPS):
        state = step(state)
    assert traced and set(traced) == {query.step_event(0)}
    assert _epsilon_of([traced[0]] * RUN_STEPS, run.delta, "rdp") == pytest.approx(run.epsilon(), rel=1e-6)
    with pytest.raises(tf.errors.InvalidArgumentError, match="plans T = 10 steps"):
        step(state)


def test_query_without_a_run_keeps_its_gaussian_events_to_cs_steps():
    c = random_banded_c(4, 2, rng=np.random.default_rng(1))
    query = BandedMatrixFactorizationQuery(l2_norm_clip=CLIP, noise_multiplier=SIGMA, mixing=c, template=SHAPES)
    assert query.steps == 4 and query.step_event(3) == dp_accounting.GaussianDpEvent(SIGMA)
    state = query.initial_global_state()
    for _ in range(4):
        _, state, event = query.get_noised_result(_sample(query, state), state)
        assert event == dp_accounting.GaussianDpEvent(SIGMA)
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        query.get_noised_result(_sample(query, state), state)
    with pytest.raises(ValueError, match=r"step must be an int in 0 \.\.\. 3"):
        query.step_event(-1)


def test_run_query_under_xla_releases_nan_past_the_plan():
    """XLA drops assertions: the step past the plan returns NaN, not the noisy sum."""
    query = BandedMatrixFactorizationQuery.from_run(_run("cyclic_poisson", "rdp"), l2_norm_clip=CLIP,
                                                    template=SHAPES, seed=SEED)

    @tf.function(jit_compile=True)
    def step(state):
        result, state, _ = query.get_noised_result(_sample(query, state), state)
        return result, state

    state = query.initial_global_state()
    for _ in range(RUN_STEPS):
        result, state = step(state)
        assert all(np.isfinite(r.numpy()).all() for r in result)
    result, state = step(state)
    assert all(np.isnan(r.numpy()).all() for r in result)
