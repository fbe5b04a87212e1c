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
