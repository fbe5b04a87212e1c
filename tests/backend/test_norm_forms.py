"""The Dense and Embedding norm forms of both engines (``keras_noisecurve.backend.norm_forms``,
``keras.ops`` on the backend in use) against per-example gradients formed in float64 numpy."""

import keras
import numpy as np
import pytest

from keras_noisecurve.backend import norm_forms

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
