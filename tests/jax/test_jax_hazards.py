"""docs/privacy.md's "What can make ε wrong" on JAX: the cases of tests/privacy/hazard_cases.py,
which tests/privacy/test_hazards.py runs on TensorFlow."""

from tests.privacy.hazard_cases import *  # noqa: F401,F403
