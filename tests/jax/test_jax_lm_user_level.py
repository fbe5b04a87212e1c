"""The user-level LoRA recipe of docs/models.md on JAX, checked by
``tests/training/lm_user_level.py`` (a tiny GPT-2 causal LM with LoRA, ``privacy_unit="user"``,
an adaptive clip, ``fit(run.dataset(x, y, users=...))``; the engine's per-user norms and clipped
sum against a per-user loop); tests/training/test_lm_user_level.py runs the same on TensorFlow."""

import pytest

from tests.training.lm_user_level import check_user_level


@pytest.mark.slow
def test_the_user_level_language_model_recipe_clips_per_user_with_an_adaptive_clip(tmp_path, monkeypatch):
    check_user_level(tmp_path, monkeypatch)
