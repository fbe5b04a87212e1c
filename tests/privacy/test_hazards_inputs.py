"""Privacy-audit findings on inputs: a crafted C file, a large delta, edited metadata, a
secret key in a message.

1. ``read_npz`` reads only the fields a file kind has: an unknown field (a zip bomb under
   any name) is refused unread, and a known field that would decompress to far more than
   it stores, or whose ``.npy`` header declares more than its entry holds, is refused
   before numpy allocates it.
2. ``noisecurve calibrate --delta 0.5`` blames delta (and says what is allowed), not epsilon.
3. ``noisecurve inspect`` warns about each metadata entry the stored C contradicts.
4. A wrong key (or a key passed as a seed) is described by type/shape/dtype, never by its words.

numpy only, no training: each test takes well under a few seconds.
"""

import io
import json
import tracemalloc
import zipfile

import numpy as np
import pytest

from keras_noisecurve.apps.cli import main
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.mixing.errors import InvalidMixingMatrixError
from keras_noisecurve.mixing.strategies import ToeplitzMixing, load_mixing, load_strategy

#: allocations above this while refusing a crafted file mean it was read
_PEAK_LIMIT = 8 << 20
#: 80 MB of float64 zeros: about 80 KB deflated (over the 64 MiB floor, ~1000x its size)
_BOMB_WORDS = 10**7


def _fields(path) -> dict:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _write_npz(path, members: dict) -> None:
    """An ``.npz`` with ``members`` (name → arrays, deflated; or raw ``.npy`` bytes, stored)."""
    with zipfile.ZipFile(path, "w") as archive:
        for name, value in members.items():
            if isinstance(value, bytes):
                archive.writestr(name + ".npy", value, compress_type=zipfile.ZIP_STORED)
                continue
            buffer = io.BytesIO()
            np.lib.format.write_array(buffer, np.asanyarray(value), allow_pickle=False)
            archive.writestr(name + ".npy", buffer.getvalue(), compress_type=zipfile.ZIP_DEFLATED, compresslevel=1)


def _peak_of(fn):
    """(the exception ``fn`` raised, the peak bytes Python and numpy allocated meanwhile)."""
    tracemalloc.start()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test checks which
        raised = exc
    else:
        raised = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


@pytest.fixture(scope="module")
def matrix_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("c") / "c.npz"
    MixingMatrix.identity(8).save(path)
    return path


# ------------------------------------------------------------------ 1. read_npz
def test_unknown_field_is_refused_unread(matrix_file, tmp_path):
    fields = _fields(matrix_file)
    bomb = tmp_path / "bomb.npz"
    _write_npz(bomb, {**fields, "junk": np.zeros(_BOMB_WORDS)})
    assert bomb.stat().st_size < 1 << 20  # a small file …
    raised, peak = _peak_of(lambda: MixingMatrix.load(bomb))
    assert isinstance(raised, InvalidMixingMatrixError), raised
    message = str(raised)
    assert "unknown field(s) 'junk'" in message
    for name in ("band_values", "digest", "format", "format_version", "metadata"):
        assert repr(name) in message
    assert peak < _PEAK_LIMIT  # … whose 80 MB field was never decompressed
    # load_mixing (the optimizer's and the CLI's reader) refuses it the same way
    with pytest.raises(ValueError, match="unknown field"):
        load_mixing(str(bomb))


def test_unknown_field_in_a_strategy_file_is_refused(tmp_path):
    good = tmp_path / "t.npz"
    strategy = ToeplitzMixing.normalised([1.0, 0.5], steps=8)
    strategy.save(good)
    assert load_strategy(good).digest() == strategy.digest()  # a valid file still loads
    bad = tmp_path / "t_bad.npz"
    _write_npz(bad, {**_fields(good), "extra": np.zeros(4)})
    with pytest.raises(InvalidMixingMatrixError, match=r"unknown field\(s\) 'extra'.*'param_coefficients'"):
        load_strategy(bad)


def test_known_field_that_decompresses_far_beyond_its_size_is_refused(matrix_file, tmp_path):
    fields = _fields(matrix_file)
    bomb = tmp_path / "bomb.npz"
    _write_npz(bomb, {**fields, "band_values": np.zeros((_BOMB_WORDS, 1))})
    raised, peak = _peak_of(lambda: MixingMatrix.load(bomb))
    assert isinstance(raised, InvalidMixingMatrixError), raised
    assert "'band_values' would decompress to 80000128 bytes" in str(raised)  # 8e7 + the .npy header
    assert peak < _PEAK_LIMIT


