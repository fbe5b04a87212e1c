"""``load_mixing``: every accepted form of a ``mixing=`` argument, and every refusal."""

import pathlib

import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.mixing import IdentityMixing, InvalidMixingMatrixError, MixingMatrix, load_mixing


def _banded():
    return MixingMatrix.from_dense(np.array([[0.6, 0.0, 0.0], [0.8, 0.6, 0.0], [0.0, 0.8, 1.0]]),
                                   metadata={"objective": "bandmf"})


def test_exported_at_the_top_level():
    assert knc.load_mixing is load_mixing


def test_object_is_returned_as_it_is_and_dpsgd_is_the_identity_without_a_plan():
    c = _banded()
    assert load_mixing(c) is c
    identity = load_mixing("dpsgd")
    assert identity == IdentityMixing() and identity.is_identity and not identity.has_plan


@pytest.mark.parametrize("as_path", [str, pathlib.Path])
def test_path(tmp_path, as_path):
    c = _banded()
    c.save(tmp_path / "c.npz")
    loaded = load_mixing(as_path(tmp_path / "c.npz"))
    assert isinstance(loaded, MixingMatrix)
    assert loaded == c and loaded.metadata == {"objective": "bandmf"}


def test_config_dict():
    c = _banded()
    loaded = load_mixing({"band_values": c.band_values.tolist(), "metadata": c.metadata})
    assert loaded == c and loaded.metadata == c.metadata
    assert load_mixing({"band_values": c.band_values}).metadata == {}


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"mixing='.*missing\.npz': no such file\. Pass a MixingMatrix"):
        load_mixing(str(tmp_path / "missing.npz"))
    with pytest.raises(ValueError, match="no such file"):  # a typo of an objective name is a path
        load_mixing("bandmf")


def test_invalid_artifact(tmp_path):
    np.savez(tmp_path / "bad.npz", something=np.ones(3))
    with pytest.raises(ValueError, match="is not a valid mixing-matrix artifact: .*not a keras-noisecurve"):
        load_mixing(tmp_path / "bad.npz")


def test_bad_dict():
    with pytest.raises(ValueError, match=r"must have 'band_values' .*got keys \['metadata'\]"):
        load_mixing({"metadata": {}})
    with pytest.raises(InvalidMixingMatrixError, match="column 0 has norm"):
        load_mixing({"band_values": [[2.0], [1.0]]})


@pytest.mark.parametrize("array", [np.ones((4, 1)), np.eye(3)])
def test_array_is_refused_with_the_way_to_wrap_it(array):
    with pytest.raises(ValueError, match=r"mixing must be a MixingMatrix.*numpy array of shape \(\d, \d\)"
                                         r".*MixingMatrix\(band_values\).*MixingMatrix\.from_dense\(C\)"):
        load_mixing(array)


@pytest.mark.parametrize("value, shown", [(3, r"got 3 \(int\)"), (None, r"got None \(NoneType\)"),
                                          ([0.5] * 1000, r"got \[0\.5, 0\.5, .*\.\.\.\] \(list\)")])
def test_other_types(value, shown):
    with pytest.raises(ValueError, match=r"mixing must be a MixingMatrix, a path to a \.npz artifact or "
                                         r"'dpsgd'; " + shown):
        load_mixing(value)
