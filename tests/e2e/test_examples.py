"""Every example runs in its --quick mode (in-process, so TensorFlow is imported once)."""

import pathlib
import runpy

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _main(name):
    return runpy.run_path(str(EXAMPLES / name), run_name="example")["main"]


def test_quadratic_prediction_matches_simulation(capsys):
    # main() itself returns 1 if a simulated gap is > 4.5 standard errors from Theorem 3.1
    assert _main("quadratic.py")(["--quick"]) == 0
    out = capsys.readouterr().out
    assert out.count("| DP-") == 2 and "| NoiseCurve (eq. 1) |" in out


def test_logistic_regression_quick(capsys):
    assert _main("logistic_regression.py")(["--quick"]) == 0
    out = capsys.readouterr().out
    for name in ("| DP-SGD |", "| DP-BandMF |", "| NoiseCurve |"):
        assert name in out


def test_small_cnn_quick(capsys):
    assert _main("small_cnn.py")(["--quick"]) == 0
    out = capsys.readouterr().out
    for name in ("| DP-SGD |", "| DP-BandMF |", "| NoiseCurve |"):
        assert name in out


def test_small_cnn_cifar10_without_data_is_a_clear_error(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(SystemExit, match="never|data-dir"):
        _main("small_cnn.py")(["--quick", "--dataset", "cifar10", "--data-dir", str(tmp_path)])


def test_custom_loop_and_mirrored_strategy_agree(capsys):
    # main() returns 1 if the MirroredStrategy run differs from the single-device run
    assert _main("custom_loop.py")(["--quick"]) == 0
    assert "MirroredStrategy on 2 devices" in capsys.readouterr().out
