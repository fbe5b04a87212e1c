"""White-box input canaries (keras_noisecurve.audit.input_canaries): canaries that pass through
a model with Dense, Conv1D, MultiHeadAttention and LayerNormalization layers."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.audit import input_canaries
from keras_noisecurve.audit.whitebox import audit_whitebox
from keras_noisecurve.training import ghost, ghost_dense

from . import broken


def test_the_model_has_a_layer_of_every_audited_rule():
    kinds = {kind for _, _, kind in ghost.describe(input_canaries.build_model())}
    assert {"Dense", "Conv", "EinsumDense", "LayerNormalization"} <= kinds


def test_canary_gradients_match_a_per_example_loop_and_live_in_their_branch():
    model = input_canaries.build_model()
    rng = np.random.default_rng(0)
    m = 4
    x = {"features": rng.normal(size=(m, 32)).astype("float32"),
         "seq": rng.normal(size=(m, 6, 32)).astype("float32"),
         "gate": np.eye(4, dtype="float32")}
    y = rng.normal(size=(m, 1)).astype("float32")
    weights = [v.numpy() for v in model.trainable_variables]
    grads = input_canaries.canary_gradients(model=model, weights=weights, canary_x=x, canary_y=y)
    names = [v.path for v in model.trainable_variables]
    sizes = [int(np.prod(v.shape)) for v in model.trainable_variables]
    owner = np.repeat([n.split("/")[0] for n in names], sizes)
    for i in range(m):  # an independent loop: one example at a time
        with tf.GradientTape() as tape:
            loss = tf.square(model({k: v[i:i + 1] for k, v in x.items()})[0, 0] - y[i, 0])
        ref = np.concatenate([np.ravel(g.numpy()) if g is not None else np.zeros(s)
                              for g, s in zip(tape.gradient(loss, model.trainable_variables), sizes)])
        np.testing.assert_allclose(grads[i], ref, rtol=1e-4, atol=1e-5)
        branch = input_canaries.BRANCHES[i]
        assert np.all(grads[i][owner != branch] == 0) and np.linalg.norm(grads[i]) > 0


def test_input_canaries_are_validated_before_training():
    with pytest.raises(ValueError, match="canary_kind"):
        audit_whitebox(canary_kind="row")
    with pytest.raises(ValueError, match="fixed_epochs"):
        audit_whitebox(canary_kind="input", sampling="cyclic_poisson")
    with pytest.raises(ValueError, match="resume_at"):
        audit_whitebox(canary_kind="input", resume_at=3)
