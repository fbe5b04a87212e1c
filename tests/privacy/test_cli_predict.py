"""The predicted gain on the command line: ``calibrate --mixing auto`` / ``--mixing FILE`` and
``solve``'s budget options. The numbers are the library's (``choose_mixing``,
``predicted_gain``: tested against dense references in test_choice.py); here, that the command
line prints them, refuses what does not fit, and records the choice in ``--json``."""

import json

import pytest

from keras_noisecurve.apps.cli import main
from keras_noisecurve.mixing import UpdateRule
from keras_noisecurve.privacy.choice import choose_mixing, predicted_gain

RUN = ["--delta", "1e-5", "--num-examples", "600", "--batch-size", "100", "--steps", "30"]


def test_calibrate_auto_prints_the_comparison_and_calibrates_the_choice(capsys):
    rc = main(["calibrate", "--epsilon", "8", *RUN, "--mixing", "auto", "--momentum", "0.9"])
    out = capsys.readouterr().out
    assert rc == 0, out
    choice = choose_mixing(num_examples=600, batch_size=100, steps=30, epsilon=8, delta=1e-5,
                           update_rule=UpdateRule(momentum=0.9))
    assert choice.summary().splitlines()[-1] in out  # the expectation sentence
    assert f"-> {choice.chosen.label}" in out
    assert f"(bands b = {choice.chosen.size})" in out
    assert f"noise multiplier sigma : {choice.noise_multiplier:.6f}" in out


def test_calibrate_auto_json_records_the_choice(capsys):
    rc = main(["calibrate", "--epsilon", "0.5", *RUN, "--mixing", "auto", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert rc == 0 and record["bands"] == 1  # DP-SGD at a small epsilon
    assert record["choice"]["chosen"] == "DP-SGD" and len(record["choice"]["candidates"]) >= 5


@pytest.mark.parametrize("argv, message", [
    (["--mixing", "auto", "--bands", "3"], "--bands and --mixing auto exclude each other"),
    (["--momentum", "0.9"], "--momentum and --max-bands are for --mixing auto"),
])
def test_calibrate_refuses_options_that_do_not_fit(argv, message, capsys):
    assert main(["calibrate", "--epsilon", "2", *RUN, *argv]) == 2
    assert message in capsys.readouterr().err


def test_solve_with_a_budget_prints_the_predicted_gain_and_calibrate_agrees(tmp_path, capsys):
    path = str(tmp_path / "c.npz")
    budget = ["--epsilon", "2", "--delta", "1e-5", "--num-examples", "600", "--batch-size", "100"]
    assert main(["solve", "--steps", "30", "--bands", "4", "--objective", "bandmf", "--momentum", "0.9",
                 "--out", path, *budget]) == 0
    solved = capsys.readouterr().out
    from keras_noisecurve.mixing import MixingMatrix

    want = predicted_gain(MixingMatrix.load(path), num_examples=600, batch_size=100, epsilon=2, delta=1e-5)
    line = f"noise variance x{want.relative_error:.3f} of DP-SGD's"
    assert line in solved and f"sigma {want.noise_multiplier:.4g}" in solved
    assert main(["calibrate", "--epsilon", "2", *RUN, "--mixing", path]) == 0
    assert line in capsys.readouterr().out


def test_solve_without_a_budget_says_how_to_get_one_and_refuses_half_a_budget(tmp_path, capsys):
    path = str(tmp_path / "c.npz")
    assert main(["solve", "--steps", "30", "--bands", "2", "--objective", "bandmf", "--out", path]) == 0
    assert "give --epsilon, --delta, --num-examples and --batch-size" in capsys.readouterr().out
    assert main(["solve", "--steps", "30", "--bands", "2", "--objective", "bandmf", "--out", path,
                 "--epsilon", "2"]) == 2
    assert "missing --delta, --num-examples, --batch-size" in capsys.readouterr().err


def test_a_budget_the_c_cannot_run_is_said_not_crashed(tmp_path, capsys):
    path = str(tmp_path / "c.npz")
    # b = 7 bands sample q = 100*7/600 > 1: no cyclic Poisson run of this C exists
    assert main(["solve", "--steps", "30", "--bands", "7", "--objective", "bandmf", "--out", path, "--epsilon", "2",
                 "--delta", "1e-5", "--num-examples", "600", "--batch-size", "100"]) == 0
    assert "predicted vs DP-SGD   : not available for this budget" in capsys.readouterr().out


def test_inspect_draws_and_reports_the_noise_at_each_c_s_own_sigma(tmp_path, capsys):
    import keras_noisecurve as knc

    path, png = str(tmp_path / "c.npz"), str(tmp_path / "c.png")
    assert main(["solve", "--steps", "30", "--bands", "3", "--objective", "bandmf", "--out", path, "--quiet"]) == 0
    capsys.readouterr()
    budget = ["--epsilon", "4", "--delta", "1e-5", "--num-examples", "600", "--batch-size", "100"]
    assert main(["inspect", path, "--json", "--no-reference", *budget]) == 0
    document = json.loads(capsys.readouterr().out)
    for name, bands in (("this C", 3), ("DP-SGD", 1)):
        want = knc.calibrate_noise_multiplier(epsilon=4, delta=1e-5, num_examples=600, batch_size=100, steps=30,
                                              bands=bands)
        assert document["noise_multipliers"][name] == pytest.approx(want, rel=1e-9)
    assert main(["inspect", path, "--no-reference", "--plot", png, *budget]) == 0
    out = capsys.readouterr().out
    assert "predicted vs DP-SGD   : sigma" in out and (tmp_path / "c.png").stat().st_size > 0
    assert main(["inspect", path, "--no-reference"]) == 0
    assert "give --epsilon, --delta, --num-examples and --batch-size" in capsys.readouterr().out
