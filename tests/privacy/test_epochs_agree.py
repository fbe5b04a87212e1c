"""One definition of epochs → steps (T = epochs·⌈n/B⌉) in every entry point, and a σ
calibrated by any entry point gives ε ≤ target in every other."""

import json

import pytest

from keras_noisecurve.apps.cli import main
from keras_noisecurve.privacy import accounting
from keras_noisecurve.privacy.run import PrivateRun

# n/B is not an integer: ceil(E·n/B) = 100 and E·ceil(n/B) = 102 differ, as in the bug
N, B, E, DELTA, TARGET = 1000, 30, 3, 1e-5, 2.0


def test_steps_for_epochs_is_epochs_times_ceil_n_over_b():
    assert accounting.steps_for_epochs(num_examples=N, batch_size=B, epochs=E) == 3 * 34
    assert PrivateRun(num_examples=N, batch_size=B, epochs=E, noise_multiplier=1.0, delta=DELTA).steps == 102
    setup = accounting.RunSpec(num_examples=N, batch_size=B, epochs=E)
    assert setup.steps == 102
    with pytest.raises((TypeError, ValueError), match="epochs"):
        accounting.steps_for_epochs(num_examples=N, batch_size=B, epochs=1.5)


def _sigma_cli(capsys, accountant):
    rc = main(["calibrate", "--epsilon", str(TARGET), "--delta", str(DELTA), "--num-examples", str(N),
               "--batch-size", str(B), "--epochs", str(E), "--accountant", accountant, "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 102
    return out["noise_multiplier"]


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_a_sigma_from_any_entry_point_meets_the_target_in_every_other(capsys, accountant):
    sigmas = {
        "cli": _sigma_cli(capsys, accountant),
        "run": PrivateRun(num_examples=N, batch_size=B, epochs=E, epsilon=TARGET, delta=DELTA,
                          accountant=accountant).noise_multiplier,
        "function": accounting.calibrate_noise_multiplier(epsilon=TARGET, delta=DELTA, num_examples=N, batch_size=B,
                                                          epochs=E, accountant=accountant),
    }
    for where, sigma in sigmas.items():
        run = PrivateRun(num_examples=N, batch_size=B, epochs=E, noise_multiplier=sigma, delta=DELTA,
                         accountant=accountant)
        eps = {
            "run": run.epsilon(),
            "compute_epsilon(epochs=)": accounting.compute_epsilon(
                noise_multiplier=sigma, delta=DELTA, num_examples=N, batch_size=B, epochs=E, accountant=accountant),
            "compute_epsilon(steps=)": accounting.compute_epsilon(
                noise_multiplier=sigma, delta=DELTA, num_examples=N, batch_size=B, steps=102, accountant=accountant),
        }
        for other, value in eps.items():
            assert value <= TARGET, (where, other, value)
            assert value >= TARGET * (1 - 1e-3), (where, other, value)  # and not over-noised


def test_fractional_epochs_are_refused_by_the_cli(capsys):
    rc = main(["calibrate", "--epsilon", "2", "--delta", "1e-5", "--num-examples", str(N), "--batch-size", str(B),
               "--epochs", "2.5"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "positive integer" in err and "--steps" in err and err.count("\n") == 1
