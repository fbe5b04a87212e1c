"""User-level clipping on TensorFlow: each engine's clipped sum over units of k rows equals an
independent per-user loop (the user's ordinary batch gradient, clipped in float64), for Dense,
attention, Conv, LoRA and Embedding models; a user with 50 rows moves the sum by at most ζ."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.backend.tensorflow.clipping import get_engine
from tests.training.user_reference import K, KINDS, build, check, mse, reference, user_weights


def _grad_of(model):
    def grad_of(xu, yu, wu):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(mse(yu, model(xu, training=True)) * wu)
        return [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, model.trainable_variables)]

    return grad_of


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
@pytest.mark.parametrize("kind", KINDS)
def test_per_user_clipped_sum_matches_a_per_user_loop(kind, engine):
    model, x, y = build(kind)
    w = user_weights()
    _, norms = reference(_grad_of(model), x, y, w, clip=1e9)
    clip = float(np.median(norms[norms > 0]))  # some users clipped, some not
    ref_sums, ref_norms = reference(_grad_of(model), x, y, w, clip)
    run = tf.function(lambda a, b, c: get_engine(engine, model)(model, mse, a, b, c, l2_norm_clip=clip, unit_rows=K))
    out = run(x, y, w)
    check([g.numpy() for g in out.grads], out.norms.numpy(), ref_sums, ref_norms)
    assert not out.nonfinite.numpy().any()


def test_merged_layers_use_their_rules_and_others_the_fallback():
    from keras_noisecurve.backend.tensorflow import ghost

    model, x, _ = build("attention")
    entries = ghost._per_unit(ghost.plan(model, like=x), K)
    kinds = {type(layer).__name__: rule.kind for layer, rule, _ in entries}
    assert kinds["EinsumDense"] == "EinsumDense" and kinds["LayerNormalization"] == "LayerNormalization"
    conv, x, _ = build("conv")
    kinds = {type(layer).__name__: rule.kind for layer, rule, _ in ghost._per_unit(ghost.plan(conv, like=x), K)}
    assert kinds["Conv2D"] == "generic" and kinds["Dense"] == "Dense"


@pytest.mark.parametrize("engine", ["ghost", "vectorized"])
def test_a_user_with_50_examples_moves_the_sum_by_at_most_one_clip(engine):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 4)).astype("float32") * 10
    y = rng.normal(size=(50, 2)).astype("float32")
    clip = 0.1
    rows = np.ones(50, np.float32)
    per_user = get_engine(engine, model)(model, mse, x, y, rows / 50, l2_norm_clip=clip, unit_rows=50)
    total = np.sqrt(sum(np.sum(g.numpy().astype(np.float64) ** 2) for g in per_user.grads))
    assert total <= clip * (1 + 1e-5)
    per_example = get_engine(engine, model)(model, mse, x, y, rows, l2_norm_clip=clip)
    moved = np.sqrt(sum(np.sum(g.numpy().astype(np.float64) ** 2) for g in per_example.grads))
    assert moved > 10 * clip  # the example-level sum: up to 50 clips


def test_a_batch_of_partial_units_is_refused():
    model, x, y = build("dense")
    with pytest.raises(Exception, match="multiple|unit|reshape|Input to reshape"):
        get_engine("vectorized", model)(model, mse, x[:7], y[:7], np.ones(7, np.float32), l2_norm_clip=1.0,
                                        unit_rows=K)


@pytest.mark.parametrize("adaptive", [False, True])
def test_one_fit_step_of_a_user_level_run_matches_the_per_user_reference(adaptive):
    from tests.training.user_reference import one_fit_step_matches_reference

    norms = one_fit_step_matches_reference(_grad_of, adaptive=adaptive)
    assert (norms > 0.05).any()  # some users clipped


def test_tf_privacy_query_refuses_a_user_level_run():
    import warnings

    import keras_noisecurve as knc

    try:
        from keras_noisecurve.integrations.tf_privacy import BandedMatrixFactorizationQuery
    except ImportError:
        pytest.skip("needs tensorflow-privacy: the tf-privacy extra (Python <= 3.11)")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = knc.PrivateRun(privacy_unit="user", num_users=100, examples_per_user=4, batch_size=10, steps=5,
                             noise_multiplier=1.0, delta=1e-5, seed=0)
    with pytest.raises(ValueError, match="privacy unit is the user"):
        BandedMatrixFactorizationQuery.from_run(run, l2_norm_clip=1.0, template=[(3,)], seed=0)


def test_a_user_level_run_resumes_exactly_and_refuses_other_users(tmp_path):
    from tests.training.user_reference import resume_matches_uninterrupted

    refused = resume_matches_uninterrupted(tmp_path)
    assert refused is not None and "data" in refused


def test_a_custom_loop_must_clip_per_user_in_a_user_level_run():
    import warnings

    import keras_noisecurve as knc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = knc.PrivateRun(privacy_unit="user", num_users=20, examples_per_user=4, batch_size=5, steps=3,
                             noise_multiplier=1.0, delta=1e-2, seed=0, sampling="fixed_epochs")
        example_run = knc.PrivateRun(num_examples=20, batch_size=5, steps=3, noise_multiplier=1.0, delta=1e-2,
                                     seed=0, sampling="fixed_epochs")
    model, x, y = build("dense")
    grads = [tf.zeros_like(v) for v in model.trainable_variables]
    optimizer = knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=1.0, seed=0)
    with pytest.raises(ValueError, match="unit_rows=4"):
        optimizer.apply_clipped_sum(grads, model.trainable_variables)  # clipped per example: refused
    optimizer.apply_clipped_sum(grads, model.trainable_variables, unit_rows=4)
    plain = knc.NoiseCurveOptimizer(run=example_run, learning_rate=0.1, l2_norm_clip=1.0, seed=0)
    with pytest.raises(ValueError, match="unit_rows=1"):
        plain.apply_clipped_sum(grads, model.trainable_variables, unit_rows=4)


def test_the_adaptive_count_of_a_custom_loop_counts_each_user_once():
    """apply_clipped_sum takes the engine's per-row norms: a user-level step moves ζ as the
    example-level step whose examples are the users (count noise ~0, the same B)."""
    import warnings

    import keras_noisecurve as knc

    def clip_after(**plan):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = knc.PrivateRun(batch_size=4, steps=3, noise_multiplier=1.0, delta=1e-2, seed=0,
                                 sampling="fixed_epochs", adaptive_clip=knc.AdaptiveClip(initial=1.0, count_stddev=1e-9),
                                 **plan)
            optimizer = knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=0)
        return optimizer

    unit_norms = np.array([0.01, 0.02, 50.0, 0.03], np.float32)  # 3 of 4 users below ζ = 1
    variable = tf.Variable(tf.zeros(3))
    users = clip_after(privacy_unit="user", num_users=20, examples_per_user=3)
    users.build([variable])
    rows = np.repeat(unit_norms, 3)
    weights = np.ones(12, np.float32)
    weights[[1, 2, 5]] = 0  # padding rows inside real users: still one count each
    users.apply_clipped_sum([tf.zeros(3)], [variable], norms=tf.constant(rows), sample_weight=weights, unit_rows=3)
    examples = clip_after(num_examples=20)
    examples.build([tf.Variable(tf.zeros(3))])
    examples.apply_clipped_sum([tf.zeros(3)], examples._trainable_variables, norms=tf.constant(unit_norms))
    assert float(users.current_clip()) == pytest.approx(float(examples.current_clip()), rel=1e-6)
    assert float(users.current_clip()) < 1.0  # 3/4 below the median target: ζ shrinks


def test_a_rule_registered_by_a_user_is_never_merged():
    from keras_noisecurve.backend.common import units

    layer = keras.layers.Dense(3)
    assert units.merges("Dense", layer) and not units.merges("Dense", layer, builtin=False)
    bias_along_positions = keras.layers.EinsumDense("abc,cd->abd", output_shape=(4, 5), bias_axes="bd")
    bias_along_positions.build((None, 4, 6))
    assert not units.merges("EinsumDense", bias_along_positions)
