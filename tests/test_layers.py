"""keras_noisecurve.apps.layers: the bundled layers keep their Keras serialization names, so
saved models load, also from a file written when they lived in ``keras_noisecurve.layers``."""

import io
import json
import zipfile

import keras
import numpy as np

from keras_noisecurve.apps import layers as knc_layers


def _model():
    inputs = keras.Input((6, 6, 4))
    x = knc_layers.GroupNorm(groups=2, name="gn")(inputs)
    x = knc_layers.AdaptiveAveragePooling2D((2, 2), name="pool")(x)
    outputs = keras.layers.Dense(3, name="out")(keras.layers.Flatten()(x))
    return keras.Model(inputs, outputs)


def _rename_module(src, dst, old, new):
    """Copy a .keras archive, replacing the module recorded for our layers (what a file
    written before the move contains)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename == "config.json":
                text = data.decode()
                assert f'"module": "{old}"' in text
                data = text.replace(f'"module": "{old}"', f'"module": "{new}"').encode()
            zout.writestr(item, data)


def test_layers_keep_their_registered_names():
    assert keras.saving.get_registered_name(knc_layers.GroupNorm) == "keras_noisecurve>GroupNorm"
    assert (
        keras.saving.get_registered_name(knc_layers.AdaptiveAveragePooling2D)
        == "keras_noisecurve>AdaptiveAveragePooling2D"
    )


def test_saved_model_with_groupnorm_loads_also_from_a_file_written_before_the_move(tmp_path):
    model = _model()
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 4)).astype("float32")
    expected = model(x).numpy()
    path = tmp_path / "new.keras"
    model.save(path)
    with zipfile.ZipFile(path) as z:
        config = json.load(io.BytesIO(z.read("config.json")))
    layers = {layer["config"]["name"]: layer for layer in config["config"]["layers"]}
    assert layers["gn"]["registered_name"] == "keras_noisecurve>GroupNorm"
    assert layers["pool"]["registered_name"] == "keras_noisecurve>AdaptiveAveragePooling2D"

    old = tmp_path / "old.keras"
    _rename_module(path, old, "keras_noisecurve.apps.layers", "keras_noisecurve.layers")
    for file in (path, old):
        loaded = keras.models.load_model(file)
        assert isinstance(loaded.get_layer("gn"), knc_layers.GroupNorm)
        assert isinstance(loaded.get_layer("pool"), knc_layers.AdaptiveAveragePooling2D)
        assert loaded.get_layer("gn").groups == 2
        np.testing.assert_allclose(loaded(x).numpy(), expected, rtol=1e-6, atol=1e-6)


def test_groupnorm_ghost_rule_is_registered_from_the_apps_side():
    from keras_noisecurve.backend.tensorflow import ghost, engine_rules

    model = _model()
    rule = engine_rules.find_rule(model.get_layer("gn"))
    assert rule.kind == "GroupNorm" and rule.kernel is knc_layers.GROUP_NORM_RULE.kernel("tensorflow")
    assert ("gn", "GroupNorm", "GroupNorm") in ghost.describe(model)
    # the core's own rules know nothing of the apps' layer
    assert not any(rule.matches(model.get_layer("gn")) for rule in engine_rules.RULES)
