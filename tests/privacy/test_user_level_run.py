"""User-level privacy, the run and the data: ``PrivateRun(privacy_unit="user", num_users=n,
examples_per_user=k)`` plans and accounts exactly as an example-level run of n examples, its
sampler draws users, and ``UserTable.rows`` expands each step's users into k rows per slot
(user-major; the masks average a user's examples). The TensorFlow pipeline is checked here
(the default backend); the numpy ``StepBatches`` the JAX backend serves is checked here too
and through the JAX pipeline in tests/jax/test_jax_user_rows.py."""

import itertools
import json

import numpy as np
import pytest

from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.privacy.sampler import key_from_seed
from keras_noisecurve.privacy.sources import as_source
from keras_noisecurve.privacy.step_batches import Samplers, StepBatches
from keras_noisecurve.privacy.users import UserTable

BASE = dict(batch_size=4, steps=6, noise_multiplier=1.0, delta=1e-5)


def _user_run(**change):
    return PrivateRun(**{**dict(privacy_unit="user", num_users=20, examples_per_user=3, seed=1, **BASE), **change})


def _ids(num_users=20, seed=0):
    """Users 0 … n−1 with 1 … n examples each (users m ≤ 3 and m > 3), shuffled over the examples."""
    ids = np.repeat(np.arange(num_users), np.arange(1, num_users + 1))
    return np.random.default_rng(seed).permutation(ids)


