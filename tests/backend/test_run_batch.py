"""How a private train step takes a run's batch apart (keras_noisecurve.backend.common.run_batch)."""

from keras_noisecurve.backend.common.run_batch import STEP_KEY, split_step


def test_a_tf_data_run_batch_is_x_y_mask_step():
    assert split_step(("x", "y", "mask", 7)) == (("x", "y", "mask"), 7)
    assert split_step(["x", "y", "mask", 7]) == (("x", "y", "mask"), 7)


def test_a_jax_run_batch_carries_the_step_in_its_inputs():
    assert split_step(({"inputs": "x", STEP_KEY: 3}, "y", "mask")) == (("x", "y", "mask"), 3)


def test_any_other_batch_has_no_step():
    for data in (("x", "y"), ("x", "y", "w"), "x", ({"inputs": "x", "other": 1}, "y"), ({"inputs": "x"}, "y"), ()):
        assert split_step(data) == (data, None)
