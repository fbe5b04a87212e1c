"""The Dense, Embedding and normalisation-layer forms of both engines (``keras_noisecurve.backend.common.norm_forms``,
``keras.ops`` on the backend in use) against per-example gradients formed in float64 numpy."""

import keras
import numpy as np
import pytest

from keras_noisecurve.backend.common import norm_forms

RNG = np.random.default_rng(0)


def _dense_reference(a, g):
    per_example = np.einsum("pli,plj->pij", a.astype(np.float64), g.astype(np.float64))
    return np.sum(per_example ** 2, axis=(1, 2))


@pytest.mark.parametrize("length, d_in, d_out, form", [
    (1, 5, 3, "one position"), (3, 4, 5, "gram"), (6, 2, 3, "outer")])
def test_sequence_norms_equal_the_formed_per_example_gradient(length, d_in, d_out, form):
    a = RNG.normal(size=(4, length, d_in)).astype(np.float32)
    g = RNG.normal(size=(4, length, d_out)).astype(np.float32)
    if length > 1:
        assert norm_forms.gram_is_cheaper(length, d_in, d_out) == (form == "gram")
    expected = _dense_reference(a, g)
    got = keras.ops.convert_to_numpy(norm_forms.sequence_sq_norms(keras.ops.convert_to_tensor(a),
                                                                  keras.ops.convert_to_tensor(g)))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for f in (norm_forms.gram_sq_norms, norm_forms.outer_sq_norms):  # both forms, whatever is chosen
        np.testing.assert_allclose(keras.ops.convert_to_numpy(f(a, g)), expected, rtol=1e-5)


@pytest.mark.parametrize("length, vocabulary", [(4, 50), (12, 3)])  # Gram form; segment sum
def test_token_norms_equal_the_formed_table_gradient(length, vocabulary):
    d, p = 3, 5
    ids = RNG.integers(0, vocabulary, size=(p, length)).astype(np.int32)
    ids[0, :2] = ids[0, 2]  # a repeated token: its rows add up
    g = RNG.normal(size=(p, length, d)).astype(np.float32)
    table = np.zeros((p, vocabulary, d))
    for i in range(p):
        np.add.at(table[i], ids[i], g[i].astype(np.float64))
    expected = np.sum(table ** 2, axis=(1, 2))
    got = keras.ops.convert_to_numpy(norm_forms.token_sq_norms(keras.ops.convert_to_tensor(ids),
                                                               keras.ops.convert_to_tensor(g), vocabulary))
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    for got in (norm_forms.token_gram_sq_norms(ids, g), norm_forms.token_rows_sq_norms(ids, g, vocabulary)):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(got), expected, rtol=1e-5)


@pytest.mark.parametrize("rms", [False, True])
def test_layer_norm_hat_is_what_keras_layer_normalization_computes(rms):
    """x̂ over the last axis and over two axes is the output of Keras's own LayerNormalization
    with γ = 1 and β = 0 (``rms_scaling`` divides by the variance's root), and the float64
    numpy formula."""
    x = (RNG.normal(size=(3, 4, 5)) * 2.0 + 7.0).astype(np.float32)  # a large mean: no E[x²] − mean²
    for axes in ((2,), (1, 2)):
        layer = keras.layers.LayerNormalization(axis=list(axes), epsilon=1e-3, rms_scaling=rms)
        expected = keras.ops.convert_to_numpy(layer(x))
        got = keras.ops.convert_to_numpy(norm_forms.layer_norm_hat(keras.ops.convert_to_tensor(x), axes, 1e-3, rms=rms))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        x64 = x.astype(np.float64)
        centred = x64 - x64.mean(axis=axes, keepdims=True)
        reference = (x64 if rms else centred) / np.sqrt(np.mean(centred ** 2, axis=axes, keepdims=True) + 1e-3)
        np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5)


def test_group_norm_hat_is_what_keras_group_normalization_computes():
    x = (RNG.normal(size=(2, 3, 4, 6)) + 3.0).astype(np.float32)  # (P, H, W, C), 3 groups of 2 channels
    layer = keras.layers.GroupNormalization(groups=3, epsilon=1e-3, center=False, scale=False)
    got = keras.ops.convert_to_numpy(norm_forms.group_norm_hat(keras.ops.convert_to_tensor(x), 3, 1e-3))
    np.testing.assert_allclose(got, keras.ops.convert_to_numpy(layer(x)), rtol=1e-5, atol=1e-5)
    grouped = x.astype(np.float64).reshape(2, 12, 3, 2)
    centred = grouped - grouped.mean(axis=(1, 3), keepdims=True)
    reference = centred / np.sqrt(np.mean(centred ** 2, axis=(1, 3), keepdims=True) + 1e-3)
    np.testing.assert_allclose(got, reference.reshape(x.shape), rtol=1e-5, atol=1e-5)


def test_scale_offset_grads_are_the_per_example_gradients_of_the_affine_map():
    """For out = γ ⊙ x̂ + β with γ, β along axes 2 and 3 of (P, L, C, D), example i's gradients of
    Σ out ⊙ g are Σ_l x̂ ⊙ g and Σ_l g: checked by differentiating each example's term with respect
    to γ and β in float64 by central differences (the map is linear, so they are exact to round-off)."""
    x_hat = RNG.normal(size=(3, 5, 2, 4))
    g = RNG.normal(size=(3, 5, 2, 4))
    gamma, beta = norm_forms.scale_offset_grads(x_hat.astype(np.float32), g.astype(np.float32), (2, 3))
    gamma, beta = keras.ops.convert_to_numpy(gamma), keras.ops.convert_to_numpy(beta)
    assert gamma.shape == beta.shape == (3, 2, 4)
    base = RNG.normal(size=(2, 4))
    for i in range(3):
        def term(scale, offset):
            return float(np.sum((scale * x_hat[i] + offset) * g[i]))
        for j in np.ndindex(2, 4):
            e = np.zeros((2, 4))
            e[j] = 1e-3
            np.testing.assert_allclose(gamma[i][j], (term(base + e, base) - term(base - e, base)) / 2e-3, rtol=1e-5)
            np.testing.assert_allclose(beta[i][j], (term(base, base + e) - term(base, base - e)) / 2e-3, rtol=1e-5)
    every, offset = norm_forms.scale_offset_grads(x_hat, g, (1, 2, 3))  # nothing to sum: the products
    np.testing.assert_allclose(keras.ops.convert_to_numpy(every), x_hat * g)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(offset), g)