# ------------------------------------------------------------------ the plan
@pytest.mark.parametrize("kwargs, match", [
    (dict(privacy_unit="user", num_examples=20, examples_per_user=2),
     r"give num_users .* instead of num_examples; got num_examples=20, num_users=None"),
    (dict(privacy_unit="user", num_examples=20, num_users=20, examples_per_user=2),
     r"instead of num_examples; got num_examples=20, num_users=20"),
    (dict(privacy_unit="user", examples_per_user=2), r"got num_examples=None, num_users=None"),
    (dict(privacy_unit="user", num_users=20), "needs examples_per_user=k >= 1"),
    (dict(privacy_unit="user", num_users=20, examples_per_user=0), "examples_per_user must be >= 1, got 0"),
    (dict(num_examples=20, num_users=20), r"num_users= and examples_per_user= are for privacy_unit='user'.*"
                                          r"got num_users=20, examples_per_user=None"),
    (dict(num_examples=20, examples_per_user=4), r"got num_users=None, examples_per_user=4"),
    (dict(), "give num_examples"),
    (dict(privacy_unit="group", num_examples=20), r"privacy_unit must be one of 'example', 'user'; got 'group'"),
])
def test_the_unit_arguments_are_refused_with_what_was_received(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrivateRun(**BASE, **kwargs)


def test_user_level_properties_and_rows():
    run = _user_run()
    assert (run.privacy_unit, run.num_users, run.num_examples, run.examples_per_user) == ("user", 20, 20, 3)
    assert run.padded_rows == 3 * run.padded_batch_size
    assert run.steps_per_epoch == 5  # ⌈20 users / 4 users per step⌉
    example = PrivateRun(num_examples=20, **BASE)
    assert (example.privacy_unit, example.num_users, example.examples_per_user) == ("example", None, 1)
    assert example.padded_rows == example.padded_batch_size
    assert "privacy_unit='user', num_users=20, examples_per_user=3" in repr(run)
    assert "privacy unit: the user" in run.summary() and "privacy unit" not in example.summary()


def test_config_round_trip_and_fingerprints():
    run = _user_run()
    config = run.get_config()
    assert {"privacy_unit", "num_users", "examples_per_user"} <= set(config) and "num_examples" not in config
    assert config["privacy_unit"] == "user" and config["num_users"] == 20 and config["examples_per_user"] == 3
    again = PrivateRun.from_config(json.loads(json.dumps(config)))
    assert again.same_plan(run) and again.examples_per_user == 3 and again.privacy_unit == "user"
    example = PrivateRun(num_examples=20, **BASE)
    prints = {run.fingerprint(), _user_run(examples_per_user=4).fingerprint(), example.fingerprint()}
    assert len(prints) == 3  # the unit and k are part of the plan
    with pytest.raises(ValueError, match="unknown \\['num_examples'\\]"):
        PrivateRun.from_config({**config, "num_examples": 20})
    with pytest.raises(ValueError, match="missing \\['examples_per_user'\\]"):
        PrivateRun.from_config({k: v for k, v in config.items() if k != "examples_per_user"})
    with pytest.raises(ValueError, match="unknown \\['num_users'\\]"):
        PrivateRun.from_config({**example.get_config(), "num_users": 20})


def test_example_level_config_and_fingerprint_are_unchanged():
    run = PrivateRun(num_examples=200, batch_size=10, steps=8, noise_multiplier=1.0, delta=1e-5, seed=3)
    assert sorted(run.get_config()) == sorted([
        "num_examples", "batch_size", "steps", "mixing", "noise_multiplier", "delta", "sampling", "accountant",
        "max_batch_size", "overflow_probability"])
    assert run.fingerprint() == 4201692430333200703  # the fingerprint before user-level runs existed
    assert repr(run) == ("PrivateRun(num_examples=200, batch_size=10, steps=8, bands=1, sampling='cyclic_poisson', "
                         "noise_multiplier=1, delta=1e-05)")
    assert PrivateRun.from_config({**run.get_config(), "privacy_unit": "example"}).same_plan(run)


@pytest.mark.parametrize("plan", [dict(steps=30), dict(epochs=2, sampling="fixed_epochs")])
def test_user_level_epsilon_is_the_example_level_accountants_with_users(plan):
    common = dict(batch_size=25, delta=1e-6, **plan)
    users = PrivateRun(privacy_unit="user", num_users=500, examples_per_user=16, noise_multiplier=0.9, **common)
    examples = PrivateRun(num_examples=500, noise_multiplier=0.9, **common)
    assert users.spec == examples.spec and users.steps == examples.steps
    assert users.epsilon() == examples.epsilon() and users.epsilon(7) == examples.epsilon(7)
    assert users.padded_batch_size == examples.padded_batch_size
    calibrated = PrivateRun(privacy_unit="user", num_users=500, examples_per_user=2, epsilon=3.0, **common)
    assert calibrated.noise_multiplier == PrivateRun(num_examples=500, epsilon=3.0, **common).noise_multiplier


def test_the_delta_warning_speaks_of_users():
    with pytest.warns(UserWarning, match=r"1/n = 0.05 \(n = 20 users\).*releasing one user's data"):
        _user_run(delta=0.1)


# ------------------------------------------------------------------ the rows of a step's users
def _reference_rows(ids, users, slot, k, weight):
    """A pure-Python expansion: per slot, its user's examples (all of them when m ≤ k; None
    where the rows are a random k-subset), padding, and the masks w·slot/min(m, k)."""
    uniq = sorted(set(ids.tolist()))
    expected = []
    for u, s in zip(users.tolist(), slot.tolist()):
        members = [i for i, v in enumerate(ids.tolist()) if v == uniq[u]]
        m = min(len(members), k)
        rows = members if len(members) <= k else None
        masks = [(1.0 if weight is None else float(weight[i])) * s / m for i in members] if rows else None
        expected.append((members, m, rows, masks))
    return expected


@pytest.mark.parametrize("k, weighted", [(3, False), (3, True), (1, True), (8, False)])
def test_the_rows_are_user_major_slots_against_a_python_loop(k, weighted):
    ids = _ids(12) * 7 + 100  # ids that are not 0 … n−1
    weight = np.random.default_rng(1).uniform(0.5, 2.0, ids.size).astype(np.float32) if weighted else None
    table = UserTable(ids, examples_per_user=k)
    assert (table.num_users, table.num_examples) == (12, ids.size)
    users = np.array([3, 11, 0, 7, 5, 0, 0], np.int64)
    slot = np.array([1, 1, 1, 1, 1, 0, 0], np.float32)  # two padding slots of the sampler
    key = key_from_seed(4)
    rows, mask = table.rows(users, slot, 5, key, sample_weight=weight)
    assert rows.dtype == np.int64 and mask.dtype == np.float32 and rows.shape == mask.shape == (users.size * k,)
    for j, (members, m, exact, masks) in enumerate(_reference_rows(ids, users, slot, k, weight)):
        r, w = rows[j * k:(j + 1) * k], mask[j * k:(j + 1) * k]
        assert set(r.tolist()) <= set(members)  # every row of slot j is its user's, padding included
        if slot[j] == 0:
            np.testing.assert_array_equal(w, 0.0)
            continue
        if exact is not None:  # m ≤ k: all of them in example order, then padding under mask 0
            assert r[:m].tolist() == exact
            np.testing.assert_allclose(w[:m], masks, rtol=1e-6)
        else:  # m > k: k distinct examples of the user, in example order
            assert len(set(r.tolist())) == k and r.tolist() == sorted(r.tolist())
            expected = [(1.0 if weight is None else float(weight[i])) / k for i in r]
            np.testing.assert_allclose(w, expected, rtol=1e-6)
        np.testing.assert_array_equal(w[m:], 0.0)


def test_the_draws_depend_on_key_step_and_user_alone():
    ids = np.repeat(np.arange(4), [50, 30, 2, 9])
    table = UserTable(ids, examples_per_user=5)
    key = key_from_seed(7)
    one = np.ones(1, np.float32)
    alone = table.rows(np.array([1]), one, 3, key)[0]
    with_others = table.rows(np.array([0, 3, 1]), np.ones(3, np.float32), 3, key)[0][10:15]
    np.testing.assert_array_equal(alone, with_others)  # the same rows whoever else is in the batch
    np.testing.assert_array_equal(alone, table.rows(np.array([1]), one, 3, key)[0])  # a replay
    steps = {tuple(table.rows(np.array([1]), one, t, key)[0].tolist()) for t in range(20)}
    assert len(steps) > 15  # other steps draw other rows
    assert not np.array_equal(alone, table.rows(np.array([1]), one, 3, key_from_seed(8))[0])


def test_the_random_subsets_are_uniform():
    m, k, steps = 5, 2, 4000
    table = UserTable(np.zeros(m, np.int64), examples_per_user=k)
    key = key_from_seed(11)
    counts = {}
    for t in range(steps):
        rows = tuple(table.rows(np.array([0]), np.ones(1, np.float32), t, key)[0].tolist())
        counts[rows] = counts.get(rows, 0) + 1
    assert set(counts) == set(itertools.combinations(range(m), k))  # sorted pairs, each one possible
    freq = np.array(list(counts.values())) / steps
    assert np.all(np.abs(freq - 0.1) < 0.02)  # 10 subsets, each with probability 1/10 (sd 0.005)


def test_a_user_of_fifty_examples_never_has_more_than_k_rows():
    ids = np.concatenate([np.zeros(50, np.int64), np.arange(1, 40)])
    run = PrivateRun(privacy_unit="user", num_users=40, examples_per_user=8, batch_size=8, steps=40,
                     noise_multiplier=1.0, delta=1e-5, seed=2)
    x = np.arange(ids.size, dtype=np.float32)[:, None]
    data = run.dataset(x, users=ids)
    samplers = Samplers(run, None, users=data.users)
    seen = 0
    for t in range(run.steps):
        rows, mask = samplers.batch(t, run.initial_key())
        assert rows.size == run.padded_rows
        mine = np.isin(rows, np.flatnonzero(ids == 0)) & (mask > 0)
        if mine.any():
            seen += 1
            assert mine.sum() == 8 and mask[mine].sum() == pytest.approx(1.0, abs=1e-6)
            first = np.flatnonzero(mine)[0]
            assert first % 8 == 0 and mine[first:first + 8].all()  # one slot: rows [j·k, (j+1)·k)
    assert seen > 0


def test_a_step_of_a_thousand_users_expands_in_milliseconds():
    import time

    table = UserTable(np.repeat(np.arange(1000), 100), examples_per_user=64)
    users, slot, key = np.arange(1000), np.ones(1000, np.float32), key_from_seed(0)
    table.rows(users, slot, 0, key)
    start = time.perf_counter()
    rows, _ = table.rows(users, slot, 1, key)
    assert rows.size == 64_000 and time.perf_counter() - start < 0.1  # ~7 ms on a loaded 2-core CPU


@pytest.mark.parametrize("users, match", [
    (np.zeros((3, 2)), "1-D array of user ids"),
    (np.linspace(0, 1, 5), "ints or strings"),
    ([], "empty"),
])
def test_bad_user_ids_are_refused(users, match):
    with pytest.raises(ValueError, match=match):
        UserTable(users, examples_per_user=2)


def test_string_ids_number_the_users_in_unique_order():
    table = UserTable(np.array(["bob", "amy", "bob", "cy"], dtype=object), examples_per_user=2)
    assert table.num_users == 3 and table.examples(0).tolist() == [1] and table.examples(1).tolist() == [0, 2]


# ------------------------------------------------------------------ the data
def _data(n_users=20):
    ids = _ids(n_users)
    x = np.arange(ids.size, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32) + 1.0
    return x, ids.astype(np.int32), ids


def test_run_dataset_refusals():
    x, y, ids = _data()
    with pytest.raises(ValueError, match="users= is for a user-level run"):
        PrivateRun(num_examples=ids.size, **BASE).dataset(x, y, users=ids)
    run = _user_run()
    with pytest.raises(ValueError, match=r"give the user of every example, run.dataset\(x, y, users=ids\)"):
        run.dataset(x, y)
    with pytest.raises(ValueError, match="users= holds 19 distinct user ids but the run was planned for num_users=20"):
        run.dataset(x, y, users=np.where(ids == 19, 0, ids))
    with pytest.raises(ValueError, match=f"users= holds {ids.size - 1} ids but the data has {ids.size} examples"):
        run.dataset(x, y, users=ids[:-1])
    with pytest.raises(ValueError, match="takes users=UserTable"):
        StepBatches(run, as_source(x, y), (0, run.initial_key()))


def test_the_data_fingerprint_includes_the_users_and_k():
    x, y, ids = _data()
    run = _user_run()
    prints = {run.dataset(x, y, users=ids).source.fingerprint(),
              run.dataset(x, y, users=np.roll(ids, 1)).source.fingerprint(),
              _user_run(examples_per_user=4).dataset(x, y, users=ids).source.fingerprint(),
              as_source(x, y).fingerprint()}
    assert len(prints) == 4
    assert run.dataset(x, y, users=ids).source.fingerprint() == run.dataset(x, y, users=ids).source.fingerprint()
    example = PrivateRun(num_examples=ids.size, **BASE)
    assert example.dataset(x, y).source.fingerprint() == as_source(x, y).fingerprint()


def _expected(run, data, t, weight=None):
    rows, mask = Samplers(run, weight, users=data.users).batch(t, run.initial_key())
    return rows, mask


@pytest.mark.parametrize("parts, multiple", [(1, 1), (2, 1), (2, 4), (3, 2)])
def test_step_batches_serve_whole_user_slots(parts, multiple):
    x, y, ids = _data()
    weight = np.random.default_rng(2).uniform(0.5, 1.5, ids.size)
    run = _user_run(examples_per_user=2)
    data = run.dataset(x, y, users=ids, sample_weight=weight)
    pieces = [StepBatches(run, data.source, (1, run.initial_key()), parts=parts, part=p, multiple=multiple,
                          users=data.users) for p in range(parts)]
    for i in range(len(pieces[0])):
        got = [piece[i] for piece in pieces]
        assert all(g[0].shape[0] % 2 == 0 for g in got)  # each process's block is whole users
        xb, yb, mask, step = (np.concatenate([g[j] for g in got]) for j in range(4))
        assert xb.shape[0] % (parts * 2) == 0 and xb.shape[0] % multiple == 0 and xb.shape[0] >= run.padded_rows
        rows, expected = _expected(run, data, 1 + i, data.source.sample_weight)
        p = run.padded_rows
        np.testing.assert_array_equal(mask[:p], expected)
        np.testing.assert_array_equal(mask[p:], 0.0)
        keep = expected > 0
        np.testing.assert_array_equal(xb[:p][keep], x[rows[keep]])
        np.testing.assert_array_equal(yb[:p][keep], y[rows[keep]])
        np.testing.assert_array_equal(xb[:p][~keep], 0.0)  # padding rows are blanked
        assert set(step.tolist()) == {1 + i}


# ------------------------------------------------------------------ the tf.data pipeline (TensorFlow)
def test_the_tf_pipeline_serves_the_expanded_rows():
    tf = pytest.importorskip("tensorflow")
    x, y, ids = _data()
    run = _user_run()
    data = run.dataset(x, y, users=ids)
    for t, (xb, yb, mask, step) in enumerate(itertools.islice(data.batches(), 3)):
        rows, expected = _expected(run, data, t)
        assert xb.shape == (run.padded_rows, 2) and mask.shape == (run.padded_rows,)
        np.testing.assert_array_equal(mask.numpy(), expected)
        keep = expected > 0
        np.testing.assert_array_equal(xb.numpy()[keep], x[rows[keep]])
        np.testing.assert_array_equal(yb.numpy()[keep], y[rows[keep]])
        np.testing.assert_array_equal(xb.numpy()[~keep], 0.0)
        assert set(step.numpy().tolist()) == {t}
    assert isinstance(data.batches(), tf.data.Dataset)


def test_the_tf_pipeline_refuses_replicas():
    tf = pytest.importorskip("tensorflow")
    x, y, ids = _data()
    data = _user_run().dataset(x, y, users=ids)
    context = tf.distribute.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)
    with pytest.raises(ValueError, match="a user-level run .* trains on one replica.*an input_context"):
        data.batches(input_context=context)
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the two logical CPUs of tests/conftest.py")
    with tf.distribute.MirroredStrategy([d.name for d in devices[:2]]).scope():
        with pytest.raises(ValueError, match="a tf.distribute strategy with 2 replicas in sync"):
            data.batches()
