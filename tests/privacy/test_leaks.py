"""docs/privacy.md's "What can make ε wrong", the paths that leave a step without noise, on
the backend of this run (TensorFlow by default): the cases are tests/privacy/leak_cases.py,
shared with tests/jax/test_jax_leaks.py."""

from tests.privacy.leak_cases import *  # noqa: F401,F403
