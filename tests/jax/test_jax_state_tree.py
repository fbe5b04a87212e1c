"""tests/training/test_state_tree.py on the JAX backend (the Orbax restore path is JAX's)."""

from tests.training.test_state_tree import *  # noqa: F401,F403 - the same tests, collected here
