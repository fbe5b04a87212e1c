"""The JAX quick start for language models (docs/models.md) as a test body, for either backend.

:func:`check_quickstart` runs the docs block in this process (its ``lm.keras`` in a temporary
folder), then lets the ORIGINAL model finish the same plan without the save and checks that the
model loaded from ``lm.keras`` and resumed ends with the same weights (same batches, same
noise: the resume restored the LoRA factors, the frozen weights and the optimizer's state).
"""

import os

import numpy as np

from tests.e2e.test_docs_code import parse_blocks

HEADING = "## The JAX quick start for language models"


def quickstart_code() -> str:
    """The python block right under :data:`HEADING` in docs/models.md."""
    blocks, problems = parse_blocks(os.path.join("docs", "models.md"))
    assert not problems, problems
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                             "docs", "models.md"), encoding="utf-8").read().split("\n")
    start = text.index(HEADING) + 1
    block = next(b for b in blocks if b.line > start)
    return block.code


def check_quickstart(tmp_path, monkeypatch):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    monkeypatch.chdir(root)
    code = quickstart_code()
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__main__"}
    exec(compile(code, "docs/models.md (JAX quick start for language models)", "exec"), namespace)
    private, restored, run = namespace["private"], namespace["restored"], namespace["run"]
    assert int(np.asarray(restored.optimizer.iterations.value)) == run.steps
    assert len(restored.trainable_variables) == len(private.trainable_variables)
    def lora(model):
        return [v.name for v in model.trainable_variables if "lora" in v.name]

    assert lora(restored) and lora(restored) == lora(private)  # the same LoRA factors train
    assert len(restored.trainable_variables) < len(restored.weights) // 2  # the rest stays frozen
    private.fit(run.dataset(namespace["x"], namespace["y"]), verbose=0)  # the same plan, no save
    assert int(np.asarray(private.optimizer.iterations.value)) == run.steps
    # float32 rounding (a different summation order after the restore) is ~1e-6; one noise step
    # moves a weight by ~lr·σζ/B ≈ 3e-3, a resume from zero factors or another step by more
    for got, want in zip(restored.weights, private.weights):
        np.testing.assert_allclose(np.asarray(got.value), np.asarray(want.value), rtol=1e-4, atol=2e-5,
                                   err_msg=got.path)
    logs = restored.evaluate(namespace["x"], namespace["y"], sample_weight=namespace["tokens"], batch_size=16,
                             verbose=0, return_dict=True)
    assert np.isfinite(logs["loss"]) and 0 <= logs["accuracy"] <= 1
