"""keras_noisecurve.layers: the layers that moved out of keras_noisecurve.models keep
their import path there and their Keras serialization names, so saved models load."""

import io
import json
import zipfile

import keras
import numpy as np

from keras_noisecurve import layers as knc_layers
from keras_noisecurve import models


def _model():
    inputs = keras.Input((6, 6, 4))
    x = models.GroupNorm(groups=2, name="gn")(inputs)  # the old import path
    x = models.AdaptiveAveragePooling2D((2, 2), name="pool")(x)
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


def test_layers_are_the_same_classes_under_both_paths():
    assert models.GroupNorm is knc_layers.GroupNorm
    assert models.AdaptiveAveragePooling2D is knc_layers.AdaptiveAveragePooling2D
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
    _rename_module(path, old, "keras_noisecurve.layers", "keras_noisecurve.models")
    for file in (path, old):
        loaded = keras.models.load_model(file)
        assert isinstance(loaded.get_layer("gn"), knc_layers.GroupNorm)
        assert isinstance(loaded.get_layer("pool"), knc_layers.AdaptiveAveragePooling2D)
        assert loaded.get_layer("gn").groups == 2
        np.testing.assert_allclose(loaded(x).numpy(), expected, rtol=1e-6, atol=1e-6)
