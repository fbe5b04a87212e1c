"""AdaptiveClip on JAX (``KERAS_BACKEND=jax``): the same ζ_t as TensorFlow and as numpy.

- η = 0 with ζ_0 a power of two trains bit for bit like a fixed clip at ζ_0 (DP-SGD and a
  banded C, the run's batches with their padding rows);
- a linear model whose per-example norms are a numpy formula: fit's logged ``l2_norm_clip``
  and the final weights equal adaptive DP-SGD written in float64 numpy (noise from the
  Philox draws, the count's from stream ``COUNT_STREAM``), and ζ ends near the median norm;
- a PrivateRun with a banded C and an adaptive clip trained here and in a TensorFlow
  subprocess: the same ζ trajectory and weights (as tests/training/test_cross_backend.py);
- resume (``BackupAndRestore`` after a crash, ``load_model``): ζ and the weights equal
  the uninterrupted run's, bit for bit (as tests/jax/test_jax_resume.py).
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from tests.training.adaptive_reference import (adaptive_dp_sgd, count_normal, dp_sgd_case, linear_model,
                                               reference_next)
from tests.training.helpers import CrashAt, noiseless, random_banded_c

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.filterwarnings("ignore:this optimizer has no PrivateRun")


class _Clips(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logged, self.steps = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.logged.append(float(logs["l2_norm_clip"]))
        self.steps.append(int(np.asarray(self.model.optimizer.iterations.value)))


def _clip_value(private):
    return np.asarray(private.optimizer.current_clip())


# -------------------------------------------------------- η = 0 is a fixed clip
N, B, T = 60, 6, 8


def _data(n=N):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, :1] - 0.5 * x[:, 1:2] + 0.3).astype("float32")


def _small():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])


def _initial_weights():
    keras.utils.set_random_seed(3)
    return _small().get_weights()


@pytest.mark.parametrize("kind", ["dpsgd", "banded"])
def test_learning_rate_zero_trains_exactly_like_a_fixed_clip(kind):
    """ζ stays 0.5 exactly; DP-SGD's weights are the fixed clip's bit for bit. With a banded C
    they agree to float32 round-off only (≤ 2 ulp measured): the adaptive step is another XLA
    program (the clip a traced scalar, the count query beside it), and XLA's CPU backend
    vectorises its reductions differently; with ``XLA_FLAGS=--xla_backend_optimization_level=0``
    they are bit for bit equal too, also with σ = 0, so neither the noise nor the clip differs.
    A clip or noise that differed would move the weights by ~η·ζσ/B ≈ 0.05 per step."""
    mixing = "dpsgd" if kind == "dpsgd" else random_banded_c(T, 3, rng=np.random.default_rng(2), diag_scale=0.5)
    init = _initial_weights()
    results = []
    for clip in (knc.AdaptiveClip(initial=0.5, learning_rate=0.0), None):
        run = knc.PrivateRun(num_examples=N, batch_size=B, steps=T, mixing=mixing, noise_multiplier=1.3,
                             delta=1e-5, seed=7, adaptive_clip=clip)
        base = _small()
        base.set_weights(init)
        private = knc.make_private(base)
        optimizer = (knc.NoiseCurveOptimizer(run=run, learning_rate=0.5, seed=11) if clip is not None else
                     knc.NoiseCurveOptimizer(run=run, learning_rate=0.5, l2_norm_clip=0.5, seed=11))
        private.compile(optimizer=optimizer, loss="mse")
        history = private.fit(run.dataset(*_data()), verbose=0)
        assert int(np.asarray(optimizer.iterations.value)) == T
        if clip is not None:
            assert _clip_value(private) == np.float32(0.5)
            assert all(v == 0.5 for v in history.history["l2_norm_clip"])
        else:
            assert "l2_norm_clip" not in history.history
        results.append([np.asarray(w) for w in base.get_weights()])
    adaptive, fixed = results
    for a, f in zip(adaptive, fixed):
        if kind == "dpsgd":
            np.testing.assert_array_equal(a, f)
        else:
            np.testing.assert_allclose(a, f, rtol=1e-6, atol=1e-7)
    assert any(not np.allclose(a, w0, atol=1e-3) for a, w0 in zip(adaptive, init))  # it trained


# ----------------------------------------- a private model: norms known in numpy
@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
def test_fit_equals_adaptive_dp_sgd_written_in_numpy(clipping):
    """The whole algorithm in float64 numpy: per-example gradients w_i·2r·[x, 1] clipped at
    ζ_t, plus ζ_t·σ·z_t (z_t the Philox draw of each variable), over B; ζ_{t+1} from the count
    of norms ≤ ζ_t among the rows of weight > 0, and n_t. The same numbers as the TensorFlow
    test of the same name."""
    case = dp_sgd_case()
    model = linear_model()
    private = knc.make_private(model, clipping=clipping)
    private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=case["eta"], l2_norm_clip=case["rule"],
                                                      noise_multiplier=case["sigma"],
                                                      expected_batch_size=case["batch"], seed=case["seed"]),
                    loss="mse")
    clips = _Clips()
    private.fit(case["x"], case["y"], sample_weight=case["weights"].astype("float32"), batch_size=case["batch"],
                epochs=1, shuffle=False, verbose=0, callbacks=[clips])

    zetas, kernel, bias = adaptive_dp_sgd(**case)
    np.testing.assert_allclose(clips.logged, zetas[:-1], rtol=1e-5)
    assert abs(np.log(zetas[-1] / 0.5)) > 0.1  # ζ moved
    np.testing.assert_allclose(float(_clip_value(private)), zetas[-1], rtol=1e-5)
    got_kernel, got_bias = model.get_weights()
    np.testing.assert_allclose(got_kernel, kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_bias, bias, rtol=1e-5, atol=1e-6)


def test_fit_logs_zeta_and_it_moves_to_the_median_norm():
    """The weights do not move (η tiny, σ = 0): the norms are the numpy formula's at every
    step, and ζ goes from 30× below their median to within 25 % of it."""
    n, batch, epochs, seed = 240, 24, 6, 13
    rng = np.random.default_rng(4)
    x = rng.normal(size=(n, 3)).astype("float32")
    y = (x @ np.array([[1.0], [0.5], [-0.5]]) + rng.normal(size=(n, 1))).astype("float32")
    model = linear_model()
    kernel, bias = (np.asarray(w, np.float64) for w in model.get_weights())
    r = x.astype(np.float64) @ kernel[:, 0] + bias[0] - y[:, 0]
    median = float(np.median(2 * np.abs(r) * np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=1) + 1)))
    rule = knc.AdaptiveClip(initial=median / 30, learning_rate=0.5)
    private = knc.make_private(model)
    private.compile(optimizer=noiseless(knc.NoiseCurveOptimizer(learning_rate=1e-30, l2_norm_clip=rule,
                                                                noise_multiplier=1.0, expected_batch_size=batch,
                                                                seed=seed)), loss="mse")
    clips = _Clips()
    history = private.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[clips])
    np.testing.assert_array_equal(np.asarray(model.get_weights()[0]), kernel.astype(np.float32))
    per_epoch = n // batch
    assert len(clips.logged) == epochs * per_epoch and len(history.history["l2_norm_clip"]) == epochs
    assert history.history["l2_norm_clip"] == pytest.approx(clips.logged[per_epoch - 1::per_epoch], rel=1e-7)
    distance = [abs(np.log(z / median)) for z in clips.logged]
    assert distance[0] > 3.0
    assert max(distance[-per_epoch:]) < 0.25, (clips.logged[-per_epoch:], median)


def test_stateless_apply_needs_the_norms():
    opt = knc.NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=knc.AdaptiveClip(), noise_multiplier=1.0,
                                  expected_batch_size=4, seed=0)
    variables = [keras.Variable(np.zeros(3, np.float32))]
    opt.build(variables)
    with pytest.raises(ValueError, match="needs the step's per-example norms"):
        opt.stateless_apply_clipped_sum([v.value for v in opt.variables], [jnp.zeros(3)], [variables[0].value])
    # with them: ζ_1 as numpy's (all 4 examples above ζ_0 = 0.1)
    _, values = opt.stateless_apply_clipped_sum([v.value for v in opt.variables], [jnp.zeros(3)],
                                                [variables[0].value], norms=jnp.full((4,), 5.0),
                                                sample_weight=jnp.ones(4))
    clip_index = [id(v) for v in opt.variables].index(id(opt._clip))
    want = reference_next(0.1, 0, 4, count_normal(0, 0), 4, knc.AdaptiveClip())
    np.testing.assert_allclose(float(values[clip_index]), want, rtol=1e-6)


# ------------------------------------------------- TensorFlow and JAX agree
SCRIPT = r"""
import json
import numpy as np
import keras
import keras_noisecurve as knc
from tests.training.helpers import random_banded_c

