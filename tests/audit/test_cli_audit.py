"""``noisecurve audit``: the report's lines, the exit status, one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from keras_noisecurve.apps.cli import main


def test_audit_prints_claim_bound_interval_and_verdict(tmp_path, capsys):
    out = tmp_path / "audit.json"
    rc = main(["audit", "--strategy", "dpsgd", "--canaries", "2000", "--epsilon", "4", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "claimed epsilon:        4.0000" in text
    assert "95 % confidence interval for the achieved epsilon: [" in text
    assert "verdict: consistent" in text and "cannot certify privacy" in text
    assert "noise check: the C-whitened noise of 1000 probe coordinates is white" in text
    data = json.loads(out.read_text())
    assert 0 < data["epsilon_lower"] <= data["claimed_epsilon"]
    assert data["verdict"] == "consistent" and data["info"]["strategy"] == "dpsgd"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--delta", "2"], "--delta must lie in (0, 1), got 2.0"),
        (["--confidence", "1.5"], "--confidence must lie in (0, 1), got 1.5"),
        (["--canaries", "1"], "--canaries must be >= 2, got 1"),
        (["--strategy", "blt", "--sampling", "cyclic_poisson"], "--strategy blt needs --sampling fixed_epochs"),
        (["--bands", "64", "--canaries", "100"], "bands must be <= steps (16); got bands=64"),
    ],
)
def test_bad_configurations_give_one_line_errors(argv, message, capsys):
    rc = main(["audit", *argv])
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("noisecurve audit: error: ") and message in lines[0], captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_malformed_numbers_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["audit", "--canaries", "many"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "expected a positive integer, got 'many'" in err and "Traceback" not in err


# ------------------------------------------------------------ exit status and --model


def test_help_lists_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--help"])
    text = capsys.readouterr().out
    assert "exit status:" in text and "--model FILE.keras" in text
    for code in ("0  consistent", "1  violation", "2  bad arguments", "3  a mechanism check failed"):
        assert code in text


def test_a_failed_noise_check_exits_with_3_even_when_consistent(monkeypatch, capsys):
    from keras_noisecurve.apps import cli_audit
    from keras_noisecurve.audit.report import summarize

    def audit(args):  # a consistent result whose probe noise is not the claimed one
        info = {"strategy": "banded", "sampling": "fixed_epochs", "steps": 16, "noise_multiplier": 1.0,
                "probes": 1000, "probe_covariance_error": 0.5, "probe_threshold": 0.2, "noise_matches_claim": False}
        return summarize(scores={"s": np.r_[np.zeros(50), np.ones(50)]}, included=np.r_[np.zeros(50), np.ones(50)] > 0,
                         claimed_epsilon=4.0, delta=1e-5, methods=("clopper-pearson",), info=info)

    monkeypatch.setattr(cli_audit, "_audit", audit)
    rc = main(["audit", "--canaries", "100"])
    out = capsys.readouterr().out
    assert rc == 3 and "noise check: MISMATCH" in out and "exit status 3" in out


def _saved_private(tmp_path, *, compiled=True):
    import keras

    import keras_noisecurve as knc

    rng = np.random.default_rng(0)
    n = 60
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 3, n)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    run = knc.PrivateRun(num_examples=n, batch_size=10, epochs=2, epsilon=4.0, delta=1e-5, sampling="fixed_epochs",
                         seed=0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(6, activation="tanh"), keras.layers.Dense(3)])
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if not compiled:
        model.save(tmp_path / "model.keras")
        (tmp_path / "run.json").write_text(json.dumps(run.get_config()))
        return
    private = knc.make_private(model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=0.1), loss=loss)
    private.save(tmp_path / "model.keras")


def test_model_checks_pass_on_a_correct_private_model_and_print_one_line_each(tmp_path, capsys):
    _saved_private(tmp_path)
    out_json = tmp_path / "checks.json"
    rc = main(["audit", "--model", str(tmp_path / "model.keras"), "--data", str(tmp_path / "data.npz"),
               "--batches", "1", "--batch-size", "6", "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for name in ("clipping: PASS", "sampling: PASS", "noise: PASS", "time:", "verdict: every mechanism check passed"):
        assert name in text
    data = json.loads(out_json.read_text())
    assert data["passed"] and set(data["checks"]) == {"clipping", "sampling", "noise"}


def test_a_planted_clipping_bug_exits_with_3(tmp_path, capsys, monkeypatch):
    from . import broken

    _saved_private(tmp_path)
    broken.drop_layer_share(monkeypatch, "Dense")
    rc = main(["audit", "--model", str(tmp_path / "model.keras"), "--data", str(tmp_path / "data.npz"),
               "--batches", "1", "--batch-size", "6"])
    text = capsys.readouterr().out
    assert rc == 3 and "clipping: FAIL" in text and "MECHANISM CHECK FAILED (clipping)" in text


def test_a_plain_model_takes_the_run_file_the_clip_and_the_loss(tmp_path, capsys):
    _saved_private(tmp_path, compiled=False)
    argv = ["audit", "--model", str(tmp_path / "model.keras"), "--data", str(tmp_path / "data.npz"), "--run",
            str(tmp_path / "run.json"), "--loss", "sparse_categorical_crossentropy", "--from-logits",
            "--batches", "1", "--batch-size", "6"]
    assert main(argv + ["--clip", "0.1"]) == 0, capsys.readouterr()
    capsys.readouterr()
    assert main(argv) == 2
    assert "needs --clip" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--model", "m.keras"], "--model needs --data FILE.npz"),
    (["--data", "d.npz"], "--data is the data of --model FILE.keras: give both"),
    (["--model", "missing.keras", "--data", "missing.npz"], "--model missing.keras: no such file"),
])
def test_model_arguments_are_checked_first(argv, message, capsys):
    assert main(["audit", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
