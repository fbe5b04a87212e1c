"""Without tensorflow-privacy (an optional extra), the integration says how to install it.

Runs with or without tensorflow-privacy installed: its absence is simulated by an
import hook that reports the package as not found, as Python does for a package
that is not installed.
"""

import importlib
import sys
import types

import pytest

import keras_noisecurve
from keras_noisecurve.backend.tensorflow.tf_privacy_import import import_tf_privacy

EXTRA = 'pip install "keras-noisecurve[tf-privacy]"'


class _NotInstalled:
    """A ``sys.meta_path`` finder for which ``tensorflow_privacy`` does not exist."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "tensorflow_privacy" or name.startswith("tensorflow_privacy."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def _forget_tf_privacy(monkeypatch):
    """Drop tensorflow-privacy and the integration from the import caches for one test."""
    for name in list(sys.modules):
        if name.split(".")[0] == "tensorflow_privacy" or name in (
            "keras_noisecurve.integrations.tf_privacy", "keras_noisecurve.backend.tensorflow.tf_privacy"):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(keras_noisecurve.__dict__, "BandedMatrixFactorizationQuery", raising=False)


@pytest.fixture
def no_tf_privacy(monkeypatch):
    """tensorflow-privacy is not installed, for one test."""
    _forget_tf_privacy(monkeypatch)
    monkeypatch.setattr(sys, "meta_path", [_NotInstalled(), *sys.meta_path])


def _check_message(exc):
    message = str(exc.value)
    assert EXTRA in message
    assert "Python <= 3.11" in message
    assert isinstance(exc.value, ModuleNotFoundError) and exc.value.name == "tensorflow_privacy"


def test_import_helper_names_the_extra(no_tf_privacy):
    with pytest.raises(ImportError) as exc:
        import_tf_privacy("privacy.dp_query.dp_query")
    _check_message(exc)


def test_integration_module_names_the_extra(no_tf_privacy):
    with pytest.raises(ImportError) as exc:
        importlib.import_module("keras_noisecurve.integrations.tf_privacy")
    _check_message(exc)


def test_lazy_export_names_the_extra(no_tf_privacy):
    with pytest.raises(ImportError) as exc:
        keras_noisecurve.BandedMatrixFactorizationQuery  # noqa: B018
    _check_message(exc)


def test_tests_that_need_it_skip(no_tf_privacy):
    with pytest.raises(pytest.skip.Exception, match="tf-privacy extra"):
        pytest.importorskip("keras_noisecurve.integrations.tf_privacy",
                            reason="needs tensorflow-privacy: the tf-privacy extra (Python <= 3.11)")


def test_other_missing_modules_are_not_disguised(monkeypatch):
    """A missing submodule (or dependency) of an installed tensorflow-privacy is its own error."""
    _forget_tf_privacy(monkeypatch)
    fake = types.ModuleType("tensorflow_privacy")
    fake.__path__ = []  # a package with no submodules
    monkeypatch.setitem(sys.modules, "tensorflow_privacy", fake)
    with pytest.raises(ModuleNotFoundError) as exc:
        import_tf_privacy("privacy.no_such_module")
    assert exc.value.name == "tensorflow_privacy.privacy"
    assert "keras-noisecurve[tf-privacy]" not in str(exc.value)


@pytest.mark.parametrize("hidden", [True, False], ids=["without-extra", "as-installed"])
def test_star_import_works_with_or_without_the_extra(hidden):
    # `from keras_noisecurve import *` resolves every name of __all__: the optional
    # export is listed only where tensorflow-privacy is installed.
    import subprocess

    hook = (
        "import sys\n"
        "class F:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'tensorflow_privacy':\n"
        "            raise ModuleNotFoundError(name, name=name)\n"
        "sys.meta_path.insert(0, F())\n"
    )
    code = (hook if hidden else "") + (
        "import importlib.util\n"
        "installed = not " + str(hidden) + " and importlib.util.find_spec('tensorflow_privacy') is not None\n"
        "ns = {}\n"
        "exec('from keras_noisecurve import *', ns)\n"
        "assert ('BandedMatrixFactorizationQuery' in ns) == installed, installed\n"
        "assert 'make_private' in ns and 'MixingMatrix' in ns\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
