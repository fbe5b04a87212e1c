"""Tests of the JAX backend: collected only under ``KERAS_BACKEND=jax`` (the JAX CI stage);
skipped on the TensorFlow default of ``tests/conftest.py``."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KERAS_BACKEND") == "jax":
        return
    skip = pytest.mark.skip(reason="JAX backend tests: run with KERAS_BACKEND=jax")
    for item in items:
        if "tests/jax/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
