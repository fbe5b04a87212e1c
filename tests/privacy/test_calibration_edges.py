"""Calibration cannot crash: strict and loose budgets (where the guessed brackets miss
and the fallback runs) calibrate with every dp-accounting version the project allows,
and an unreachable target is one line saying what is possible."""

import dp_accounting
import pytest

from keras_noisecurve.apps.cli import main
from keras_noisecurve.privacy import accounting, calibration

PLAN = dict(num_examples=1000, batch_size=30, steps=102)


def test_fallback_catches_only_exceptions_this_dp_accounting_has():
    mc = dp_accounting.mechanism_calibration
    assert ValueError in calibration._BRACKET_ERRORS
    for error in calibration._BRACKET_ERRORS:
        assert isinstance(error, type) and issubclass(error, Exception)
        assert error is ValueError or getattr(mc, error.__name__) is error


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
@pytest.mark.parametrize("target", [0.01, 0.05, 30.0])
def test_strict_and_loose_budgets_calibrate(target, accountant):
    sigma = accounting.calibrate_noise_multiplier(epsilon=target, delta=1e-5, accountant=accountant, **PLAN)
    eps = accounting.compute_epsilon(noise_multiplier=sigma, delta=1e-5, accountant=accountant, **PLAN)
    assert target * (1 - 1e-3) <= eps <= target


def test_a_meaningless_target_is_refused_in_one_line_saying_what_is_possible():
    with pytest.raises(ValueError, match=r"Possible: epsilon <= [0-9.e+]+") as info:
        accounting.calibrate_noise_multiplier(epsilon=1e6, delta=1e-5, **PLAN)
    assert "\n" not in str(info.value)
    largest = float(str(info.value).split("epsilon <= ")[1].split(" ")[0])
    # the bound it names is reachable
    sigma = accounting.calibrate_noise_multiplier(epsilon=0.9 * largest, delta=1e-5, accountant="rdp", **PLAN)
    assert sigma >= 0.2


def test_cli_at_strict_and_impossible_budgets(capsys):
    base = ["calibrate", "--delta", "1e-5", "--num-examples", "1000", "--batch-size", "30", "--steps", "102"]
    assert main(base + ["--epsilon", "0.01"]) == 0
    assert "noise multiplier sigma" in capsys.readouterr().out
    assert main(base + ["--epsilon", "1e6"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("noisecurve calibrate: error:") and "Possible" in err and err.count("\n") == 1
