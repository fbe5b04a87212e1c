"""`noisecurve demo`: bad flags exit 2 fast; `--quick` runs the whole pipeline end to end."""

import json
import os

import pytest

from keras_noisecurve import cli


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--epsilon", "0"], "--epsilon"),
        (["--delta", "1.5"], "--delta"),
        (["--epochs", "0"], "--epochs"),
        (["--bands", "1"], "--bands"),
        (["--clip", "-1"], "--clip"),
        (["--learning-rate", "0"], "--learning-rate"),
        (["--public-size", "5000"], "--public-size"),
        (["--batch-size", "2000", "--bands", "4"], "exceeds"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags, message, tmp_path, capsys):
    rc = cli.main(["demo", "--out", str(tmp_path / "o"), *flags])
    assert rc == 2
    assert message in capsys.readouterr().err


def test_unknown_choice_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--objective", "nonsense"])
    assert exc.value.code == 2


def test_demo_objective_comes_from_one_constant():
    from keras_noisecurve import demo
    from keras_noisecurve.mixing import CURVATURE_OBJECTIVES

    assert demo.NOISECURVE_OBJECTIVE in CURVATURE_OBJECTIVES


def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    rc = cli.main(["demo", "--quick", "--deterministic", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "NoiseCurve objective" in printed and "| method | test accuracy |" in printed
    summary = json.loads((out / "results.json").read_text())
    assert set(summary["results"]) == {"DP-SGD", "DP-BandMF", "NoiseCurve"}
    for name, r in summary["results"].items():
        assert 0.0 <= r["test_accuracy"] <= 1.0
        # the calibrated sigma meets the target epsilon (and is not wastefully large)
        assert r["epsilon"] <= 2.0 + 1e-6 and r["epsilon"] > 1.9
        assert len(r["accuracy_per_epoch"]) == 2
    assert summary["results"]["DP-SGD"]["bands"] == 1 and summary["results"]["NoiseCurve"]["bands"] == 4
    # the demo learned something: better than chance (10 %) for DP-SGD after 2 epochs
    assert summary["results"]["DP-SGD"]["test_accuracy"] > 0.2
    for name in ("spectrum.png", "mixing_matrices.png", "noise.png", "accuracy.png", "spectrum.npz",
                 "mixing_dpbandmf.npz", "mixing_noisecurve.npz"):
        assert os.path.getsize(out / name) > 0
