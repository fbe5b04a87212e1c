"""``keras_noisecurve.backend.common.calls.wrapped_calls``: each layer instance's ``call`` is wrapped
for the ``with`` block and its instance dictionary is restored exactly afterwards (also after
an exception, nested wrappings and a layer that had its own instance ``call``). Checked on
real Keras layers against what the layer computes without any wrapping."""

import keras
import numpy as np
import pytest

from keras_noisecurve.backend.common.calls import wrapped_calls


def _dense(units=3, seed=0):
    layer = keras.layers.Dense(units, kernel_initializer=keras.initializers.RandomNormal(seed=seed))
    layer.build((None, 2))
    return layer


def _x():
    return np.arange(8, dtype="float32").reshape(4, 2) / 7.0


def _log(seen, tag):
    """A wrap that notes ``tag`` for every call and returns the original's output unchanged."""

    def wrap(layer, original):
        def call(*args, **kwargs):
            seen.append((tag, layer.name))
            return original(*args, **kwargs)

        return call

    return wrap


def test_calls_go_through_the_wrapper_and_the_class_call_comes_back():
    layers = [_dense(seed=0), _dense(seed=1)]
    x = _x()
    expected = [np.asarray(layer(x)) for layer in layers]
    seen = []
    with wrapped_calls(layers, wrap=_log(seen, "w")):
        assert all("call" in vars(layer) for layer in layers)
        got = [np.asarray(layer(x)) for layer in layers]
    assert seen == [("w", layers[0].name), ("w", layers[1].name)]
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)
    assert all("call" not in vars(layer) for layer in layers)
    layers[0](x)
    assert len(seen) == 2  # no longer wrapped


def test_a_wrapper_can_change_what_the_call_returns():
    layer = _dense()
    x = _x()
    reference = np.asarray(x @ np.asarray(layer.kernel) + np.asarray(layer.bias))  # Dense, linear

    def doubled(layer, original):
        return lambda *args, **kwargs: 2.0 * original(*args, **kwargs)

    with wrapped_calls([layer], wrap=doubled):
        np.testing.assert_allclose(np.asarray(layer(x)), 2.0 * reference, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(layer(x)), reference, rtol=1e-6)


def test_a_layer_with_its_own_instance_call_gets_that_same_object_back():
    layer = _dense()
    class_call = layer.call
    seen = []

    def own(*args, **kwargs):
        seen.append("own")
        return class_call(*args, **kwargs)

    object.__setattr__(layer, "call", own)
    originals = []

    def wrap(layer, original):
        originals.append(original)
        return lambda *args, **kwargs: original(*args, **kwargs)

    with wrapped_calls([layer], wrap=wrap):
        layer(_x())
    assert originals == [own]  # the wrapper wrapped the instance's own call
    assert seen == ["own"]
    assert vars(layer)["call"] is own


def test_nested_wrappings_unwind_in_order():
    layer = _dense()
    seen = []
    with wrapped_calls([layer], wrap=_log(seen, "outer")):
        outer = vars(layer)["call"]
        with wrapped_calls([layer], wrap=_log(seen, "inner")):
            layer(_x())
        assert vars(layer)["call"] is outer
    assert [tag for tag, _ in seen] == ["inner", "outer"]  # the inner wrapper runs first, around the outer
    assert "call" not in vars(layer)


def test_a_layer_given_twice_is_wrapped_twice_and_restored():
    layer = _dense()
    seen = []
    with wrapped_calls([layer, layer], wrap=_log(seen, "w")):
        layer(_x())
    assert len(seen) == 2
    assert "call" not in vars(layer)


def test_an_exception_in_the_block_restores_every_layer():
    layers = [_dense(seed=0), _dense(seed=1)]
    with pytest.raises(RuntimeError, match="inside"):
        with wrapped_calls(layers, wrap=_log([], "w")):
            raise RuntimeError("inside")
    assert all("call" not in vars(layer) for layer in layers)


def test_an_exception_of_wrap_part_way_restores_the_layers_already_wrapped():
    layers = [_dense(seed=0), _dense(seed=1), _dense(seed=2)]
    count = []

    def failing(layer, original):
        count.append(layer)
        if len(count) == 2:
            raise ValueError("second")
        return original

    with pytest.raises(ValueError, match="second"):
        with wrapped_calls(layers, wrap=failing):
            pass
    assert all("call" not in vars(layer) for layer in layers)


def test_shared_blocks_of_several_threads_run_inside_one_wrapper():
    """The shared mode (the TensorFlow engine's replica threads): two threads inside shared
    blocks over the same layer at once wrap it once (the first block's wrapper serves both), a
    layer with its own instance ``call`` gets that object back when the last block leaves, and a
    non-shared block inside a shared one still nests."""
    import threading

    layer = _dense()
    own = layer.call
    object.__setattr__(layer, "call", own)  # an instance entry of its own, to get back
    x = _x()
    expected = np.asarray(layer(x))
    seen, wraps = [], []

    def wrap(layer, original):
        wraps.append(original)
        return _log(seen, f"wrapper {len(wraps)}")(layer, original)

    inside, release, outputs = threading.Barrier(2), threading.Event(), {}

    def replica(name):
        with wrapped_calls([layer], wrap=wrap, shared=True):
            inside.wait(timeout=30)  # both threads inside their blocks
            outputs[name] = np.asarray(layer(x))
            if name == "first":
                release.wait(timeout=30)  # leaves after the second
            else:
                assert vars(layer)["call"] is not own
                release.set()

    threads = [threading.Thread(target=replica, args=(n,)) for n in ("first", "second")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(wraps) == 1 and wraps[0] is own  # wrapped once, around the layer's own call
    assert seen == [("wrapper 1", layer.name)] * 2
    for out in outputs.values():
        np.testing.assert_array_equal(out, expected)
    assert vars(layer)["call"] is own  # the last block out restored the layer's own entry
    with wrapped_calls([layer], wrap=_log(seen, "outer"), shared=True):
        with wrapped_calls([layer], wrap=_log(seen, "inner")):
            layer(x)
        with pytest.raises(RuntimeError, match="inside"):
            with wrapped_calls([layer], wrap=_log(seen, "again"), shared=True):
                raise RuntimeError("inside")
        assert vars(layer)["call"] is not own  # the outer shared block still holds it
    assert seen[2:] == [("inner", layer.name), ("outer", layer.name)]
    assert vars(layer)["call"] is own


def test_refuses_a_wrap_that_is_not_callable_or_returns_no_callable():
    layer = _dense()
    with pytest.raises(TypeError, match="wrap must be a callable .* but got 3"):
        with wrapped_calls([layer], wrap=3):
            pass
    with pytest.raises(TypeError, match="must return a callable .* but it returned None"):
        with wrapped_calls([layer], wrap=lambda layer, original: None):
            pass
    assert "call" not in vars(layer)


def test_training_kwargs_passes_training_only_to_a_call_that_takes_it():
    from keras_noisecurve.backend.common.calls import training_kwargs

    class Takes:
        def call(self, x, training=None):
            return x

    class Keywords:
        def call(self, x, **kwargs):
            return x

    class Plain:
        def call(self, x):
            return x

    assert training_kwargs(Takes(), True) == {"training": True}
    assert training_kwargs(Keywords(), False) == {"training": False}
    assert training_kwargs(Plain(), True) == {}