def run_once():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x[:, :1] - 0.5 * x[:, 1:2]).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    init = np.random.default_rng(1)
    model.set_weights([init.normal(size=w.shape).astype("float32") * 0.5 for w in model.get_weights()])
    mixing = random_banded_c(8, 2, rng=np.random.default_rng(2), diag_scale=2.0)
    run = knc.PrivateRun(num_examples=64, batch_size=8, steps=8, mixing=mixing, noise_multiplier=1.0, delta=1e-5,
                         seed=7, adaptive_clip=knc.AdaptiveClip(initial=0.05, learning_rate=0.5))
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.2, seed=5), loss="mse")
    clips = []
    logger = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: clips.append(float(logs["l2_norm_clip"])))
    private.fit(run.dataset(x, y), verbose=0, callbacks=[logger])
    clips.append(float(np.asarray(private.optimizer.current_clip())))
    return {"clips": clips, "weights": [np.asarray(w, np.float64).tolist() for w in model.get_weights()]}

if __name__ == "__main__":
    print(json.dumps(run_once()))
"""


def test_tensorflow_and_jax_give_the_same_zeta_and_weights(tmp_path):
    script = tmp_path / "adaptive_clip_run.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, KERAS_BACKEND="tensorflow", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    tf_result = json.loads(out.stdout.strip().splitlines()[-1])
    namespace = {}
    exec(compile(SCRIPT.replace('if __name__ == "__main__":', "if False:"), "adaptive_clip_run", "exec"), namespace)
    jax_result = namespace["run_once"]()
    assert len(jax_result["clips"]) == len(tf_result["clips"]) == 9  # ζ_0 … ζ_8
    np.testing.assert_allclose(jax_result["clips"], tf_result["clips"], rtol=1e-5)
    assert jax_result["clips"][0] == pytest.approx(0.05) and abs(np.log(jax_result["clips"][-1] / 0.05)) > 0.3
    for got, want in zip(jax_result["weights"], tf_result["weights"]):
        got, want = np.array(got), np.array(want)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.max(np.abs(want)))


# ------------------------------------------------------------------- resume
RN, RB, RT = 80, 10, 8  # 8 steps per pass: one epoch


def _resume_run(seed=3):
    return knc.PrivateRun(num_examples=RN, batch_size=RB, steps=RT, mixing=knc.solve_mixing_matrix(steps=RT, bands=2),
                          noise_multiplier=1.0, delta=1e-5, seed=seed,
                          adaptive_clip=knc.AdaptiveClip(initial=0.05, learning_rate=0.5))


def _resume_model(run, noise_seed=4):
    keras.utils.set_random_seed(0)
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(1)])
    private = knc.make_private(inner)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=noise_seed), loss="mse")
    return private


@pytest.fixture(scope="module")
def uninterrupted():
    run = _resume_run()
    private = _resume_model(run)
    clips = _Clips()
    private.fit(run.dataset(*_data(RN)), verbose=0, callbacks=[clips])
    assert int(np.asarray(private.optimizer.iterations.value)) == RT
    return [np.asarray(w) for w in private.get_weights()], _clip_value(private), clips.logged


def _assert_same(private, uninterrupted):
    weights, clip, _ = uninterrupted
    assert _clip_value(private) == clip
    for a, b in zip(private.get_weights(), weights):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_backup_and_restore_restores_zeta(tmp_path, uninterrupted):
    backup = str(tmp_path / "backup")
    run = _resume_run()
    private = _resume_model(run)
    with pytest.raises(RuntimeError, match="simulated crash"):
        private.fit(run.dataset(*_data(RN)), verbose=0,
                    callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), CrashAt(at_step=4)])
    resumed = _resume_model(_resume_run(seed=None), noise_seed=999)  # the key, the step and ζ come from the backup
    clips = _Clips()
    resumed.fit(run.dataset(*_data(RN)), verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1), clips])
    assert clips.steps == [5, 6, 7, 8]
    assert clips.logged == uninterrupted[2][4:]  # ζ_4 … ζ_7, as the uninterrupted run's
    _assert_same(resumed, uninterrupted)


def test_load_model_restores_zeta(tmp_path, uninterrupted):
    run = _resume_run()
    private = _resume_model(run)
    private.fit(run.dataset(*_data(RN)), verbose=0, steps_per_epoch=4)
    saved = _clip_value(private)
    assert saved != np.float32(0.05) and saved == np.float32(uninterrupted[2][4])
    path = str(tmp_path / "mid.keras")
    private.save(path)
    resumed = keras.models.load_model(path)
    assert resumed.optimizer.adaptive_clip == run.adaptive_clip
    assert _clip_value(resumed) == saved
    resumed.fit(_resume_run(seed=None).dataset(*_data(RN)), verbose=0)
    _assert_same(resumed, uninterrupted)
