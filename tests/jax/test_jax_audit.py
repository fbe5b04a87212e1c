"""The mechanism checks (keras_noisecurve.audit.mechanism) on the JAX backend: correct runs pass
every check, the engine is compared layer by layer with an independent per-example ``jax.grad``
loop in float64 (``jax.enable_x64``), and bugs planted from outside the library (a rule that
drops its layer's share, a noise of the wrong scale) are caught; ``noisecurve audit --model``
runs on a ``.keras`` file saved on JAX."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.apps.cli import main
from keras_noisecurve.audit.mechanism import check_mechanism
from keras_noisecurve.backend.common import kernel_rules

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    yield


def _data(n=48, features=6):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, features)).astype("float32"), rng.integers(0, 3, n)


def _model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh", name="body"),
                             keras.layers.LayerNormalization(name="norm"), keras.layers.Dense(3, name="head")])


def _private(strategy="banded", clipping="auto", factory=knc.NoiseCurveOptimizer, **kwargs):
    x, y = _data()
    steps = 12
    mixing = (knc.MixingMatrix.identity(steps) if strategy == "dpsgd"
              else knc.solve_mixing_matrix(steps=steps, bands=3, objective="bandmf"))
    run = knc.PrivateRun(num_examples=len(y), batch_size=8, steps=steps, mixing=mixing, epsilon=4.0, delta=1e-5,
                         seed=1)
    private = knc.make_private(_model(), clipping=clipping)
    kwargs.setdefault("learning_rate", None if "inner" in kwargs else 0.1)
    private.compile(optimizer=factory(run=run, l2_norm_clip=0.5, seed=2, **kwargs), loss=LOSS)
    return private, x, y


@pytest.mark.parametrize("strategy, clipping, inner", [
    ("dpsgd", "auto", None),
    ("banded", "ghost", "momentum"),
    ("banded", "vectorized", None),
])
def test_correct_runs_pass_every_check_on_jax(strategy, clipping, inner):
    kwargs = {"inner": keras.optimizers.SGD(0.1, momentum=0.9)} if inner else {}
    private, x, y = _private(strategy, clipping, **kwargs)
    report = check_mechanism(model=private, x=x, y=y, batches=1, batch_size=8)
    assert report.passed, report.lines()
    assert list(report.checks) == ["clipping", "sampling", "noise"]
    clip = report.checks["clipping"]
    # the reference is float64 (jax.enable_x64), the engine float32: agreement to float32 rounding
    assert clip.reference_dtype == "float64" and clip.worst_error < 1e-5 and clip.norm_error < 1e-5, clip.line
    assert [entry["layer"].split("/")[-1] for entry in clip.layers] == ["body", "norm", "head"]
    rules = (["vectorized"] * 3 if clipping == "vectorized" else ["Dense", "LayerNormalization", "Dense"])
    assert [entry["rule"] for entry in clip.layers] == rules, clip.layers
    assert abs(report.checks["noise"].scale - 1) < 0.03


def test_a_rule_that_drops_its_layers_share_is_caught_and_named(monkeypatch):
    """A broken LayerNormalization rule (its norms zero, its sums right) fails the check, which
    names that layer and rule; the same model passes with the library's rule."""
    private, x, y = _private()
    good = check_mechanism(model=private, x=x, y=y, checks=("clipping",), batches=1, batch_size=8).checks["clipping"]
    assert good.passed, good.line
    from keras_noisecurve.backend.common.ghost_norm import layer_norm as original

    def dropped(layer, calls):
        result = original(layer, calls)
        if result is None:
            return None
        sq, sums = result
        return sq * 0.0, sums

    monkeypatch.setattr(kernel_rules, "RULES", tuple((kind, dropped if r is original else r) for kind, r in kernel_rules.RULES))
    bad = check_mechanism(model=private, x=x, y=y, checks=("clipping",), batches=1, batch_size=8).checks["clipping"]
    assert not bad.passed and "clipping: FAIL" in bad.line, bad.line
    name, cls, rule = bad.worst_layer
    assert name.endswith("norm") and cls == "LayerNormalization" and rule == "LayerNormalization", bad.line
    assert bad.worst_error > 0.5


