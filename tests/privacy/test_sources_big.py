"""A memory-mapped file larger than 4 GiB is streamed: gathering batches does not load it.

The file is created sparse (one row in 256 is written), so it takes little disk
space and a second to make; its unwritten rows read as zeros. The pages just
written are dropped from the page cache so the run starts cold. A private run's
pipeline (``knc.PrivateRun(...).dataset(memmap_x, y)``, which gathers through
``as_source(...).tf_gather``) yields a few hundred batches of random rows, and the
process's PEAK resident memory (VmHWM, reset just before iterating) must grow by far
less than the file: only the touched pages of the file are mapped, and nothing is
copied into anonymous memory.
"""

import os
import resource
import shutil
import sys

import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.privacy.sources import as_source

ROWS, COLS = 4_500_000, 256  # float32: 4.29 GiB, rows of 1 KiB
EVERY = 256  # rows 0, 256, 512, ... are written: row i holds i // 256 + 1
STEPS, BATCH = 250, 32
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


def _expected(indices):
    """The file's rows for ``indices``, known without reading the file."""
    rows = np.zeros((indices.size, COLS), dtype=np.float32)
    written = indices % EVERY == 0
    rows[written] = (indices[written] // EVERY + 1)[:, None]
    return rows


def test_memmap_larger_than_4_gib_is_streamed_without_loading_it(tmp_path):
    nbytes = ROWS * COLS * 4
    assert nbytes > 4 * 2**30
    free = shutil.disk_usage(tmp_path).free
    if free < 6 * 2**30:
        pytest.skip(f"needs 6 GiB free in {tmp_path} for the (sparse) {nbytes / 2**30:.2f} GiB file; "
                    f"{free / 2**30:.1f} GiB free")
    path = tmp_path / "big.npy"
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(ROWS, COLS))
    out[::EVERY] = (np.arange(0, ROWS, EVERY, dtype=np.float32) // EVERY + 1)[:, None]  # 17 MiB; the rest: holes
    out.flush()
    del out
    assert path.stat().st_size > 4 * 2**30
    if hasattr(os, "posix_fadvise"):  # start cold, like a file written earlier: drop the pages just written
        fd = os.open(path, os.O_RDONLY)  # (cached as large folios, each fault would map a whole one)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    x = np.load(path, mmap_mode="r")
    y = (np.arange(ROWS) % 10).astype(np.int32)  # labels in memory (17 MiB)
    source = as_source(x, y)
    assert source.kind == "memmap" and source.num_examples == ROWS
    run = knc.PrivateRun(num_examples=ROWS, batch_size=BATCH, steps=STEPS, noise_multiplier=1.0, delta=1e-7, seed=0)
    sampler = run.sampler()  # the same batches as the dataset's (the run's key, from step 0)
    ds = run.dataset(x, y).batches()
    P = run.padded_batch_size
    assert ds.element_spec[0].shape == (P, COLS) and ds.element_spec[1].shape == (P,)

    reset_ok = _reset_peak()
    before = _peak_mib(reset_ok)
    anon_before = _status_mib("RssAnon")
    anon_peak = anon_before
    count = hits = 0
    for t, (xb, yb, mask, step) in enumerate(ds.as_numpy_iterator()):
        indices, real, _ = sampler.batch(t)
        assert np.all(step == t) and np.array_equal(mask, real)
        keep = (real > 0)[:, None]  # padding rows are blanked
        np.testing.assert_array_equal(xb, np.where(keep, _expected(indices), 0))
        np.testing.assert_array_equal(yb, np.where(real > 0, y[indices], 0))
        hits += int(np.sum((indices % EVERY == 0) & (real > 0)))
        if anon_before is not None:
            anon_peak = max(anon_peak, _status_mib("RssAnon"))
        count += 1
    growth = _peak_mib(reset_ok) - before
    assert count == STEPS and hits > 0  # some batches held written rows (seed 0: fixed)
    print(f"file {nbytes / 2**30:.2f} GiB; {STEPS} batches of P = {P} (B = {BATCH}): peak RSS grew {growth:.0f} MiB"
          + ("" if anon_before is None else f", anonymous memory {anon_peak - anon_before:.0f} MiB"))
    assert growth < GROWTH_LIMIT_MIB, f"peak RSS grew {growth:.0f} MiB streaming a {nbytes / 2**30:.2f} GiB file"
    if anon_before is not None:
        # anonymous memory holds the sampler's O(n) permutation (36 MiB here) and the batches in flight
        assert anon_peak - anon_before < GROWTH_LIMIT_MIB, "rows of the file were copied into anonymous memory"
    del ds, x
    os.remove(path)
