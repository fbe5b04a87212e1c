"""The JAX backend's tests: run with ``KERAS_BACKEND=jax python -m pytest tests/jax``.

``tests/conftest.py`` selects TensorFlow unless ``KERAS_BACKEND`` is set, so in the
default test run this folder is skipped as a whole (with the reason below); the
cross-backend comparison that the default run does is tests/training/test_cross_backend.py.
"""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KERAS_BACKEND") == "jax":
        return
    skip = pytest.mark.skip(reason="tests/jax runs under the JAX Keras backend only: KERAS_BACKEND=jax pytest tests/jax")
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(skip)


@pytest.fixture
def fallbacks(monkeypatch):
    """The names of the layers the JAX ghost engine sent to its per-layer fallback (trace time,
    in order; a caller clipped whole is one of them)."""
    from tests.jax.helpers import spy_fallback

    names = []
    spy_fallback(monkeypatch, lambda layer: names.append(layer.name))
    return names
