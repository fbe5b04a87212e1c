"""Statistics and shapes of the cyclic Poisson sampler and the fixed-epochs order."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from keras_noisecurve.privacy.sampler import banded_poisson_dataset, sampling_plan


def test_partitions_balanced_disjoint_and_batches_stay_in_their_partition():
    plan = sampling_plan(num_examples=203, batch_size=10, bands=4, steps=400, seed=3)
    sizes = sorted(p.size for p in plan.partitions)
    assert sizes == [50, 51, 51, 51]
    allidx = np.concatenate(plan.partitions)
    assert np.array_equal(np.sort(allidx), np.arange(203))
    owner = np.empty(203, dtype=int)
    for i, p in enumerate(plan.partitions):
        owner[p] = i
    for t in range(plan.steps):
        batch = plan.batch(t)
        assert np.all(owner[batch] == t % 4), f"step {t} uses examples of another partition"
        assert np.unique(batch).size == batch.size  # no duplicates within a step
        assert plan.mask[t].sum() == batch.size
        assert np.all(plan.mask[t][batch.size:] == 0)


def test_inclusion_frequency_matches_q_for_every_example():
    n, B, b, T = 200, 10, 4, 4000
    q = B * b / n  # 0.2
    plan = sampling_plan(num_examples=n, batch_size=B, bands=b, steps=T, seed=11)
    assert plan.sampling_probability == pytest.approx(q)
    counts = np.zeros(n)
    for t in range(T):
        counts[plan.batch(t)] += 1
    trials = T // b  # every partition is visited T/b times
    # two-sided binomial interval, Bonferroni over the n examples at family level 1e-3
    alpha = 1e-3 / n
    lo, hi = stats.binom.ppf(alpha / 2, trials, q), stats.binom.isf(alpha / 2, trials, q)
    assert np.all(counts >= lo) and np.all(counts <= hi), (counts.min(), counts.max(), lo, hi)
    # batch sizes are Binomial(50, q): mean B, variance 50 q (1 - q)
    sizes = plan.mask.sum(axis=1)
    assert abs(sizes.mean() - B) < 5 * np.sqrt(50 * q * (1 - q) / T)
    assert plan.truncated_steps == 0


def test_dataset_shapes_fixed_mask_sum_and_gathered_rows():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 3)).astype("float32")
    y = np.arange(120, dtype=np.int64)
    ds, plan = banded_poisson_dataset(x, y, batch_size=8, bands=3, steps=9, seed=5, return_plan=True)
    P = plan.padded_size
    spec = ds.element_spec
    assert spec[0].shape == (P, 3) and spec[1].shape == (P,) and spec[2].shape == (P,)
    assert spec[2].dtype == tf.float32
    elements = list(ds.as_numpy_iterator())
    assert len(elements) == 9
    for t, (xb, yb, m) in enumerate(elements):
        real = plan.batch(t)
        assert m.sum() == real.size
        assert np.array_equal(yb[m > 0], real)
        np.testing.assert_array_equal(xb[m > 0], x[real])


def test_sample_weight_is_multiplied_into_mask_and_dict_inputs():
    x = {"a": np.arange(60, dtype="float32")[:, None], "b": np.ones((60, 2), "float32")}
    w = np.linspace(0.5, 1.5, 60).astype("float32")
    ds, plan = banded_poisson_dataset(x, None, batch_size=6, bands=2, steps=4, seed=1, sample_weight=w,
                                      return_plan=True)
    for t, (xb, yb, m) in enumerate(ds.as_numpy_iterator()):
        assert yb is None
        np.testing.assert_allclose(m, plan.mask[t] * w[plan.indices[t]])
        np.testing.assert_array_equal(xb["a"][plan.mask[t] > 0, 0], plan.batch(t).astype("float32"))


def test_fixed_epochs_repeats_the_same_order():
    n, B, b = 53, 10, 3
    per_epoch = 6
    plan = sampling_plan(num_examples=n, batch_size=B, bands=b, steps=3 * per_epoch, seed=2, sampling="fixed_epochs")
    assert plan.padded_size == B
    for t in range(plan.steps - per_epoch):
        assert np.array_equal(plan.indices[t], plan.indices[t + per_epoch])
    epoch0 = np.concatenate([plan.batch(t) for t in range(per_epoch)])
    assert np.array_equal(np.sort(epoch0), np.arange(n))  # each example exactly once per epoch
    assert plan.mask[per_epoch - 1].sum() == 3  # the last batch is padded
    steps_of = {}
    for t in range(plan.steps):
        for i in plan.batch(t):
            steps_of.setdefault(int(i), []).append(t)
    gaps = {g for ts in steps_of.values() for g in np.diff(ts)}
    assert gaps == {per_epoch}
    with pytest.raises(ValueError, match="steps_per_epoch"):
        sampling_plan(num_examples=20, batch_size=10, bands=3, steps=6, sampling="fixed_epochs", epochs=3)


def test_tf_data_input_gives_the_same_batches_as_numpy():
    x = np.arange(90, dtype="float32").reshape(45, 2)
    y = np.arange(45)
    ref = list(banded_poisson_dataset(x, y, batch_size=5, bands=3, steps=6, seed=7).as_numpy_iterator())
    for source in (tf.data.Dataset.from_tensor_slices((x, y)), tf.data.Dataset.from_tensor_slices((x, y)).batch(4)):
        got = list(banded_poisson_dataset(source, batch_size=5, bands=3, steps=6, seed=7).as_numpy_iterator())
        for (a, b_, c), (d, e, f) in zip(ref, got):
            np.testing.assert_array_equal(a, d)
            np.testing.assert_array_equal(b_, e)
            np.testing.assert_array_equal(c, f)


def test_unseeded_plans_differ():
    a = sampling_plan(num_examples=1000, batch_size=20, bands=2, steps=20)
    b = sampling_plan(num_examples=1000, batch_size=20, bands=2, steps=20)
    assert not np.array_equal(a.indices, b.indices)
    c = sampling_plan(num_examples=1000, batch_size=20, bands=2, steps=20, seed=4)
    d = sampling_plan(num_examples=1000, batch_size=20, bands=2, steps=20, seed=4)
    assert np.array_equal(c.indices, d.indices)


def test_truncation_is_counted_and_warned():
    with pytest.warns(RuntimeWarning, match="truncated"):
        plan = sampling_plan(num_examples=400, batch_size=20, bands=1, steps=200, seed=0, max_batch_size=20)
    assert plan.truncated_steps > 0 and plan.dropped_examples >= plan.truncated_steps
    assert plan.mask.sum(axis=1).max() == 20
    assert plan.overflow_probability > 0.1


def test_sampler_validation():
    with pytest.raises(ValueError, match="must be < 1"):
        sampling_plan(num_examples=100, batch_size=30, bands=4, steps=8)
    with pytest.raises(ValueError, match="cannot exceed steps"):
        sampling_plan(num_examples=100, batch_size=3, bands=4, steps=3)
    with pytest.raises(ValueError, match="not both"):
        sampling_plan(num_examples=100, batch_size=3, bands=1, steps=3, max_batch_size=9, overflow_probability=1e-6)
    with pytest.raises(ValueError, match="same leading"):
        banded_poisson_dataset({"a": np.zeros((10, 1)), "b": np.zeros((11, 1))}, None, batch_size=2, bands=1, steps=2)


def test_oversized_tf_data_input_is_refused(monkeypatch):
    from keras_noisecurve.privacy import sources

    monkeypatch.setattr(sources, "MAX_MATERIALIZED_BYTES", 1000)
    ds = tf.data.Dataset.from_tensor_slices(np.zeros((100, 8), "float32"))
    with pytest.raises(ValueError, match="GiB when materialised"):
        banded_poisson_dataset(ds, batch_size=5, bands=1, steps=2)
