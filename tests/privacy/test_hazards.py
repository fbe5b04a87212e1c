"""docs/privacy.md's "What can make ε wrong", on the backend of this run (TensorFlow by
default): the cases are tests/privacy/hazard_cases.py, shared with tests/jax/test_jax_hazards.py."""

from tests.privacy.hazard_cases import *  # noqa: F401,F403
