"""``noisecurve calibrate`` in-process through the dispatcher."""

import json

import dp_accounting
import pytest
from dp_accounting import rdp

from keras_noisecurve.apps.cli import main


def test_calibrate_json_rechecks_independently(capsys):
    rc = main(["calibrate", "--epsilon", "3", "--delta", "1e-5", "--num-examples", "5000", "--batch-size", "50",
               "--epochs", "2", "--bands", "4", "--accountant", "rdp", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 200 and out["compositions"] == 50
    assert out["sampling_probability"] == pytest.approx(0.04)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.04, dp_accounting.GaussianDpEvent(out["noise_multiplier"])), 50
    )
    eps = rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert eps == pytest.approx(out["epsilon"], rel=1e-12)
    assert abs(eps - 3.0) / 3.0 < 1e-3
    assert 50 < out["padded_batch_size"] < 5000 / 4 and out["overflow_probability"] <= 1e-12


def test_calibrate_text_fixed_epochs(capsys):
    rc = main(["calibrate", "--epsilon", "8", "--delta", "1e-5", "--num-examples", "1000", "--batch-size", "100",
               "--steps", "35", "--bands", "2", "--sampling", "fixed_epochs", "--accountant", "rdp"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "noise multiplier sigma" in text and "epochs                 : 4 (10 steps per epoch)" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--num-examples", "100", "--batch-size", "60", "--steps", "10", "--bands", "2"], "must be < 1"),
        (["--num-examples", "1000", "--batch-size", "10", "--steps", "3", "--bands", "4"], "cannot exceed steps"),
        (["--num-examples", "1000", "--batch-size", "10", "--epochs", "1.5", "--sampling", "fixed_epochs"],
         "positive integer"),
    ],
)
def test_bad_input_exits_2_with_message(argv, message, capsys):
    rc = main(["calibrate", "--epsilon", "2", "--delta", "1e-5", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err


def test_bad_delta_and_missing_arguments_exit_2(capsys):
    assert main(["calibrate", "--epsilon", "2", "--delta", "2", "--num-examples", "1000", "--batch-size", "10",
                 "--steps", "10"]) == 2
    assert "delta" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--epsilon", "2", "--delta", "1e-5", "--num-examples", "1000", "--batch-size", "10"])
    assert exc.value.code == 2


def test_calibrate_takes_bands_from_mixing_file(tmp_path, capsys):
    import numpy as np

    from keras_noisecurve.mixing.matrix import MixingMatrix

    T, b = 40, 4
    dense = np.tril(np.ones((T, T)))
    dense[np.subtract.outer(np.arange(T), np.arange(T)) >= b] = 0
    dense /= np.linalg.norm(dense, axis=0, keepdims=True)
    path = tmp_path / "C.npz"
    MixingMatrix.from_dense(dense, bands=b).save(path)
    args = ["calibrate", "--epsilon", "4", "--delta", "1e-5", "--num-examples", "2000", "--batch-size", "20",
            "--steps", str(T), "--accountant", "rdp", "--json", "--mixing", str(path)]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bands"] == b and out["compositions"] == T // b and out["sensitivity"] == pytest.approx(1.0)
    assert main(args + ["--bands", "2"]) == 2
    assert "does not match the mixing matrix" in capsys.readouterr().err
    assert main(args[:-1] + [str(tmp_path / "missing.npz")]) == 2