class _HalfNoise(knc.NoiseCurveOptimizer):
    """Adds ζ·(σ/2)·z̃_t while the run (and its ε) still says σ: a planted bug."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise_multiplier = self.noise_multiplier * 0.5


def test_a_noise_of_the_wrong_scale_is_caught_on_jax():
    private, x, y = _private(factory=_HalfNoise)
    result = check_mechanism(model=private, x=x, y=y, checks=("noise",)).checks["noise"]
    assert not result.passed, result.line
    assert result.scale == pytest.approx(0.5, abs=0.02)


def test_noisecurve_audit_model_runs_on_a_file_saved_on_jax(tmp_path, capsys):
    private, x, y = _private()
    np.savez(tmp_path / "data.npz", x=x, y=y)
    private.save(tmp_path / "model.keras")
    out_json = tmp_path / "checks.json"
    rc = main(["audit", "--model", str(tmp_path / "model.keras"), "--data", str(tmp_path / "data.npz"),
               "--batches", "1", "--batch-size", "6", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for name in ("clipping: PASS", "sampling: PASS", "noise: PASS", "verdict: every mechanism check passed"):
        assert name in text
    assert json.loads(out_json.read_text())["passed"]


# ----------------------------------------------------------------- canary audits on JAX
SMALL = {"canaries": 2000, "epochs": 2, "steps_per_epoch": 8}


@pytest.mark.parametrize("strategy", ["dpsgd", "banded"])
def test_whitebox_correct_runs_stay_below_their_claim_on_jax(strategy):
    from keras_noisecurve.audit.whitebox import audit_whitebox

    result = audit_whitebox(strategy=strategy, epsilon=4.0, seed=1, **SMALL).result
    assert result.verdict == "consistent", result.to_dict()
    assert result.epsilon_lower > 0.4 * result.claimed_epsilon  # the audit is not weak (as on TensorFlow)
    assert result.info["noise_matches_claim"]


def test_whitebox_catches_a_noise_scaled_by_one_half_on_jax():
    from keras_noisecurve.audit.whitebox import audit_whitebox

    result = audit_whitebox(strategy="banded", epsilon=4.0, seed=3, optimizer_factory=_HalfNoise, **SMALL).result
    assert result.verdict == "violation" and result.epsilon_lower > result.claimed_epsilon, result.epsilon_lower


def test_whitebox_audits_a_run_resumed_through_save_and_load_on_jax():
    from keras_noisecurve.audit.whitebox import audit_whitebox

    result = audit_whitebox(strategy="banded", epsilon=4.0, seed=2, resume_at=5, **SMALL).result
    assert result.verdict == "consistent" and result.info["noise_matches_claim"], result.to_dict()


def test_input_canary_gradients_match_a_per_example_jax_grad_loop():
    import jax
    import jax.numpy as jnp

    from keras_noisecurve.audit import input_canaries

    model = input_canaries.build_model()
    rng = np.random.default_rng(0)
    m = 4
    x = {"features": rng.normal(size=(m, 32)).astype("float32"),
         "seq": rng.normal(size=(m, 6, 32)).astype("float32"),
         "gate": np.eye(4, dtype="float32")}
    y = rng.normal(size=(m, 1)).astype("float32")
    weights = [keras.ops.convert_to_numpy(v.value) for v in model.trainable_variables]
    grads = input_canaries.canary_gradients(model=model, weights=weights, canary_x=x, canary_y=y)
    non_trainable = [v.value for v in model.non_trainable_variables]
    for i in range(m):  # an independent loop: one example at a time
        def loss(tv, i=i):
            out, _ = model.stateless_call(tv, non_trainable, {k: v[i:i + 1] for k, v in x.items()}, training=False)
            return jnp.square(out[0, 0] - y[i, 0])

        ref = np.concatenate([np.ravel(g) for g in jax.grad(loss)([jnp.asarray(w) for w in weights])])
        np.testing.assert_allclose(grads[i], ref, rtol=1e-4, atol=1e-5)
        assert np.linalg.norm(grads[i]) > 0


def test_input_canary_audit_is_consistent_on_jax():
    from keras_noisecurve.audit.whitebox import audit_whitebox

    audit = audit_whitebox(canary_kind="input", strategy="dpsgd", epsilon=1.0, canaries=400, epochs=2,
                           steps_per_epoch=16, learning_rate=0.05, seed=1)
    result = audit.result
    assert result.verdict == "consistent", result.to_dict()
    # an included (clipped) canary adds exactly 1 to its observation at a step it takes part in
    inc, part, obs = audit.included, audit.patterns > 0, audit.observations
    seen_in, seen_out = obs[:, inc][part[:, inc]], obs[:, ~inc][part[:, ~inc]]
    se = np.sqrt(seen_in.var() / seen_in.size + seen_out.var() / seen_out.size)
    assert abs(seen_in.mean() - seen_out.mean() - 1.0) < 3 * se, (seen_in.mean() - seen_out.mean(), se)


def test_blackbox_audit_stays_below_the_claim_on_jax():
    from keras_noisecurve.audit.blackbox import audit_blackbox

    result = audit_blackbox(strategy="banded", epsilon=4.0, seed=0)
    assert result.verdict == "consistent" and set(result.bounds) == {"loss/one-run"}


class _FrozenClipNoise(knc.NoiseCurveOptimizer):
    """An adaptive clip whose noise stays at ζ_0·σ while ζ_t moves."""

    def _dp_noise_std(self, dtype):
        return self.l2_norm_clip * self.noise_multiplier


def _adaptive_private(factory=knc.NoiseCurveOptimizer):
    x, y = _data()
    steps = 30
    run = knc.PrivateRun(num_examples=len(y), batch_size=8, steps=steps, noise_multiplier=1.0, delta=1e-5, seed=1,
                         mixing=knc.solve_mixing_matrix(steps=steps, bands=3, objective="bandmf"),
                         adaptive_clip=knc.AdaptiveClip(initial=0.2, learning_rate=0.5, count_stddev=0.5))
    private = knc.make_private(_model())
    private.compile(optimizer=factory(run=run, learning_rate=0.1, seed=2), loss=LOSS)
    return private, x, y


def test_an_adaptive_clip_passes_every_check_and_noise_frozen_at_the_first_clip_is_caught_on_jax():
    private, x, y = _adaptive_private()
    report = check_mechanism(model=private, x=x, y=y, batches=1, batch_size=8, noise_steps=24)
    assert report.passed, report.lines()
    assert abs(report.checks["noise"].scale - 1) < 0.03
    private, x, y = _adaptive_private(_FrozenClipNoise)
    frozen = check_mechanism(model=private, x=x, y=y, checks=("noise",), noise_steps=24).checks["noise"]
    assert not frozen.passed and abs(frozen.scale - 1) > 0.1, frozen.line
