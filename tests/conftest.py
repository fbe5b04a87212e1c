"""Test configuration shared by the whole suite.

Keras runs on TensorFlow; the CPU is split into two logical devices (before
TensorFlow initialises) so ``tf.distribute.MirroredStrategy`` can be tested on a
machine without accelerators. After every test the survivors of a garbage collection
are moved out of the collector's sight (:func:`_freeze_what_survives`).
"""

import gc
import os
import sys

import pytest

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# XLA compiles the tests' programs without LLVM's optimisations (set before JAX or TensorFlow
# starts; subprocesses inherit it). The tests' models are tiny, so compiling dominates: measured
# on 2 cores, tests/jax/test_jax_depthwise.py + test_jax_catalogue.py 236 s -> 109 s, the whole
# JAX suite 1,342 s -> 1,069 s (TensorFlow's tests use XLA only where they ask). The HLO passes
# (fusion, layout) still run, so a test sees the programs a user's machine compiles, only not
# vectorised the same way; the benchmarks and the CI's demo and JAX quick-start runs compile as
# users do. An optimisation level set by the caller wins.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def pytest_configure(config):
    if os.environ["KERAS_BACKEND"] != "tensorflow":  # tests/jax: TensorFlow is not needed
        return
    try:
        import tensorflow as tf
    except ImportError:  # pragma: no cover - the numpy-only tests still run
        return
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
        )
    except RuntimeError:  # already initialised
        pass


def pytest_collection_modifyitems(config, items):
    """Run the modules that hold a slow test (``@pytest.mark.slow``, or any of tests/e2e) first,
    each module's tests together and in their order: with ``-n 2`` a minutes-long test started
    last would leave the other worker idle at the end of the run."""
    slow = {item.path for item in items if item.get_closest_marker("slow") or "e2e" in item.path.parts}
    items.sort(key=lambda item: item.path not in slow)  # stable: the rest keep their order


@pytest.fixture(autouse=True)
def _separate_collective_keys():
    """Give every test's ``MirroredStrategy`` its own collective keys.

    Each new ``MirroredStrategy`` numbers its collective groups and instances from the
    same start, and TensorFlow's collective executor remembers the shapes of the
    instances it has run: a second strategy in the same process then all-reduces
    against the first one's shapes ("Shape mismatch in the collective instance 100",
    tensorflow/tensorflow#62790). TensorFlow's own tests move the keys' base for
    every strategy (``strategy_combinations.py``); so do we, before every test.
    """
    if "tensorflow" in sys.modules:
        from tensorflow.python.distribute import mirrored_strategy

        mirrored_strategy.MirroredStrategy._collective_key_base += 100_000
    yield


@pytest.fixture(autouse=True)
def _freeze_what_survives():
    """After each test, collect garbage, then ``gc.freeze()`` what is left.

    TensorFlow (2.13 and later) never frees the graphs ``tf.function`` traces for
    ``fit``, even after the model is gone and ``keras.backend.clear_session()`` ran
    (plain Keras too: keras-team/tf-keras#286, tensorflow/tensorflow#61791): their
    operations form reference cycles through TensorFlow's C++ graph, which Python's
    collector cannot see. Each test worker accumulates them (~20k operations per
    KerasHub model of the catalogue), and every later full collection walks them again,
    so the suite slowed down as it ran. Frozen objects are skipped by later collections;
    what is garbage is collected first, so nothing collectable is kept. Measured: ten
    catalogue backbones and one collecting test in one process, 125.5 s -> 95.8 s.
    """
    yield
    gc.collect()
    gc.freeze()
