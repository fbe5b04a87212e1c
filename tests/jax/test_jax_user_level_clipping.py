"""User-level clipping on JAX: each engine's clipped sum over units of k rows equals an
independent per-user loop (the user's ordinary ``jax.grad`` of ``Σ_j w_j·loss_j`` over its rows,
clipped in float64), for Dense, attention, Conv, LoRA and Embedding models; merged layers keep
their ghost rules; a user with 50 rows moves the sum by at most ζ."""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve.backend.jax.clipping import clipped_sum
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from tests.training.user_reference import K, KINDS, build, check, mse, reference, user_weights

ENGINES = {
    "ghost": lambda *a, **k: ghost_clipped_sum(*a, clipping="ghost", **k),
    "vectorized": clipped_sum,
}


def _values(model):
    return [v.value for v in model.trainable_variables], [v.value for v in model.non_trainable_variables]


def _grad_of(model):
    trainable, non_trainable = _values(model)

    def loss(tv, xu, yu, wu):
        pred, _ = model.stateless_call(tv, non_trainable, xu, training=True)
        return jnp.sum(mse(yu, pred) * wu)

    grad = jax.jit(jax.grad(loss))
    return lambda xu, yu, wu: grad(trainable, xu, yu, wu)


def _run(engine, model, x, y, w, clip, unit_rows):
    trainable, non_trainable = _values(model)

    @jax.jit
    def step(tv, ntv, x, y, w):
        sums, norms, _, _, _ = ENGINES[engine](model, mse, tv, ntv, x, y, w, l2_norm_clip=clip, unit_rows=unit_rows)
        return sums, norms

    return step(trainable, non_trainable, x, y, jnp.asarray(w))


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("kind", KINDS)
def test_per_user_clipped_sum_matches_a_per_user_loop(kind, engine):
    model, x, y = build(kind)
    w = user_weights()
    _, norms = reference(_grad_of(model), x, y, w, clip=1e9)
    clip = float(np.median(norms[norms > 0]))  # some users clipped, some not
    ref_sums, ref_norms = reference(_grad_of(model), x, y, w, clip)
    sums, got_norms = _run(engine, model, x, y, w, clip, K)
    check(sums, got_norms, ref_sums, ref_norms)


def test_merged_layers_use_their_rules_and_others_the_fallback(fallbacks):
    model, x, y = build("attention")
    _run("ghost", model, x, y, user_weights(), 1.0, K)
    assert fallbacks == []  # EinsumDense, LayerNormalization, Dense: their rules, on merged rows
    conv, x, y = build("conv")
    _run("ghost", conv, x, y, user_weights(), 1.0, K)
    assert [name for name in fallbacks if "conv" in name]  # the convolution: the exact fallback
    assert not [name for name in fallbacks if "dense" in name]


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_a_user_with_50_examples_moves_the_sum_by_at_most_one_clip(engine):
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    rng = np.random.default_rng(1)
    x = rng.normal(size=(50, 4)).astype("float32") * 10
    y = rng.normal(size=(50, 2)).astype("float32")
    clip = 0.1
    rows = np.ones(50, np.float32)
    sums, _ = _run(engine, model, x, y, rows / 50, clip, 50)
    assert np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in sums)) <= clip * (1 + 1e-5)
    sums, _ = _run(engine, model, x, y, rows, clip, 1)
    assert np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in sums)) > 10 * clip


def test_a_batch_of_partial_units_is_refused():
    model, x, y = build("dense")
    with pytest.raises(ValueError, match="multiple of 3"):
        _run("vectorized", model, x[:7], y[:7], np.ones(7, np.float32), 1.0, K)
    with pytest.raises(ValueError, match="multiple of 3"):
        _run("ghost", model, x[:7], y[:7], np.ones(7, np.float32), 1.0, K)


@pytest.mark.parametrize("adaptive", [False, True])
def test_one_fit_step_of_a_user_level_run_matches_the_per_user_reference(adaptive):
    from tests.training.user_reference import one_fit_step_matches_reference

    norms = one_fit_step_matches_reference(_grad_of, adaptive=adaptive)
    assert (norms > 0.05).any()  # some users clipped


def test_a_user_level_run_resumes_exactly_and_refuses_other_users(tmp_path):
    from tests.training.user_reference import resume_matches_uninterrupted

    refused = resume_matches_uninterrupted(tmp_path)
    assert refused is not None and "data" in refused
