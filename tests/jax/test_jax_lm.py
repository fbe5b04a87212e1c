"""LM fine-tuning on JAX end to end: the quick start of docs/models.md (a tiny GPT-2 causal LM
with LoRA, padding masks, ``fit(run.dataset(...))``, ``evaluate``, ``model.save`` /
``keras.models.load_model`` and resume), checked by ``tests/training/lm_quickstart.py``;
tests/training/test_lm_quickstart.py runs the same on TensorFlow."""

import pytest

from tests.training.lm_quickstart import check_quickstart


@pytest.mark.slow
def test_the_language_model_quick_start_trains_saves_loads_and_resumes_exactly(tmp_path, monkeypatch):
    check_quickstart(tmp_path, monkeypatch)
