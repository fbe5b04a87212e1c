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


# --adaptive-clip: sigma is calibrated with the count queries of keras_noisecurve.AdaptiveClip
ADAPTIVE_RUN = ["--delta", "1e-5", "--num-examples", "5000", "--batch-size", "50", "--steps", "200", "--bands", "4",
                "--accountant", "rdp"]


@pytest.mark.parametrize("options, stddev", [([], 2.5), (["--count-stddev", "4", "--target-quantile", "0.7"], 4.0)])
def test_calibrate_adaptive_clip_includes_the_count_queries(options, stddev, capsys):
    import math

    import keras_noisecurve as knc

    assert main(["calibrate", "--epsilon", "3", *ADAPTIVE_RUN, "--adaptive-clip", *options, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    counts = 2.0 * stddev  # sensitivity 1/2: the noise multiplier is 2*s_b; default s_b = B/20 = 2.5
    assert out["count_noise_multiplier"] == pytest.approx(counts)
    assert out["count_noise_multiplier"] == knc.AdaptiveClip(count_stddev=stddev).count_noise_multiplier(50)
    assert out["adaptive_clip"]["count_stddev"] == stddev
    plan = dict(epsilon=3.0, delta=1e-5, num_examples=5000, batch_size=50, steps=200, bands=4, accountant="rdp")
    assert out["noise_multiplier"] == knc.calibrate_noise_multiplier(**plan, count_noise_multiplier=counts)
    assert out["noise_multiplier"] > knc.calibrate_noise_multiplier(**plan) * 1.005  # the counts cost noise
    # re-checked independently: 50 Poisson-sampled Gaussians of the pair (gradient, count)
    pair = 1.0 / math.sqrt(1.0 / out["noise_multiplier"] ** 2 + 1.0 / counts**2)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.04, dp_accounting.GaussianDpEvent(pair)), 50)
    eps = rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert eps == pytest.approx(out["epsilon"], rel=1e-9) and abs(eps - 3.0) / 3.0 < 1e-3


def test_calibrate_adaptive_clip_text_and_fixed_epochs(capsys):
    import keras_noisecurve as knc

    argv = ["calibrate", "--epsilon", "8", "--delta", "1e-5", "--num-examples", "1000", "--batch-size", "100",
            "--epochs", "4", "--sampling", "fixed_epochs", "--accountant", "rdp"]
    assert main([*argv, "--adaptive-clip", "--clip-learning-rate", "0.1"]) == 0
    text = capsys.readouterr().out
    sigma = knc.calibrate_noise_multiplier(epsilon=8, delta=1e-5, num_examples=1000, batch_size=100, epochs=4,
                                           sampling="fixed_epochs", accountant="rdp", count_noise_multiplier=10.0)
    assert f"noise multiplier sigma : {sigma:.6f}" in text
    assert "count noise multiplier : 10 (count stddev 5 examples (B/20)" in text
    assert "AdaptiveClip(target_quantile=0.5, learning_rate=0.1)" in text
    assert main(argv) == 0
    assert "count noise multiplier" not in capsys.readouterr().out


@pytest.mark.parametrize("options, message", [
    (["--count-stddev", "3"], "--count-stddev is for --adaptive-clip"),
    (["--target-quantile", "0.7", "--clip-learning-rate", "0.1"],
     "--target-quantile and --clip-learning-rate are for --adaptive-clip"),
    (["--adaptive-clip", "--target-quantile", "1.5"], "--target-quantile must lie strictly between 0 and 1"),
    (["--adaptive-clip", "--clip-learning-rate", "-1"], "--clip-learning-rate must be >= 0"),
    (["--adaptive-clip", "--count-stddev", "0"], "--count-stddev must be > 0"),
])
def test_calibrate_refuses_clip_options_that_do_not_fit(options, message, capsys):
    assert main(["calibrate", "--epsilon", "3", *ADAPTIVE_RUN, *options]) == 2
    assert message in capsys.readouterr().err


# --privacy-unit user: the same sigma, n and B counted in users, K printed
USER_RUN = ["calibrate", "--epsilon", "2", "--delta", "1e-5", "--num-examples", "1000", "--batch-size", "50",
            "--steps", "100", "--accountant", "rdp"]


def test_calibrate_user_level_changes_only_the_wording(capsys):
    import keras_noisecurve as knc

    assert main([*USER_RUN, "--json"]) == 0
    examples = json.loads(capsys.readouterr().out)
    assert "privacy_unit" not in examples and "examples_per_user" not in examples
    assert main([*USER_RUN, "--privacy-unit", "user", "--examples-per-user", "8", "--json"]) == 0
    users = json.loads(capsys.readouterr().out)
    assert users.pop("privacy_unit") == "user" and users.pop("examples_per_user") == 8
    assert users == examples  # sigma, epsilon, P: the example-level numbers with n users
    run = knc.PrivateRun(privacy_unit="user", num_users=1000, examples_per_user=8, batch_size=50, steps=100,
                         epsilon=2.0, delta=1e-5, accountant="rdp")
    assert users["noise_multiplier"] == run.noise_multiplier
    assert main([*USER_RUN, "--privacy-unit", "user", "--examples-per-user", "8"]) == 0
    text = capsys.readouterr().out
    assert "privacy unit           : user (n = 1000 users, B = 50 users per step, at most K = 8 examples" in text
    assert f"padded batch size P    : {users['padded_batch_size']} users ({users['padded_batch_size'] * 8} rows" in text


@pytest.mark.parametrize("options, message", [
    (["--privacy-unit", "user"], "--privacy-unit user needs --examples-per-user K >= 1"),
    (["--privacy-unit", "user", "--examples-per-user", "0"], "needs --examples-per-user K >= 1 (the most examples"),
    (["--examples-per-user", "4"], "--examples-per-user is for --privacy-unit user"),
])
def test_calibrate_refuses_user_options_that_do_not_fit(options, message, capsys):
    assert main([*USER_RUN, *options]) == 2
    assert message in capsys.readouterr().err


def test_calibrate_user_level_delta_warning_speaks_of_users(capsys):
    argv = ["calibrate", "--epsilon", "2", "--delta", "0.01", "--num-examples", "100", "--batch-size", "10",
            "--steps", "10", "--accountant", "rdp", "--privacy-unit", "user", "--examples-per-user", "2"]
    assert main(argv) == 0
    assert "(n = 100 users): a delta of 1/n or more allows releasing a user outright" in capsys.readouterr().err
