"""The quick start for language models of docs/models.md on TensorFlow (tests/jax/test_jax_lm.py
runs it on JAX): a tiny GPT-2 causal LM with LoRA trains, saves, loads and resumes exactly."""

import pytest

from tests.training.lm_quickstart import check_quickstart


@pytest.mark.slow
def test_the_language_model_quick_start_trains_saves_loads_and_resumes_exactly(tmp_path, monkeypatch):
    check_quickstart(tmp_path, monkeypatch)
