"""The bad-input catalogue: every file and number a user can pass, wrong, gives ONE line
of error (no traceback) — a non-zero exit status from the CLI (run in-process through
``keras_noisecurve.apps.cli.main``), a ``ValueError``/``TypeError`` from the Python API."""

import os
import zipfile

import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.apps.cli import main
from keras_noisecurve.mixing.strategies import MixingMatrix, load_mixing
from keras_noisecurve.privacy import accounting
from keras_noisecurve.spectrum.artifact import Spectrum


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Good, damaged, empty and foreign files, by name."""
    d = tmp_path_factory.mktemp("bad")
    dense = np.eye(40) - 0.3 * np.eye(40, k=-1)
    dense /= np.linalg.norm(dense, axis=0)
    good = d / "good.npz"
    MixingMatrix.from_dense(dense, bands=2, metadata={"objective": "bandmf"}).save(good)
    data = good.read_bytes()
    paths = {"good": good, "dir": d / "a_directory"}
    paths["dir"].mkdir()
    (d / "empty.npz").write_bytes(b"")
    (d / "truncated.npz").write_bytes(data[: len(data) // 2])
    (d / "tail_cut.npz").write_bytes(data[:-10])
    (d / "random.npz").write_bytes(np.random.default_rng(0).bytes(300))
    (d / "text.npz").write_text("band_values = 1, 2, 3\n")
    flipped = bytearray(data)
    flipped[200] ^= 0xFF
    (d / "bitflip.npz").write_bytes(bytes(flipped))
    np.savez(d / "foreign.npz", a=np.arange(3))
    np.save(d / "single.npy", np.arange(3))
    np.savez(d / "pickled.npz", format=np.array(["x", {}], dtype=object))
    np.savez(d / "bad_json.npz", format=np.array("keras-noisecurve/mixing-matrix"), format_version=np.array(1),
             band_values=np.ones((3, 1)), metadata=np.array("{not json"), digest=np.array("x"))
    with zipfile.ZipFile(d / "empty_zip.npz", "w"):
        pass
    spec = d / "spectrum.npz"
    Spectrum(np.array([3.0, 1.0]), np.array([1, 9]), 10, {}).save(spec)
    paths["spectrum"] = spec
    for name in ("empty", "truncated", "tail_cut", "random", "text", "bitflip", "foreign", "pickled", "bad_json",
                 "empty_zip"):
        paths[name] = d / f"{name}.npz"
    paths["npy"] = d / "single.npy"
    paths["missing"] = d / "missing.npz"
    return {k: str(v) for k, v in paths.items()}


def _cli(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse: usage line(s) and one error line
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, err


def _assert_one_line(rc, err, *needles):
    assert rc not in (0, None), err
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


CAL = ["calibrate", "--delta", "1e-5", "--num-examples", "4000", "--batch-size", "40"]
CAL_E = CAL + ["--epsilon", "2"]
DAMAGED = ["empty", "truncated", "tail_cut", "random", "text", "bitflip", "foreign", "pickled", "bad_json",
           "empty_zip", "npy", "dir", "missing"]

CALIBRATE_NUMBERS = [
    (["--epsilon", "0", "--steps", "40"], "epsilon"),
    (["--epsilon", "-1", "--steps", "40"], "epsilon"),
    (["--epsilon", "nan", "--steps", "40"], "epsilon"),
    (["--epsilon", "inf", "--steps", "40"], "epsilon"),
    (["--epsilon", "abc", "--steps", "40"], "--epsilon"),
    (["--epsilon", "1e6", "--steps", "40"], "Possible"),
    (["--epsilon", "2", "--steps", "0"], "steps"),
    (["--epsilon", "2", "--steps", "-3"], "steps"),
    (["--epsilon", "2", "--steps", "4.5"], "--steps"),
    (["--epsilon", "2", "--epochs", "0"], "epochs"),
    (["--epsilon", "2", "--epochs", "1.5"], "epochs"),
    (["--epsilon", "2", "--epochs", "nan"], "epochs"),
    (["--epsilon", "2", "--epochs", "-2"], "epochs"),
    (["--epsilon", "2", "--steps", "40", "--bands", "0"], "bands"),
    (["--epsilon", "2", "--steps", "40", "--bands", "41"], "bands"),
    (["--epsilon", "2", "--steps", "400", "--bands", "100"], "q"),
    (["--epsilon", "2", "--steps", "40", "--overflow-probability", "0"], "overflow_probability"),
    (["--epsilon", "2", "--steps", "40", "--overflow-probability", "1.5"], "overflow_probability"),
    (["--epsilon", "2", "--steps", "40", "--sampling", "poisson"], "--sampling"),
    (["--epsilon", "2", "--steps", "40", "--accountant", "moments"], "--accountant"),
    (["--epsilon", "2", "--steps", "40", "--sampling", "fixed_epochs", "--epochs", "2"], "--epochs"),
]


@pytest.mark.parametrize("argv,needle", CALIBRATE_NUMBERS)
def test_calibrate_numbers(argv, needle, capsys):
    _assert_one_line(*_cli(CAL + argv, capsys), needle)


def test_calibrate_delta_and_sizes(capsys):
    for delta in ("0", "1", "2", "-1e-5", "nan"):
        argv = ["calibrate", "--epsilon", "2", "--delta", delta, "--num-examples", "4000", "--batch-size", "40",
                "--steps", "40"]
        _assert_one_line(*_cli(argv, capsys), "delta")
    for n, b in (("0", "40"), ("4000", "0"), ("40", "4000")):
        argv = ["calibrate", "--epsilon", "2", "--delta", "1e-5", "--num-examples", n, "--batch-size", b,
                "--steps", "40"]
        _assert_one_line(*_cli(argv, capsys))


@pytest.mark.parametrize("name", DAMAGED)
def test_calibrate_damaged_mixing_file(name, files, capsys):
    _assert_one_line(*_cli(CAL_E + ["--steps", "40", "--mixing", files[name]], capsys), files[name])


def test_calibrate_mixing_that_does_not_fit_the_run(files, capsys):
    _assert_one_line(*_cli(CAL_E + ["--steps", "41", "--mixing", files["good"]], capsys), "steps")
    _assert_one_line(*_cli(CAL_E + ["--steps", "40", "--bands", "3", "--mixing", files["good"]], capsys), "bands")


SOLVE = ["solve", "--objective", "bandmf"]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (SOLVE + ["--steps", "0", "--bands", "2"], "--steps"),
        (SOLVE + ["--steps", "10", "--bands", "0"], "--bands"),
        (SOLVE + ["--steps", "10", "--bands", "11"], "--bands"),
        (SOLVE + ["--steps", "1000000000", "--bands", "4"], "GiB"),
        (SOLVE + ["--steps", "100000000000", "--bands", "4", "--strategy", "toeplitz"], "TiB"),
        (SOLVE + ["--steps", "10", "--bands", "2", "--tol", "-1"], "--tol"),
        (SOLVE + ["--steps", "10", "--bands", "2", "--max-iterations", "0"], "--max-iterations"),
        (SOLVE + ["--steps", "10", "--strategy", "blt"], "--buffers"),
        (["solve", "--steps", "10", "--bands", "2", "--objective", "noisecurve", "--learning-rate", "0.1"],
         "--spectrum"),
        (SOLVE + ["--steps", "10", "--bands", "2", "--strategy", "circulant"], "--strategy"),
    ],
)
def test_solve_numbers(argv, needle, capsys):
    _assert_one_line(*_cli(argv, capsys), needle)


@pytest.mark.parametrize("name", ["empty", "truncated", "random", "foreign", "pickled", "missing", "dir"])
def test_solve_damaged_spectrum_file(name, files, capsys):
    argv = ["solve", "--steps", "10", "--bands", "2", "--objective", "noisecurve", "--learning-rate", "0.1",
            "--spectrum", files[name], "--out", os.devnull]
    _assert_one_line(*_cli(argv, capsys), files[name])


@pytest.mark.parametrize("name", ["empty", "truncated", "random", "foreign", "bad_json", "npy", "missing", "dir"])
def test_inspect_damaged_file(name, files, capsys):
    _assert_one_line(*_cli(["inspect", files[name]], capsys), files[name])


# ------------------------------------------------------------------ Python API
def _one_line_error(call, *needles, types=(ValueError, TypeError)):
    with pytest.raises(types) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message, message
    for needle in needles:
        assert needle in message, (needle, message)


RUN = dict(num_examples=4000, batch_size=40, steps=40, delta=1e-5)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"num_examples": 0}, "num_examples"),
        ({"batch_size": "40"}, "batch_size"),
        ({"batch_size": 5000}, "batch_size"),
        ({"steps": None, "epochs": None}, "steps"),
        ({"epochs": 2}, "epochs"),
        ({"steps": 0}, "steps"),
        ({"delta": 1.5}, "delta"),
        ({"delta": 0.0}, "delta"),
        ({"sampling": "poisson"}, "sampling"),
        ({"accountant": "moments"}, "accountant"),
        ({"steps": 10**12, "num_examples": 10**13}, "memory"),
    ],
)
def test_private_run_numbers(kwargs, needle):
    _one_line_error(lambda: knc.PrivateRun(**{**RUN, "noise_multiplier": 1.0, **kwargs}), needle)


def test_private_run_sigma_and_epsilon():
    _one_line_error(lambda: knc.PrivateRun(**RUN), "noise_multiplier")
    _one_line_error(lambda: knc.PrivateRun(**RUN, noise_multiplier=1.0, epsilon=2.0), "noise_multiplier")
    _one_line_error(lambda: knc.PrivateRun(**RUN, noise_multiplier=0.0), "noise_multiplier")
    _one_line_error(lambda: knc.PrivateRun(**RUN, noise_multiplier=float("nan")), "noise_multiplier")
    _one_line_error(lambda: knc.PrivateRun(**RUN, epsilon=-1.0), "epsilon")
    _one_line_error(lambda: knc.PrivateRun(**RUN, epsilon=1e6), "Possible")


@pytest.mark.parametrize("name", DAMAGED)
def test_python_loaders_name_the_damaged_file(name, files):
    _one_line_error(lambda: load_mixing(files[name]), files[name])
    _one_line_error(lambda: knc.PrivateRun(**RUN, noise_multiplier=1.0, mixing=files[name]), files[name])
    _one_line_error(lambda: Spectrum.load(files[name]), files[name])


def test_python_mixing_and_spectrum_values():
    _one_line_error(lambda: load_mixing(np.ones(3)), "numpy array")
    _one_line_error(lambda: load_mixing(3), "mixing")
    _one_line_error(lambda: load_mixing({"kind": "toeplitz"}), "steps")
    _one_line_error(lambda: MixingMatrix(np.ones((3, 1)) * 2.0), "norm")
    _one_line_error(lambda: knc.solve_mixing_matrix(steps=10, bands=2, objective="noisecurve",
                                                    spectrum="no/such/spectrum.npz", learning_rate=0.1),
                    "no/such/spectrum.npz")


def test_python_accounting_numbers():
    kw = dict(num_examples=4000, batch_size=40, steps=40)
    _one_line_error(lambda: accounting.compute_epsilon(noise_multiplier=0.0, delta=1e-5, **kw), "noise_multiplier")
    _one_line_error(lambda: accounting.compute_epsilon(noise_multiplier=1.0, delta=1e-5, num_examples=4000,
                                                       batch_size=40), "steps")
    _one_line_error(lambda: accounting.calibrate_noise_multiplier(epsilon=float("nan"), delta=1e-5, **kw), "epsilon")
    _one_line_error(lambda: accounting.calibrate_noise_multiplier(epsilon=2.0, delta=1e-5, bands=0, **kw), "bands")
    _one_line_error(lambda: accounting.steps_for_epochs(num_examples=10, batch_size=2, epochs=0), "epochs")


def test_python_optimizer_has_no_silent_defaults(files):
    pytest.importorskip("tensorflow")
    from keras_noisecurve.training import NoiseCurveOptimizer

    bandmf = load_mixing(files["good"])
    assert bandmf.metadata.get("learning_rate") is None  # what the docs' C.metadata["learning_rate"] gives
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=bandmf.metadata.get("learning_rate"), mixing=bandmf,
                                                noise_multiplier=1.0, expected_batch_size=4), "learning_rate")
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=0.1, mixing=bandmf, expected_batch_size=4),
                    "noise_multiplier")
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=0.1, expected_batch_size=4), "noise_multiplier")
    # sigma = 0 is no privacy: refused here as by the run and compute_epsilon
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=0.0, expected_batch_size=4),
                    "noise_multiplier")
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=0.1, mixing=files["truncated"], noise_multiplier=1.0,
                                                expected_batch_size=4), files["truncated"])
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=-0.1, noise_multiplier=1.0, expected_batch_size=4),
                    "learning_rate")
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=0),
                    "expected_batch_size")
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=4,
                                                l2_norm_clip=0.0), "l2_norm_clip")
    _one_line_error(lambda: NoiseCurveOptimizer(learning_rate=0.1, run="a run"), "run")


def test_python_wrong_data_for_the_run():
    pytest.importorskip("tensorflow")
    import keras

    from keras_noisecurve.training import NoiseCurveOptimizer, make_private

    run = knc.PrivateRun(num_examples=48, batch_size=6, steps=8, noise_multiplier=1.0, delta=1e-5, seed=0)
    x, y = np.zeros((48, 3), np.float32), np.zeros(48, np.int64)
    _one_line_error(lambda: run.dataset(x[:40], y[:40]), "num_examples")
    model = make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), clipping="vectorized")
    model.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    _one_line_error(lambda: model.fit(x, y, batch_size=40, verbose=0), "run.dataset(")
    _one_line_error(lambda: model.fit(run.dataset(x, y), y, verbose=0), "labels")
