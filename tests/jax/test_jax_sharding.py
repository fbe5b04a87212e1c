"""``keras.distribution.ModelParallel`` on 8 virtual CPU devices (mesh 2 × 4, data × model):
the noise state of a sharded weight is sharded like the weight (the buffer axis whole),
never replicated; the noise is drawn shard by shard, bit-identical to the unsharded draw;
the optimizer step needs no collective; a fixed-seed run ends with the 1-device weights.

The multi-device work runs in a subprocess (tests/jax/_sharding_run.py) because the device
count is fixed when JAX starts; the draw itself is checked here in one more subprocess.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DRAW = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from keras_noisecurve.backend.jax import noise as jn, sharding as js
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
key = jnp.asarray(jn.key_words(np.array([7, 9], np.int64)))
out = []
for spec, shape, scale in [((None, "model"), (64, 32), None), (("model", None), (64, 20), 0.7),
                           (("data", "model"), (6, 8, 4), 1.5)]:
    sharding = NamedSharding(mesh, P(*spec))
    def draw(key, step):
        return js.sharded_normal(jn.variable_seed(jn.step_seed(key, step), 3), shape, jnp.float32, sharding, scale)
    f = jax.jit(draw, out_shardings=sharding)
    text = f.lower(key, 2).compile().as_text()
    sizes = [int(np.prod([int(d) for d in s.split(",")])) for s in re.findall(r"\b(?:f32|u32|s32|pred)\[([0-9,]+)\]", text)]
    z = f(key, 2)
    ref = jn.normal_from_seed(jn.variable_seed(jn.step_seed(key, 2), 3), shape, scale=scale)
    out.append({"shape": shape, "largest": max(sizes), "shards": sorted({tuple(s.data.shape) for s in z.addressable_shards}),
                "equal": bool(np.array_equal(np.asarray(z), np.asarray(ref))),
                "collectives": re.findall(r"\b(all-gather|all-reduce|all-to-all|collective-permute)\b", text)})
print(json.dumps(out))
"""


def _run(args, timeout=900):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_sharded_draw_is_the_unsharded_draw_made_shard_by_shard():
    for case in _run(["-c", DRAW]):
        shape = tuple(case["shape"])
        shard = max(int(np.prod(s)) for s in case["shards"])
        assert case["equal"], case  # bit for bit normal_from_seed
        assert shard < int(np.prod(shape)), case
        # no array of the compiled draw is larger than one device's shard: no device
        # computes a word of another device's slice; nothing crosses devices
        assert case["largest"] == shard, case
        assert case["collectives"] == [], case


def _check_states(states, fraction):
    """Every noise state is laid out as its variable, the buffer axis whole: a device holds
    ``buffers × (its shard of the variable)``; a sharded variable's state is never replicated."""
    sharded = 0
    for s in states:
        (variable_shard,) = s["variable_shards"]
        (state_shard,) = s["shards"]
        assert s["devices"] == 8, s
        assert tuple(state_shard) == (s["shape"][0], *variable_shard), s
        assert s["spec"] == [None] + s["variable_spec"] + [None] * (len(s["shape"]) - 1 - len(s["variable_spec"])), s
        per_device = int(np.prod(state_shard)) / int(np.prod(s["shape"]))
        if any(axis is not None for axis in s["variable_spec"]):
            sharded += 1
            assert per_device == pytest.approx(fraction[s["variable"]] if isinstance(fraction, dict) else fraction), s
        else:
            assert per_device == 1.0, s
    return sharded


def _check_weights(one, sharded):
    assert len(one) == len(sharded)
    for a, b in zip(one, sharded):
        a, b = np.asarray(a), np.asarray(b)
        assert np.max(np.abs(b - a)) <= 1e-5 * np.max(np.abs(a)), (np.max(np.abs(b - a)), np.max(np.abs(a)))


@pytest.mark.slow
def test_model_parallel_banded_and_blt_end_with_the_one_device_weights_and_a_quarter_of_the_state_per_device():
    result = _run([os.path.join("tests", "jax", "_sharding_run.py"), "small"])
    for kind in ("banded", "blt"):
        _check_weights(result[kind]["one"], result[kind]["sharded"])
        # embedding table, both Dense kernels: split 4 ways over "model" (replicated over "data")
        assert _check_states(result[kind]["states"], 0.25) == 3
    step = result["banded"]["step"]
    # the optimizer step on the mesh: every draw, state update and weight update local
    assert step["collectives"] == [], step
    # no array as large as the whole embedding table (32 × 16): its noise is drawn per shard
    assert step["largest"] < 32 * 16, step


@pytest.mark.benchmark  # ~6 min on 2 loaded cores (XLA compiles the 8-device Gemma step twice): out of CI's budget
def test_a_tiny_keras_hub_gemma_under_its_own_layout_map_keeps_an_eighth_of_each_sharded_state_per_device():
    pytest.importorskip("keras_hub")
    result = _run([os.path.join("tests", "jax", "_sharding_run.py"), "gemma"])["banded"]
    _check_weights(result["one"], result["sharded"])
    # GemmaBackbone.get_layout_map splits the embedding and every attention and FFW kernel
    # over both mesh axes (data and model): 1/8 of each on a device; the norms' scales are whole
    assert _check_states(result["states"], 1 / 8) == 8  # embedding, query, key, value, output, 3 FFW kernels
    assert result["step"]["collectives"] == [], result["step"]


@pytest.mark.slow
def test_a_sharded_run_resumed_from_model_save_equals_the_uninterrupted_run_on_the_same_and_another_mesh():
    result = _run([os.path.join("tests", "jax", "_sharding_run.py"), "resume"])
    for mesh, model_shards in (("2x4", 4), ("4x2", 2)):
        resumed = result[mesh]
        assert resumed["step"] == 3
        _check_weights(result["whole"], resumed["weights"])
        for s in resumed["states"]:  # restored into the layout of the mesh it resumes on
            (variable_shard,) = s["variable_shards"]
            (state_shard,) = s["shards"]
            assert tuple(state_shard[1:]) == tuple(variable_shard), s
        split = [s for s in resumed["states"] if "bias" not in s["variable"]]
        assert len(split) == 3  # embedding and both kernels: 1/4 of each on 2 x 4, 1/2 on 4 x 2
        for s in split:
            assert np.prod(s["shards"][0][1:]) * model_shards == np.prod(s["shape"]), s
