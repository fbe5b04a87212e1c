"""A memory-mapped file larger than 4 GiB is streamed: gathering batches does not load it.

The file is created sparse (only a few rows are written), so it takes no disk space
and a second to make; its unwritten rows read as zeros. The pipeline gathers a few
hundred batches of random rows through ``as_source(memmap).tf_gather`` in a
``tf.data`` map, and the process's PEAK resident memory (VmHWM, reset just before
iterating) must grow by far less than the file: only the touched pages of the file
are mapped, and nothing is copied into anonymous memory.
"""

import os
import resource
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.privacy.sources import as_source

ROWS, COLS = 4_500_000, 256  # float32: 4.29 GiB, rows of 1 KiB
STEPS, P = 250, 64
GROWTH_LIMIT_MIB = 300


def _status_mib(field):
    """A field of /proc/self/status in MiB (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_mib("VmHWM") is not None
    except OSError:
        return False


def _peak_mib(reset_ok):
    if reset_ok:
        return _status_mib("VmHWM")
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def test_memmap_larger_than_4_gib_is_streamed_without_loading_it(tmp_path):
    nbytes = ROWS * COLS * 4
    assert nbytes > 4 * 2**30
    free = shutil.disk_usage(tmp_path).free
    if free < 6 * 2**30:
        pytest.skip(f"needs 6 GiB free in {tmp_path} for the (sparse) {nbytes / 2**30:.2f} GiB file; "
                    f"{free / 2**30:.1f} GiB free")
    path = tmp_path / "big.npy"
    rng = np.random.default_rng(0)
    written = np.sort(rng.choice(ROWS, size=32, replace=False))
    pattern = (np.arange(32, dtype=np.float32)[:, None] + 1) * np.ones(COLS, dtype=np.float32)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(ROWS, COLS))
    out[written] = pattern  # the rest of the file is a hole: zeros, no disk blocks
    out.flush()
    del out
    assert path.stat().st_size > 4 * 2**30

    x = np.load(path, mmap_mode="r")
    y = np.arange(ROWS, dtype=np.int32) % 10  # labels in memory (17 MiB)
    source = as_source(x, y)
    assert source.kind == "memmap" and source.num_examples == ROWS

    indices = rng.integers(0, ROWS, size=(STEPS, P)).astype(np.int64)
    indices[:, :4] = written[rng.integers(0, written.size, size=(STEPS, 4))]  # some written rows, repeats
    ds = tf.data.Dataset.range(STEPS).map(
        lambda t: source.tf_gather(tf.gather(indices, t)), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True
    ).prefetch(4)
    assert ds.element_spec[0].shape == (P, COLS) and ds.element_spec[1].shape == (P,)

    def expected(idx):  # the file's rows, known without reading the file
        rows = np.zeros((idx.size, COLS), dtype=np.float32)
        where = np.searchsorted(written, idx)
        hit = (where < written.size) & (written[np.minimum(where, written.size - 1)] == idx)
        rows[hit] = pattern[where[hit]]
        return rows

    reset_ok = _reset_peak()
    before = _peak_mib(reset_ok)
    anon_before = _status_mib("RssAnon")
    anon_peak = anon_before
    count = 0
    for t, (xb, yb) in enumerate(ds.as_numpy_iterator()):
        np.testing.assert_array_equal(xb, expected(indices[t]))
        np.testing.assert_array_equal(yb, y[indices[t]])
        if anon_before is not None:
            anon_peak = max(anon_peak, _status_mib("RssAnon"))
        count += 1
    growth = _peak_mib(reset_ok) - before
    assert count == STEPS
    print(f"file {nbytes / 2**30:.2f} GiB; {STEPS} batches of {P}: peak RSS grew {growth:.0f} MiB"
          + ("" if anon_before is None else f", anonymous memory {anon_peak - anon_before:.0f} MiB"))
    assert growth < GROWTH_LIMIT_MIB, f"peak RSS grew {growth:.0f} MiB streaming a {nbytes / 2**30:.2f} GiB file"
    if anon_before is not None:
        assert anon_peak - anon_before < 100, "rows were copied into anonymous memory beyond the batches in flight"
    del ds, x
    os.remove(path)
