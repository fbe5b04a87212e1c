"""The private Keras methods this package overrides on the JAX backend still exist with the
parameters it was written for (``keras_noisecurve._compat.PRIVATE_OVERRIDES``; the default
run checks the others in tests/test_compat.py)."""

import pytest

from keras_noisecurve import _compat

JAX_OVERRIDES = [entry for entry in _compat.PRIVATE_OVERRIDES if entry[4] in (None, "jax")]


@pytest.mark.parametrize("ours, base, method, parameters, backend", JAX_OVERRIDES,
                         ids=[entry[2] for entry in JAX_OVERRIDES])
def test_private_overrides_still_match_keras_on_jax(ours, base, method, parameters, backend):
    if method == "_distributed_tf_update_step":
        pytest.skip("a tf.distribute hook: Keras's JAX optimizer has no such method")
    assert _compat.check_private_override(ours, base, method, parameters) is None
