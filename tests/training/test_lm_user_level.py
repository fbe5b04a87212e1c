"""The user-level LoRA recipe of docs/models.md on TensorFlow (tests/jax/test_jax_lm_user_level.py
runs it on JAX): a tiny GPT-2 causal LM with LoRA trains per user with an adaptive clip, and its
engine clips each user's rows as one unit."""

import pytest

from tests.training.lm_user_level import check_user_level


@pytest.mark.slow
def test_the_user_level_language_model_recipe_clips_per_user_with_an_adaptive_clip(tmp_path, monkeypatch):
    check_user_level(tmp_path, monkeypatch)