def test_npy_header_larger_than_its_entry_is_refused(matrix_file, tmp_path):
    """numpy allocates the header's shape before it reads: 80 MB for a 16-byte entry."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (_BOMB_WORDS, 1)})
    lying = tmp_path / "lying.npz"
    _write_npz(lying, {**_fields(matrix_file), "band_values": header.getvalue() + bytes(16)})
    raised, peak = _peak_of(lambda: MixingMatrix.load(lying))
    assert isinstance(raised, InvalidMixingMatrixError), raised
    assert "declares a float64 array of shape (10000000, 1)" in str(raised)
    assert peak < _PEAK_LIMIT


def test_valid_matrix_file_still_loads(matrix_file):
    loaded = MixingMatrix.load(matrix_file)
    np.testing.assert_array_equal(loaded.band_values, np.ones((8, 1)))


# -------------------------------------------------------------- 2. calibrate delta
def test_calibrate_blames_a_large_delta(capsys):
    n = 1000
    rc = main(["calibrate", "--epsilon", "2", "--delta", "0.5", "--num-examples", str(n), "--batch-size", "10",
               "--steps", "10"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "error: delta=0.5 is too large" in err
    assert "must lie in (0, 1)" in err and f"much smaller than 1/n = {1 / n:g}" in err
    assert "epsilon=2 is so large" not in err


def test_calibrate_warns_when_delta_is_not_below_one_over_n(capsys):
    argv = ["calibrate", "--epsilon", "1", "--num-examples", "1000", "--batch-size", "10", "--steps", "20",
            "--sampling", "fixed_epochs", "--accountant", "rdp", "--json"]
    assert main(argv + ["--delta", "0.01"]) == 0
    err = capsys.readouterr().err
    assert "warning: --delta 0.01 is not much smaller than 1/n = 0.001" in err
    assert main(argv + ["--delta", "1e-6"]) == 0
    assert "warning" not in capsys.readouterr().err


# --------------------------------------------------------- 3. inspect metadata
def _with_metadata(src, dst, **edits):
    fields = _fields(src)
    meta = json.loads(str(fields["metadata"]))
    for key, value in edits.items():
        target = meta
        *parents, last = key.split("__")
        for part in parents:
            target = target[part]
        target[last] = value
    fields["metadata"] = np.array(json.dumps(meta, sort_keys=True))
    np.savez(dst, **fields)  # the digest covers C only: the file still loads


def test_inspect_warns_about_each_edited_metadata_entry(tmp_path, capsys):
    c = MixingMatrix.identity(8).with_metadata(strategy="banded")  # T = 8, b = 1, unit columns
    original = tmp_path / "c.npz"
    c.save(original)
    assert main(["inspect", str(original), "--no-reference"]) == 0
    assert "WARNING" not in capsys.readouterr().out

    edited = tmp_path / "edited.npz"
    _with_metadata(original, edited, steps=99, bands=4, strategy="toeplitz", sensitivity=0.5)
    assert main(["inspect", str(edited), "--no-reference"]) == 0  # C itself is valid: a warning, status 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 4
    expected = {"steps = 99": "T is 8", "bands = 4": "bands b is 1", 'strategy = "toeplitz"': "its kind is banded",
                "sensitivity = 0.5": "one participation is 1 "}
    for entry, fact in expected.items():
        assert any(f"metadata {entry} contradicts the stored matrix" in w and fact in w for w in warnings), entry

    assert main(["inspect", str(edited), "--no-reference", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["metadata_warnings"]) == 4


def test_inspect_checks_a_strategy_files_size_and_sensitivity(tmp_path, capsys):
    strategy = ToeplitzMixing.normalised([1.0, 0.5, 0.25], steps=12)
    strategy = type(strategy)(strategy.coefficients, steps=12,
                              metadata={"strategy": "toeplitz", "steps": 12, "bands": 3})
    original = tmp_path / "t.npz"
    strategy.save(original)
    assert main(["inspect", str(original)]) == 0
    assert "WARNING" not in capsys.readouterr().out

    # the sensitivity^2 of 2 participations 2 steps apart, from the dense C: ‖C[:, 0] + C[:, 2]‖²
    dense = strategy.to_dense()
    sens2 = float(np.sum((dense[:, 0] + dense[:, 2]) ** 2))
    edited = tmp_path / "edited.npz"
    _with_metadata(original, edited, bands=5, participations=2, separation=2,
                   loss_components={"sensitivity_squared": 1.0, "trace": 1.0})
    assert main(["inspect", str(edited)]) == 0
    warnings = [line for line in capsys.readouterr().out.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 2
    assert "metadata bands = 5" in warnings[0] and "bands b is 3" in warnings[0]
    assert "loss_components.sensitivity_squared = 1.0" in warnings[1] and f"is {sens2:.10g}" in warnings[1]


# ------------------------------------------------------------------- 4. keys
WORDS = (918273645546372819, 827364554637281909, 736455463728190918)


def _leaks(message: str) -> list:
    return [w for w in WORDS if str(w) in message or f"{w:x}" in message or f"{w:e}"[:8] in message]


@pytest.mark.parametrize("key", [np.array(WORDS, dtype=np.int64), list(WORDS), np.array(WORDS[:2], dtype=np.float64),
                                 np.array([WORDS[:2]], dtype=np.int64), [WORDS[0], [WORDS[1]]]])
def test_a_wrong_key_is_described_never_shown(key):
    from keras_noisecurve import PrivateRun

    run = PrivateRun(num_examples=100, batch_size=10, steps=5, noise_multiplier=1.0, delta=1e-5)
    with pytest.raises(ValueError) as info:
        run.sampler(key)
    message = str(info.value)
    assert not _leaks(message), message
    assert "shape (2,)" in message and "not shown" in message or "not an array" in message


def test_the_message_of_a_wrong_key_says_its_shape_and_dtype():
    from keras_noisecurve.privacy.sampler import check_key

    with pytest.raises(ValueError, match=r"of shape \(3,\) and dtype int64"):
        check_key(np.array(WORDS, dtype=np.int64))
    np.testing.assert_array_equal(check_key(np.array(WORDS[:2], dtype=np.uint64)),
                                  np.array(WORDS[:2], dtype=np.uint64).astype(np.int64))


@pytest.mark.parametrize("seed", [np.array(WORDS[:2], dtype=np.int64), -WORDS[0], float(WORDS[0])])
def test_a_key_passed_as_a_seed_is_not_shown(seed):
    from keras_noisecurve.privacy.sampler import key_from_seed as sampling_key_from_seed
    from keras_noisecurve.training.noise import key_from_seed as noise_key_from_seed

    for fn in (sampling_key_from_seed, noise_key_from_seed):
        with pytest.raises((TypeError, ValueError)) as info:
            fn(seed)
        assert not _leaks(str(info.value)), str(info.value)
        assert "seed must be" in str(info.value)
