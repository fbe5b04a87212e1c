"""docs/privacy.md's "What can make ε wrong", the paths that leave a step without noise, on
JAX: the cases of tests/privacy/leak_cases.py, which tests/privacy/test_leaks.py runs on
TensorFlow."""

from tests.privacy.leak_cases import *  # noqa: F401,F403
